"""The codec interface: everything the correlator needs to know about a response format.

A codec is a pure, synchronous object (no I/O, no clock). The core never looks inside a body;
it asks the codec. Modelled on a client codec: which decode chunks need prefill data, how to join
a decode chunk with the prefill leg, how to fold a stream into a unary response, and how to build
the format's native error envelope.

Sequence fields (values indexed by token position, such as routed expert rows) are handled by
small :class:`SequenceCodec` objects, so a format can override one field's encoding and inherit
everything else (``sglang-zstd`` does exactly that).
"""

from __future__ import annotations

import enum
import re
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Generic, Mapping, MutableSequence, Sequence, TypeVar

import msgspec

from . import defaults
from .errors import ContractError, CorruptPayload, MigrationRefused  # noqa: F401 (ContractError: for codecs, JoinSession.join)
from .events import Verdict

DEFAULT_MAX_DECOMPRESSED_BYTES = defaults.MAX_DECOMPRESSED_BYTES  # the name codecs import


class CodecOptions(msgspec.Struct, frozen=True):
    """Limits every codec must honour and format-specific options (set from the processor's configuration)."""

    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    # ``--format-option KEY=VALUE``: facts about the workers a codec cannot read from the bodies
    # (e.g. ``streaming=cumulative`` for SGLang). Each codec documents the keys it reads.
    format_options: tuple[tuple[str, str], ...] = ()

    def option(self, key: str, default: str) -> str:
        """The value of one format option, or ``default`` when it was not given."""
        for name, value in reversed(self.format_options):
            if name == key:
                return value
        return default


def parse_format_options(text: str) -> tuple[tuple[str, str], ...]:
    """``"k=v,k2=v2"`` as pairs; raises ``ValueError`` for an item without ``=`` or key, and for a key
    given twice (which one was meant is not known)."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"format option {item!r} is not KEY=VALUE")
        if key in pairs:
            raise ValueError(f"format option {key!r} is given twice ({pairs[key]!r} and {value.strip()!r})")
        pairs[key] = value.strip()
    return tuple(pairs.items())


class ErrorKind(enum.StrEnum):
    """Why the processor ended a request itself, or the edge a stream (``unavailable``). Codecs map
    these to their native error types."""

    TIMEOUT = "timeout"  # no progress for --request-timeout
    OVERLOADED = "overloaded"  # a budget ran out (--max-inflight, --max-total-bytes, --max-decode-cpu, ...)
    INVALID_CHUNK = "invalid_chunk"  # a chunk broke the wire contract
    UNKNOWN_FORMAT = "unknown_format"  # Streamproc-Format names no installed (or no loadable) codec
    INTERNAL = "internal"  # a codec or the shell raised, or a poison chunk; the processor lives on
    MIGRATION_REFUSED = "migration_refused"  # its worker was lost and its state cannot move to another
    UNAVAILABLE = "unavailable"  # the edge: the results stream a stream read was deleted (edge/source.py)

    @property
    def http_status(self) -> int:
        """The HTTP status an edge answers with, and the ``code`` a codec writes into its error body:
        one table, so a client sees the same number in the status line and in the envelope."""
        return ERROR_STATUS[self]


_KINDS = frozenset(kind.value for kind in ErrorKind)
OTHER_KIND = "other"


_KIND_SHAPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def known_kind(text: str) -> str:
    """A result's ``Streamproc-Error`` as a metric label: a kind of this version, else ``other``.
    The header is its publisher's text (forged, or from a newer processor): each distinct one was a
    label of its own, kept for the process's life."""
    return text if text in _KINDS else OTHER_KIND


def shown_kind(text: str) -> str:
    """A result's ``Streamproc-Error`` as a reader passes it on (an HTTP header, an SSE meta frame):
    a word shaped like a kind (a newer processor's too) as it is, anything else ``other``. Echoed
    whole, text that is not latin-1 made the edge's unary answer a bare 500 and 60 KB a 60 KB header."""
    return text if _KIND_SHAPE.fullmatch(text) else OTHER_KIND


# An upstream (worker or processor) failure is a 5xx: the client's request itself was fine.
ERROR_STATUS: dict[str, int] = {
    ErrorKind.TIMEOUT: 504,  # the workers stopped answering: a gateway timeout
    ErrorKind.OVERLOADED: 503,
    ErrorKind.INVALID_CHUNK: 502,  # a worker broke the wire contract: a bad upstream answer
    ErrorKind.UNKNOWN_FORMAT: 502,  # a worker named a codec the processor does not have
    ErrorKind.INTERNAL: 500,
    ErrorKind.MIGRATION_REFUSED: 503,  # the worker was lost and the request could not move
    ErrorKind.UNAVAILABLE: 503,  # what the edge read results from is gone
}


