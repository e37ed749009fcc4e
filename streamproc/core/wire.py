"""Wire contract v1: subjects, headers and the typed chunk/result records that cross NATS.

Everything that a worker, an edge or another processor must agree on lives here and in
``docs/protocol.md``; the rest of the code only sees :class:`Chunk` and :class:`Result`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import msgspec

from . import defaults
from .errors import MAX_ERROR_TEXT, ContractError, cut_error_text, shown
from .events import (  # noqa: F401  (re-exported: the wire contract's records, under their old path)
    MAX_SEQ,
    Chunk,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    MigrateRequest,
    Result,
    ResultInfo,
    Role,
    Sealed,
    SealRecord,
    Verdict,
)

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = defaults.PREFIX

# Header names (case matters on the wire: NATS headers are case-sensitive in nats-py).
SEQ = "Streamproc-Seq"
FINAL = "Streamproc-Final"
ATTEMPT = "Streamproc-Attempt"
FORMAT = "Streamproc-Format"
JOIN = "Streamproc-Join"
ERROR = "Streamproc-Error"
MSG_ID = "Nats-Msg-Id"
TRACEPARENT = "traceparent"
# Not on the wire: the NATS shell puts this in place of a header block it could not decode, with
# why, cut to MAX_UNREADABLE_REASON characters. A worker can send a header of that name itself.
UNREADABLE_HEADERS = "Streamproc-Unreadable-Headers"
MAX_UNREADABLE_REASON = 200
# Lines (LF bytes) a message's header block may hold, its NATS/1.0 line and closing empty line
# included; a longer block is not parsed and is marked unreadable (FastClient and RobustClient, before
# any per-line work). Each line costs the reader a Python step: ~95,000 tiny lines filling max_payload cost
# ~110 ms of the event loop, where the same bytes as a body cost nothing. Honest blocks hold ~10
# lines: a chunk's 6 streamproc headers (Nats-Msg-Id, traceparent among them) and a tracestate, a
# result's 6; nats-server adds at most 6 of its own (a direct get's or a republished message's
# Nats-Stream, -Subject, -Sequence, -Time-Stamp, -Num-Pending, -Last-Sequence) to what was stored, and
# its stream.go names 22 Nats-* headers in all. 128 leaves room for whatever a worker's stack adds.
MAX_HEADER_LINES = 128


def over_header_lines(block: bytes) -> dict[str, str] | None:
    """The headers a raw header block of more than :data:`MAX_HEADER_LINES` lines (LF bytes, counted in
    C) is read as, unparsed: the unreadable mark, naming the count and the bound (the victim's
    ``invalid_chunk`` text); None for a block within the bound, to be parsed. One check for every
    reader of raw blocks (FastClient, RobustClient)."""
    lines = block.count(b"\n")
    if lines > MAX_HEADER_LINES:
        return {UNREADABLE_HEADERS: f"{lines} lines, more than the {MAX_HEADER_LINES} a header block may hold"}
    return None


ROLES = {r.value: r for r in Role}  # a role's subject token -> Role (also fast_client.chunk_from_block's)
_FORBIDDEN_TOKEN_CHARS = frozenset(" \t\r\n.*>")
MAX_REQUEST_ID_LEN = 256
# A longer traceparent is taken as absent. W3C's version 00 is 55 characters; the processor keeps a
# streamed request's for its whole life and copies it into every result, and a worker may send up to
# 64 KiB of headers: 10,000 requests held ~640 MiB outside every byte budget, and a result whose header
# block passed 64 KiB was refused by JetStream at every send (tests/test_durable_worker_attack.py).
MAX_TRACEPARENT_LEN = 512
REQUEST_ID_RULE = (f"1 to {MAX_REQUEST_ID_LEN} printable ASCII characters (0x21-0x7e) other than '.', '*' and "
                   "'>': no whitespace, no control characters")


def valid_request_id(request_id: str) -> bool:
    """The one definition of a valid request id (processor, publisher, edge, docs/protocol.md).

    An id becomes one NATS subject token, read by every client library: printable ASCII only, so no
    client splits it (nats-py takes VT and FF for separators) and no wildcard or separator is in it.
    """
    return (0 < len(request_id) <= MAX_REQUEST_ID_LEN and request_id.isascii() and request_id.isprintable()
            and " " not in request_id and "." not in request_id and "*" not in request_id
            and ">" not in request_id)


def check_request_id(request_id: str) -> str:
    """Raise ``ValueError`` naming the rule unless ``request_id`` is valid (see :func:`valid_request_id`)."""
    if not isinstance(request_id, str):
        raise ValueError(f"invalid request id (a {type(request_id).__name__}): a request id is {REQUEST_ID_RULE}")
    if not valid_request_id(request_id):  # cut: the edge answers this to whoever sent the path (64 KiB)
        raise ValueError(f"invalid request id {shown(request_id)}: a request id is {REQUEST_ID_RULE}")
    return request_id


class Subjects(msgspec.Struct, frozen=True):
    """Subject names under one prefix (``--prefix`` / ``STREAMPROC_PREFIX``)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or any(not t or set(t) & _FORBIDDEN_TOKEN_CHARS for t in self.prefix.split(".")):
            raise ValueError(f"invalid subject prefix {self.prefix!r}")

    @property
    def all_chunks(self) -> str:
        return f"{self.prefix}.chunks.>"

    @property
    def all_results(self) -> str:
        return f"{self.prefix}.results.>"

    def chunk(self, request_id: str, role: Role | str) -> str:
        return f"{self.prefix}.chunks.{request_id}.{Role(role).value}"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}.results.{request_id}"

    def migrate(self, request_id: str) -> str:
        return f"{self.prefix}.control.{request_id}.migrate"

    @property
    def all_migrate(self) -> str:
        return f"{self.prefix}.control.*.migrate"

    def request_id_of_migrate(self, subject: str) -> str:
        head = f"{self.prefix}.control."
        if not (subject.startswith(head) and subject.endswith(".migrate")):
            raise ContractError(f"subject {subject!r} is not {head}<request_id>.migrate")
        request_id = subject[len(head):-len(".migrate")]
        if not valid_request_id(request_id):
            raise ContractError(f"subject {subject!r} is not {head}<request_id>.migrate")
        return request_id

    def parse_chunk_subject(self, subject: str) -> tuple[str, Role]:
        head = f"{self.prefix}.chunks."
        if not subject.startswith(head):
            raise ContractError(f"subject {subject!r} is not under {head!r}")
        rest = subject[len(head):]
        request_id, dot, role = rest.rpartition(".")
        if not dot or not request_id or "." in request_id:
            raise ContractError(f"subject {subject!r} is not {head}<request_id>.<role>")
        if not valid_request_id(request_id):
            # Nobody can be answered on a subject built from it: counted and logged, never answered.
            raise ContractError(f"subject {subject!r}: the request id is not {REQUEST_ID_RULE}")
        found = ROLES.get(role)
        if found is None:
            raise ContractError(f"unknown role {shown(role)} (expected agg, prefill or decode)", request_id)
        return request_id, found

    def request_id_of_result(self, subject: str) -> str:
        return subject[len(self.prefix) + len(".results."):]


