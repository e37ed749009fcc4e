"""One log format for every component, checked on real processes: `streamproc run` and
`streamproc edge` write logfmt by default and JSON with --log-format json, Uvicorn's own lines
included, and a normal SIGTERM shutdown writes no warning."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
import sys
import time

import pytest
from edge_harness import EdgeProcess, http_status

from streamproc.logs import StructuredFormatter, configure, kv, log_event

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]

_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?: |$)')


def parse_logfmt(line: str) -> dict[str, str]:
    """Strict: the whole line must be key=value pairs (quoted values are JSON strings)."""
    fields, pos = {}, 0
    while pos < len(line):
        match = _PAIR.match(line, pos)
        assert match, f"not logfmt at {pos}: {line!r}"
        key, value = match.groups()
        fields[key] = json.loads(value) if value.startswith('"') else value
        pos = match.end()
    return fields


def parse_lines(text: str, fmt: str) -> list[dict]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "no log lines"
    records = [json.loads(line) if fmt == "json" else parse_logfmt(line) for line in lines]
    for record in records:
        assert {"ts", "level", "logger", "event"} <= record.keys(), record
    return records


def assert_quiet_shutdown(records: list[dict]) -> None:
    loud = [r for r in records if r["level"] in ("warning", "error", "critical")]
    assert loud == []


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_processor_subprocess_log_lines_parse_and_shutdown_is_quiet(nats_url, fmt, tmp_path):
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "streamproc.cli", "run", "--nats-url", nats_url,
                                 "--mode", "durable", "--partitions", "2", "--log-format", fmt],
                                stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while '"started"' not in log_path.read_text() and "event=started" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log_path.read_text()
    records = parse_lines(log_path.read_text(), fmt)
    events = [r["event"] for r in records]
    assert "started" in events and events[-1] == "stopped"
    assert_quiet_shutdown(records)


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_edge_routes_uvicorn_logs_through_the_one_format_and_stops_quietly(nats_url, fmt, tmp_path):
    key = tmp_path / "edge.key"  # with a key: an --insecure-demo edge warns that it is one at start
    key.write_bytes(b"k" * 32)
    edge = EdgeProcess(nats_url, "--log-format", fmt, "--auth-key-file", str(key)).start()
    try:
        assert http_status(f"{edge.url}/healthz") == 200
        edge.proc.send_signal(signal.SIGTERM)
        assert edge.proc.wait(15) == 0  # a signal is the normal way to stop: not 143
        records = parse_lines(edge.log(), fmt)
    finally:
        edge.close()
    assert any(r["event"] == "http_request" and r["path"] == "/healthz" and str(r["status"]) == "200"
               for r in records)
    assert any(r["logger"].startswith("uvicorn") and r["event"] == "log" for r in records)
    assert any(r["event"] == "connected" for r in records)
    assert_quiet_shutdown(records)


def test_formatter_keeps_hostile_values_on_one_parseable_line():
    stream = io.StringIO()
    configure("DEBUG", "logfmt", stream)
    try:
        log = logging.getLogger("streamproc.test")
        log_event(log, logging.WARNING, "odd", detail='a "quoted" = value\nwith a newline \\ and tab\t', empty="")
        logging.getLogger("somelib").info("plain %s message", "library")
        try:
            raise ValueError("boom")
        except ValueError:
            log_event(log, logging.ERROR, "bug", exc_info=True)
    finally:
        logging.getLogger().handlers.clear()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    odd, plain, bug = map(parse_logfmt, lines)
    assert odd["detail"] == 'a "quoted" = value\nwith a newline \\ and tab\t' and odd["empty"] == ""
    assert (plain["event"], plain["msg"], plain["logger"]) == ("log", "plain library message", "somelib")
    assert "ValueError: boom" in bug["traceback"] and bug["level"] == "error"


def test_json_format_carries_typed_fields():
    record = logging.LogRecord("streamproc.x", logging.INFO, __file__, 1, "ignored", None, None)
    record.streamproc_fields = {"event": "stats", "chunks": 3, "ratio": 0.5}
    line = json.loads(StructuredFormatter("json").format(record))
    assert (line["event"], line["chunks"], line["ratio"], line["level"]) == ("stats", 3, 0.5, "info")
    assert kv(a="b c") == 'a="b c"'


def test_unprintable_characters_from_attacker_chosen_values_are_escaped_in_logfmt():
    """A subject or id a publisher chose may hold VT, ESC, DEL or U+2028: the line keeps them inert."""
    from streamproc.logs import kv

    line = kv(subject="a\x0bb\x1b[31m", rid="del\x7f", sep="\u2028", plain="ok", accent="é")
    assert line == 'subject="a\\u000bb\\u001b[31m" rid="del\\u007f" sep="\\u2028" plain=ok accent=é'
    assert line.isprintable()