def is_error_status(status: object) -> bool:
    """Whether ``status`` is an HTTP error status a unary answer may carry: an ``int`` (``HTTPStatus``
    members included; not a bool) in ``[400, 600)``, the range the engines answer an error with (the
    codecs cite where)."""
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= int(status) < 600


# Statuses that, from the edge, say the *client's* credentials were refused (401 with the edge's
# ``WWW-Authenticate``, 403 for a token that does not cover the request, 407 for a proxy's): a worker's
# body claiming one speaks of the worker's own credentials towards its engine, a deployment fault the
# client can do nothing about, so it is answered as one (Bad Gateway).
CLIENT_CREDENTIAL_STATUSES = frozenset({401, 403, 407})
WORKER_FAULT_STATUS = 502


def answer_status_of(codec: Codec, body: bytes) -> int:
    """``codec.answer_status(body)`` when it is an error status (:func:`is_error_status`), else 200: a
    codec (a third-party one too) can only pick among the statuses a worker's error answer may
    have, never an invalid status line (``99``, ``999``) nor a redirect or an empty ``204``; and
    never one that says the client's credentials were refused (:data:`CLIENT_CREDENTIAL_STATUSES`:
    502 instead). A codec that raises is the caller's to catch. A plain ``int`` (an ``HTTPStatus``
    member is taken as its number)."""
    status = codec.answer_status(body)
    if not is_error_status(status):
        return 200
    status = int(status)
    return WORKER_FAULT_STATUS if status in CLIENT_CREDENTIAL_STATUSES else status


# The Content-Type of a unary answer whose codec names none (every JSON format's bodies).
ANSWER_MEDIA_TYPE = "application/json"
# What ``Codec.answer_media_type`` may name: JSON (``application/json``, ``application/<x>+json``) or
# ``text/plain``, each with at most a ``charset`` parameter (ASCII tokens, one header line: no CR/LF, no
# quotes). An allowlist, not a shape: a third-party codec may let a worker's body choose its type, and
# ``text/html`` or ``image/svg+xml`` answered from the edge's origin would run the worker's markup in the
# reader's browser (stored XSS). Anything else is answered as :data:`ANSWER_MEDIA_TYPE`.
_ANSWER_MEDIA_TYPES = re.compile(r"(?:application/(?:[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,58}\+)?json|text/plain)"
                                 r"(?:; ?charset=[A-Za-z0-9!#$&^_.+-]{1,64})?", re.ASCII | re.IGNORECASE)


def answer_media_type_of(codec: Codec, body: bytes) -> str:
    """``codec.answer_media_type(body)`` when it is a ``str`` naming JSON or plain text (with at most a
    ``charset`` parameter), else :data:`ANSWER_MEDIA_TYPE`: a codec can name the Content-Type its engine
    answers a body with, never a malformed header (a CR/LF, a non-latin-1 character) nor a type a browser
    renders as active content (``text/html``, ``image/svg+xml``). A codec that raises is the caller's to
    catch."""
    media_type = codec.answer_media_type(body)
    if isinstance(media_type, str) and _ANSWER_MEDIA_TYPES.fullmatch(media_type):
        return media_type
    return ANSWER_MEDIA_TYPE


def trailing_int(body: bytes, key: bytes, closing: int, tail: int = 64) -> int | None:
    """The integer of member ``key`` (a JSON key as written, quotes included) when it is the last
    member of ``closing`` nested objects that end the body, read from its last ``tail`` bytes only:
    ``..., "<key>": 503}}`` for ``closing`` 2 (whitespace allowed between tokens); else None. A
    codec's bounded look for an envelope's status code written last (:meth:`Codec.answer_status`);
    digits only (no sign, no fraction), at most 20 of them."""
    pattern = _TRAILING_INT.get((key, closing))
    if pattern is None:
        pattern = _TRAILING_INT[(key, closing)] = re.compile(
            rb"[{,]\s*" + re.escape(key) + rb"\s*:\s*([0-9]{1,20})" + rb"\s*\}" * closing + rb"\s*\Z")
    found = pattern.search(body, max(0, len(body) - tail))
    return int(found.group(1)) if found is not None else None


_TRAILING_INT: dict[tuple[bytes, int], re.Pattern[bytes]] = {}