def _parse_flag(value: str | None, name: str, request_id: str) -> bool:
    if value is None or value == "false":
        return False
    if value == "true":
        return True
    raise ContractError(f"header {name} must be 'true' or 'false', got {shown(value)}", request_id)


def plain_index(value: str) -> int | None:
    """A seq or attempt header's value as a number: ASCII digits, at most 18 (``MAX_SEQ``); None
    otherwise (``'²'.isdigit()`` and ``'٠'.isdigit()`` are true, and ``int`` refuses the first)."""
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None


def _parse_index(value: str | None, name: str, request_id: str, *, required: bool) -> int:
    if value is None:
        if required:
            raise ContractError(f"missing required header {name}", request_id)
        return 0
    index = plain_index(value)
    if index is None:
        raise ContractError(f"header {name} must be a non-negative integer, got {shown(value)}", request_id)
    return index


def _traceparent(value: str | None) -> str | None:
    """A chunk's traceparent as the processor keeps it: None past :data:`MAX_TRACEPARENT_LEN` or not ASCII
    (a W3C one is; a non-ASCII one took up to 4 bytes a character in every result's header block,
    past the bound ``max_error_result_size`` counts)."""
    return value if value is None or (len(value) <= MAX_TRACEPARENT_LEN and value.isascii()) else None


