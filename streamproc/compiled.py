"""Which of streamproc's modules run compiled, and a refusal to run any whose source changed since.

``scripts/build-compiled`` (mypyc; optional, ``make install-compiled``) puts an extension module
beside each per-message module's ``.py`` and records each source's SHA-256 in ``compiled.json``
here. Python imports the extension in the ``.py``'s place, also after the ``.py`` is edited, so an
edit would silently not run: :func:`check` (called first by ``import streamproc``) raises
:class:`~streamproc.core.errors.StaleBuild` instead, also for an extension module the record does
not name. What counts is what this interpreter would import: a build for another Python version
is not loaded, so it neither counts as compiled nor refuses an edit. Pure Python is the reference
build; the check lists the package's directories once (well under a millisecond).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from .core.errors import StaleBuild

PACKAGE = Path(__file__).parent
MANIFEST = PACKAGE / "compiled.json"
# mypyc's shared library of the build (group ``streamproc.hotpath``), beside the modules' own.
SHARED_LIBRARY = "streamproc.hotpath__mypyc"
REBUILD = "run `scripts/build-compiled` again, or `scripts/build-compiled clean` for pure Python"


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiled_modules() -> list[str]:
    """The dotted names of the modules this interpreter imports compiled (empty: pure Python)."""
    recorded = _recorded()
    return sorted(set(extension_modules()) & set(recorded))


def build_name() -> str:
    """What ``streamproc --version`` says of the build (benchmark output names it too)."""
    modules = compiled_modules()
    return f"{len(modules)} modules compiled with mypyc" if modules else "pure Python"


def extension_modules() -> dict[str, Path]:
    """Extension modules in the package that this interpreter would import: dotted name -> file."""
    found: dict[str, Path] = {}
    for directory, subdirectories, names in os.walk(PACKAGE):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        for name in names:
            for suffix in EXTENSION_SUFFIXES:  # most specific first, as the import system tries them
                if name.endswith(suffix):
                    stem = name[:-len(suffix)]
                    if "." not in stem:  # "x.cpython-312-...so" under 3.11: not importable as x
                        relative = Path(directory, stem).relative_to(PACKAGE.parent)
                        found.setdefault(".".join(relative.parts), Path(directory, name))
                    break
    return found


def check() -> None:
    """Raise :class:`StaleBuild` if a compiled module's source differs from the one it was built
    from, or an extension module (or mypyc's library) is there without the build's record of it."""
    extensions = extension_modules()
    if not extensions:
        return
    recorded = _recorded()
    for module, path in sorted(extensions.items()):
        if module == SHARED_LIBRARY:
            if not recorded:
                raise StaleBuild(f"{path.name} is a compiled build without its record {MANIFEST.name}: {REBUILD}")
            continue
        digest = recorded.get(module)
        if digest is None:
            raise StaleBuild(f"{path.relative_to(PACKAGE.parent)} is compiled but not recorded in "
                             f"{MANIFEST.name}: it would run whatever source it was built from: {REBUILD}")
        source = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
        try:
            current = source_digest(source)
        except OSError as exc:
            raise StaleBuild(f"{module} was compiled but its source cannot be read ({exc}): {REBUILD}") from None
        if current != digest:
            raise StaleBuild(f"{source.relative_to(PACKAGE.parent)} changed since it was compiled, "
                             f"and the compiled module would run in its place: {REBUILD}")


def _recorded() -> dict[str, str]:
    """The build's record: each compiled module's source digest (empty without a build)."""
    return _read_manifest() if MANIFEST.is_file() else {}


def _read_manifest() -> dict[str, str]:
    try:
        sources = json.loads(MANIFEST.read_bytes())["sources"]
        if isinstance(sources, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
            return sources
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise StaleBuild(f"{MANIFEST} is unreadable: {REBUILD}")
