"""Server-sent event framing, as the SGLang server and Dynamo's frontend frame native routes.

Each result body becomes one event whose ``data`` is the body's bytes, inserted verbatim; the
stream ends with ``data: [DONE]``. SSE cannot carry a line terminator inside a field, so a body
with CR/LF bytes is split into several ``data:`` lines, which a conforming client joins back with
``\\n`` (CRLF and lone CR inside a body therefore arrive as LF). Worker bodies are compact JSON,
which escapes newlines inside strings, so in practice every body is exactly one ``data:`` line.
Bytes are not decoded here: clients decode the stream as UTF-8, as the SSE standard requires.
"""

from __future__ import annotations

import re

from ..core.errors import shown
from ..core.wire import ResultInfo

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
MEDIA_TYPE = "text/event-stream"

# An event with an id and a body of one line (every result's, in practice): ``RESULT_EVENT % (seq, body)``.
RESULT_EVENT = b"id: %d\ndata: %b\n\n"

_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def result_event(result: ResultInfo) -> bytes:
    """``event(result.body, id=result.seq)``, the frame ``Edge.frames`` writes. The fan-out's
    direct writes frame one per SSE event, so a body of one line is formatted here, without
    ``event``'s call (docs/benchmarks.md, "Calls per SSE event"); ``DirectFrames.offer`` reads the
    same two lines inline ("Edge CPU per event, eighth pass")."""
    body = result.body
    # int needles (10 LF, 13 CR): a one-byte bytes needle costs ~7x more here (docs/benchmarks.md,
    # "Edge CPU per event, fifth pass")
    if 10 in body or 13 in body:
        return event(body, id=result.seq)
    return RESULT_EVENT % (result.seq, body)


def event(data: bytes, *, id: int | None = None, event: str | None = None) -> bytes:
    """One event. ``id`` sets the client's Last-Event-ID; ``event`` names a non-``message`` type."""
    if event is None and type(id) is int and b"\n" not in data and b"\r" not in data:
        return RESULT_EVENT % (id, data)  # every result event: one format, no concatenations
    head = b""
    if event is not None:
        head += b"event: " + _field(event) + b"\n"
    if id is not None:
        head += b"id: " + str(id).encode() + b"\n"
    if b"\n" not in data and b"\r" not in data:  # every compact-JSON body: one data line
        return head + b"data: " + data + b"\n\n"
    lines = _LINE_BREAK.split(data)
    return head + b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


def comment(text: str) -> bytes:
    return b": " + _field(text) + b"\n\n"


def _field(text: str) -> bytes:
    raw = text.encode()
    if _LINE_BREAK.search(raw):
        raise ValueError(f"SSE field value must be one line: {text!r}")
    return raw


def parse_last_event_id(value: str | None) -> int | None:
    """The seq a reconnecting client saw last, or None. Raises ValueError on anything but a seq: ASCII
    digits, with only HTTP's optional whitespace (SP, HTAB) around them. A header is read as latin-1,
    where ``"²".isdigit()`` and ``str.strip`` takes NBSP and NEL for whitespace."""
    if value is None:
        return None
    value = value.strip(" \t")
    if value == "":
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise ValueError(f"Last-Event-ID must be a result seq (a non-negative integer), got {shown(value)}")
    return int(value)
