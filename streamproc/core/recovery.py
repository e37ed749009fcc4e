"""Recovery decisions: whether a chunk must wait for the stores before it is decided, and where and
how a request adopted from them resumes.

A durable instance sees chunks of requests another instance may have served (a failover, a
hand-over, a migrate). These pure rules say when the shell must read the stores first
(:func:`store_read`, a round trip per request at most), what a stored result says
(:func:`resume_point`), with the request's seal record how it is adopted (:func:`adoption`), and
how long chunks a previous owner took may still come back (:func:`previous_hold_left`), and whether a
seal still holds once its published results are stored (:func:`seal_overtaken`); the reads themselves
are the shell's (``streamproc/nats/durable/recovery.py``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Container, Mapping

from .events import Chunk, MigrateErrorCode, Role, Sealed
from .wire import FINAL, SEQ, plain_index

if TYPE_CHECKING:
    from .correlator import Correlator

__all__ = ["Adoption", "StoreRead", "adoption", "delivery_count", "history_over_bound", "needs_lookup",
           "previous_hold_left", "resume_point", "seal_overtaken", "store_read"]


class StoreRead(enum.Enum):
    """What must be read from the stores before a chunk is decided."""

    # A request this instance does not know that may continue one served elsewhere: read its last
    # stored result (and seal record) first.
    LOOKUP = "lookup"
    # An active request granted a later attempt by a seal this instance did not make: adopt it again.
    RETAKE = "retake"


def delivery_count(reply: str) -> int:
    """How often JetStream delivered a message, from its ack subject.

    ``$JS.ACK.<stream>.<consumer>.<delivered>...`` (9 tokens, v1) or
    ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>...`` (v2), as nats-py's
    ``Msg.Metadata._from_reply`` reads it (``nats/aio/msg.py``: ``tokens[4]`` for v1,
    ``Msg.Ack.NumDelivered`` = 6 for v2).
    """
    tokens = reply.split(".")
    try:
        return int(tokens[4] if len(tokens) == 9 else tokens[6])
    except (IndexError, ValueError):
        return 1


def needs_lookup(seq: int, role: Role, reply: str) -> bool:
    """Whether a chunk of a request this instance does not know might continue one served elsewhere.

    Only the first delivery of a request's first output chunk surely starts it; anything else
    (a later seq, a prefill leg, a redelivery) needs the last stored result read first.
    """
    return bool(seq) or role is Role.PREFILL or delivery_count(reply) > 1


def store_read(correlator: Correlator, chunk: Chunk, reply: str, sealed: Container[str]) -> StoreRead | None:
    """What must be read from the stores before ``chunk`` (delivered with ack subject ``reply``) is
    decided, or None.

    :attr:`StoreRead.LOOKUP` for a request ``correlator`` does not know whose chunk may continue one
    served elsewhere: an attempt above 0, :func:`needs_lookup`, or a request ``sealed`` lists (the
    partition's requests with a seal record: a first output chunk may belong to the sealed attempt,
    whose worker was lost but still publishing). :attr:`StoreRead.RETAKE` for an active request
    whose chunk names a later attempt than the one held here: a seal this instance did not make
    (another one held the partition for a moment) granted it."""
    rid = chunk.request_id
    if not correlator.knows(rid):
        if chunk.attempt or needs_lookup(chunk.seq, chunk.role, reply) or rid in sealed:
            return StoreRead.LOOKUP
    elif chunk.attempt and chunk.attempt > (correlator.attempt_of(rid) or 0) \
            and not correlator.is_finished(rid):
        return StoreRead.RETAKE
    return None


def resume_point(headers: Mapping[str, str] | None) -> tuple[int, bool] | None:
    """``(next seq, final)`` after a stored result's headers; None when they name no seq."""
    h = headers or {}
    seq = plain_index(h.get(SEQ, ""))  # as every reader of it: a forger's '²' or 400 digits name none
    if seq is None:
        return None
    return seq + 1, h.get(FINAL) == "true"


