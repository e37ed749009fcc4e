"""The user-facing docs (README.md, docs/*.md but benchmarks.md) name what the code has.

Pinned drift classes, each found once in the docs (docs-drift review, 2026-12-03):

- a ``streamproc <command> ... --flag`` in a code block or a code span is an option of that command,
  and a ``--flag`` named on its own in prose is an option of some command (or another tool's);
- a ``STREAMPROC_*`` variable the docs name is one a setting reads, or a name the code spells out;
- the settings tables (README's, configuration.md's, edge.md's) name each setting's flag, variable
  and default as ``--help`` states them, and list every setting of their command (edge.md lacked
  the edge's ``--duplicate-window``, ``--stream-storage`` and ``--stream-replicas``);
- operations.md's tuning and limits tables give each ``run`` setting's default in prose (``10 s``,
  ``32 MiB of chunk bodies``) as ``--help`` states it (newcomer pass, 2026-12-06: they matched, but no
  check read them);
- every metric name in the docs is exported as written (counters with ``_total``: edge.md named nine
  without it), and every exported metric is named somewhere (operations.md covered most with patterns);
- edge.md's unary status table has every error kind with the status the edge answers
  (``migration_refused`` and ``unavailable`` were missing);
- every event name the code logs (``log_event``, a ``LogLimiter``'s ``.log``, a correlator ``Notice``)
  has a row of operations.md's log events table at the level the code logs it, and every row names
  one the code logs (31 events, mostly ``*_failed`` warnings, were in no doc; docs pass, 2026-12-04).
  Names are read from the source with ``ast``; one built at run time must be listed in
  ``DYNAMIC_EVENTS`` with the pattern the table documents and every value it can take.

No NATS server: the parser, the collectors and the tables are read in process.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamproc.cli import build_parser
from streamproc.core.codec import ErrorKind, OmissionReason
from streamproc.core.correlator import UNSTORABLE_CHUNK, Stats
from streamproc.core.latency import LatencyHistogram
from streamproc.edge.app import ERROR_STATUS
from streamproc.core.read_budget import ReadBudget
from streamproc.edge.metrics import EdgeCollector, EdgeMetrics
from streamproc.metrics import ProcessorCollector
from streamproc.nats.durable.input import DurableStats
from streamproc.nats.input import QUIET_EVENTS, IOStats

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
_HELP_SETTING = re.compile(r"\[env (STREAMPROC_[A-Z0-9_]+), default (.*)\]$", re.DOTALL)

def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(command: str) -> set[str]:
    return {s for a in _subparsers()[command]._actions for s in a.option_strings}


def _settings(command: str) -> dict[str, tuple[str, str]]:
    """``--flag`` -> (environment variable, default as --help prints it) for settings with a variable."""
    out = {}
    for action in _subparsers()[command]._actions:
        found = _HELP_SETTING.search(action.help or "")
        if found and action.option_strings:
            out[action.option_strings[0]] = (found.group(1), found.group(2))
    return out


def _code(path: Path) -> list[tuple[int, str]]:
    """(line number, code) for every line of a fenced block and every code span of other lines."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line))
        else:
            out.extend((number, span) for span in re.findall(r"`+([^`]+)`+", line))
    return out


def documented_command_flags() -> list[tuple[str, str, str]]:
    """(where, command, flag) for each flag written after ``streamproc <command>`` in code."""
    found = []
    invocation = re.compile(r"(?:\bstreamproc|python -m streamproc\.edge)\s+"
                            r"(run|edge|token|demo|simulate|codecs)?([^#;|&`]*)")
    for path in DOCS:
        for number, code in _code(path):
            for m in invocation.finditer(code):
                command = "edge" if m.group(0).startswith("python") else m.group(1)
                if command is None:
                    continue
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(2)):
                    found.append((f"{_rel(path)}:{number}", command, flag))
    return found


def test_the_docs_show_command_lines():
    assert len(documented_command_flags()) > 20  # the extraction finds the README's and the guides' commands


