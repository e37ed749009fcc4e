"""The package layout is the architecture: these tests keep its layers honest.

- ``streamproc.core`` is pure: importing any of its modules loads no I/O library.
- No import cycles between streamproc modules (top-level imports, the ones that run at import).
- The runtime path (processor, edge, CLI) never loads the simulation.
- Only the NATS shell, the edge, the client helpers and the simulation import nats-py.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import streamproc

PACKAGE_DIR = Path(streamproc.__file__).parent
IO_LIBRARIES = ("nats", "anyio", "asyncio", "socket", "starlette", "uvicorn", "httpx", "selenium")
NATS_PY_HOMES = ("streamproc.nats", "streamproc.edge", "streamproc.client", "streamproc.sim")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}
CORE_MODULES = sorted(m for m in SOURCES if m == "streamproc.core" or m.startswith("streamproc.core."))


def loaded_after_import(*modules: str) -> list[str]:
    """Every module in ``sys.modules`` after importing ``modules`` in a fresh interpreter."""
    code = f"import importlib, json, sys\nfor m in {list(modules)!r}: importlib.import_module(m)\n" \
           "print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ------------------------------------------------------------------------------ the pure core

def test_the_core_package_lists_its_modules():
    assert {"streamproc.core", "streamproc.core.correlator", "streamproc.core.wire"} <= set(CORE_MODULES)


def test_a_bare_interpreter_has_no_io_library_loaded():
    """The check below means something only if Python's own start-up loads none of them."""
    loaded = set(loaded_after_import())
    assert not loaded & set(IO_LIBRARIES)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_io_library(module: str):
    loaded = loaded_after_import(module)
    assert module in loaded
    assert [name for name in loaded if name.split(".")[0] in IO_LIBRARIES] == []


# ------------------------------------------------------------------------------ import graph