class Adoption(enum.Enum):
    """How a request this instance does not hold is taken over from the stores."""

    # Nothing stored and no seal record: every chunk of it is still unacknowledged, so it starts
    # afresh here like any new request (nothing to adopt).
    AFRESH = "afresh"
    # Resume after the last stored result (final or not); no migration session to rebuild.
    RESUME = "resume"
    # A seal record and no final result: resume, unfinished, with the stored bodies read back, from
    # which the correlator rebuilds the migration session at the recorded seal points.
    RESUME_WITH_HISTORY = "resume_with_history"


def adoption(point: tuple[int, bool] | None, sealed: bool) -> Adoption:
    """How to adopt a request whose last stored result says ``point`` (:func:`resume_point`; None:
    nothing stored) and which has a seal record (``sealed``).

    A finished request needs no history even when it was migrated: nothing of it is published
    again, so no session has to fold what was."""
    if not sealed or (point is not None and point[1]):
        return Adoption.AFRESH if point is None else Adoption.RESUME
    return Adoption.RESUME_WITH_HISTORY


def history_over_bound(results: int, kept_bytes: int, max_results: int, max_bytes: int, *,
                       received: int = 0, received_bytes: int = 0, max_copies: int = 1) -> str | None:
    """Why a take-over's read of stored bodies stops (None: it goes on), so the heir never holds more of
    one request than the bounds: ``results`` asked for past ``max_results``, or ``kept_bytes`` (the bodies
    it keeps: the first stored copy of each seq) past ``max_bytes``. The live session never held a
    request's whole output (it counts and folds what it retains), so past them the bodies count as lost.

    Copies of a seq stored again (after the duplicate window) are not kept and cost nothing toward those
    bounds; ``received`` / ``received_bytes`` count every copy the read was sent, and past ``max_copies``
    times either bound it stops too: a store of endless copies of one seq costs a bounded read."""
    if results > max_results:
        return f"{results} stored results, past the take-over's bound of {max_results}"
    if kept_bytes > max_bytes:
        return f"more than {max_bytes} bytes of stored results, past the take-over's bound"
    if received > max_copies * max_results or received_bytes > max_copies * max_bytes:
        return (f"{received} stored results ({received_bytes} bytes) sent for fewer distinct ones, past the "
                f"take-over's bound of {max_copies} copies of {max_results} results or {max_bytes} bytes")
    return None


def previous_hold_left(ack_wait: float, slack: float, taken: float | None, now: float) -> float:
    """Seconds from ``now`` until chunks a previous owner of a partition took and never acknowledged
    have surely been redelivered (0 or less: they have).

    Such chunks were delivered before this instance took the partition (at ``taken``; None: it does
    not hold it, so their hold may have begun just now), so the server gives them back within
    ``ack_wait`` of that, plus ``slack`` for the redelivery to arrive."""
    held_for = ack_wait + slack
    if taken is not None:
        held_for += taken - now
    return held_for


def seal_overtaken(correlator: Correlator, sealed: Sealed) -> tuple[MigrateErrorCode, str] | None:
    """Why ``sealed`` may not be recorded or answered after the wait for the results it counts as
    published to be stored, or None when the request is still held here at the granted attempt.

    The wait ends when nothing of the request is queued, which is also how a result given up
    leaves: one that can never be published was replaced by an error result that ended the request
    (``finished``: the seal would grant an attempt whose chunks are dropped as late, and say a result
    was sent whose place the error took), and one the stream kept refusing was dropped with its
    request, its chunks redelivered (``unavailable``: the seal would say a result was sent that is
    not stored, and the resumed attempt would continue after a gap)."""
    rid = sealed.request_id
    if correlator.attempt_of(rid) == sealed.attempt:
        return None
    if correlator.is_finished(rid):
        return MigrateErrorCode.FINISHED, ("its final result was published while the seal waited for its results "
                                           "to be stored (an error result in place of one that could not be "
                                           "published); nothing to resume")
    return MigrateErrorCode.UNAVAILABLE, "a result it published could not be stored while the seal waited for it"