class OmissionReason(enum.StrEnum):
    """Why a joined field was left out: the value of ``<field>_unavailable_reason`` (every codec).

    The omission policy (docs/architecture.md) publishes a P/D field only when it can be rebuilt
    completely and correctly; otherwise the field is removed and one of these names the cause.
    """

    PREFILL_TIMEOUT = "prefill_timeout"  # no complete prefill leg within --prefill-timeout
    PREFILL_MISSING = "prefill_missing"  # the prefill leg did not carry the field
    PREFILL_CORRUPT = "prefill_corrupt"  # the prefill leg's value does not decode or is implausible
    PREFILL_ERROR = "prefill_error"  # the prefill worker answered with an error
    DECODE_MISSING = "decode_missing"
    DECODE_ERROR = "decode_error"  # the decode leg ended with an error or abort without the field the aggregated answer has
    DECODE_CORRUPT = "decode_corrupt"
    LENGTH_MISMATCH = "length_mismatch"  # the legs' sizes (a stitched value's counts) disagree with the token counts
    SHAPE_MISMATCH = "shape_mismatch"  # the legs' row shapes (layers x top-k, dtype) disagree
    TOO_LARGE = "too_large"  # decoding would exceed the byte budget
    STITCH_CORRUPT = "stitch_corrupt"  # a resumed attempt's value cannot be stitched to the earlier ones
    STITCH_INCOMPLETE = "stitch_incomplete"  # the value covers the whole output, and the earlier attempts never published theirs
    FOLD_AMBIGUOUS = "fold_ambiguous"  # a folded stream fits two unary values, and nothing in it says which
    NOT_STREAMED = "not_streamed"  # the unary answer has the field, and no chunk of the folded stream carries it

    @classmethod
    def of_leg(cls, exc: CorruptPayload, leg: str) -> OmissionReason:
        """The reason for a payload of ``leg`` (``"prefill"`` or ``"decode"``) that failed to decode:
        ``too_large`` when the budget refused it, else ``<leg>_corrupt``."""
        if exc.reason == cls.TOO_LARGE:
            return cls.TOO_LARGE
        return cls(f"{leg}_corrupt")


# Every codec marks a field it could not give ``<field>_unavailable_reason`` (Dynamo's convention): the
# field removed, left ``null`` where the format keeps the key, or a list with the unavailable entries
# ``null`` (SGLang's token 0 logprob of a prefill leg asked for none); readers such as the edge's
# experts view collect them without knowing the format's field names.
UNAVAILABLE_SUFFIX = "_unavailable_reason"
_MARKER_DEPTH = 4  # how deep a body's omission markers are searched (every format nests them shallowly)


def omission_markers(value: Any, out: dict[str, str] | None = None, depth: int = 0) -> dict[str, str]:
    """Every ``<field>_unavailable_reason`` in a parsed body, as field -> reason (depth-bounded)."""
    out = {} if out is None else out
    if depth > _MARKER_DEPTH:
        return out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        if isinstance(key, str) and key.endswith(UNAVAILABLE_SUFFIX) and isinstance(inner, str):
            out[key.removesuffix(UNAVAILABLE_SUFFIX)] = inner
        elif isinstance(inner, (dict, list)):
            omission_markers(inner, out, depth + 1)
    return out


# A key ``"<field>_unavailable_reason":`` in JSON bytes: a quote directly after the suffix, then a colon, is a
# key's end (a quote inside a string value is escaped, and a value is never followed by a colon).
_MARKER_END = (UNAVAILABLE_SUFFIX + '"').encode()
_KEY_COLON = re.compile(rb"\s*:")


def marker_names(body: bytes) -> set[bytes]:
    r"""The fields a JSON body's ``<field>_unavailable_reason`` keys name, at any depth, with no parse: the
    matches of ``"([^"\\]*)_unavailable_reason"\s*:`` (non-overlapping, left to right), found by ``bytes.find``
    of the suffix and ``rfind`` of the quote before it, each byte looked at about once. That regex itself
    backtracks over a whole long string value (~120 ms on a 7.2 MB answer, the GIL held, stalling the
    edge's event loop); tests/test_edge_fold_verdict.py holds the two equal."""
    names = set()
    floor = 0  # where the last match ended: a match never starts inside one (findall's rule)
    at = body.find(_MARKER_END)
    while at >= 0:
        end = at + len(_MARKER_END)
        quote = body.rfind(b'"', floor, at)  # a name holds no quote: its opening quote is the nearest one
        colon = _KEY_COLON.match(body, end) if quote >= 0 else None
        if colon is not None and body.find(b"\\", quote, at) < 0:
            names.add(body[quote + 1:at])
            floor = colon.end()
        at = body.find(_MARKER_END, end)
    return names


def fold_added_markers(bodies: Sequence[bytes], folded: bytes) -> bool:
    """Whether :meth:`Codec.fold` wrote an omission marker none of the results it folded carries (a field
    the unary answer has and the stream does not say): the answer is then ``omitted`` whatever its
    results' verdicts (docs/protocol.md), never ``passthrough``, which says the worker's bytes untouched."""
    added = marker_names(folded)
    if not added:
        return False
    for body in bodies:
        added -= marker_names(body)
    return bool(added)


class RowSource(enum.StrEnum):
    """Which worker computed a span of routed-expert rows."""

    WORKER = "worker"  # an aggregated request: one worker computed every row
    PREFILL = "prefill"
    DECODE = "decode"
    JOINED = "joined"  # a P/D join, but the body does not say where prefill's rows end
    RESUMED = "resumed"  # a migrated request: rows of more than one attempt, which is not in the body