def _unreadable(headers: Mapping[str, str], request_id: str) -> ContractError:
    """The contract error of a header block marked unreadable. The shell's own reason is at most
    :data:`MAX_UNREADABLE_REASON` characters; a longer one was sent by a worker (up to ``max_payload``:
    repeated whole, its error result could not be published and its log line was as long), so it
    is shown cut."""
    reason = headers[UNREADABLE_HEADERS]
    if len(reason) > MAX_UNREADABLE_REASON:
        reason = shown(reason)
    return ContractError(f"unreadable header block ({reason})", request_id)


def chunk_from_message(
    subjects: Subjects, subject: str, headers: Mapping[str, str] | None, body: bytes, token: Any = None
) -> Chunk:
    """Validate one incoming NATS message against the contract. Raises :class:`ContractError`."""
    request_id, role = subjects.parse_chunk_subject(subject)
    h = headers or {}
    if UNREADABLE_HEADERS in h:
        raise _unreadable(h, request_id)
    return Chunk(
        request_id=request_id,
        role=role,
        seq=_parse_index(h.get(SEQ), SEQ, request_id, required=True),
        body=body,
        final=_parse_flag(h.get(FINAL), FINAL, request_id),
        attempt=_parse_index(h.get(ATTEMPT), ATTEMPT, request_id, required=False),
        format=h.get(FORMAT) or None,
        traceparent=_traceparent(h.get(TRACEPARENT)),
        token=token,
    )


class ChunkParser:
    """:func:`chunk_from_message` specialised to one prefix for the per-message hot path.

    Well-formed messages take a straight line of C-level string and dict operations; anything
    unusual falls back to :func:`chunk_from_message`, which raises the precise ContractError.
    """

    __slots__ = ("subjects", "head", "cut")  # head, cut: read by fast_client.chunk_from_block too

    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects
        self.head = f"{subjects.prefix}.chunks."
        self.cut = len(self.head)

    def __call__(self, subject: str, headers: Mapping[str, str] | None, body: bytes, token: Any = None) -> Chunk:
        if headers is not None and subject.startswith(self.head):
            request_id, _, role = subject[self.cut:].rpartition(".")
            found = ROLES.get(role)
            seq = headers.get(SEQ)
            final = headers.get(FINAL)
            attempt = headers.get(ATTEMPT)
            if (found is not None and len(request_id) <= MAX_REQUEST_ID_LEN and request_id.isascii()
                    and request_id.isprintable() and " " not in request_id and "." not in request_id
                    and "*" not in request_id and ">" not in request_id and request_id
                    and seq is not None and seq.isascii() and seq.isdigit() and len(seq) <= 18
                    and (final is None or final == "true" or final == "false")
                    and (attempt is None or attempt == "0")):
                traceparent = headers.get(TRACEPARENT)  # _traceparent, inlined (calls per chunk)
                if traceparent is not None and (len(traceparent) > MAX_TRACEPARENT_LEN
                                                or not traceparent.isascii()):
                    traceparent = None
                return Chunk(request_id, found, int(seq), body, final == "true", 0,
                             headers.get(FORMAT) or None, traceparent, token)
        return chunk_from_message(self.subjects, subject, headers, body, token)


def chunk_headers(
    request_id: str,
    role: Role | str,
    seq: int,
    *,
    final: bool = False,
    attempt: int = 0,
    format: str | None = None,
    traceparent: str | None = None,
) -> dict[str, str]:
    """Headers a worker sends with one chunk (used by the publisher helper and the simulators)."""
    role = Role(role)
    headers = {
        SEQ: str(seq),
        ATTEMPT: str(attempt),
        MSG_ID: f"{request_id}.{role.value}.{attempt}.{seq}",
    }
    if final:
        headers[FINAL] = "true"
    if format:
        headers[FORMAT] = format
    if traceparent:
        headers[TRACEPARENT] = traceparent
    return headers


ERROR_MSG_ID_SUFFIX = ".error"  # an error result's Nats-Msg-Id: <request_id>.<seq>.error (result_headers)