@pytest.mark.parametrize("where,command,flag", documented_command_flags())
def test_a_documented_command_line_flag_exists(where: str, command: str, flag: str):
    assert flag in _options(command), f"{where}: `streamproc {command} {flag}`: no such option"


# Flags of other tools the docs name in code spans: upstream engines' server flags, docker, nsc,
# nats-server, the Dockerfile's RUN, the benchmark scripts (benchmarks/*.py), the key example.
OTHER_TOOLS_FLAGS = {
    "--api-key", "--enable-metrics", "--enable-prompt-tokens-details", "--incremental-streaming-output",
    "--max-logprobs", "--preferred-sampling-params",  # SGLang / vLLM servers
    "--build", "--secret", "--mount", "--allow-pub", "--signal",  # docker compose / build, nsc, nats-server
    "--paced", "--rounds", "--chunks",  # benchmarks/durable.py, benchmarks/scale.py
    "--x",  # configuration.md: the source a --print-config shows, `flag --x`
}


def in_doc_code(pattern: str) -> dict[str, str]:
    """Every match of ``pattern`` written in a code span or block of the docs -> where first."""
    found: dict[str, str] = {}
    for path in DOCS:
        for number, code in _code(path):
            for name in re.findall(pattern, code):
                found.setdefault(name, f"{_rel(path)}:{number}")
    return found


def flags_in_doc_code() -> dict[str, str]:
    """Every ``--flag`` written in a code span or block of the docs -> where first."""
    return in_doc_code(r"(?<![\w-])--[a-z][a-z0-9-]*")


def test_a_flag_the_docs_name_anywhere_is_an_option_of_a_command():
    """The check above reads flags after ``streamproc <command>``; prose names many more on their own
    (`--shed-min-idle`, `--max-finished-bytes`): a renamed or removed option left there is caught
    here, whichever command had it."""
    options = {s for command in _subparsers() for s in _options(command)}
    options |= {s for a in build_parser()._actions for s in a.option_strings}
    named = flags_in_doc_code()
    assert len(named) > 100  # the extraction reads the docs' code spans
    unknown = {flag: where for flag, where in named.items() if flag not in options | OTHER_TOOLS_FLAGS}
    assert unknown == {}, "no streamproc command has these options (another tool's: OTHER_TOOLS_FLAGS)"


# Variables the docs write that nothing here reads: nats-server configuration examples in security.md.
EXAMPLE_VARIABLES = {"STREAMPROC_EDGE_EU1_PASSWORD", "STREAMPROC_TOKEN"}


def variables_in_doc_code() -> dict[str, str]:
    """Every ``STREAMPROC_*`` name written in a code span or block of the docs -> where first."""
    return in_doc_code(r"\bSTREAMPROC_[A-Z0-9_]*[A-Z0-9]\b")