class RowSpan(msgspec.Struct, frozen=True):
    """Rows ``[start, stop)`` of a routed-experts matrix and the worker that computed them."""

    source: RowSource
    start: int
    stop: int


def row_spans(positions: int, prefill_rows: int | None, verdict: Verdict | None) -> list[RowSpan]:
    """Where each row came from, by the request's strongest verdict: one worker for a passthrough
    request; for a joined (or omitted) one, prefill's ``prefill_rows`` then decode's (unknown split:
    one ``joined`` span); one ``resumed`` span for a stitched one (aggregated or P/D, the attempts'
    rows are not told apart in the body); ``[]`` when the verdict is not known."""
    if verdict is None:
        return []
    if verdict is Verdict.PASSTHROUGH:
        return [RowSpan(RowSource.WORKER, 0, positions)]
    if verdict is Verdict.STITCHED:
        return [RowSpan(RowSource.RESUMED, 0, positions)]
    if prefill_rows is None:
        return [RowSpan(RowSource.JOINED, 0, positions)]
    split = min(max(0, prefill_rows), positions)
    spans = [RowSpan(RowSource.PREFILL, 0, split)] if split else []
    return spans + ([RowSpan(RowSource.DECODE, split, positions)] if split < positions else [])


class RoutedExperts(msgspec.Struct, kw_only=True):
    """A format-neutral description of the routed experts in one result body (:meth:`Codec.routed_experts`).

    ``matrix`` is a 2-D integer numpy array, one row per token position from ``start``, each row
    ``layers x top_k`` ids (``layers``/``top_k`` known only when the wire states the shape).
    """

    field: str | None = None  # the format's own name for the value, for display only
    present: bool = False  # the body carries a value (else see ``omitted``)
    matrix: Any = None  # positions x row ids, or None (absent, or see ``problem``)
    dtype: str | None = None
    start: int = 0  # token position of row 0
    layers: int | None = None
    top_k: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    splice: int | None = None  # row index of the first row after the prompt, when inside the matrix
    spans: list[RowSpan] = []  # which worker computed which rows (needs the request's verdict)
    omitted: dict[str, str] = {}  # field -> reason, from every ``<field>_unavailable_reason`` marker
    problem: str | None = None  # why a present value cannot be shown as a matrix


R = TypeVar("R")


class SequenceCodec(ABC, Generic[R]):
    """Wire encoding of one sequence field: JSON value <-> rows that can be sliced and joined.

    ``decode`` must be bounded (``CodecOptions.max_decompressed_bytes``) and must raise
    :class:`CorruptPayload`, never anything else, on bad input.
    """

    def __init__(self, options: CodecOptions) -> None:
        self.options = options

    @abstractmethod
    def decode(self, value: object) -> R: ...

    @abstractmethod
    def encode(self, rows: R) -> object: ...

    def decoded_bound(self, value: object, limit: int) -> int:
        """At most how many bytes ``decode_within(value, limit)`` allocates for its output, judged
        without decoding (a length, a header): the correlator reserves them in the processor's byte
        budget before a join that decodes ``value`` runs off the event loop. This default knows
        nothing of the encoding: the codec's ceiling (``max_decompressed_bytes``), which the default
        :meth:`decode_within` may reach before it compares the size with ``limit``."""
        return self.options.max_decompressed_bytes

    def decode_within(self, value: object, limit: int) -> R:
        """``decode``, refusing (``too_large``) past ``limit`` bytes, the size the caller expects
        from the body's token counts. This default checks after decoding (still bounded by
        ``max_decompressed_bytes``); encodings that inflate override it to stop earlier."""
        rows = self.decode(value)
        size = getattr(rows, "nbytes", None)
        size = len(rows) if size is None else size  # type: ignore[arg-type]
        if size > limit:
            raise CorruptPayload(OmissionReason.TOO_LARGE, f"decoded {size} bytes, the body allows {limit}")
        return rows


# What ``msgspec.json.decode`` can allocate per structural character of a JSON text, as Python
# objects (CPython 3.11, 64-bit, tracemalloc). Every object a text makes follows one of these
# characters or is the top-level one: ``{`` a dict with the table of its first entries (184), ``:``
# a dict entry's share of table growth and a value (a non-ASCII one-character string is 76-80), ``[``
# a list with its first slots (88), ``,`` a slot and an element or key. The worst shape measured,
# chains of one-entry dicts under distinct one-character keys (``{"中":{"丁":...}}``), takes 260
# bytes per ``{`` + ``:`` pair; the weights give 256 plus 5x the 7 text bytes, ~12% above.
# tests/test_parsed_bound.py checks the bound against tracemalloc on generated and worst shapes.
_PARSED_WEIGHTS: tuple[tuple[bytes, int], ...] = ((b"{", 168), (b":", 88), (b"[", 104), (b",", 72))
_PARSED_TOP = 264  # the top-level value, which follows no structural character


