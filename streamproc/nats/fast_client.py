"""nats-py's per-message work in C-level bytes and string operations (issue 14, targets 1 and 2).

Issue 14's py-spy profile of both the processor and a bare nats-py relay put ~10 µs of every message in
pure-Python header work inside nats-py 2.16: ``any(c.isspace() for c in key)`` per received header
name (``Client._parse_header_lines``), a regex ``fullmatch`` per published key and
``str.translate`` with a dict table per published value (``Client._send_publish``), one coroutine
per step (``publish`` -> ``_send_publish`` -> ``_send_command``; ``_process_msg`` ->
``_process_headers``). :class:`FastClient` does the same work with the same results:

- **Receive**: ``_process_msg`` for a plain subscription (no JetStream state, no old-style request
  future; anything else goes to nats-py's own method) parses the header block inline. Header names
  are cached (bounded) after the first time they are seen, so a known name costs one dict lookup;
  an unknown one runs nats-py's exact checks (strip, ASCII decode, whitespace). Inline status lines
  (``NATS/1.0 503``) and blocks of 10 bytes or less go to the stock ``_process_headers``. The
  ``Msg`` is built positionally, as ``RobustClient._build_message`` builds it (field order checked).
  One bound beyond nats-py: a block of more than :data:`~streamproc.core.wire.MAX_HEADER_LINES`
  lines, status line or not, is counted and read as unreadable, not parsed line by line (nats-py
  parses every line; :class:`RobustClient`, the stock path, keeps the same bound for the blocks it
  parses itself).
- **Publish**: ``publish`` does nats-py's checks in nats-py's order, then builds the header block as
  one ``str`` (validated key prefixes cached, values translated only when they hold CR or LF) and
  encodes it once. On any exception the stock encoder runs instead, so every error is nats-py's own.
  :meth:`FastClient.publish_header_block` sends a block the caller pre-formatted (the processor's
  passthrough results, :func:`streamproc.core.wire.result_header_block`). One check is this
  client's own: header block and payload together within ``max_payload`` (``_append``).
- **Inline delivery**: :meth:`FastClient.deliver_inline` lets a synchronous handler take a plain
  subscription's message in the read loop, before a ``Msg`` is built or queued, while nothing of
  that subscription is queued or in its callback (core mode's fused passthrough path, the durable
  input's chunks and PubAcks; ~1 µs a message of queue, ``Msg`` and coroutine saved).
  :meth:`FastClient.publish_block_nowait` and :meth:`FastClient.enqueue` are its publishes, made
  safe by the checks before the call. A handler registered with ``raw_headers`` gets the header
  block unparsed (the edge's fan-out reads a result from it: :func:`result_from_block`; the durable
  processor a chunk: :func:`chunk_from_block`).
- **Read loop**: the client's protocol parser is :class:`~streamproc.nats.fast_parser.FastParser`
  (when nats-py's grammar is the one it mirrors, :func:`~streamproc.nats.fast_parser.parser_support`):
  MSG/HMSG frames are cut from each socket read with ``find``/``split``/slices and handed to
  :meth:`FastClient._msg_now`, the plain-subscription part of ``_process_msg`` as a plain call (no
  coroutine per message; the same counts, pending limits, slow-consumer errors and order), and the
  same for an ordered consumer's data message in its expected delivery sequence (nats-py's sequence
  tracking; the edge reads a JetStream results stream that way); what it declines (other
  JetStream messages, old-style requests, unknown sids, inline status lines) is awaited through
  ``_process_msg``, and every other frame goes to nats-py's own ``Parser``.
- **Eager reads**: each connection's read loop first puts :class:`~streamproc.nats.eager_reads.EagerReads`
  in front of the socket's protocol: a read that arrives while the loop waits for it is parsed in
  the socket's callback, without the task's wake-up (:data:`STOCK_READS_ENV` turns it off).

The wire bytes and errors are pinned against stock nats-py on random headers
(tests/test_fast_client.py), the parser's calls, errors and state against nats-py's ``Parser`` on
random frames cut at random reads (tests/test_fast_parser.py). The fast path is used only for nats-py versions in
:data:`SUPPORTED_NATS_PY` whose internals match what it was written against (:func:`fast_path_support`)
and :data:`STOCK_CLIENT_ENV` is not set; otherwise :func:`new_client` returns the stock-path
:class:`RobustClient` and logs why. The
upstream-ready description is in docs/benchmarks.md ("nats-py header fast path").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from typing import Any, Callable, Iterator

import nats.aio.client as _client
from nats import errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.protocol import command as _command

from ..core.events import Chunk
from ..core.wire import (ATTEMPT, ERROR, FINAL, FORMAT, JOIN, MAX_HEADER_LINES, MAX_REQUEST_ID_LEN,
                         MAX_TRACEPARENT_LEN, ROLES, SEQ, TRACEPARENT, ChunkParser, ResultInfo, Subjects, Verdict,
                         held_error_text, over_header_lines, result_from_message)
from ..logs import error_text, log_event
from .buffered_reads import READ_SIZE
from .eager_reads import _CLOSED_OR_RECONNECTING, EagerReads
from .eager_reads import install as install_eager_reads
from .fast_parser import LATER, FastParser, parser_support
from .internals import require_stock_support
from .robust import RobustClient

log = logging.getLogger("streamproc.nats")

# [first, end) of the nats-py releases whose header code this mirrors (nats/aio/client.py).
SUPPORTED_NATS_PY = ((2, 16), (2, 17))
# Set (non-empty) to use the stock-path RobustClient on any nats-py: how CI, which runs the newest
# nats-py, runs the processor and the edge as they run on a release outside SUPPORTED_NATS_PY.
STOCK_CLIENT_ENV = "STOCK_NATS_PY"  # not STREAMPROC_*: no setting reads it (the CLI warns of those)
# Set (non-empty) to use the stock-path RobustClient on a supported nats-py, as where fast_client's own
# checks fail (fast_mail_parser installed): the edge still runs there (edge/pending.py's check passes),
# while with STOCK_NATS_PY, as on an unsupported release, it refuses to start.
STOCK_CLIENT_ONLY_ENV = "STOCK_NATS_CLIENT"
# Set (non-empty) to read through nats-py's read loop only, without eager reads (eager_reads.py):
# for benchmarks that measure them, and a way back should a future Python's asyncio differ.
STOCK_READS_ENV = "STOCK_NATS_READS"

_CRLF = b"\r\n"
# pause_reads only after writes smaller than this (light load): at peak drain a 2 ms pause after every
# write cost nats-server more CPU per chunk (its writes to us back up) and gained nothing, as every
# wakeup there has plenty to read anyway.
PAUSE_READS_BELOW = 8 * 1024
_HDR_LINE = b"NATS/1.0"
_TRANSLATE = str.maketrans({"\r": " ", "\n": " "})
_MSG_FIELDS = ["_client", "subject", "reply", "data", "headers", "_metadata", "_ackd", "_sid"]
_KEY_PATTERN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_MAX_CACHED = 1024  # header names / keys remembered; beyond, each new one is checked every time
_MAX_CACHED_LEN = 64  # longer names are checked every time (a hostile sender cannot grow the cache much)

# Received name bytes (before strip) -> decoded key, or _SKIP when nats-py drops the line.
_SKIP = object()
# _msg_now's headers for a raw-block inline handler's sid: not parsed yet (FastClient._accept)
UNPARSED: Any = object()
_NAMES: dict[bytes, Any] = {}
# Published key (exact str) -> "Key: " prefix, or "" when nats-py skips the empty key.
_KEYS: dict[str, str] = {}


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


# The connection states in which nats-py 2.16's ``Client.is_connected`` is true (CONNECTED, or
# draining: ``is_draining``). The per-message checks read ``_status`` once against it instead of
# calling three properties (9 Python calls per durable chunk; benchmarks/call_counts.py);
# fast_path_support checks the properties still say the same for every state. Read with getattr:
# a nats-py without one of these names gets the stock path, it must not fail this import.
_CONNECTED_STATES = frozenset(getattr(Client, name, None) for name in ("CONNECTED", "DRAINING_SUBS", "DRAINING_PUBS"))
_CONNECTED = getattr(Client, "CONNECTED", None)
_STATES = ("DISCONNECTED", "CONNECTED", "CLOSED", "RECONNECTING", "CONNECTING", "DRAINING_SUBS", "DRAINING_PUBS")
# nats-py 2.16 numbers its states 0-6; the check covers room for states a later version might add.
_STATE_RANGE = range(-1, 64)


def _states_agree() -> bool:
    """``is_connected``, ``is_closed``, ``is_draining_pubs`` and ``is_reconnecting`` of nats-py's
    ``Client`` agree with :data:`_CONNECTED_STATES`, :data:`_CLOSED_OR_RECONNECTING` and the two
    state constants for each named state and every small integer one (a state nats-py adds, e.g. a
    connected one, would otherwise read as disconnected)."""
    try:
        client = Client.__new__(Client)  # no __init__: only _status is read
        for state in {*(getattr(Client, name) for name in _STATES), *_STATE_RANGE}:
            client._status = state
            if (client.is_connected != (state in _CONNECTED_STATES) or client.is_closed != (state == Client.CLOSED)
                    or client.is_draining_pubs != (state == Client.DRAINING_PUBS)
                    or (client.is_closed or client.is_reconnecting) != (state in _CLOSED_OR_RECONNECTING)):
                return False
    except Exception:  # noqa: BLE001  (a state or property gone: not the client mirrored here)
        return False
    return None not in _CONNECTED_STATES and None not in _CLOSED_OR_RECONNECTING


def _ack_tokens(text: str) -> list[str] | None:
    """The rule ``FastClient._ordered_now`` inlines: ``text``'s tokens when nats-py 2.16's
    ``Msg.Metadata._get_metadata_fields`` returns them, None where it raises."""
    tokens = text.split(".")
    count = len(tokens)
    if (count == 9 or count >= 11) and tokens[0] == "$JS" and tokens[1] == "ACK":
        return tokens
    return None


# Replies of 0-14 tokens, with and without the ack prefix: _ack_tokens must take exactly nats-py's.
_ACK_SAMPLES = ["", "$JS", "$JS.ACK", "$JS.NAK.S.C.1.2.3.4.5", "JS.ACK.S.C.1.2.3.4.5", "$js.ack.S.C.1.2.3.4.5",
                *(".".join(["$JS", "ACK", *map(str, range(n))]) for n in range(13))]


def _ordered_bookkeeping_agrees() -> bool:
    """What ``FastClient._ordered_now`` does in place of two nats-py calls still matches them:
    :func:`_ack_tokens` against ``Msg.Metadata._get_metadata_fields``, and ``_JSI.track_sequences``
    sets nothing but ``_fciseq + 1`` and ``_cmeta``."""
    from types import SimpleNamespace

    from nats.js.client import JetStreamContext

    try:
        for text in _ACK_SAMPLES:
            try:
                theirs: list[str] | None = Msg.Metadata._get_metadata_fields(text)
            except errors.Error:
                theirs = None
            if theirs != _ack_tokens(text):
                return False
        jsi = SimpleNamespace(_fciseq=4, _cmeta=None)
        JetStreamContext._JSI.track_sequences(jsi, "$JS.ACK.S.C.1.2.3.4.5")  # type: ignore[arg-type]
        return vars(jsi) == {"_fciseq": 5, "_cmeta": "$JS.ACK.S.C.1.2.3.4.5"}
    except Exception:  # noqa: BLE001  (a name gone or a new attribute read: not the code mirrored here)
        return False


def supported_range() -> str:
    """:data:`SUPPORTED_NATS_PY` as people read it, e.g. ``2.16 <= v < 2.17``."""
    low, high = SUPPORTED_NATS_PY
    return f"{'.'.join(map(str, low))} <= v < {'.'.join(map(str, high))}"


def outside_supported_range(version: str) -> str | None:
    """Why nats-py ``version`` is not in :data:`SUPPORTED_NATS_PY`, or None when it is: the one range
    check of the processor's fast path and the edge's pending-message path (edge/pending.py)."""
    low, high = SUPPORTED_NATS_PY
    if low <= _version(version) < high:
        return None
    return f"nats-py {version} is outside the supported range {supported_range()}"


def fast_path_support(version: str | None = None) -> tuple[bool, str]:
    """(usable, reason): the installed nats-py is in range and its internals are the ones mirrored."""
    if version is None:
        for name in (STOCK_CLIENT_ENV, STOCK_CLIENT_ONLY_ENV):
            if os.environ.get(name):
                return False, f"{name} is set"
    version = _client.__version__ if version is None else version
    outside = outside_supported_range(version)
    if outside:
        return False, outside
    checks = {
        "parse_email is None (no fast_mail_parser)": getattr(_client, "parse_email", 0) is None,
        "_HEADER_KEY_RE": getattr(getattr(_client, "_HEADER_KEY_RE", None), "pattern", None) == _KEY_PATTERN,
        "_HEADER_VALUE_NEWLINES": getattr(_client, "_HEADER_VALUE_NEWLINES", None) == _TRANSLATE,
        "NATS_HDR_LINE": getattr(_client, "NATS_HDR_LINE", None) == _HDR_LINE,
        "Client._parse_header_lines": callable(getattr(Client, "_parse_header_lines", None)),
        "HPUB_OP": getattr(_command, "HPUB_OP", None) == "HPUB",
        "Msg fields": dataclasses.is_dataclass(Msg) and [f.name for f in dataclasses.fields(Msg)] == _MSG_FIELDS,
        "connection states": _states_agree(),
        "ordered consumer bookkeeping": _ordered_bookkeeping_agrees(),
    }
    # Every nats-py internal FastClient, its parser and eager reads touch (nats/internals.py, one list).
    from .internals import FAST_CLIENT_INTERNALS, missing

    wrong = [*missing(FAST_CLIENT_INTERNALS), *(name for name, ok in checks.items() if not ok)]
    if wrong:
        return False, f"nats-py {version} internals differ: {', '.join(wrong)}"
    return True, f"nats-py {version}"


def eager_reads_wanted() -> bool:
    """Eager reads are on unless :data:`STOCK_READS_ENV` is set (read at each connection)."""
    return not os.environ.get(STOCK_READS_ENV)


def _name(name: bytes) -> Any:
    """nats-py's per-name rule (``Client._parse_header_lines``): the key, or _SKIP."""
    try:
        key = name.strip().decode("ascii")
    except UnicodeDecodeError:
        return _SKIP
    if " " in key or (not key.isprintable() and any(c.isspace() for c in key)):
        return _SKIP
    return key