def result_headers(result: Result) -> dict[str, str]:
    seq = str(result.seq)
    headers = {SEQ: seq, MSG_ID: result.request_id + "." + seq}
    if result.final:
        headers[FINAL] = "true"
    verdict = result.verdict
    if verdict is not None:
        headers[JOIN] = verdict._value_  # plain attribute: Enum.value is a slower descriptor
    if result.error is not None:
        headers[ERROR] = result.error
        # Its own id: a core-mode processor restarted within the results stream's duplicate window ends
        # a request it never saw with an error at its own seq 0 (Correlator._fail), where the old one's
        # result 0 is stored; under that result's id the stream would drop the error as a repeat.
        headers[MSG_ID] += ERROR_MSG_ID_SUFFIX
    if result.traceparent:
        headers[TRACEPARENT] = result.traceparent
    return headers


def max_error_result_size(error_bodies: list[Callable[[str, Any], bytes]], kinds: list[Any]) -> int:
    """The most bytes an error result takes against ``max_payload`` (its header block and body, as
    nats-server counts them): the longest request id, seq, kind and traceparent in
    :func:`result_headers`, and the largest of the ``error_bodies`` (each a codec's ``error_body``)
    for a text of :data:`errors.MAX_ERROR_TEXT` one-byte characters, which a cut text's JSON never
    exceeds (``errors.cut_error_text``). A server whose ``max_payload`` is below it cannot take every
    error result, and one it refuses is never replaced (the processor refuses to start). An
    ``error_body`` that raises (a broken codec plugin) is not counted: it builds no error result (its
    requests are answered through ``Pipeline.failed``), and a broken plugin must not stop the
    processor from serving every other format."""
    text = "x" * MAX_ERROR_TEXT
    sizes = [0]
    for error_body in error_bodies:
        for kind in kinds:
            try:
                sizes.append(len(error_body(text, kind)))
            except Exception:  # noqa: BLE001 - a codec's bug, met again (and answered) per request
                continue
    body = max(sizes)
    longest = max((str(getattr(kind, "value", kind)) for kind in kinds), key=len)  # ErrorKind's words
    headers = result_headers(Result("x" * MAX_REQUEST_ID_LEN, MAX_SEQ, b"", True, error=longest,
                                    traceparent="x" * MAX_TRACEPARENT_LEN))
    block = len("NATS/1.0\r\n\r\n") + sum(len(k) + len(v) + len(": \r\n") for k, v in headers.items())
    return block + body


def plain_header_value(value: str) -> bool:
    """True when a NATS client sends ``value`` unchanged (nats-py strips it and turns CR/LF into
    spaces): printable ASCII, no space at either end. Such a value can go in a pre-formatted block."""
    return value.isascii() and value.isprintable() and value == value.strip()


def result_header_block(request_id: str, seq: int, final: bool, traceparent: str | None) -> bytes:
    """The NATS header block of a passthrough result, formatted directly: the bytes nats-py's
    ``publish`` would send for ``result_headers(Result(request_id, seq, body, final,
    Verdict.PASSTHROUGH, None, traceparent))`` (same keys, same order; nats-py 2.16
    ``Client._send_publish``). ``request_id`` is valid (:func:`valid_request_id`) and a truthy
    ``traceparent`` is plain (:func:`plain_header_value`): callers check, tests pin the equality."""
    seq_text = str(seq)
    text = f"NATS/1.0\r\n{SEQ}: {seq_text}\r\n{MSG_ID}: {request_id}.{seq_text}\r\n"
    if final:
        text += _FINAL_LINE
    text += _JOIN_PASSTHROUGH_LINE
    if traceparent:
        text += f"{TRACEPARENT}: {traceparent}\r\n"
    return (text + "\r\n").encode()


_FINAL_LINE = f"{FINAL}: true\r\n"
_JOIN_PASSTHROUGH_LINE = f"{JOIN}: {Verdict.PASSTHROUGH._value_}\r\n"