def json_structure(body: bytes) -> tuple[int, ...]:
    """How many of each of ``{ : [ ,`` (in that order) a JSON text holds: what
    :func:`parsed_json_bound` weighs, counted once for a caller that needs the counts too."""
    return tuple(body.count(char) for char, _ in _PARSED_WEIGHTS)


def parsed_json_bound(body: bytes, narrow: int = 0, structure: tuple[int, ...] | None = None) -> int:
    """At most how many bytes the Python objects of ``msgspec.json.decode(body)`` hold: what a
    codec that keeps a parsed body (an absorbed prefill leg) must charge to ``--max-total-bytes``.
    Counted, not parsed (a few ``bytes.count`` passes): each structural character at the most an
    object following it can take, plus the text itself once, or five times when it is not ASCII or
    holds a ``\\u`` escape (a string holding one astral character is UCS-4: 4 bytes per character,
    its ASCII ones included; and once the value is encoded, as a join republishes it, each wide
    string keeps its UTF-8 copy too, ``PyUnicode_AsUTF8AndSize``: one more byte per byte of text).
    ``narrow``: bytes of the text the caller knows to be ASCII strings (Base64 rows it parsed),
    which take one byte per character however wide the rest is. Honest logprob bodies parse to 6-7x
    their length and are charged 13-16x; the fixed 6x of before let shapes that parse to 24-31x
    (``[{"1":{}},...]``) hold ~5x the budget. ``structure``: :func:`json_structure` of ``body``,
    when the caller has counted it already."""
    size = len(body)
    total = _PARSED_TOP + size
    if not body.isascii() or b"\\u" in body:  # a \\uXXXX escape can make a string wide too
        total += 4 * max(0, size - narrow)
    if structure is None:
        structure = json_structure(body)
    for (_, weight), count in zip(_PARSED_WEIGHTS, structure):
        total += weight * count
    return total


class JoinSession(ABC):
    """Per-request P/D join state, owned by the codec and driven by the correlator.

    Call order: any number of ``needs_prefill``/``join`` calls on decode chunks in seq order;
    ``join`` is only called on a chunk that needs prefill after exactly one of
    ``absorb_prefill`` or ``prefill_unavailable``.
    """

    @abstractmethod
    def needs_prefill(self, body: bytes, final: bool) -> bool:
        """Whether this decode chunk can only be published after the prefill leg is known."""

    @abstractmethod
    def absorb_prefill(self, bodies: Sequence[bytes]) -> None:
        """The complete prefill leg, in seq order. Bad payloads are remembered, not raised."""

    @abstractmethod
    def prefill_unavailable(self, reason: str) -> None:
        """The prefill leg will never be complete (e.g. ``prefill_timeout``)."""

    @abstractmethod
    def join(self, body: bytes, final: bool) -> tuple[bytes, Verdict]:
        """The client-visible body for one decode chunk and what was done to it. Raises
        :class:`ContractError` for a body the codec refuses as a whole (the request then ends with an
        ``invalid_chunk`` error naming the reason); any other exception ends it as ``internal``."""

    def published(self, bodies: Sequence[bytes]) -> None:
        """The current attempt's results another instance published before this one adopted the request
        (durable take-over: ``Correlator.resume`` with the stored bodies), in seq order, before any
        other call. A session whose decisions count across chunks (a format whose stream chunks carry
        no usage: tokens seen so far) reads them here, so it decides as the session that joined them
        did (law 7); their chunks are settled and never redelivered. After a take-over without a seal
        record they are read back only for a codec that sets :attr:`Codec.needs_published`. Nothing
        by default."""

    def published_lost(self, count: int, reason: str) -> None:
        """The ``count`` results published before a take-over cannot be read back (``reason``): a
        session that counts across chunks must not decide on part of the request as if it were all of
        it (omit what depends on the count, with a reason). Nothing by default."""

    def set_aside(self) -> None:
        """The chunk :meth:`needs_prefill` was just asked about waits (for the prefill leg, or its
        turn at the join thread): drop anything parsed from it, which nothing charges. A flood of
        waiting SGLang decode chunks kept parsed (~30x their length for some shapes) took
        ``streamproc run`` to 1.4 GiB VmHWM at the 96 MiB budget. It is asked again when it resumes."""

    # Set by the correlator before each call: bytes the session may still decode within the
    # processor's global budget (``max_total_bytes``); None means no budget. A codec whose payloads
    # inflate bounds its decoding by it, so a bomb inside ``max_decompressed_bytes`` ends as a
    # ``too_large`` omission instead of an allocation.
    decode_budget: int | None = None

    def join_bytes(self, body: bytes, final: bool) -> int | None:
        """At most how many bytes the :meth:`join` of ``body`` decodes beyond :meth:`retained_bytes`
        (payloads, the parsed body), judged without decoding: lengths, headers, what
        :meth:`needs_prefill` already parsed. The correlator calls it on the event loop just before
        the join leaves for another thread, and charges the bytes to the processor's byte budget
        (``max_total_bytes``) until :meth:`Correlator.finish`, so requests arriving meanwhile cannot
        fill the room the running join is decoding into. None: no bound is known, and all the
        budget has left is reserved. This default is the parsed form of a JSON body,
        :func:`parsed_json_bound`; a codec whose payloads inflate (Base64, zstd, ``.npy``) adds
        them (:meth:`SequenceCodec.decoded_bound`)."""
        return parsed_json_bound(body)

    # Sequence payloads (e.g. expert rows) the session has decoded or tried to decode so far,
    # counted by the codec before each decode (a payload that fails half-way cost CPU too). A join's
    # CPU is charged to the request's decode-time budget (``max_decode_cpu``) only when the join
    # made it grow: the budget bounds what inflating payloads cost, not logprob copies. None (the
    # default): the codec does not count, and every offloaded join is charged.
    decodes: int | None = None

    def retained_bytes(self) -> int:
        """Bytes of decoded payloads the session keeps between calls (e.g. prefill's rows).

        The correlator charges them to the processor's global byte budget (``max_total_bytes``), so
        a small payload that inflates cannot hold memory outside every bound. 0 by default.
        """
        return 0