def parse_header_block(headers: bytes) -> dict[str, str] | None:
    """``Client._process_headers`` for a block without an inline status (len > 10, byte 8 not a
    space: callers check); same dict, same ``None`` for an empty one. A block of more than
    :data:`~streamproc.core.wire.MAX_HEADER_LINES` lines is not parsed (one Python step a line:
    ~110 ms for a block of ~95,000 filling ``max_payload``): it reads as :func:`over_header_lines`'
    unreadable mark, counted in C, where nats-py parses every line. The count is taken here, not by
    calling ``over_header_lines`` for every block: one Python call per chunk less on the durable path
    (docs/benchmarks.md, "Durable calls per chunk, third pass")."""
    if headers.count(b"\n") > MAX_HEADER_LINES:
        return over_header_lines(headers)
    out: dict[str, str] = {}
    names = _NAMES
    for line in headers[10:].split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        key = names.get(name)
        if key is None:
            key = _name(name)
            if len(names) < _MAX_CACHED and len(name) <= _MAX_CACHED_LEN:
                names[name] = key
        if key is _SKIP:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out or None


# A result's header name bytes (before strip) -> the slot result_from_block keeps its value in; -1 for
# names a result does not read and lines nats-py drops. Bounded as _NAMES.
_RESULT_FIELDS = {SEQ: 0, FINAL: 1, JOIN: 2, ERROR: 3, TRACEPARENT: 4}
_RESULT_SLOTS: dict[bytes, int] = {}
_VERDICT_BYTES: dict[bytes, Verdict] = {v.value.encode(): v for v in Verdict}