def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_imports(body: list[ast.stmt]):
    """Import statements that run when the module is imported: not in functions, not under TYPE_CHECKING."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from import_time_imports(node.body)
            yield from import_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from import_time_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from import_time_imports(node.body)


def absolute_imports(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules ``node`` names, with relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    # ``from pkg import name`` imports the submodule pkg.name when there is one, else a name of pkg.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the streamproc modules its import-time statements name.

    Initialising the parent packages of an imported module is not an edge: every submodule
    "imports" its package that way, and that never deadlocks on a half-initialised name.
    """
    graph: dict[str, set[str]] = {}
    for module, path in SOURCES.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {t for node in import_time_imports(tree.body) for t in absolute_imports(module, node)}
        graph[module] = {t for t in targets if t in SOURCES and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None if the graph is acyclic."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_find_cycle_reports_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_relative_imports_and_skips_deferred_ones():
    graph = import_graph()
    assert "streamproc.core.errors" in graph["streamproc.core.wire"]  # from .errors import ContractError
    assert "streamproc.core.wire" in graph["streamproc.nats.processor"]  # from ..core.wire import ...
    assert "streamproc.sim.simulation" not in graph["streamproc.catalog"]  # only under TYPE_CHECKING


def test_streamproc_modules_import_each_other_without_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# ------------------------------------------------------------------------------ runtime path

def test_the_runtime_path_does_not_load_the_simulation():
    loaded = loaded_after_import("streamproc.nats.processor", "streamproc.edge.app", "streamproc.cli")
    assert {"streamproc.nats.processor", "streamproc.edge.app", "streamproc.cli"} <= set(loaded)
    simulation = ("streamproc.sim.", "streamproc.simulation")  # the package and its old path
    assert [m for m in loaded if m == "streamproc.sim" or m.startswith(simulation)] == []


# ------------------------------------------------------------------------------ nats-py

def imports_nats_py(source: str) -> list[int]:
    """Lines of every import of nats-py in ``source``, deferred ones (in functions) included."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "nats" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "nats":
            lines.append(node.lineno)
    return sorted(lines)


# Known violations (module -> reason), each a strict xfail: once fixed the XPASS fails and the entry
# must go. Empty since `streamproc simulate` connects through streamproc.nats.connection (issue 11).
KNOWN_NATS_PY_IMPORTERS: dict[str, str] = {}
OUTSIDE_NATS_HOMES = [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_NATS_PY_IMPORTERS[m]))
    if m in KNOWN_NATS_PY_IMPORTERS else m
    for m in SOURCES if not any(m == h or m.startswith(h + ".") for h in NATS_PY_HOMES)
]


def test_nats_py_imports_are_told_from_streamproc_nats():
    source = ("import nats\nfrom nats.js import api\nfrom .nats import gate\nfrom ..nats.processor import P\n"
              "import natsort\ndef connect():\n    import nats.aio.client\n")
    assert imports_nats_py(source) == [1, 2, 7]


@pytest.mark.parametrize("module", OUTSIDE_NATS_HOMES)
def test_only_the_shell_edge_client_and_simulation_import_nats_py(module: str):
    lines = imports_nats_py(SOURCES[module].read_text())
    assert lines == [], f"{SOURCES[module]} imports nats-py at line(s) {lines}"


# ------------------------------------------------------------------------------ format knowledge
# "Format code lives in codecs/<format>/; the core knows no SGLang or vLLM field names." The names a
# format knows are gathered from the codecs themselves (every string a codec keys a body or request
# with, or names in an UPPER_CASE constant); none of them may appear as a string in streamproc/.

CODEC_SOURCES = sorted(PACKAGE_DIR.parent.glob("codecs/*/streamproc_*/*.py"))
PAGE_SOURCES = sorted([*PACKAGE_DIR.rglob("*.js"), *PACKAGE_DIR.rglob("*.html")])
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Words a codec uses that are also streamproc's own vocabulary, each with where streamproc uses it.
OWN_VOCABULARY = {
    "error": "the edge's error envelope and the result error header, ErrorKind",
    "message": "the edge's error envelope",
    "type": "the edge's error envelope",
    "code": "the edge's error envelope",
    "request_id": "streamproc's wire contract (subjects, Streamproc-Request-Id)",
    "stream": "the edge's ?stream=false, the chunk stream",
    "token": "capabilities (streamproc token), NATS auth tokens",
    "id": "HTML element ids, SSE id:",
    "length": "Truth.finish, the ground truth's finish reason (length or stop)",
    "stop": "Truth.finish, the ground truth's finish reason (length or stop); the experts view's span ends (span.stop)",
    "n": "slot and node names",
    "abort": "AbortController.abort() in the page",
    "dtype": "the experts view's own field (ExpertsView.dtype), numpy's word",
    "s": "string formatting",
    "rid": "streamproc token --rid (the capability's request ids)",
    "yes": "option values (vllm's stream_routed_experts; the edge's and the settings' yes/no)",
    "no": "option values (vllm's stream_routed_experts; the edge's and the settings' yes/no)",
    "unknown": "option values (vllm's stream_routed_experts), the edge's unknown MSG.GET access",
    "version": "argparse's action for streamproc --version",
    "start": "the experts view's row spans (RowSpan.start, read by the page's experts.js)",
    "metrics": "an attribute name (edge/direct.py's __slots__: the edge's metrics)",
    "host": "the --http-host / --host settings (a network host, not SGLang's host-memory cache count)",
    "object": "JavaScript's typeof x === \"object\" in the page (edge.js, experts.js), not SGLang's "
              "ErrorResponse.object",
    "refusal": "a refused migrate (the correlator's _Request.refusal) and the edge's HTTP refusal in the page "
               "(page.refusal), not vLLM's ChatMessage.refusal",
    "name": "a route parameter (the edge's /{name}.js), not a tool call's function name",
}
# Names the brief names explicitly: the gatherer must find them, or the check below means nothing.
KNOWN_FORMAT_FIELDS = {"meta_info", "output_ids", "prompt_logprobs", "choices", "logprobs", "routed_experts",
                       "input_token_logprobs", "routed_experts_dtype", "routed_experts_start_len"}


def _literal_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.match(node.value):
        return node.value
    return None


def keyed_names(source: str) -> set[str]:
    """Strings a codec keys a body with: ``d["x"]``, ``d.get("x")``/``pop``/``setdefault``, ``{"x": ...}``,
    ``"x" in d``, and every name-like string in an ``UPPER_CASE = ...`` constant."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets):
            names.update(n for sub in ast.walk(node.value) if (n := _literal_name(sub)))
        elif isinstance(node, ast.Subscript) and (n := _literal_name(node.slice)):
            names.add(n)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "pop", "setdefault") and (n := _literal_name(node.args[0]))):
            names.add(n)
        elif isinstance(node, ast.Dict):
            names.update(n for key in node.keys if key is not None and (n := _literal_name(key)))
        elif (isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
              and (n := _literal_name(node.left))):
            names.add(n)
    return names


def format_field_names() -> set[str]:
    return set().union(*(keyed_names(p.read_text()) for p in CODEC_SOURCES)) - OWN_VOCABULARY.keys()


def python_strings(source: str) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def page_strings(source: str) -> list[tuple[int, str]]:
    """Quoted strings and property names (``doc.meta_info``) of a script or page, comments removed
    (prose may name a format)."""
    code = re.sub(r"/\*.*?\*/|<!--.*?-->", lambda m: "\n" * m.group().count("\n"), source, flags=re.DOTALL)
    code = re.sub(r"(?m)(^|[^:\\])//.*$", r"\1", code)  # line comments, not the // of a URL
    strings = re.finditer(r'"((?:[^"\\\n]|\\.)*)"|\'((?:[^\'\\\n]|\\.)*)\'|`((?:[^`\\]|\\.)*)`', code)
    found = [(code[:m.start()].count("\n") + 1, next(g for g in m.groups() if g is not None)) for m in strings]
    properties = re.finditer(r"(?<![\w.])[A-Za-z_$][\w$]*\??\.([a-z][a-z0-9_]*)(?![\w$])", code)
    return found + [(code[:m.start()].count("\n") + 1, m.group(1)) for m in properties]


