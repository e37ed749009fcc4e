"""A log line's traceback and a library's message are bounded, whatever the exception.

``StructuredFormatter`` wrote ``formatException(exc_info)`` whole: a codec plugin's fold raising with a
10 MB message (an exception text may echo a worker's input) was a 10 MB ``event=fold_failed`` line, and
100,000 frames or 100,000 chained exceptions a line of megabytes. Now (``logs.bounded_traceback``) the
last ``MAX_LOG_FRAMES`` frames of the last ``MAX_LOG_CHAIN`` exceptions are kept, each message cut
(``cut_error_text``), the whole at most ``MAX_LOG_TRACEBACK`` bytes as JSON; a library's ``msg`` at most
``MAX_LOG_MESSAGE``. Unit tests on the formatter, both formats, and a real ``streamproc edge`` subprocess
with the loud codec (helpers.loud_codec_site) and a real nats-server.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
import types

import httpx
import pytest
from edge_harness import publish_results, running_edge
from helpers import loud_codec_site

from streamproc.core.errors import MAX_LOG_FRAMES, MAX_LOG_MESSAGE, MAX_LOG_TRACEBACK
from streamproc.core.wire import Subjects
from streamproc.logs import StructuredFormatter

pytestmark = [pytest.mark.timeout(120)]

FORMATS = ("logfmt", "json")
# ts, level, logger, event, msg and the keys around the traceback: far less than this
HEAD = 300
HUGE = 10_000_000


def record_of(exc: BaseException, tb: types.TracebackType | None = None) -> logging.LogRecord:
    return logging.LogRecord("streamproc.test", logging.ERROR, __file__, 1, "failed", None,
                             (type(exc), exc, tb if tb is not None else exc.__traceback__))


def traceback_of(line: str, fmt: str) -> str:
    """The traceback field read back (a JSON string in both formats; it is the last field)."""
    if fmt == "json":
        return json.loads(line)["traceback"]
    key = " traceback="
    assert key in line, line[:300]
    return json.loads(line[line.index(key) + len(key):])


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("char", ["x", "\x01", "\u2028"])
def test_a_huge_exception_message_is_cut_in_the_line(fmt, char):
    exc = raised(RuntimeError(char * HUGE))
    line = StructuredFormatter(fmt).format(record_of(exc))
    assert "\n" not in line
    assert len(line) <= HEAD + MAX_LOG_TRACEBACK, len(line)
    text = traceback_of(line, fmt)
    assert text.startswith("Traceback (most recent call last):\n"), text[:200]
    assert "in raised\n" in text  # the frames are kept
    assert "\nRuntimeError: " + char * 50 in text, text[-700:]
    assert text.endswith(f"... ({len('RuntimeError: ') + HUGE} characters)"), text[-100:]


def deep_traceback(frames: int) -> tuple[BaseException, types.TracebackType]:
    """An exception with a traceback of ``frames`` entries, built without recursing: one frame of
    :func:`raised` at two instructions on different lines, alternating (``traceback`` folds only
    consecutive repeats into ``[Previous line repeated ...]``), so each entry is written."""
    exc = raised(ValueError("deep"))
    tb = exc.__traceback__
    assert tb is not None
    offsets = {}
    for start, _end, line in raised.__code__.co_lines():
        if line is not None:
            offsets.setdefault(line, start)
    assert len(offsets) >= 2, offsets
    lastis = list(offsets.values())[-2:]
    head = None
    for i in range(frames):
        head = types.TracebackType(head, tb.tb_frame, lastis[i % 2], 1)
    return exc, head


@pytest.mark.parametrize("fmt", FORMATS)
def test_100000_frames_keep_the_last_ones(fmt):
    exc, tb = deep_traceback(100_000)
    line = StructuredFormatter(fmt).format(record_of(exc, tb))
    assert len(line) <= HEAD + MAX_LOG_TRACEBACK, len(line)
    text = traceback_of(line, fmt)
    assert f"[{100_000 - MAX_LOG_FRAMES} earlier frames not shown]" in text, text[:300]
    assert text.count(", in raised") == MAX_LOG_FRAMES
    assert text.endswith("\nValueError: deep")


def test_without_the_private_walk_the_public_one_keeps_the_bound(monkeypatch):
    """A later CPython without ``traceback._walk_tb_with_full_positions`` (private in 3.11 and 3.12):
    the public ``walk_tb`` / ``StackSummary.extract`` keep the same last frames, without carets."""
    import traceback

    from streamproc import logs
    monkeypatch.setattr(logs, "_WALK", traceback.walk_tb)
    monkeypatch.setattr(logs, "_EXTRACT", traceback.StackSummary.extract)
    exc, tb = deep_traceback(100_000)
    text = traceback_of(StructuredFormatter("json").format(record_of(exc, tb)), "json")
    assert len(text) <= MAX_LOG_TRACEBACK, len(text)
    assert f"[{100_000 - MAX_LOG_FRAMES} earlier frames not shown]" in text, text[:300]
    # walk_tb reads each entry's tb_lineno, the same in deep_traceback's: traceback folds the repeats
    repeated = re.search(r"\[Previous line repeated (\d+) more times\]", text)
    assert text.count(", in raised") + (int(repeated.group(1)) if repeated else 0) == MAX_LOG_FRAMES, text
    assert text.endswith("\nValueError: deep")


@pytest.mark.parametrize("fmt", FORMATS)
def test_100000_chained_exceptions_keep_the_last_ones(fmt):
    exc = None
    for i in range(100_000):
        new = raised(KeyError(f"link {i} " + "z" * 1000))
        new.__cause__ = exc
        exc = new
    line = StructuredFormatter(fmt).format(record_of(exc))
    assert len(line) <= HEAD + MAX_LOG_TRACEBACK, len(line)
    text = traceback_of(line, fmt)
    assert "earlier exceptions of the chain not shown]" in text, text[:300]
    assert "The above exception was the direct cause of the following exception:" in text
    assert "\nKeyError: 'link 99999 zzz" in text  # the one logged
    assert "link 0 " not in text


def test_a_cycle_of_causes_ends():
    first, second = raised(KeyError("a")), raised(KeyError("b"))
    first.__cause__, second.__cause__ = second, first
    text = traceback_of(StructuredFormatter("json").format(record_of(first)), "json")
    assert "KeyError: 'a'" in text and "KeyError: 'b'" in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_library_message_is_cut(fmt):
    record = logging.LogRecord("nats.aio.client", logging.ERROR, __file__, 1, "nats: error %s", ("q" * HUGE,),
                               None)
    line = StructuredFormatter(fmt).format(record)
    assert len(line) <= HEAD + MAX_LOG_MESSAGE, len(line)
    assert "nats: error qqqq" in line
    assert f"... ({len('nats: error ') + HUGE} characters)" in line


def divide(a: int, b: int) -> float:
    return 1 + a / b  # a sub-expression: Python writes carets under it


def test_a_short_traceback_is_the_one_python_writes():
    plain = raised(RuntimeError("plain"))
    try:
        try:
            divide(1, 0)
        except ZeroDivisionError as exc:
            try:
                raise KeyError("during") from exc
            except KeyError:
                raise ValueError("last")  # noqa: B904 - the implicit __context__ is the point
    except ValueError as exc:
        chained = exc
    for exc in (plain, chained):
        text = traceback_of(StructuredFormatter("json").format(record_of(exc)), "json")
        assert text == logging.Formatter().formatException((type(exc), exc, exc.__traceback__))
    assert "^^^^^" in text and "direct cause" in text and "During handling" in text


def body(rid: str) -> bytes:
    return json.dumps({"text": rid, "output_ids": [1, 2, 3], "meta_info": {"id": rid}}).encode()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.parametrize("fmt", FORMATS)
async def test_the_edge_logs_a_loud_fold_failure_on_a_bounded_line(server, nc, tmp_path, fmt):
    """A real edge whose codec's fold raises with 10 MB (``loud-huge``) or 100,000 control characters
    (``loud-ctl``): each ``fold_failed`` line is at most MAX_LOG_TRACEBACK + HEAD characters, and names
    the error and the start of its message."""
    subjects = Subjects()
    env = {"PYTHONPATH": f"{loud_codec_site(tmp_path)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rids = ["loud-huge", "loud-ctl"]
    with running_edge(server.url, "--format", "loud", "--ensure-results-stream", "--log-format", fmt,
                      env=env) as edge:
        for rid in rids:
            await publish_results(nc, subjects, rid, [body(rid), body(rid)])
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            for rid in rids:
                assert (await client.get(f"/v1/results/{rid}?stream=false")).status_code == 500
        log = edge.log()
    lines = [line for line in log.splitlines() if "fold_failed" in line]
    assert len(lines) == 2, [line[:200] for line in log.splitlines()]
    for line in lines:
        assert len(line) <= HEAD + MAX_LOG_TRACEBACK, len(line)
        text = traceback_of(line, fmt)
        assert "in fold\n" in text, text[:2000]
        assert "\nRuntimeError: xxxx" in text or "\nRuntimeError: \x01\x01\x01" in text, text[-700:]
    assert sys.getsizeof(log) < 4 * MAX_LOG_TRACEBACK + 100_000  # the whole log, not a 10 MB line


def test_a_traceback_over_the_bound_keeps_its_start_and_end():
    from streamproc.logs import _cut_middle
    text = "Traceback (most recent call last):\n" + "\x01" * 100_000 + "\nRuntimeError: the last"
    cut = _cut_middle(text, MAX_LOG_TRACEBACK)
    assert len(json.dumps(cut)) - 2 <= MAX_LOG_TRACEBACK
    assert cut.startswith("Traceback (most recent call last):\n\x01")
    assert cut.endswith("\x01\nRuntimeError: the last")
    assert "characters not shown ...]" in cut


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("char", ["E", "\x01"])
def test_a_huge_field_is_cut(fmt, char):
    """``error=error_text(exc)`` (49 log_event calls pass one) carried an exception's text whole."""
    from streamproc.logs import error_text, log_event
    stream = io.StringIO()
    logger = logging.getLogger("streamproc.test.fields")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(StructuredFormatter(fmt))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        log_event(logger, logging.WARNING, "malformed_result", request_id="r1",
                  error=error_text(ValueError(char * HUGE)), short="kept whole " + "s" * 600)
    finally:
        logger.removeHandler(handler)
    line = stream.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= HEAD + 2 * MAX_LOG_MESSAGE, len(line)
    fields = json.loads(line) if fmt == "json" else None
    error = fields["error"] if fields else json.loads(line[line.index(" error=") + 7:line.index(" short=")])
    assert error.startswith("ValueError: " + char * 10)
    assert error.endswith(f"... ({len('ValueError: ') + HUGE} characters)")
    assert "kept whole " + "s" * 600 in line