def _slot(name: bytes, fields: dict[str, int], cache: dict[bytes, int]) -> int:
    """The slot of header name bytes ``name`` in ``fields`` (-1: not read, or a line nats-py drops),
    learnt into ``cache`` (bounded as _NAMES)."""
    key = _NAMES.get(name)
    if key is None:
        key = _name(name)
    slot = -1 if key is _SKIP else fields.get(key, -1)
    if len(cache) < _MAX_CACHED and len(name) <= _MAX_CACHED_LEN:
        cache[name] = slot
    return slot


def _block_values(headers: bytes, fields: dict[str, int], cache: dict[bytes, int]) -> list[bytes | None]:
    """The raw values of ``fields``' five names in a header block, each line taken as
    ``parse_header_block`` takes it (the same name rule; the last of a repeated name wins): the one
    line walk of :func:`result_from_block` and :func:`chunk_from_block`."""
    values: list[bytes | None] = [None, None, None, None, None]
    for line in headers[10:].split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        slot = cache.get(name)
        if slot is None:
            slot = _slot(name, fields, cache)
        if slot >= 0:
            values[slot] = value
    return values


def result_from_block(subjects: Subjects, subject: str, headers: bytes, body: bytes) -> ResultInfo:
    """``result_from_message(subjects, subject, parse_header_block(headers), body)`` read straight
    from the raw block (the same callers' checks: len > 10, byte 8 not a space), for the edge's
    fan-out, once per SSE event: no dict, one line walk (:func:`_block_values`), and a plain seq and
    a known verdict are read as bytes, undecoded (docs/benchmarks.md, "Edge CPU per event, sixth
    pass"). Each line is taken as ``parse_header_block`` takes it (the same name rule, the last of a
    repeated name wins); anything but a plain seq, an absent/``true``/``false`` final and an absent, empty or
    known verdict, and a block over ``MAX_HEADER_LINES``, goes the two-step way, for the same value
    or the same error (tests/test_result_block.py compares the two on random blocks)."""
    if headers.count(b"\n") > MAX_HEADER_LINES:
        return result_from_message(subjects, subject, parse_header_block(headers), body)
    seq, final, join, error, traceparent = _block_values(headers, _RESULT_FIELDS, _RESULT_SLOTS)
    if seq is None or not (seq := seq.strip()).isdigit() or len(seq) > 18:  # bytes.isdigit: ASCII digits only
        return result_from_message(subjects, subject, parse_header_block(headers), body)
    if final is not None:
        final = final.strip()
        if final != b"true" and final != b"false":
            return result_from_message(subjects, subject, parse_header_block(headers), body)
    verdict = None
    if join is not None and (join := join.strip()):
        verdict = _VERDICT_BYTES.get(join)
        if verdict is None:
            return result_from_message(subjects, subject, parse_header_block(headers), body)
    # As result_from_message keeps them: header values as ASCII, a byte a character (held_error_text;
    # a traceparent that is not ASCII is no W3C traceparent: absent). bytes.isascii is one C pass.
    text: str | None = None
    if error is not None:
        text = error.strip().decode("utf-8", "replace")
        if not text.isascii():
            text = held_error_text(text)
    if traceparent is not None:
        traceparent = traceparent.strip()
        if not traceparent.isascii():
            traceparent = None
    return ResultInfo(
        request_id=subject[len(subjects.prefix) + _RESULTS_INFIX:],
        seq=int(seq),
        final=final == b"true",
        verdict=verdict,
        error=text,
        body=body,
        traceparent=None if traceparent is None else traceparent.decode("ascii"),
    )


_RESULTS_INFIX = len(".results.")


# A chunk's header name bytes (before strip) -> the slot chunk_from_block keeps its value in; -1 for names
# ChunkParser does not read and lines nats-py drops. Bounded as _NAMES.
_CHUNK_FIELDS = {SEQ: 0, FINAL: 1, ATTEMPT: 2, FORMAT: 3, TRACEPARENT: 4}
_CHUNK_SLOTS: dict[bytes, int] = {}


def chunk_from_block(parse: ChunkParser, subject: str, headers: Any, body: bytes, token: Any = None) -> Chunk:
    """``parse(subject, parse_header_block(headers), body, token)`` read straight from the raw block
    (the same callers' checks: len > 10, byte 8 not a space), for the durable processor's inline chunk
    handler, once per chunk: no dict, one line walk (:func:`_block_values`) (docs/benchmarks.md,
    "Durable chunks read from the raw header block"). Each line is taken as ``parse_header_block``
    takes it (the same name rule, the last of a repeated name wins). What ``ChunkParser``'s straight line accepts (a valid id
    and role, a plain seq, an absent/``true``/``false`` final, an absent or ``0`` attempt) is built
    here the same way; anything else, a block over ``MAX_HEADER_LINES``, and ``headers`` already
    parsed (a dict or None) go the two-step way, for the same chunk or the same ContractError
    (tests/test_chunk_block.py compares the two on random blocks)."""
    if headers.__class__ is not bytes:  # parsed already (no block; an inline status line's)
        return parse(subject, headers, body, token)
    if headers.count(b"\n") > MAX_HEADER_LINES:
        return parse(subject, parse_header_block(headers), body, token)
    seq, final, attempt, fmt, traceparent = _block_values(headers, _CHUNK_FIELDS, _CHUNK_SLOTS)
    request_id, _, role = subject[parse.cut:].rpartition(".")
    found = ROLES.get(role)
    # ChunkParser.__call__'s straight-line test, on the raw values (bytes.isdigit: ASCII digits only;
    # a non-ASCII value is no digit, no 'true' and no '0' either way)
    if (seq is not None and (seq := seq.strip()).isdigit() and len(seq) <= 18
            and (final is None or (final := final.strip()) == b"true" or final == b"false")
            and (attempt is None or attempt.strip() == b"0")
            and found is not None and subject.startswith(parse.head)
            and len(request_id) <= MAX_REQUEST_ID_LEN and request_id.isascii()
            and request_id.isprintable() and " " not in request_id and "." not in request_id
            and "*" not in request_id and ">" not in request_id and request_id):
        if fmt is not None:
            fmt = fmt.strip()
        if traceparent is not None:
            raw = traceparent.strip()  # wire._traceparent's rule: ASCII, at most MAX_TRACEPARENT_LEN
            tp = raw.decode() if len(raw) <= MAX_TRACEPARENT_LEN and raw.isascii() else None
        else:
            tp = None
        return Chunk(request_id, found, int(seq), body, final == b"true", 0,
                     fmt.decode("utf-8", "replace") if fmt else None, tp, token)
    return parse(subject, parse_header_block(headers), body, token)


