"""The optional compiled build (``scripts/build-compiled``, mypyc) behaves as the pure-Python one.

mypyc turns annotations into runtime checks and refuses some dynamic Python (a method replaced on
an instance, a 1-tuple variable given a longer one): three such differences were found only by
running tests against the compiled modules (docs/benchmarks.md, "Compiled hot modules"). So the
build is made here, once, in a copy of the source tree (~1 min), and the tests of the compiled
modules run against it in a subprocess; then an edited source is refused until rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("streamproc", "codecs", "tests", "scripts", "pyproject.toml")
IGNORED = shutil.ignore_patterns("__pycache__", "*.so", "compiled.json", "*.egg-info", ".hypothesis", "build")
# The tests of the compiled modules: the pure core's (correlator, outbox, wire, credit, the laws)
# and the NATS shell's on a real nats-server (the fast parser and client, durable mode, the
# processor, the edge's fan-out).
PURE_TESTS = ["tests/test_correlator.py", "tests/test_outbox.py", "tests/test_settlement.py",
              "tests/test_passthrough_path.py", "tests/test_fast_parser.py", "tests/test_wire.py",
              "tests/test_credit.py", "tests/test_laws.py"]
NATS_TESTS = ["tests/test_outbox_pump.py", "tests/test_durable.py", "tests/test_processor_nats.py",
              "tests/test_edge_fanout.py"]

pytestmark = pytest.mark.slow


def run_in(tree: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python *args`` importing the copy's streamproc and codecs (PYTHONPATH comes before the
    editable install's finder)."""
    paths = [tree, tree / "codecs" / "sglang", tree / "codecs" / "vllm", tree / "codecs" / "sglang-zstd"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_lines(tree: Path, *lines: str) -> subprocess.CompletedProcess[str]:
    """A few lines of Python run against the copy (:func:`run_in`)."""
    return run_in(tree, "-c", "\n".join(lines), timeout=60)


@pytest.fixture(scope="module")
def compiled_tree(tmp_path_factory) -> Path:
    if not (shutil.which("cc") or shutil.which("gcc")):  # scripts/install-system-deps installs gcc where it can
        pytest.skip("no C compiler: scripts/install-system-deps could not install gcc")
    tree = tmp_path_factory.mktemp("compiled") / "tree"
    tree.mkdir()
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=IGNORED)
        else:
            shutil.copy2(source, tree / name)
    done = run_in(tree, "scripts/build-compiled", timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tree


def test_the_build_compiles_every_listed_module_and_they_are_the_ones_imported(compiled_tree):
    done = run_lines(compiled_tree,
                     "import importlib, streamproc.compiled as c",
                     "mods = c.compiled_modules()",
                     "print(len(mods)); print(c.build_name())",
                     "for m in mods: print(m, importlib.import_module(m).__file__)")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert int(lines[0]) == 18 and lines[1] == "18 modules compiled with mypyc"
    for line in lines[2:]:
        module, path = line.split()
        assert path.startswith(str(compiled_tree)) and path.endswith(".so"), line


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tests", [PURE_TESTS, NATS_TESTS], ids=["pure-core", "nats-shell"])
def test_the_compiled_modules_pass_their_tests(compiled_tree, tests):
    done = run_in(compiled_tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests, timeout=580)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]