class Emitted(msgspec.Struct, frozen=True):
    """What the client has been sent of one request, in the terms a resumed request needs."""

    token_ids: list[int]
    state: dict[str, Any] = {}  # format-specific facts (e.g. the original prompt length), JSON-able


def keep_emitted(progress: MutableSequence[int], token_ids: Sequence[int]) -> None:
    """Append a published body's token ids to a migration session's progress (an ``array("q")``: 8
    bytes a token). An id past 64 bits is the worker's fault, refused as such: it raised
    ``OverflowError``, which the correlator reports as the codec's own failure."""
    try:
        progress.extend(token_ids)
    except OverflowError:
        raise MigrationRefused("a published body has a token id outside the 64-bit range, so the emitted "
                               "tokens cannot be kept") from None


def check_resumed_prompt(prompt_tokens: int, emitted: Emitted, state_key: str) -> None:
    """Refuse to resume a request whose prompt is not the one the client was sent results for
    (``emitted.state[state_key]``, recorded by the format's migration session, when known)."""
    seen = emitted.state.get(state_key)
    if type(seen) is int and seen != prompt_tokens:
        raise MigrationRefused(f"the request's prompt has {prompt_tokens} tokens but the client was sent results "
                               f"for a {seen}-token prompt: not the request being resumed")


def restated_prompt(attempt_prompt: int, emitted: int, original: int | None) -> int:
    """A resumed attempt's prompt count in the client's terms: its prompt holds the original prompt
    and the ``emitted`` tokens, so ``attempt_prompt - emitted`` (``original``: the count the client
    was sent, when known). A body whose count does not hold them was not built on what the client
    was sent (a buggy frontend or worker): :class:`ContractError`, the request ends ``invalid_chunk``
    (it was published as ``stitched`` with a negative prompt count)."""
    restated = attempt_prompt - emitted
    if restated < 0 or (original is not None and restated != original):
        expected = f"{original} + {emitted}" if original is not None else f"at least {emitted}"
        raise ContractError(f"a resumed attempt's prompt has {attempt_prompt} tokens, not the {expected} it "
                            "must hold (the original prompt and the tokens the client was sent)")
    return restated


def final_error_body(bodies: Sequence[bytes], docs: Sequence[object], is_error: Callable[[Any], bool],
                     engine: str) -> bytes | None:
    """For ``Codec.fold``: the stream's last body when it is the worker's error body, else None. The
    same request unary answers the error alone, never the output produced before it, and a stream
    sends nothing after its error frame but its end; an error body with chunks after it is nothing
    ``engine`` writes (ValueError: it cannot be folded). ``docs`` are the parsed ``bodies``."""
    errors = [index for index, doc in enumerate(docs) if is_error(doc)]
    if not errors:
        return None
    if errors != [len(docs) - 1]:
        raise ValueError(f"chunk {errors[0]} is the worker's error body and chunks follow it: "
                         f"no stream {engine} writes; it cannot be folded")
    return bodies[-1]