def _stock_header_block(headers: dict[str, Any]) -> bytes:
    """``Client._send_publish``'s header encoding, verbatim (nats-py 2.16): the fallback that
    raises nats-py's own errors."""
    hdr = bytearray()
    hdr.extend(_HDR_LINE)
    hdr.extend(_CRLF)
    for k, v in headers.items():
        key = k.strip()
        if not key:
            continue
        if not _client._HEADER_KEY_RE.fullmatch(key):
            raise errors.BadHeaderError(key)
        hdr.extend(key.encode())
        hdr.extend(b": ")
        value = v.strip().translate(_client._HEADER_VALUE_NEWLINES)
        hdr.extend(value.encode())
        hdr.extend(_CRLF)
    hdr.extend(_CRLF)
    return bytes(hdr)


def _key(k: str) -> str:
    key = k.strip()
    if not key:
        prefix = ""
    elif _client._HEADER_KEY_RE.fullmatch(key):
        prefix = key + ": "
    else:
        raise errors.BadHeaderError(key)
    if type(k) is str and len(_KEYS) < _MAX_CACHED and len(k) <= _MAX_CACHED_LEN:
        _KEYS[k] = prefix
    return prefix


def encode_header_block(headers: dict[str, Any]) -> bytes:
    """The header block nats-py's ``publish`` sends for ``headers``, byte for byte; its errors too."""
    try:
        text = "NATS/1.0\r\n"
        keys = _KEYS
        for k, v in headers.items():
            prefix = keys.get(k)
            if prefix is None:
                prefix = _key(k)
            if not prefix:
                continue
            value = v.strip()
            if "\r" in value or "\n" in value:
                value = value.translate(_TRANSLATE)
            text += prefix + value + "\r\n"
        return (text + "\r\n").encode()
    except Exception:  # noqa: BLE001  (nats-py's own code decides what is raised, and how)
        return _stock_header_block(headers)


