"""Which of streamproc's modules run compiled, and a refusal to run any whose source changed since.

``scripts/build-compiled`` (mypyc; optional, ``make install-compiled``) puts an extension module
beside each per-message module's ``.py`` and records each source's SHA-256 in ``compiled.json``
here. Python imports the extension in the ``.py``'s place, also after the ``.py`` is edited, so an
edit would silently not run: :func:`check` (called first by ``import streamproc``) raises
:class:`~streamproc.core.errors.StaleBuild` instead. Pure Python, with no such file, is the
reference build, and costs one directory lookup here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .core.errors import StaleBuild

PACKAGE = Path(__file__).parent
MANIFEST = PACKAGE / "compiled.json"
# mypyc's shared library of the build (group ``streamproc.hotpath``), beside the modules' own.
SHARED_LIBRARY_GLOB = "hotpath__mypyc*"
REBUILD = "run `scripts/build-compiled` again, or `scripts/build-compiled clean` for pure Python"


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiled_modules() -> list[str]:
    """The dotted names of the modules this installation runs compiled (empty: pure Python)."""
    if not MANIFEST.is_file():
        return []
    return sorted(_read_manifest())


def build_name() -> str:
    """What ``streamproc --version`` says of the build (benchmark output names it too)."""
    modules = compiled_modules()
    return f"{len(modules)} modules compiled with mypyc" if modules else "pure Python"


def check() -> None:
    """Raise :class:`StaleBuild` if a compiled module's source differs from the one it was built
    from, or if a build left extension modules without its record."""
    if not MANIFEST.is_file():
        stray = next(PACKAGE.glob(SHARED_LIBRARY_GLOB), None)
        if stray is not None:
            raise StaleBuild(f"{stray.name} is a compiled build without its record {MANIFEST.name}: {REBUILD}")
        return
    for module, digest in _read_manifest().items():
        path = PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")
        try:
            current = source_digest(path)
        except OSError as exc:
            raise StaleBuild(f"{module} was compiled but its source cannot be read ({exc}): {REBUILD}") from None
        if current != digest:
            raise StaleBuild(f"{path.relative_to(PACKAGE.parent)} changed since it was compiled, "
                             f"and the compiled module would run in its place: {REBUILD}")


def _read_manifest() -> dict[str, str]:
    try:
        sources = json.loads(MANIFEST.read_bytes())["sources"]
        if isinstance(sources, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
            return sources
    except (OSError, ValueError, KeyError, TypeError):
        pass
    raise StaleBuild(f"{MANIFEST} is unreadable: {REBUILD}")
