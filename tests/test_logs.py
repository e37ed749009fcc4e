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


# Characters that JSON leaves as they are but that split a line (str.splitlines, many log viewers:
# U+2028, U+2029, NEL) or drive a terminal (C1 CSI U+009B, DEL).
_LINE_BREAKERS = "\u2028\u2029\x85\x9b\x7f"


@pytest.mark.anyio
async def test_json_log_lines_keep_line_separators_and_c1_controls_from_a_subject_inert(nats_url, tmp_path):
    """A chunk subject is the publisher's choice, and `event=unreadable_message` logs it. logfmt
    escaped every unprintable character; JSON left U+2028, U+2029, NEL, the C1 CSI and DEL raw
    (msgspec escapes only what JSON requires), so one line read back as several (str.splitlines)
    and a terminal could act on the CSI. The honest request beside them is answered."""
    from helpers import connection, free_port, scrape, wait_until

    from streamproc import ChunkPublisher, follow
    from streamproc.wire import Subjects

    log_path, port = tmp_path / "run.log", free_port()
    subjects = Subjects("streamproc")
    hostile = [f"streamproc.chunks.a{c}level=error.agg" for c in _LINE_BREAKERS]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "streamproc.cli", "run", "--nats-url", nats_url, "--mode", "core",
                                 "--log-format", "json", "--http-port", str(port)],
                                stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL)
    try:
        await wait_until(lambda: '"started"' in log_path.read_text(), 20, "the processor started")
        async with connection(nats_url) as nc:
            for subject in hostile:
                await nc.publish(subject, b"{}", headers={"Streamproc-Seq": "0"})
            async with follow(nc, subjects, "honest-1", timeout=10) as results:
                await ChunkPublisher(nc, subjects).publish_leg("honest-1", "agg", [b'{"text":"ok"}'])
                assert [r.body for r in await results.collect()] == [b'{"text":"ok"}']
        await wait_until(lambda: scrape(port).get("streamproc_unreadable_total") == len(hostile), 10,
                         "every hostile subject counted unreadable")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log_path.read_text()
    text = log_path.read_text()
    assert text.splitlines() == text.split("\n")[:-1]  # no line holds a character splitlines splits on
    assert all(line.isprintable() for line in text.splitlines())
    records = parse_lines(text, "json")
    logged = [r["subject"] for r in records if r["event"] == "unreadable_message"]
    assert logged == hostile  # escaped, not lost: JSON reads them back exactly


def test_json_format_escapes_what_logfmt_escapes_and_reads_back_exactly():
    record = logging.LogRecord("streamproc.x", logging.INFO, __file__, 1, "ignored", None, None)
    value = "a\x0bb\x1b[31m" + _LINE_BREAKERS + "é😀\U000e0001"
    record.streamproc_fields = {"event": "odd", "value": value}
    line = StructuredFormatter("json").format(record)
    assert line.isprintable() and "é😀" in line  # readable text stays as it is
    assert json.loads(line)["value"] == value


def test_an_exception_group_is_logged_as_the_error_it_holds():
    """anyio's task groups wrap even a single failure: a durable recovery lookup that timed out was
    logged ``error="ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)"`` (found by an
    attack on durable mode), so the operator never saw the timeout."""
    from streamproc.logs import error_text

    timeout = TimeoutError("nats: timeout")
    assert error_text(ExceptionGroup("unhandled errors in a TaskGroup", [timeout])) == "TimeoutError: nats: timeout"
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [ValueError("bad")])])
    assert error_text(nested) == "ValueError: bad"
    several = ExceptionGroup("unhandled errors in a TaskGroup", [timeout, ValueError("bad")])
    assert error_text(several) == "2 errors, the first TimeoutError: nats: timeout"
    assert error_text(KeyError("k")) == "KeyError: 'k'"