def result_block(result: Result) -> bytes | None:
    """``result_headers(result)`` as the header block nats-py's ``publish`` would send for it,
    formatted directly (as :func:`result_header_block`, for any verdict); None when a value is not
    plain (an error text, an unusual traceparent or id): then the caller encodes the dict. The
    durable pump's results: one string instead of a dict and a second pass over it."""
    request_id = result.request_id
    traceparent = result.traceparent
    # plain_header_value(request_id), inline (a call per result on the durable hot path)
    if result.error is not None or (traceparent and not plain_header_value(traceparent)) \
            or not (request_id.isascii() and request_id.isprintable() and request_id == request_id.strip()):
        return None
    seq_text = str(result.seq)
    text = f"NATS/1.0\r\n{SEQ}: {seq_text}\r\n{MSG_ID}: {request_id}.{seq_text}\r\n"
    if result.final:
        text += _FINAL_LINE
    verdict = result.verdict
    if verdict is not None:
        text += f"{JOIN}: {verdict._value_}\r\n"
    if traceparent:
        text += f"{TRACEPARENT}: {traceparent}\r\n"
    return (text + "\r\n").encode()


# Verdict(text) costs ~1.3 µs in Python 3.11 (EnumType.__call__); the edge parses one per SSE event.
_VERDICTS: dict[str, Verdict] = {v.value: v for v in Verdict}


def _parse_verdict(value: str, request_id: str) -> Verdict:
    """A ``Streamproc-Join`` that is no verdict: a ContractError showing it cut (``shown``), where
    ``Verdict(value)``'s ValueError echoed a forged value whole into every error text and log line."""
    raise ContractError(f"header {JOIN} must be one of {', '.join(_VERDICTS)}, got {shown(value)}", request_id)


_RESULTS_INFIX = len(".results.")
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def held_error_text(text: str) -> str:
    """A ``Streamproc-Error`` that is not ASCII as a reader keeps it: each non-ASCII character ``?``.
    One character past Latin-1 makes CPython keep every character of a ``str`` in 2 or 4 bytes (PEP
    393), so a forged ``"\\U0001F600" + "a" * 50_000`` (50,004 bytes on the wire) held ~200 kB while
    ``ResultInfo.held_bytes`` charges its length: a stream held up to 4 x ``--stream-buffer-bytes``.
    ASCII, a character a byte, never longer than the value's wire bytes (each non-ASCII character came
    from at least one), so the charge stays what it holds and below what nats-server counts for it. The
    processor writes an ``ErrorKind`` word (ASCII) there: no honest value changes, and a reader shows any
    text not shaped like a kind as ``other`` (``shown_kind``) either way."""
    return text.encode("ascii", "replace").decode("ascii")


def result_from_message(subjects: Subjects, subject: str, headers: Mapping[str, str] | None, body: bytes) -> ResultInfo:
    """The edge parses one per SSE event (the fan-out's dispatch), so the common case is read here
    without a call: the request id (``Subjects.request_id_of_result``), a plain seq and a final flag
    that is absent, ``true`` or ``false``. Anything else goes through ``_parse_index`` and
    ``_parse_flag``, for the same value or the same ``ContractError`` (docs/benchmarks.md, "Calls per
    SSE event")."""
    request_id = subject[len(subjects.prefix) + _RESULTS_INFIX:]
    h = headers or _NO_HEADERS
    text = h.get(SEQ)
    if text is not None and text.isascii() and text.isdigit() and len(text) <= 18:  # plain_index, inline
        seq = int(text)
    else:
        if UNREADABLE_HEADERS in h:  # RobustClient's mark (no Streamproc-Seq): say so, as chunk_from_message does
            raise _unreadable(h, request_id)
        seq = _parse_index(text, SEQ, request_id, required=True)
    text = h.get(FINAL)
    if text is None or text == "false":
        final = False
    elif text == "true":
        final = True
    else:
        final = _parse_flag(text, FINAL, request_id)
    verdict = h.get(JOIN)
    # Header values held as ASCII, a byte a character (held_error_text): a W3C traceparent is lowercase
    # hex and dashes (https://www.w3.org/TR/trace-context/#traceparent-header), so one that is not
    # ASCII is none and reads as absent. str.isascii is O(1) (CPython keeps the flag).
    error = h.get(ERROR)
    if error is not None and not error.isascii():
        error = held_error_text(error)
    traceparent = h.get(TRACEPARENT)
    if traceparent is not None and not traceparent.isascii():
        traceparent = None
    return ResultInfo(
        request_id=request_id,
        seq=seq,
        final=final,
        verdict=(_VERDICTS.get(verdict) or _parse_verdict(verdict, request_id)) if verdict else None,
        error=error,
        body=body,
        traceparent=traceparent,
    )