def test_the_benchmark_floors_may_subclass_the_compiled_read_buffer(compiled_tree):
    """A compiled class refuses interpreted subclasses unless it allows them: sse_floor.RawNats and
    durable_floor.DurableFloor subclass BufferedReads (``make bench`` failed on the first build:
    "interpreted classes cannot inherit from compiled")."""
    done = run_lines(compiled_tree,
                     "from streamproc.nats.buffered_reads import BufferedReads",
                     "class Floor(BufferedReads):",
                     "    def data_received(self, data): self.got = data",
                     "floor = Floor(); floor.data_received(b'x'); print(floor.got)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "b'x'"


def test_an_edited_compiled_module_is_refused_until_it_is_rebuilt_or_cleaned(compiled_tree, tmp_path):
    """An extension module beside its .py wins the import even when the .py is newer: the edit would
    silently not run. ``import streamproc`` says so instead; ``clean`` gives pure Python back."""
    tree = tmp_path / "tree"
    shutil.copytree(compiled_tree, tree, ignore=shutil.ignore_patterns("__pycache__"))
    wire = tree / "streamproc" / "core" / "wire.py"
    wire.write_text(wire.read_text() + "\n# an edit after the build\n")
    refused = run_in(tree, "-c", "import streamproc", timeout=60)
    assert refused.returncode != 0
    assert "StaleBuild: streamproc/core/wire.py changed since it was compiled" in refused.stderr
    cli = run_in(tree, "-c", "from streamproc.cli import main; main(['--version'])", timeout=60)
    assert cli.returncode != 0 and "scripts/build-compiled" in cli.stderr

    assert run_in(tree, "scripts/build-compiled", "clean", timeout=60).returncode == 0
    pure = run_in(tree, "-c", "import streamproc.core.wire as w, streamproc.compiled as c; "
                              "print(w.__file__); print(c.build_name())", timeout=60)
    assert pure.returncode == 0, pure.stderr
    assert pure.stdout.split()[0].endswith("streamproc/core/wire.py")
    assert pure.stdout.splitlines()[1] == "pure Python"
    assert not list((tree / "streamproc").rglob("*.so"))


def test_a_shared_library_left_without_its_record_is_refused(tmp_path):
    """A build interrupted after mypyc wrote its library, or a record deleted by hand: which
    sources the modules were built from is unknown, so nothing is trusted."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "streamproc", tree / "streamproc", ignore=IGNORED)
    (tree / "streamproc" / "hotpath__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    refused = run_in(tree, "-c", "import streamproc", timeout=60)
    assert refused.returncode != 0
    assert "hotpath__mypyc.cpython-311-x86_64-linux-gnu.so is a compiled build without its record" in refused.stderr


def test_an_extension_module_left_without_the_record_is_refused(tmp_path):
    """Without compiled.json (deleted by hand, or a tree built by the first, experimental script,
    which wrote none): a module's extension beside its .py still wins the import, so it is refused
    (the review found it ran silently, and --version said pure Python)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "streamproc", tree / "streamproc", ignore=IGNORED)
    (tree / "streamproc" / "nats" / f"fast_parser{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    refused = run_in(tree, "-c", "import streamproc", timeout=60)
    assert refused.returncode != 0
    assert "StaleBuild: streamproc/nats/fast_parser" in refused.stderr and "not recorded" in refused.stderr


def test_a_record_of_modules_this_interpreter_does_not_load_is_pure_python(tmp_path):
    """A build for another Python version (or whose .so files were deleted) is not imported: the
    tree runs pure, says so, and an edited source is not refused (the review: it was labelled
    compiled, and every edit refused)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "streamproc", tree / "streamproc", ignore=IGNORED)
    (tree / "streamproc" / "compiled.json").write_text(json.dumps({"sources": {"streamproc.core.wire": "0" * 64}}))
    (tree / "streamproc" / "core" / "wire.cpython-399-x86_64-linux-gnu.so").write_bytes(b"")
    done = run_lines(tree, "import streamproc.compiled as c, streamproc.core.wire as w",
                     "print(c.build_name()); print(w.__file__)")
    assert done.returncode == 0, done.stderr
    name, path = done.stdout.splitlines()
    assert name == "pure Python" and path.endswith("streamproc/core/wire.py")


def test_a_pure_tree_says_so_and_checks_nothing(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "streamproc", tree / "streamproc", ignore=IGNORED)
    done = run_in(tree, "-c", "from streamproc.cli import main; main(['--version'])", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("(pure Python)")