def test_a_variable_the_docs_name_is_read_by_a_command_or_the_code():
    """A ``STREAMPROC_*`` name in the docs is a setting's variable (as ``--help`` names it), or a name
    the code, the shipped nats-server configuration or the compose file spells out (stream and bucket
    names, the servers' password variables, test switches); a misspelled or retired variable is
    neither, and a user who sets it gets a warning and the default."""
    helped = {name for command, parser in _subparsers().items() for a in parser._actions
              for name in re.findall(r"STREAMPROC_[A-Z0-9_]*[A-Z0-9]", a.help or "")}
    sources = [*(p for d in ("streamproc", "codecs", "benchmarks") for p in (ROOT / d).rglob("*.py")),
               ROOT / "deploy" / "nats-server.conf", ROOT / "docker-compose.yml"]
    spelled = set(re.findall(r"\bSTREAMPROC_[A-Z0-9_]*[A-Z0-9]\b", "\n".join(p.read_text() for p in sources)))
    # From the tests, only the switches they read from the environment: a test may spell a misspelled
    # variable on purpose (the warning it gets), which must not make the docs' misspelling pass.
    spelled |= set(re.findall(r"""(?:environ\.get\(|getenv\(|environ\[)\s*["'](STREAMPROC_[A-Z0-9_]*[A-Z0-9])["']""",
                              "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))))
    named = variables_in_doc_code()
    assert len(named) > 80  # the extraction reads the docs' code spans
    unknown = {name: where for name, where in named.items() if name not in helped | spelled | EXAMPLE_VARIABLES}
    assert unknown == {}


def _table_rows(path: Path) -> list[tuple[int, list[str]]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("| `--"):
            rows.append((number, [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]))
    return rows


def _same_default(documented: str, helped: str) -> bool:
    text = documented.strip("`").split("`")[0].strip()
    helped = helped.strip("'")
    if text in ("", "empty"):
        return helped in ("", "()")
    if text.endswith(" MiB"):  # README: `512 MiB`
        text = str(int(text.split()[0]) * 2 ** 20)
    try:
        return float(text) == float(helped)
    except ValueError:
        return text.lower() == helped.lower()


SETTINGS_TABLES = [("README.md", "run", False), ("docs/configuration.md", "run", True),
                   ("docs/edge.md", "edge", True)]


@pytest.mark.parametrize("doc,command,with_env", SETTINGS_TABLES)
def test_a_settings_table_states_flags_variables_and_defaults_as_the_help_does(doc: str, command: str,
                                                                               with_env: bool):
    settings, options, problems = _settings(command), _options(command), []
    for number, cells in _table_rows(ROOT / doc):
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        envs = re.findall(r"`(STREAMPROC_[A-Z0-9_]+)`", cells[1]) if with_env else []
        default = cells[2] if with_env else cells[1]
        for i, flag in enumerate(flags):
            if flag not in options:
                problems.append(f"{doc}:{number}: {flag} is no option of `streamproc {command}`")
                continue
            if flag not in settings or len(flags) > 1:  # a row of several flags states no one default
                continue
            env, helped = settings[flag]
            if with_env and envs and envs[i] != env:
                problems.append(f"{doc}:{number}: {flag}'s variable is {env}, not {envs[i]}")
            if not _same_default(default, helped):
                problems.append(f"{doc}:{number}: {flag}'s default is {helped}, not {default}")
    assert problems == []


_UNITS = {"ms": 1e-3, "s": 1, "min": 60, "h": 3600, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "Mi": 2 ** 20}
_LEADING_AMOUNT = re.compile(r"([0-9][0-9,]*(?:\.[0-9]+)?)(?:\s*(ms|s|min|h|KiB|MiB|GiB|Mi)\b)?")


def _leading_amount(cell: str) -> float | None:
    """``10 s`` -> 10, ``2 ms`` -> 0.002, ``32 MiB of chunk bodies ...`` -> 33554432; None: no number first."""
    found = _LEADING_AMOUNT.match(cell.strip("` "))
    if found is None:
        return None
    return float(found.group(1).replace(",", "")) * _UNITS.get(found.group(2) or "", 1)


def _section_rows(doc: str, heading: str) -> list[tuple[int, list[str]]]:
    """The ``| `--flag` | ...`` rows under ``heading``, up to the next heading of the same or a higher level."""
    lines = (ROOT / doc).read_text().splitlines()
    start, level = lines.index(heading), heading.split()[0]
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#") and len(line.split()[0]) <= len(level):
            break
        if line.startswith("| `--"):
            rows.append((number, [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]))
    return rows


def test_a_leading_amount_reads_the_units_the_prose_tables_use():
    assert [_leading_amount(c) for c in ("10 s", "2 ms", "`64`", "32 MiB of chunk bodies", "256 KiB of",
                                         "4 Mi messages", "10000 requests", "200,000 finished", "-")] == [
        10, 0.002, 64, 2 ** 25, 2 ** 18, 2 ** 22, 10000, 200000, None]


# Tables of operations.md that give a ``run`` setting's default in their second cell, in prose
# (``10 s``, ``32 MiB of chunk bodies per request``): none of the settings tables above, so the
# settings-table check did not read them.
PROSE_DEFAULT_TABLES = [("docs/operations.md", "## Tuning"), ("docs/operations.md", "## Limits and abuse")]


@pytest.mark.parametrize("doc,heading", PROSE_DEFAULT_TABLES)
def test_a_prose_table_states_each_default_as_the_help_does(doc: str, heading: str):
    settings, problems, checked = _settings("run"), [], 0
    for number, cells in _section_rows(doc, heading):
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        if len(flags) != 1 or flags[0] not in settings:  # a row of several flags states no one default
            problems += [f"{doc}:{number}: {f} is no setting of `streamproc run`" for f in flags if f not in settings]
            continue
        documented, helped = _leading_amount(cells[1]), float(settings[flags[0]][1])
        checked += 1
        if documented is None or abs(documented - helped) > 1e-9 * max(1.0, helped):
            problems.append(f"{doc}:{number}: {flags[0]}'s default is {settings[flags[0]][1]}, not {cells[1][:40]!r}")
    assert checked >= 8 and problems == []


@pytest.mark.parametrize("doc,command", [("docs/configuration.md", "run"), ("docs/edge.md", "edge")])
def test_a_settings_table_lists_every_setting_of_its_command(doc: str, command: str):
    rows = "\n".join(line for line in (ROOT / doc).read_text().splitlines() if line.startswith("| "))
    missing = [f"{flag} ({env})" for flag, (env, _) in _settings(command).items()
               if f"`{flag}`" not in rows and f"`{env}`" not in rows]
    assert missing == [], f"{doc}: settings of `streamproc {command}` in no table row"


def exported_metrics() -> set[str]:
    """Names as /metrics shows them: counters with ``_total``, gauges and histograms as named."""
    processor = SimpleNamespace(
        correlator=SimpleNamespace(stats=Stats(), error_kinds={}, omission_reasons={}, inflight=0, buffered_bytes=lambda: 0,
                                   retained_bytes=lambda: 0, join_wait=LatencyHistogram(),
                                   join_seconds=LatencyHistogram()),
        io=IOStats(),
        input=SimpleNamespace(stats=DurableStats(), outbox=SimpleNamespace(
            puback_latency=LatencyHistogram(), result_latency=LatencyHistogram())),
        pipeline=SimpleNamespace(result_latency=LatencyHistogram()),
        control_replies_refused=0, control_migrates_throttled=0, control_migrates_dropped=0, status_server=SimpleNamespace(evicted=0, accept_errors=0),
        connected=True, ready=True)
    families = [*ProcessorCollector(processor).collect(), *EdgeCollector(EdgeMetrics(), ReadBudget(1)).collect()]
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


def documented_metrics() -> dict[str, str]:
    """Metric-looking names in the docs -> where first; package names and ``streamproc_edge_*``-style
    prefixes are not metrics."""
    found: dict[str, str] = {}
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"\bstreamproc_[a-z0-9_]*[a-z0-9]\b(?!\.)", line):
                if re.fullmatch(r"streamproc_(sglang|vllm)(_zstd)?", name):
                    continue
                found.setdefault(name, f"{_rel(path)}:{number}")
    return found


def test_the_collectors_export_the_usual_metrics():
    names = exported_metrics()
    assert {"streamproc_results_total", "streamproc_durable_acks_total", "streamproc_edge_streams_active",
            "streamproc_join_wait_seconds"} <= names and len(names) > 100


def test_every_documented_metric_is_exported_as_written():
    exported = exported_metrics()
    wrong = [f"{where}: {name}" + (f" (exported as {name}_total)" if name + "_total" in exported else "")
             for name, where in documented_metrics().items()
             if name not in exported and re.sub(r"_(bucket|count|sum)$", "", name) not in exported]
    assert wrong == []


def test_every_exported_metric_is_documented():
    documented = documented_metrics()
    assert sorted(exported_metrics() - set(documented)) == []


def test_the_unary_status_table_has_every_error_kind():
    text = (ROOT / "docs/edge.md").read_text()
    table = text[text.index("| kind | status |"):].split("\n\n")[0]
    statuses = {}
    for row in table.splitlines()[2:]:
        kinds, status = [c.strip() for c in row.strip("|").split("|")]
        for kind in re.findall(r"`([a-z_]+)`", kinds):
            statuses[kind] = int(status)
    documented = {kind.value: statuses.get(kind.value) for kind in ErrorKind}
    assert documented == {kind.value: ERROR_STATUS[kind] for kind in ErrorKind}


LOG_EVENTS_DOC, LOG_EVENTS_HEADING = "docs/operations.md", "### Log events"
LEVELS = ("debug", "info", "warning", "error")
# An event name built at run time: (file, source of the name) -> (pattern as documented, its values).
DYNAMIC_EVENTS = {
    ("streamproc/core/correlator.py", "f'error:{kind.value}'"): ("error:<kind>", [k.value for k in ErrorKind]),
}
# Names passed on, not made: the limiter's own ``event``; a Notice's, collected where it is built.
FORWARDED = {("streamproc/logs.py", "event"), ("streamproc/nats/input.py", "notice.event")}
NAMED_CONSTANTS = {f"OmissionReason.{m.name}": m.value for m in OmissionReason} | {"UNSTORABLE_CHUNK": UNSTORABLE_CHUNK}


def _level(node: ast.expr) -> str | None:
    """``logging.WARNING`` -> ``warning``; a level chosen at run time -> None (not checked)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "logging":
        return node.attr.lower()
    return None


def logged_events() -> tuple[dict[str, set[str | None]], list[str]]:
    """Event name -> the levels it is logged at (None: chosen at run time), and the names the code
    builds in a way this reader cannot resolve. Calls read: ``log_event(logger, level, name)``,
    ``<limiter>.log(logging.LEVEL, name)``, ``Notice(request_id, name)`` (logged at warning, debug
    for ``QUIET_EVENTS``) and a ``{"event": name}`` record (a library line, at the library's level)."""
    found: dict[str, set[str | None]] = {}
    unresolved: list[str] = []
    for path in sorted(p for d in ("streamproc", "codecs") for p in (ROOT / d).rglob("*.py")):
        rel = _rel(path)
        for node in ast.walk(ast.parse(path.read_text())):
            named: list[tuple[ast.expr, str | None]] = []
            if isinstance(node, ast.Dict):
                named = [(v, None) for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and k.value == "event"]
            elif isinstance(node, ast.Call):
                f = node.func
                callee = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if callee == "log_event" and len(node.args) >= 3:
                    named = [(node.args[2], _level(node.args[1]))]
                elif (callee == "log" and isinstance(f, ast.Attribute) and len(node.args) >= 2
                      and _level(node.args[0]) is not None):
                    named = [(node.args[1], _level(node.args[0]))]
                elif callee == "Notice" and len(node.args) >= 2:
                    named = [(node.args[1], "notice")]
            for arg, level in named:
                branches = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
                for branch in branches:
                    source = ast.unparse(branch)
                    if isinstance(branch, ast.Constant) and isinstance(branch.value, str):
                        name = branch.value
                    elif source in NAMED_CONSTANTS:
                        name = NAMED_CONSTANTS[source]
                    elif (rel, source) in DYNAMIC_EVENTS:
                        name = DYNAMIC_EVENTS[(rel, source)][0]
                    elif (rel, source) in FORWARDED:
                        continue
                    else:
                        unresolved.append(f"{rel}:{branch.lineno}: {source}")
                        continue
                    if level == "notice":
                        level = "debug" if name in QUIET_EVENTS else "warning"
                    found.setdefault(name, set()).add(level)
    return found, unresolved


def documented_log_events() -> dict[str, tuple[int, str, str]]:
    """Event name -> (line, level cell, whole row) of the log events table; a row may name several."""
    lines = (ROOT / LOG_EVENTS_DOC).read_text().splitlines()
    if LOG_EVENTS_HEADING not in lines:
        return {}
    start = lines.index(LOG_EVENTS_HEADING)
    rows: dict[str, tuple[int, str, str]] = {}
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = (number, cells[1], line)
    return rows


def test_the_code_logs_the_usual_events():
    events, _ = logged_events()
    assert {"started", "stopped", "lease_acquired", "result_given_up", "subscribe_failed", "log_suppressed",
            "overloaded", "prefill_timeout", "error:<kind>", "result_batch_refused", "result_not_stored",
            "http_request"} <= set(events) and len(events) > 100


def test_every_event_name_the_code_logs_is_read():
    assert logged_events()[1] == [], "an event name built at run time: add it to DYNAMIC_EVENTS"


def test_every_logged_event_is_in_the_log_events_table():
    documented = documented_log_events()
    missing = sorted(set(logged_events()[0]) - set(documented))
    text = "\n".join(path.read_text() for path in DOCS)
    nowhere = [name for name in missing if not re.search(rf"(?<![\w:<]){re.escape(name)}(?![\w:])", text)]
    assert missing == [], (f"{LOG_EVENTS_DOC} ({LOG_EVENTS_HEADING}) lacks {len(missing)} events; "
                           f"{len(nowhere)} of them in no doc at all: {nowhere}")


def test_the_log_events_table_names_only_logged_events_at_their_levels():
    events, problems = logged_events()[0], []
    for name, (number, level_cell, _) in documented_log_events().items():
        where = f"{LOG_EVENTS_DOC}:{number}: `{name}`"
        if name not in events:
            problems.append(f"{where} is not logged by the code")
        elif None not in events[name] and set(re.findall("|".join(LEVELS), level_cell)) != events[name]:
            problems.append(f"{where}: logged at {sorted(events[name])}, the table says {level_cell!r}")
    assert problems == []


@pytest.mark.parametrize("key", sorted(DYNAMIC_EVENTS))
def test_a_dynamic_event_row_lists_every_value(key: tuple[str, str]):
    pattern, values = DYNAMIC_EVENTS[key]
    rows = documented_log_events()
    assert pattern in rows, f"{LOG_EVENTS_DOC}: no row for `{pattern}`"
    row = rows[pattern][2]
    assert [v for v in values if f"`{v}`" not in row] == []


def test_the_pull_permission_is_written_as_the_shipped_config_grants_it():
    """``$JS.API.CONSUMER.MSG.NEXT.<stream>.>`` is what deploy/nats-server.conf grants and exports;
    ``ReplayRefused`` named ``.*`` and a changelog entry said ``.*`` while the docs said ``.>``. A
    reader who copied ``.*`` gets a narrower grant than the conf's (one token only): the same
    right today, a different line to compare when a refusal is being diagnosed."""
    conf = (ROOT / "deploy" / "nats-server.conf").read_text()
    assert '"$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.>"' in conf
    wildcard = re.compile(r"CONSUMER\.MSG\.NEXT\.(?:STREAMPROC_RESULTS|<stream>|\{[^}]*\})\.\*")
    written = [*ROOT.glob("docs/*.md"), ROOT / "CHANGELOG.md", ROOT / "README.md", *ROOT.glob("streamproc/**/*.py"),
               *ROOT.glob("tests/*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in written
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if wildcard.search(line) and path.name != "test_docs_match_code.py"]
    assert found == []


def test_the_experts_panel_explains_every_omission_reason():
    """The live page's experts panel lists every ``<field>_unavailable_reason`` a result carries, with its
    meaning from its own table (``REASONS`` in experts.js): the reasons it lacked (``decode_error``, a
    migrated request's ``stitch_corrupt`` and ``stitch_incomplete`` on ``metrics``, ``created``,
    ``weight_versions`` or the rows; ``fold_ambiguous``) were shown as "a reason this page does not know"."""
    script = (ROOT / "streamproc/edge/page/experts.js").read_text()
    table = re.search(r"const REASONS = \{(.*?)\n  \};", script, re.S)
    assert table is not None
    assert set(re.findall(r"^\s*(\w+):", table.group(1), re.M)) == {reason.value for reason in OmissionReason}