def check_sampling_params(params: object, *, guided: Sequence[str], samples: str) -> dict[str, Any]:
    """A request's sampling parameters if one request with them can be resumed elsewhere: a single
    object (not a batch), one sample (the format's ``samples`` field absent or 1), no guided decoding
    (``guided`` fields) whose grammar state could not be carried over. Raises :class:`MigrationRefused`."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise MigrationRefused("a batched request (a list of sampling parameters) cannot be resumed")
    n = params.get(samples)
    if n not in (None, 1):
        raise MigrationRefused(f"{samples} = {n}: parallel samples cannot be resumed as one request")
    for field in guided:
        if params.get(field) is not None:
            raise MigrationRefused(f"guided decoding ({field}): the grammar state cannot be carried over")
    return params


def resumed_budget(params: dict[str, Any], emitted: int, *, max_key: str, min_key: str,
                   default: int | None) -> dict[str, Any]:
    """Sampling parameters of the resumed request: the token budget ``max_key`` and the minimum
    ``min_key`` shrink by the ``emitted`` tokens. An absent ``max_key`` is the format's ``default``
    (None: unbounded); an explicit null is unbounded and stays null, as the engines read it (SGLang's
    ``SamplingParams.max_new_tokens`` defaults to 128 but a null reaches ``init_req_max_new_tokens``
    as ``1 << 30``), so turning it into ``default - k`` cut an unbounded request short.
    Raises :class:`MigrationRefused` when no budget is left. The input is not changed."""
    out = dict(params)
    budget = out[max_key] if max_key in out else default
    if budget is not None:
        if type(budget) is not int or budget - emitted < 1:
            raise MigrationRefused(f"no token budget left ({max_key} {budget}, {emitted} emitted)")
        out[max_key] = budget - emitted
    if type(out.get(min_key)) is int:
        out[min_key] = max(0, out[min_key] - emitted)
    return out


class MigrationSession(ABC):
    """Per-request migration state, owned by the codec and driven by the correlator.

    The correlator keeps references to the bodies it published for the current attempt and hands
    them to :meth:`absorb` only when needed (a migrate, or its retention bound), so a request that
    never migrates costs no parsing. Call order: ``absorb`` any number of times, then ``seal`` at
    a migration; ``stitch`` on every body of a resumed attempt before it is published (its result
    is published, and later absorbed, instead). All methods are pure.
    """

    @abstractmethod
    def absorb(self, bodies: Sequence[bytes]) -> None:
        """Published bodies, in result order. Raises :class:`MigrationRefused` if they show the
        request cannot move (the refusal is final for the request)."""

    @abstractmethod
    def seal(self) -> Emitted:
        """The current attempt ends: what the client has seen so far, over every attempt."""

    @abstractmethod
    def stitch(self, body: bytes, final: bool) -> tuple[bytes, Verdict] | None:
        """A resumed attempt's (already joined) body, rewritten so the stream reads as one request,
        with the rewritten body's verdict: ``Verdict.OMITTED`` when it carries an omission marker
        (its own or one the join put there and it kept), else ``STITCHED``; the correlator publishes
        that verdict as is. None when nothing needs to change (the join's verdict stays)."""

    @abstractmethod
    def progress_bytes(self) -> int:
        """Bytes the session keeps between calls: the emitted token ids (which grow with the output,
        without bound for a request that never ends) and whatever it kept from single bodies.

        The correlator charges them to the request (``max_buffered_bytes``) and to the processor's
        global byte budget (``max_total_bytes``) after every :meth:`absorb`, so a request that
        streams forever ends with an ``overloaded`` error instead of growing memory outside every
        bound. An estimate within a small factor of the real footprint is enough; never 0 for a
        state that grows with the output.
        """


class Codec(ABC):
    """One response format. Registered under ``name`` in the ``streamproc.codecs`` entry-point group."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Wire encoding per sequence field; a derived format overrides one entry and inherits the rest
    # (``sglang-zstd``). The instances in ``self.sequences`` are shared by every session of this
    # codec instance (one processor thread), so stateful encoders are created per instance.
    sequence_codecs: ClassVar[Mapping[str, type[SequenceCodec]]] = {}
    # The ``--format-option`` keys this codec reads (``options.option``): a key no installed codec
    # reads is a typo that would silently leave the codec's default in place, so the
    # command line refuses it (exit 2). ``None``: not declared (a codec written before this field);
    # while one installed codec declares nothing, an unread key is only warned about.
    option_keys: ClassVar[frozenset[str] | None] = None
    # Whether its join sessions read the bodies published before a durable take-over
    # (:meth:`JoinSession.published`): the heir then reads them back from the results stream before
    # it adopts a request (docs/operations.md). False costs a take-over no read of them.
    needs_published: ClassVar[bool] = False

    def __init__(self, options: CodecOptions | None = None) -> None:
        self.options = options or CodecOptions()
        self.sequences: dict[str, SequenceCodec] = {
            field: cls(self.options) for field, cls in self.sequence_codecs.items()
        }

    @abstractmethod
    def open_session(self) -> JoinSession:
        """Fresh join state for one P/D request."""

    @abstractmethod
    def fold(self, bodies: Sequence[bytes]) -> bytes:
        """Fold a stream of (joined) chunks into the equivalent unary response."""

    def folds_alone(self, body: bytes) -> bool:
        """Whether a request whose only result is ``body`` answers a unary client with
        ``fold([body])`` rather than ``body`` verbatim: a stream's only chunk that is not in the
        unary shape (a streamed batch's item). Called on the event loop for every unary answer of one
        result, so it may only look at the bytes, not parse them (a large body would hold the loop):
        a bounded part of them, or byte searches that read each byte at most once (linear, at C
        speed, whatever the bytes); ``fold`` then decides, and gives back
        ``body`` itself when it is the unary answer after all. The default: never (one result is the
        unary answer)."""
        return False

    def answer_status(self, body: bytes) -> int:
        """The HTTP status the aggregated engine answers with when ``body`` is its unary answer (a
        request's only result served as is, or :meth:`fold` of its results): the status of an error
        body the format's own bytes tell (an engine's error envelope that holds its status, or a
        shape the engine only writes with one status); 200 for every other body. The edge answers a
        unary client with it (an SSE stream has sent 200 before any result, as the engines' streams
        do); streamproc's own error results (``Streamproc-Error``) keep :data:`ERROR_STATUS`.
        Called on the event loop for every unary answer, so it may only look at a bounded part of
        the bytes (a prefix, a suffix: no parse, no scan of the whole body) and must say its bound.
        Anything but an integer in ``[400, 600)`` (an ``HTTPStatus`` member is one) is answered as 200
        (:func:`answer_status_of`), so a worker's body claiming another status cannot make an invalid
        status line. The default: 200 (the format's bodies tell no status)."""
        return 200

    def answer_media_type(self, body: bytes) -> str:
        """The Content-Type the aggregated engine answers ``body`` with as its unary answer (the same
        bodies as :meth:`answer_status`): a format's engine answers some errors with a body that is not
        JSON (a framework's plain-text 500), and a client reading the edge should see what the engine
        sends. The same bound as :meth:`answer_status` (on the event loop: a bounded look). Anything
        but JSON or ``text/plain`` (optionally with a ``charset``) is answered as
        :data:`ANSWER_MEDIA_TYPE` (:func:`answer_media_type_of`). The default: ``application/json`` (every built-in format's
        bodies, errors included, are JSON)."""
        return ANSWER_MEDIA_TYPE

    @abstractmethod
    def error_body(self, message: str, kind: ErrorKind) -> bytes:
        """The format's native error envelope."""

    def omissions(self, body: bytes) -> dict[str, str]:
        """The omission markers of a result body the join marked ``omitted`` (field -> reason), which
        the processor counts by reason. The default reads a JSON body (every built-in format); a body
        it cannot read has none."""
        try:
            return omission_markers(msgspec.json.decode(body))
        except (msgspec.DecodeError, RecursionError):
            return {}

    # The format's name for the generated text in a body, None when its bodies carry none: the live
    # page shows it (the edge passes it on in ``GET /v1/info``) without naming a format's field.
    text_field: ClassVar[str | None] = None

    # The format's name for its routed-experts value (a sequence field), None when it has none.
    # Readers that must find the value in a body they hold (the live page) learn it from here.
    experts_field: ClassVar[str | None] = None

    def routed_experts(self, body: bytes, *, verdict: Verdict | None = None,
                       limit: int = DEFAULT_MAX_DECOMPRESSED_BYTES) -> RoutedExperts:
        """The routed experts of one result body, format-neutral, decoded within ``limit`` bytes;
        ``verdict`` (the request's strongest) says whether rows were joined from two legs.
        Raises ``ValueError`` when ``body`` is not a result body of this format. The default, for
        a format without routed experts, does not look at the body."""
        return RoutedExperts(problem=f"format {self.name} describes no routed experts")

    # Migration hooks. The defaults refuse, so a codec without migration support stays valid.

    def open_migration(self) -> MigrationSession:
        """Fresh migration state for one request (created lazily by the correlator)."""
        raise MigrationRefused(f"format {self.name!r} does not support migration")

    def check_migratable(self, request: bytes) -> None:
        """Raise :class:`MigrationRefused` if the native request cannot be resumed elsewhere
        (used by the serving layer's helper before it seals anything)."""
        raise MigrationRefused(f"format {self.name!r} does not support migration")

    def resume_request(self, request: bytes, emitted: Emitted) -> bytes:
        """The native request that continues ``request`` after ``emitted`` (prompt + emitted tokens,
        a smaller budget). Raises :class:`MigrationRefused`."""
        raise MigrationRefused(f"format {self.name!r} does not support migration")