# ------------------------------------------------------------------ migration control (request/reply)

_control_encoder = msgspec.json.Encoder()
_migrate_request = msgspec.json.Decoder(MigrateRequest)
_migrate_reply = msgspec.json.Decoder(MigrateReply)


def encode_control(message: MigrateRequest | MigrateReply) -> bytes:
    """A control message's bytes; a :class:`MigrateError`'s text cut to ``errors.MAX_ERROR_TEXT`` bytes as
    JSON (``cut_error_text``), whoever built it: many carry an exception's text (a codec plugin's, a
    malformed request's parse error, a store's), whose length nothing else bounds, and a reply past
    ``max_payload`` never reaches its migrator."""
    if isinstance(message, MigrateError):
        text = cut_error_text(message.message)
        if text != message.message:
            message = msgspec.structs.replace(message, message=text)
    return _control_encoder.encode(message)


def _too_deep() -> msgspec.DecodeError:
    """msgspec raises ``RecursionError`` for JSON nested too deeply (inside ``Any`` fields and skipped
    unknown ones): a malformed body like any other to the callers, which catch ``DecodeError``."""
    return msgspec.DecodeError("JSON is nested too deeply")


def decode_migrate_request(body: bytes) -> MigrateRequest:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) for a malformed body."""
    try:
        return _migrate_request.decode(body) if body.strip() else MigrateRequest()
    except RecursionError:
        raise _too_deep() from None


def decode_migrate_reply(body: bytes) -> MigrateReply:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a body that is no migrate reply."""
    try:
        return _migrate_reply.decode(body)
    except RecursionError:
        raise _too_deep() from None


_seal_record = msgspec.json.Decoder(SealRecord)


class _SealsRaw(msgspec.Struct, frozen=True):
    """A seal record with its ``seals`` left undecoded: counted before the list is built. The whole
    record, not ``seals`` alone: a record naming ``seals`` twice (no honest encoder does) is read with
    the last one, as msgspec does, and the earlier ones are skipped, never built; counting only the last
    and then decoding the whole record built every earlier list unbounded."""

    seals: msgspec.Raw
    sealed: Sealed
    id: str | None = None


_seals_raw = msgspec.json.Decoder(_SealsRaw)
_seals_list = msgspec.json.Decoder(list[int])


def max_seals(max_buffered_bytes: int) -> int:
    """The most seals a seal record read back may hold: as many as fit the per-request byte budget
    at what decoding them costs (``SEAL_DECODED_BYTES`` each, a list of ints), 932,067 at the
    default. No honest instance writes more: its migrate refuses a seal past the budget first
    (``Correlator.migrate``), at ``SEAL_BYTES`` a seal."""
    return max_buffered_bytes // defaults.SEAL_DECODED_BYTES


def encode_seal_record(record: SealRecord) -> bytes:
    """The bytes the migrations bucket stores: what ``SealLedger.write`` sends and what
    ``Correlator.migrate`` measures before a seal, so a record that cannot be written is never sealed."""
    return _control_encoder.encode(record)


def decode_seal_record(body: bytes, max_seals: int | None = None) -> SealRecord:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a value that is not a seal record, or
    (``max_seals``) one holding more seals than that, counted before any list is built: msgspec's
    ``max_length`` is checked only once the whole array is decoded (4,000,000 seals in 8 MB of JSON
    took a 35 MB peak to be refused), the count here only its bytes (JSON integers hold no comma)."""
    try:
        if max_seals is not None:
            bounded = _seals_raw.decode(body)
            raw = bytes(bounded.seals)  # a copy of part of the body, at most its size
            count = raw.count(b",")
            count = count + 1 if count or raw.strip(b"[] \t\r\n") else 0  # (no comma: one seal at most)
            if count > max_seals:
                raise msgspec.ValidationError(f"{count} seals, more than the {max_seals} a request may hold "
                                              "(max_buffered_bytes) - at `$.seals`")
            return SealRecord(_seals_list.decode(raw), bounded.sealed, bounded.id)
        return _seal_record.decode(body)
    except RecursionError:
        raise _too_deep() from None
