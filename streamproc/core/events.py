"""The records that flow through the core: chunks in, decisions out, migrate messages.

Every other module speaks in these terms: the correlator turns :class:`Chunk` into
:class:`Decision` values (:class:`Result` to publish, :class:`Settle` for input that contributes
to nothing, :class:`Notice` for the log); the control plane exchanges :class:`MigrateRequest` and
:data:`MigrateReply`; readers of results see :class:`ResultInfo`. How they look on the wire
(subjects, headers) is :mod:`streamproc.core.wire`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

from . import defaults

# The largest Streamproc-Seq (and Streamproc-Attempt) the processor reads: at most 18 ASCII digits,
# so every index fits an int64 on any reader (wire.py reads the headers; Sealed bounds its fields).
MAX_SEQ = 10**18 - 1


class Role(enum.StrEnum):
    """Which worker leg a chunk comes from (the last token of its subject)."""

    AGG = "agg"
    PREFILL = "prefill"
    DECODE = "decode"


class Verdict(enum.StrEnum):
    """What the processor did to a result body (the ``Streamproc-Join`` header)."""

    PASSTHROUGH = "passthrough"  # body is the input chunk's bytes, untouched
    JOINED = "joined"  # the codec merged prefill data into the decode chunk
    OMITTED = "omitted"  # a joined field was unavailable and was removed, with a reason marker
    STITCHED = "stitched"  # a resumed attempt's body, rewritten to continue the earlier attempts' stream


class Chunk(msgspec.Struct, frozen=True):
    """One worker response chunk as the correlator sees it. ``token`` is the shell's ack handle."""

    request_id: str
    role: Role
    seq: int
    body: bytes
    final: bool = False
    attempt: int = 0
    format: str | None = None
    traceparent: str | None = None
    token: Any = None


class Result(msgspec.Struct, gc=False):
    """One result to publish on ``P.results.<request_id>``.

    ``settles`` lists the input tokens that may be acknowledged once this result is stored.
    """

    request_id: str
    seq: int
    body: bytes
    final: bool
    verdict: Verdict | None = None
    error: str | None = None
    traceparent: str | None = None
    settles: tuple = ()
    # The request's format (its codec's name): an error result put in place of a final result that
    # can never be published takes its shape once the request is finished and keeps no codec
    # (durable mode, Correlator.unpublishable; core mode reads the chunk's Streamproc-Format).
    format: str | None = None

    @property
    def msg_id(self) -> str:
        return f"{self.request_id}.{self.seq}"


class Settle(msgspec.Struct, frozen=True):
    """Input tokens that contribute to no result (duplicates, late chunks): ack them now."""

    tokens: tuple


class Notice(msgspec.Struct, frozen=True):
    """Something an operator may want in the log, always with the request id."""

    request_id: str
    event: str
    detail: str = ""


Decision = Result | Settle | Notice


class ResultInfo(msgspec.Struct, frozen=True):
    """A result as an edge reads it back from NATS."""

    request_id: str
    seq: int
    final: bool
    verdict: Verdict | None
    error: str | None
    body: bytes
    traceparent: str | None = None

    @property
    def held_bytes(self) -> int:
        """What a reader holding it is charged against its byte bound: the body, the header values
        it keeps (any publisher chooses their length) and a fixed cost, so empty results count. The
        values are ASCII as read (``wire.held_error_text``; a traceparent that is not ASCII is dropped):
        ``len`` is then the bytes they hold, never more than nats-server counts for them (a character
        past Latin-1 made a ``str`` 2 or 4 bytes a character: 4 x the bound held)."""
        return (len(self.body) + len(self.error or "") + len(self.traceparent or "") + len(self.request_id)
                + defaults.RESULT_HELD_OVERHEAD)


# ------------------------------------------------------------------ migration control (request/reply)

MAX_MIGRATE_ID_LENGTH = 256
MAX_REFUSE_LENGTH = 1024


class MigrateRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Body of a NATS request on ``P.control.<request_id>.migrate``; an empty body means all defaults."""

    # Seal only if this is still the current attempt: two migrators racing cannot both win.
    expected_attempt: int | None = None
    # The caller already knows the request cannot move (e.g. guided decoding): end it with a
    # ``migration_refused`` error result instead of leaving the client waiting for request_timeout.
    # Bounded: it becomes the text of the request's error result (and an unbounded one could make
    # that result larger than a NATS message).
    refuse: Annotated[str, msgspec.Meta(max_length=MAX_REFUSE_LENGTH)] | None = None
    reason: str = ""  # free text for the processor's log (e.g. which worker was lost), logged cut
    # Names this migrate so a retry after a lost reply (a processor killed between recording the
    # seal and answering) gets the seal it caused again instead of ``attempt_mismatch``. Bounded: it is
    # stored in the seal record beside the sealed state, which must fit one NATS message.
    id: Annotated[str, msgspec.Meta(max_length=MAX_MIGRATE_ID_LENGTH)] | None = None


class MigrateErrorCode(enum.StrEnum):
    UNKNOWN_REQUEST = "unknown_request"  # no chunk of it reached this processor (or it was forgotten)
    FINISHED = "finished"  # its final result is already published: nothing to resume
    ATTEMPT_MISMATCH = "attempt_mismatch"  # expected_attempt is not the current attempt
    REFUSED = "refused"  # state cannot transfer; the request was ended with an error result
    BAD_REQUEST = "bad_request"  # the control message itself is malformed
    UNAVAILABLE = "unavailable"  # durable mode: the seal could not be recorded; nothing moved, retry


class Sealed(msgspec.Struct, frozen=True, tag="sealed", tag_field="status"):
    """Success: the previous attempt is sealed and ``attempt`` is granted to the resumed request."""

    request_id: str
    # Bounded as decoded: a reply that is none (a buggy or newer processor, anyone answering on the
    # control subject) is a ContractError, never a Streamproc-Attempt header no chunk may carry
    # (MAX_SEQ: 18 digits) or a negative count.
    attempt: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]  # every chunk of the resumed request's Streamproc-Attempt
    emitted_tokens: Annotated[int, msgspec.Meta(ge=0)]  # output tokens the client has been sent, over all attempts
    emitted_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]]
    result_seq: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]  # the result seq the resumed attempt's chunk seq 0 becomes
    format: str
    state: dict[str, Any] = {}  # format-specific facts the format's resume hook may check


class MigrateError(msgspec.Struct, frozen=True, tag="error", tag_field="status"):
    request_id: str
    code: MigrateErrorCode
    message: str
    attempt: int | None = None  # the current attempt, when the request is known
    # ``unavailable`` only: the most seconds until the processor can answer (chunks a killed owner
    # held come back within ack_wait of the partition's hand-over); None when it cannot say.
    retry_after: Annotated[float, msgspec.Meta(ge=0)] | None = None


MigrateReply = Sealed | MigrateError


class SealRecord(msgspec.Struct, frozen=True):
    """Durable mode: a request's migrations as the migrations bucket keeps them (one key per request,
    written with compare-and-set on its revision, so exactly one seal of an attempt wins).

    With the results stream (what the client was sent) this is everything another instance needs
    to continue the request: the current attempt is ``len(seals)``, and replaying the stored result
    bodies through the format's migration session, sealing at each of ``seals``, rebuilds the
    session exactly (``Correlator.resume``)."""

    seals: list[int]  # seals[i]: the result seq where attempt i + 1 starts
    sealed: Sealed  # the reply of the last seal, sent again to a retry of the same migrate
    id: str | None = None  # MigrateRequest.id of the last seal

    @property
    def attempt(self) -> int:
        return len(self.seals)