class FastClient(RobustClient):
    """:class:`RobustClient` with nats-py's header work done fast (see the module doc)."""

    # Least seconds between two socket writes (0: nats-py's behaviour, a write per loop iteration
    # that published). A kick within that time of the last write waits for the rest of it, so the
    # publishes of the window leave in one write; a publish after a quiet spell leaves at once.
    # Set by the durable processor (``flush_interval``): at light load every chunk otherwise costs
    # its own wakeups and writes for its result and its ack (docs/benchmarks.md, target 4).
    flush_interval = 0.0
    _last_write = 0.0
    # The interval adapts to the write rate (write_gap): it is there to gather about this many
    # commands (results, acks) per write; when they come faster, waiting the whole interval only
    # adds latency per hop (a request's next result leaves after its predecessor's PubAck, so a
    # request of n chunks pays about n - 1 gaps), and the writes are large enough anyway.
    coalesce_commands = 12
    _gap = 0.0  # the current least seconds between two writes (0: flush_interval, nothing measured yet)
    _rate_commands = 0.0  # smoothed commands per write
    _rate_seconds = 0.0  # smoothed seconds between writes

    def write_gap(self) -> float:
        """Least seconds between two writes now: ``flush_interval``, shortened to the time
        ``coalesce_commands`` take to arrive at the recent write rate, never below an eighth of it;
        0 while :meth:`urgent_writes` holds."""
        if self.urgent:
            return 0.0
        return self._gap or self.flush_interval

    # Above 0 while someone waits for a round trip on the message path (the durable input's recovery
    # lookup holds up its partition): writes leave at once and reads are not paused after them
    # (write_gap() is 0). With the interval, each lookup waited for the next timer write and then for
    # reads to resume: ~5 ms each, one after another, so 5,000 chunks that each needed a lookup held
    # a partition's other requests back 27 s (tests/test_durable_attack_review.py).
    urgent = 0

    @contextlib.contextmanager
    def urgent_writes(self) -> Iterator[None]:
        """Within it, what is queued is written now and what arrives is read now."""
        self.urgent += 1
        try:
            if self._status in _CONNECTED_STATES:
                timer = self._write_timer
                if timer is not None:  # a later timer write: the pending commands leave now instead
                    timer.cancel()
                    self._write_timer = None
                    self._write_soon()
                if self._resume_timer is not None:
                    self._resume_timer.cancel()
                    self._resume_reading()
            yield
        finally:
            self.urgent -= 1

    def _wrote(self, commands: int, now: float) -> None:
        """Account a write of ``commands`` at ``now`` for :meth:`write_gap` (smoothed over ~5 writes)."""
        interval = self.flush_interval
        if interval > 0:
            since = min(now - self._last_write, 8 * interval)  # a quiet spell counts as a long gap, not its length
            self._rate_commands += (commands - self._rate_commands) * 0.2
            self._rate_seconds += (since - self._rate_seconds) * 0.2
            self._gap = adaptive_gap(interval, self._rate_commands, self._rate_seconds, self.coalesce_commands)
        self._last_write = now

    async def _flusher(self) -> None:
        # nats-py 2.16 Client._flusher, plus the interval: the kicks that arrive while it waits are
        # taken with the first one (their commands are already in _pending), and all their futures
        # are resolved after the one write. Read per round, so it may be set after connect.
        queue = self._flush_queue
        assert self._transport, "Client.connect must be called first"
        assert queue, "Client.connect must be called first"
        loop = asyncio.get_running_loop()
        while True:
            if not self.is_connected or self.is_connecting:
                break
            futures = [await queue.get()]
            stop = False  # break after the finally, not inside it: mypyc 2.4 has no break in try/finally
            try:
                interval = self.flush_interval
                if interval > 0:
                    wait = self._last_write + self.write_gap() - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                        while not queue.empty():
                            futures.append(queue.get_nowait())
                if self._pending_data_size > 0:
                    commands = len(self._pending)
                    self._transport.writelines(self._pending[:])
                    self._pending = []
                    self._pending_data_size = 0
                    if interval > 0:
                        self._wrote(commands, loop.time())
                    await self._transport.drain()
            except OSError as e:
                await self._error_cb(e)
                await self._process_op_err(e)
                stop = True
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                # RuntimeError in case the event loop is closed
                stop = True
            finally:
                for future in futures:  # a future might have been cancelled (nats-py issue #624)
                    if not future.done():
                        future.set_result(None)
            if stop:
                break

    def __init__(self) -> None:
        super().__init__()
        global _parser_ok
        if _parser_ok is None:
            _parser_ok = parser_support()
            if not _parser_ok[0]:
                log_event(log, logging.WARNING, "nats_fast_parser_disabled", reason=_parser_ok[1])
        if _parser_ok[0]:
            self._ps = FastParser(self)

    eager: EagerReads | None = None  # the current connection's (eager_reads.py), None on the stock path

    async def _read_loop(self) -> None:
        """nats-py's read loop, with the connection's reads handed over as they arrive while it
        waits for them (eager_reads.py); started anew on each connection, after its handshake."""
        eager = self.eager = install_eager_reads(self) if eager_reads_wanted() else None
        try:
            await super()._read_loop()
        finally:
            if eager is not None:
                eager.active = False  # a later read loop (a reconnect) has a new transport and its own

    def _msg_now(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> Any:
        """``_process_msg`` without a coroutine, for :class:`FastParser`: None when done, a
        ``SlowConsumerError`` for the error callback, or ``LATER`` (nothing done): await
        ``_process_msg`` (JetStream, old-style requests, unknown sids, inline status lines)."""
        sub = self._subs.get(sid)
        if sub is None or sub._future is not None:
            return LATER
        if not headers:
            hdr = None
        elif len(headers) > 10 and headers[8] != 32:
            raw = self._raw_inline
            # UNPARSED: _accept hands a raw-block handler the block itself, and parses it only for a Msg
            hdr = UNPARSED if raw is not None and sid in raw else parse_header_block(headers)
        else:
            return LATER
        jsi = sub._jsi
        if jsi is not None:
            return self._ordered_now(sub, jsi, sid, subject, reply, data, headers, hdr)
        return self._accept(sub, sid, subject, reply, data, headers, hdr)

    def _ordered_now(self, sub: Any, jsi: Any, sid: int, subject: bytes, reply: bytes, data: bytes,
                     headers: bytes | None, hdr: Any) -> Any:
        """nats-py 2.16 ``Client._process_msg`` for an ordered consumer's data message in its
        expected delivery sequence, as a plain call; ``LATER`` (nothing done) for anything else:
        other JetStream subscriptions, an empty payload (a control message carries none), a reply
        that is not an ack subject, a delivery sequence that makes nats-py reset the consumer, and a
        message that would pass the subscription's pending limits (so nats-py reports it, in its
        order). The edge reads every result of a JetStream results stream this way (docs/benchmarks.md)."""
        if not jsi._ordered or not data or not reply:
            return LATER
        text = reply.decode("utf-8", "surrogateescape")
        # Msg.Metadata._get_metadata_fields, inline (one Python call per result less; _ack_tokens is
        # the same rule, checked against nats-py's by fast_path_support)
        tokens = text.split(".")
        count = len(tokens)
        if not ((count == 9 or count >= 11) and tokens[0] == "$JS" and tokens[1] == "ACK"):
            return LATER
        try:
            sseq = int(tokens[5])
            dseq = int(tokens[6])
        except ValueError:
            return LATER
        queue = sub._pending_queue
        # A queue with no unfinished task is empty (each put counts one, task_done takes it off), so
        # not full: full() is asked only when something is queued (never for the edge's ring, which
        # is read inline: one Python call per result less).
        if (dseq != jsi._dseq or queue._unfinished_tasks and queue.full()
                or sub._pending_bytes_limit > 0 and sub._pending_size + len(data) >= sub._pending_bytes_limit):
            return LATER
        jsi._active = True
        jsi._dseq = dseq + 1
        jsi._sseq = sseq
        followed = self._ordered_inline
        if followed is not None:
            entry = followed.get(jsi)
            if entry is not None and entry[0] != sid:  # nats-py remade the consumer under a new sid
                self._follow_reset(sid, entry)
        self._accept(sub, sid, subject, reply, data, headers, hdr, text)  # None: the limits were checked above
        jsi._fciseq += 1  # _JSI.track_sequences(text), inline (checked by fast_path_support)
        jsi._cmeta = text
        return None

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes | None) -> None:
        # nats-py 2.16 Client._process_msg, for a plain subscription: stats, max_msgs, headers,
        # message, pending limits, queue. JetStream, old-style requests and unknown sids: upstream.
        sub = self._subs.get(sid)
        if sub is None or sub._jsi is not None or sub._future is not None:
            try:
                return await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            finally:
                self.end_handover()
        if not headers:
            hdr = None
        elif len(headers) > 10 and headers[8] != 32:
            hdr = parse_header_block(headers)
        else:  # inline status line, or too short to hold a header: nats-py's own parser (never suspends)
            hdr = await self._process_headers(headers)
        try:
            slow = self._accept(sub, sid, subject, reply, data, headers, hdr)
        finally:
            self.end_handover()
        if slow is not None:
            await self._error_cb(slow)

    def end_handover(self) -> None:
        """:attr:`read_done`, if set: after an eager read (eager_reads.py), and after each message
        that went through ``_process_msg``: the stock parser (which ``FastParser.parse`` hands lines
        it does not read to, with the rest of the read) may await between two messages, and what the
        first one made (the edge's direct SSE frames) must not wait through that."""
        done = self.read_done
        if done is not None:
            done()
        if self._write_timer is _AT_READ_END:
            self._write_now()

    def _accept(self, sub: Any, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None,
                hdr: Any, reply_text: str | None = None) -> Any:
        """The rest of ``Client._process_msg`` for a plain subscription, in its order, without
        awaiting: the ``SlowConsumerError`` to hand to the error callback, or None. ``reply_text``:
        ``reply`` decoded already (``_ordered_now``), not decoded a second time for the handler. ``hdr``:
        the parsed headers, None or :data:`UNPARSED` (typed ``Any``: the compiled build checks a
        ``dict | None`` annotation at the call and refused the sentinel)."""
        payload_size = len(data)
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += payload_size
        sub._received += 1
        if sub._max_msgs > 0 and sub._received >= sub._max_msgs:
            self._subs.pop(sid, None)
        text = subject.decode("utf-8", "surrogateescape")
        handler = self._handlers_inline.get(sid) if self._handlers_inline else None
        # Inline delivery (see deliver_inline): only with nothing of this subscription queued or
        # in its callback (order), and when a result of this message's size (a bound: subject,
        # block and payload each at most the received ones' plus 256 bytes of fixed lines) can be
        # queued for the flusher without a forced flush, which would suspend.
        if (handler is not None and sub._pending_queue._unfinished_tasks == 0
                and self._status == Client.CONNECTED and payload_size <= self._max_payload
                and (self._max_pending_size <= 0 or self._pending_data_size + payload_size
                     + (len(headers) if headers else 0) + 2 * len(subject) + 256 <= self._max_pending_size)
                and self._flusher_task is not None and not self._flusher_task.done()):
            try:
                if reply_text is None:
                    reply_text = reply.decode("utf-8", "surrogateescape") if reply else ""
                if handler(text, reply_text, headers if hdr is UNPARSED else hdr, data):
                    return None
            except Exception as exc:  # noqa: BLE001  (never into nats-py's read loop)
                # Handlers catch their own errors; one that escapes drops the message, which JetStream
                # redelivers after ack_wait (a chunk) or the outbox resends for (a PubAck).
                log_event(log, logging.ERROR, "inline_handler_failed", subject=text, error=error_text(exc))
                return None
        if hdr is UNPARSED:
            hdr = parse_header_block(headers)  # type: ignore[arg-type]
        if self.msg_class is Msg:  # RobustClient._build_message, positionally (Msg's field order is checked)
            if reply_text is None:
                reply_text = reply.decode("utf-8", "surrogateescape")
            msg = Msg(self, text, reply_text, data, hdr, None, False, sid)
        else:
            msg = self._build_message(sid, subject, reply, data, hdr)
            if not msg:
                return None
        try:
            sub._pending_size += payload_size
            if sub._pending_bytes_limit > 0 and sub._pending_size >= sub._pending_bytes_limit:
                sub._pending_size -= payload_size
                return errors.SlowConsumerError(subject=msg.subject, reply=msg.reply, sid=sid, sub=sub)
            sub._pending_queue.put_nowait(msg)
        except asyncio.QueueFull:
            sub._pending_size -= len(msg.data)
            return errors.SlowConsumerError(subject=msg.subject, reply=msg.reply, sid=sid, sub=sub)
        return None

    _handlers_inline: dict[int, Any] | None = None  # not `_inline`: mypyc names its C field `__inline`, a gcc keyword
    # The sids whose inline handler takes the raw header block (deliver_inline's raw_headers)
    _raw_inline: set[int] | None = None
    # An ordered consumer's handler by its ``_JSI``, with the sid it is registered under (deliver_inline)
    _ordered_inline: dict[Any, list[Any]] | None = None

    # Called by the read loop once every frame of a socket read has been handed over (inline
    # handlers, queues, callbacks' queues), also when handling one raised, before the read loop
    # awaits anything (a frame it cannot hand over at once), and after each message that went
    # through _process_msg. The edge writes the SSE frames the read's results made there
    # (edge/direct.py WriteBatch.flush) rather than in a later loop pass: between the two, the loop
    # polls and runs whatever else is ready (opens, teardowns), and on a loaded machine may wait
    # for a core. Must not raise or suspend.
    read_done: Any = None

    @property
    def calls_read_done(self) -> bool:
        """Whether :attr:`read_done` is called (the fast parser reads; not on its stock fallback)."""
        return isinstance(self._ps, FastParser)

    def deliver_inline(self, sub: Any, handler: Any, raw_headers: bool = False) -> None:
        """Hand ``sub``'s messages to ``handler(subject, reply, headers, data) -> bool`` in the read
        loop, before a ``Msg`` is built and queued, whenever nothing of ``sub`` is queued or in its
        callback; False: the message takes the queue and the callback as usual. The one way this
        client runs a handler in its read loop: core mode's fused passthrough, the durable input's
        chunks and its PubAcks, the edge's results (``headers`` parsed as for a ``Msg``; ``reply`` ""
        when none). An ordered consumer's data messages in sequence are handed over too
        (``_ordered_now``), under whatever sid nats-py gives it when it remakes the consumer.

        Why: the queue, the ``Msg``, the callback's coroutine and ``_wait_for_msgs``' bookkeeping
        cost ~1 µs a message, the largest per-message cost left in the passthrough path after the
        header work (docs/benchmarks.md). The handler must not suspend; it may publish without
        awaiting (:meth:`publish_block_nowait`, :meth:`enqueue`): before the call the connection is
        up, the payload within the server's limit and the pending buffer has room for a result of
        the message's size. An exception that escapes it is logged and drops the message (the read
        loop goes on; JetStream redelivers a chunk after ``ack_wait``, the outbox resends a result
        whose PubAck was lost). Order is kept: a message goes inline only when every earlier one of
        ``sub`` has been handled; inline messages are never queued, so they count neither against
        the subscription's pending limits nor as slow-consumer drops.

        ``raw_headers``: ``headers`` may also be the raw header block (bytes) where the read loop
        has one not yet parsed (a block with no inline status line), so the handler can read what
        it needs from it without the dict (the edge's fan-out: ``result_from_block``; the durable
        chunks: ``chunk_from_block``)."""
        if self._handlers_inline is None:
            self._handlers_inline = {}
        self._handlers_inline[sub._id] = handler
        if raw_headers:
            if self._raw_inline is None:
                self._raw_inline = set()
            self._raw_inline.add(sub._id)
        elif self._raw_inline:
            self._raw_inline.discard(sub._id)
        if sub._jsi is not None and sub._jsi._ordered:  # its sid changes each time nats-py remakes it
            if self._ordered_inline is None:
                self._ordered_inline = {}
            self._ordered_inline[sub._jsi] = [sub._id, handler]

    def _follow_reset(self, sid: int, entry: list[Any]) -> None:
        """Move an ordered consumer's handler to the sid ``_JSI.reset_ordered_consumer`` gave it
        (seen at its first data message there): else every result after a reset would take the
        ``Msg`` and queue path again."""
        handlers = self._handlers_inline
        if handlers is not None:
            handlers.pop(entry[0], None)
            handlers[sid] = entry[1]
        raw = self._raw_inline
        if raw is not None and entry[0] in raw:
            raw.discard(entry[0])
            raw.add(sid)
        entry[0] = sid

    def stop_inline(self, sub: Any) -> None:
        if self._handlers_inline:
            self._handlers_inline.pop(sub._id, None)
        if self._raw_inline:
            self._raw_inline.discard(sub._id)
        if self._ordered_inline and sub._jsi is not None:
            entry = self._ordered_inline.pop(sub._jsi, None)
            if entry is not None and self._handlers_inline:
                self._handlers_inline.pop(entry[0], None)
            if entry is not None and self._raw_inline:
                self._raw_inline.discard(entry[0])

    def publish_block_nowait(self, subject: str, payload: bytes, header_block: bytes) -> None:
        """:meth:`publish_header_block` without an await, for an inline handler: the connection is
        up, the payload within the server's limit and the pending buffer has room (checked before
        the handler ran), so nats-py's publish would not raise or suspend either; same bytes, same
        stats, the same kick of the flusher (``_flush_pending``)."""
        self._append(subject, "", payload, header_block)
        queue = self._flush_queue
        if queue is not None and queue.empty():
            queue.put_nowait(asyncio.Future())

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """nats-py 2.16 ``Client.publish`` + ``_send_publish`` + ``_send_command`` in one coroutine."""
        self._preflight(subject, reply, payload)
        await self._send(subject, reply, payload, None if headers is None else encode_header_block(headers))

    async def publish_header_block(self, subject: str, payload: bytes, header_block: bytes) -> None:
        """Publish with a header block the caller formatted exactly as :func:`encode_header_block`
        would (``NATS/1.0\\r\\n``, ``Key: value\\r\\n`` lines, a blank line), on a subject the
        caller knows to be valid (non-empty, no whitespace): it is not checked again."""
        self._check_sendable(payload)
        await self._send(subject, "", payload, header_block)

    def _preflight(self, subject: str, reply: str, payload: bytes) -> None:
        """``Client.publish``'s checks, in its order (returns None; raises nats-py's errors)."""
        if not self._skip_subject_validation:
            _client._validate_subject(subject)
            if reply:
                _client._validate_subject(reply)
        self._check_sendable(payload)
        if subject == "":
            raise errors.BadSubjectError

    def _check_sendable(self, payload: bytes) -> None:
        """The connection-state and size checks of ``Client.publish``, in its order."""
        status = self._status
        if status == Client.CLOSED:
            raise errors.ConnectionClosedError
        if status == Client.DRAINING_PUBS:
            raise errors.ConnectionDrainingError
        payload_size = len(payload)
        if status not in _CONNECTED_STATES:
            if self._max_pending_size <= 0 or payload_size + self._pending_data_size > self._max_pending_size:
                raise errors.OutboundBufferLimitError
        if payload_size > self._max_payload:
            raise errors.MaxPayloadError

    def _write_pending(self) -> int:
        # RobustClient._send_ping writes the queued commands ahead of its PING; with a flush interval
        # (which delays them further still) that write counts toward the write rate.
        commands = super()._write_pending()
        if commands and self.flush_interval > 0:
            self._wrote(commands, asyncio.get_running_loop().time())
        return commands

    # Seconds a deferred publish (publish_deferred) may wait for another write to take it along.
    defer_linger = 0.0
    _deferred: asyncio.TimerHandle | None = None

    async def publish_deferred(self, subject: str, payload: bytes = b"", reply: str = "") -> None:
        """``publish`` for messages nobody waits on at once (the durable input's acks, in-progress
        acks, NAKs and pull requests): the command is queued without kicking the flusher, so it
        leaves with the next result's write, or ``defer_linger`` seconds later at the latest. At
        light load this halves the writes per chunk (a result and an ack each used their own)."""
        if self.defer_linger <= 0:
            return await self.publish(subject, payload, reply)
        self._preflight(subject, reply, payload)
        self._append(subject, reply, payload, None)
        if self._max_pending_size > 0 and self._pending_data_size > self._max_pending_size:
            await self._flush_pending(force_flush=True)
        elif self._deferred is None:
            self._deferred = asyncio.get_running_loop().call_later(self.defer_linger, self._kick)

    def _kick(self) -> None:
        """The deferred commands' deadline: write them unless a write already took them."""
        self._deferred = None
        if self._pending_data_size > 0 and self._status in _CONNECTED_STATES:
            if self.flush_interval > 0:
                self._write_soon()
                return
            queue = self._flush_queue
            if queue is not None and queue.empty():
                queue.put_nowait(asyncio.get_running_loop().create_future())

    # With a flush interval, enqueue() and the deferred deadline write from a timer, not through the
    # flusher task: nats-py's kick -> flusher task -> asyncio.sleep -> flusher task costs three
    # event-loop iterations per write, the timer one. At light load every iteration is paid in full
    # (docs/benchmarks.md, target 4). The flusher task still serves every other kick (publish(),
    # flush(), nats-py's own commands) and is the only writer that awaits drain(): the timer hands
    # over to it when the transport's buffer is not empty (the socket is behind).
    _write_timer: asyncio.TimerHandle | None = None

    def _write_soon(self) -> None:
        """Write ``_pending`` at the next allowed time (``_last_write + write_gap()``); at light load
        (the gap is the whole interval), when that time has come and an eager read is being handed
        over, at that read's end (:meth:`end_handover`)."""
        if self._write_timer is None:
            loop = asyncio.get_running_loop()
            now = loop.time()
            gap = self.write_gap()
            due = self._last_write + gap
            if due <= now and self._in_read and gap >= self.flush_interval:
                # A timer due now would cost the loop one more pass (a zero-timeout epoll_wait, a
                # timer handle) to write what the read's end can write at the same instant. Not with
                # a shortened gap (commands come fast): the timer's pass may take further reads along.
                self._write_timer = _AT_READ_END
                return
            self._write_timer = loop.call_at(due if due > now else now, self._write_now)

    # True while an eager read's frames are handed over (EagerReads.data_received, which calls
    # end_handover when they are): a write that is due then leaves at the read's end, not from a timer.
    _in_read = False

    # Set by the durable outbox pump (OutboxPump.stage_writes): called at each timer write before
    # the pending commands are written, so what it hands over leaves in this write; True when it
    # kept something back for a later write (its byte budget, room_for_writes(), was spent).
    before_write: Callable[[], bool] | None = None

    def stage_write(self) -> None:
        """Something waits for ``before_write``: make sure a timer write comes. Nothing to do while
        ``_write_timer`` is set, which the durable inline handlers test before calling (a call per chunk)."""
        if self._write_timer is None and self._status in _CONNECTED_STATES:
            self._write_soon()

    def room_for_writes(self) -> int:
        """Bytes that may join ``_pending`` before it is :meth:`backlogged` (a large number without a limit)."""
        if self._max_pending_size <= 0:
            return 1 << 62
        return self._max_pending_size // 2 - self._pending_data_size

    def _write_now(self) -> None:
        more = False
        hook = self.before_write
        if hook is not None:  # while _write_timer is still set: what it enqueues schedules nothing
            try:
                more = hook()
            except Exception as exc:  # noqa: BLE001  (a bug there must not stop the writes)
                log_event(log, logging.ERROR, "before_write_failed", error=error_text(exc))
        self._write_timer = None
        try:
            self._write_pending_now()
        finally:
            if more and self._status in _CONNECTED_STATES and self._write_timer is None:
                # A full interval from now, not from the last write: when nothing could be written
                # (the socket is behind, the flusher drains) that one is past, and the timer would
                # fire every loop iteration for as long as the socket stays behind.
                loop = asyncio.get_running_loop()
                self._write_timer = loop.call_at(loop.time() + self.flush_interval, self._write_now)

    def _write_pending_now(self) -> None:
        if self._pending_data_size <= 0 or self._status not in _CONNECTED_STATES or self._transport is None:
            return
        writer = getattr(getattr(self._transport, "_io_writer", None), "transport", None)
        # On the stock read path (STOCK_NATS_READS) asyncio's transport asks recv() for its max_size,
        # 256 KiB, which glibc may serve with mmap + mremap + munmap and fresh page faults on every
        # read (strace showed it on the durable connection at 2,000 chunks/s); EagerReads reads into
        # a READ_SIZE buffer of its own instead (recv_into, where max_size does not apply).
        if getattr(writer, "max_size", READ_SIZE) > READ_SIZE:
            writer.max_size = READ_SIZE  # type: ignore[union-attr]
        try:
            if writer is None or writer.get_write_buffer_size() > 0:
                raise BlockingIOError  # the socket is behind (or not a plain TCP transport): the flusher drains
            self._transport.writelines(self._pending[:])
        except Exception:  # noqa: BLE001  (the flusher task writes, drains and handles errors as nats-py does)
            queue = self._flush_queue
            if queue is not None and queue.empty():
                queue.put_nowait(asyncio.get_running_loop().create_future())
            return
        written = self._pending_data_size
        commands = len(self._pending)
        self._pending = []
        self._pending_data_size = 0
        now = asyncio.get_running_loop().time()
        self._wrote(commands, now)
        if self.pause_reads and written < PAUSE_READS_BELOW and self.write_gap() >= self.flush_interval:
            # Not with a shortened gap: commands come fast enough, and a pause would only idle a
            # loop that has work (at peak drain, writes between two reads fell under 8 KiB).
            self._pause_reading(writer, now)

    # With pause_reads (and a flush interval), reading stops after each timer write until the next
    # write may leave: what arrives meanwhile (PubAcks of that write, new chunks) is read in one go
    # and answered at once, one wakeup per interval instead of one per arrival plus one per write.
    pause_reads = False
    _resume_timer: asyncio.TimerHandle | None = None

    def _pause_reading(self, transport: Any, now: float) -> None:
        if self._resume_timer is not None:
            return
        try:
            transport.pause_reading()
        except Exception:  # noqa: BLE001  (closing, or a transport without flow control: read as usual)
            return
        self._resume_timer = asyncio.get_running_loop().call_at(now + self.flush_interval, self._resume_reading)

    def _resume_reading(self) -> None:
        self._resume_timer = None
        transport = getattr(getattr(self._transport, "_io_writer", None), "transport", None)
        try:
            if transport is not None and not transport.is_closing():
                eager = self.eager
                read = getattr(transport, "_read_ready", None) if eager is not None and eager.active else None
                if read is not None and not self.urgent:
                    # Read what arrived during the pause now, in this timer's loop pass, as the loop
                    # would after the resume (asyncio's _SelectorSocketTransport._read_ready: one
                    # recv_into; nothing there raises nothing). A read whose write paused reads again
                    # leaves the transport paused: no epoll_ctl pair and no loop pass for the read,
                    # another for its write (docs/benchmarks.md, "Durable CPU at light load").
                    read()
                    if self._resume_timer is not None or transport.is_closing():
                        return
                transport.resume_reading()
        except Exception:  # noqa: BLE001
            pass

    def enqueue(self, subject: str, payload: bytes, reply: str = "", header_block: bytes | None = None, *,
                checked: bool = False, defer: bool = False) -> None:
        """``publish`` without awaiting, for handlers that run inside the read loop
        (:meth:`deliver_inline`): the command joins ``_pending`` and
        the flusher is kicked (``defer``: as :meth:`publish_deferred`, it waits for the next write or
        ``defer_linger``). ``header_block`` as :func:`encode_header_block` makes it. ``checked``: the
        subjects came from the server or were validated before (an ack subject, our own inbox),
        nats-py's subject checks are skipped. Unlike ``publish`` it never waits for the flusher when
        ``_pending`` is over ``_max_pending_size``: callers stop using it past :meth:`backlogged`."""
        size = len(payload)  # read once, here and in _append (a C call per result and per ack)
        if not checked:
            self._preflight(subject, reply, payload)
        elif self._status != _CONNECTED or size > self._max_payload:
            self._check_sendable(payload)  # which passes without a call when connected and within the limit
        self._append(subject, reply, payload, header_block, size)
        if defer and self.defer_linger > 0:
            if self._deferred is None and self._write_timer is None:
                self._deferred = asyncio.get_running_loop().call_later(self.defer_linger, self._kick)
        elif self.flush_interval > 0:
            if self._write_timer is None and self._status in _CONNECTED_STATES:
                self._write_soon()
        else:  # Client._flush_pending without its await: a future on an empty queue, when connected
            queue = self._flush_queue
            if queue is not None and queue.empty() and self._status in _CONNECTED_STATES:
                queue.put_nowait(asyncio.get_running_loop().create_future())

    def backlogged(self) -> bool:
        """More than half of ``_max_pending_size`` waits to be written: publish with backpressure
        (``await publish``), not :meth:`enqueue`. The durable inline handlers (deliveries.py,
        outbox_pump.py) write this rule out: one Python call per chunk less."""
        return self._pending_data_size * 2 > self._max_pending_size > 0

    def _append(self, subject: str, reply: str, payload: bytes, hdr: bytes | None, size: int = -1) -> None:
        """The ``PUB``/``HPUB`` command into ``_pending``, counted as nats-py's ``_send_command``
        counts it (``hdr``: a block as :func:`encode_header_block` makes it). Every publish path
        of this client goes through here; what differs is when the flusher is kicked.

        Raises ``MaxPayloadError`` (nothing queued) when header block and payload together exceed
        the server's ``max_payload``: nats-server counts both and closes the connection on such a
        publish ("Maximum Payload Violation"), losing every command written with it and every
        message sent to it until the reconnect; nats-py checks the payload alone. A chunk of
        exactly ``max_payload`` with a short header block has a passthrough result with a longer
        one (tests/test_hostile_fast.py). ``size``: ``len(payload)`` when the caller read it
        (:meth:`enqueue`), read once either way (C calls per chunk on the durable path: a result
        and an ack; docs/benchmarks.md, "Durable calls per chunk, third pass")."""
        if size < 0:
            size = len(payload)
        if hdr is None:
            cmd = f"PUB {subject} {reply} {size}\r\n".encode() + payload + _CRLF
        else:
            hdr_len = len(hdr)
            total = size + hdr_len
            if total > self._max_payload:
                raise errors.MaxPayloadError
            cmd = f"HPUB {subject} {reply} {hdr_len} {total}\r\n".encode() + hdr + payload + _CRLF
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += size
        self._pending.append(cmd)
        self._pending_data_size = self._pending_data_size + len(cmd)  # not +=: mypyc 2.4 fails on it

    async def _send(self, subject: str, reply: str, payload: bytes, hdr: bytes | None) -> None:
        self._append(subject, reply, payload, hdr)
        if self._max_pending_size > 0 and self._pending_data_size > self._max_pending_size:
            await self._flush_pending(force_flush=True)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()