def format_names_in(path: Path, names: set[str]) -> list[str]:
    strings = page_strings(path.read_text()) if path.suffix in (".js", ".html") else python_strings(path.read_text())
    return [f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {text!r}" for line, text in strings if text in names]


def test_the_format_field_names_are_gathered_from_every_codec_tree():
    assert {p.parent.parent.name for p in CODEC_SOURCES} == {"sglang", "vllm", "sglang-zstd"}
    assert KNOWN_FORMAT_FIELDS <= format_field_names()


def test_the_check_sees_a_field_name_in_python_and_in_a_page_script_but_not_in_prose(tmp_path):
    names = {"meta_info", "routed_experts"}
    script = tmp_path / "x.js"
    script.write_text('// routed_experts is "routed_experts"\nconst F = "routed_experts";\nfetch("http://a/b");\n'
                      "const m = doc.meta_info;\n")
    module = tmp_path / "x.py"
    module.write_text('"""Reads meta_info."""\ndef f(doc):\n    return doc.get("meta_info")\n')
    global PACKAGE_DIR
    home, PACKAGE_DIR = PACKAGE_DIR, tmp_path / "streamproc"
    try:
        assert format_names_in(script, names) == ["x.js:2: 'routed_experts'", "x.js:4: 'meta_info'"]
        assert format_names_in(module, names) == ["x.py:3: 'meta_info'"]
    finally:
        PACKAGE_DIR = home


def test_streamproc_names_no_format_field():
    names = format_field_names()
    found = [hit for path in [*SOURCES.values(), *PAGE_SOURCES] for hit in format_names_in(path, names)]
    assert found == [], "format field names outside codecs/ (move them into a codec hook):\n" + "\n".join(found)


# ------------------------------------------------------------------------------ test helpers
# "Shared helpers live once in tests/": in helpers.py, durable_helpers.py, edge_harness.py,
# nats_auth.py, toy_codec.py, conftest.py. A test module importing another test module couples two
# test files and makes pytest collect one as a side effect of the other.

TESTS_DIR = Path(__file__).parent
TEST_MODULES = sorted(p.stem for p in TESTS_DIR.glob("test_*.py"))
# Helpers being moved on other branches: strict xfails, so an entry must go once they are shared
# (none left: hostile-rest moved test_durable_hostile's, migration-gap test_migration_crash's).
KNOWN_TEST_IMPORTERS: dict[str, str] = {
}


def imported_test_modules(source: str) -> list[str]:
    """The ``test_*`` modules ``source`` imports, deferred imports (in functions) included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0].startswith("test_")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0].startswith("test_"):
            found.append(node.module)
    return found


def test_imports_of_test_modules_are_told_from_helper_imports():
    source = ("import test_a\nfrom helpers import rid\nfrom streamproc import testing\n"
              "def f():\n    from test_b import x\n")
    assert imported_test_modules(source) == ["test_a", "test_b"]


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=KNOWN_TEST_IMPORTERS[m]))
    if m in KNOWN_TEST_IMPORTERS else m
    for m in TEST_MODULES
])
def test_no_test_module_imports_another(module: str):
    imported = imported_test_modules((TESTS_DIR / f"{module}.py").read_text())
    assert imported == [], f"tests/{module}.py imports {imported}: move the helpers into a shared module"


# tests/ is no package: pytest puts each test module's own folder on sys.path, so helpers are
# imported by their bare names. `from tests.helpers import ...` resolves only when the repository
# root is on sys.path too (`python -m pytest`, `PYTHONPATH=.`); the `pytest` console script, which
# a newcomer runs, then fails to collect the module (ModuleNotFoundError: No module named 'tests').
TEST_SOURCES = sorted(p for d in (TESTS_DIR, TESTS_DIR.parent / "codecs" / "sglang-zstd" / "tests")
                      for p in d.glob("*.py"))


def imports_through_the_tests_package(source: str) -> list[str]:
    """Modules ``source`` imports as ``tests.<name>`` (or ``tests`` itself), deferred imports included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "tests":
            found.append(node.module)
    return found


def test_imports_through_the_tests_package_are_told_from_helper_imports():
    source = ("from tests.helpers import wait_until\nimport tests.edge_harness\nfrom helpers import rid\n"
              "import testsuite\ndef f():\n    from tests import conftest\n")
    assert imports_through_the_tests_package(source) == ["tests.helpers", "tests.edge_harness", "tests"]


@pytest.mark.parametrize("path", TEST_SOURCES, ids=lambda p: str(p.relative_to(TESTS_DIR.parent)))
def test_a_test_source_imports_helpers_by_their_bare_names(path: Path):
    imported = imports_through_the_tests_package(path.read_text())
    assert imported == [], (f"{path.name} imports {imported}: tests/ is no package, so `pytest` cannot "
                            f"collect it; import the helper by its bare name (`from helpers import ...`)")