class _AtReadEnd:
    """``FastClient._write_timer`` while a due write waits for the end of the read being handed over."""

    __slots__ = ()

    def cancel(self) -> None:
        pass


_AT_READ_END: Any = _AtReadEnd()


def adaptive_gap(interval: float, commands: float, seconds: float, target: int) -> float:
    """Least seconds between two writes: the time ``target`` commands take to arrive at the rate
    ``commands`` per ``seconds`` (smoothed, per write), within [``interval`` / 8, ``interval``]."""
    if commands <= 0 or seconds <= 0:
        return interval
    return min(interval, max(interval / 8, target * seconds / commands))


_support: tuple[bool, str] | None = None
_parser_ok: tuple[bool, str] | None = None


def new_client() -> RobustClient:
    """A :class:`FastClient` when the installed nats-py is supported, else the stock-path
    :class:`RobustClient` (logged once per process); :class:`errors.NatsPyUnsupported` when
    nats-py lacks an internal RobustClient reads."""
    global _support
    require_stock_support()  # both clients are RobustClients: no fallback below them (internals.py)
    if _support is None:
        _support = fast_path_support()
        if not _support[0]:
            log_event(log, logging.WARNING, "nats_fast_path_disabled", reason=_support[1])
    return FastClient() if _support[0] else RobustClient()
