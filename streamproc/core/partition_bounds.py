"""A durable partition's bounds: how many of its result bytes may wait in the outbox before its
pulls stop, and how many of its chunks the correlator may hold before it sheds requests.

Each partition is read by its own pull consumer, so one partition's backlog must never hold back
another's: these bounds are per partition, each a share of what the instance allows in all. The
durable shell consults them before each pull (``streamproc/nats/durable/pulls.py``) and in each
watchdog round (``streamproc/nats/durable/partitions.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .outbox import Outbox

__all__ = ["MAX_QUEUED_RESULT_BYTES", "HeldLimit", "QueuedResultShare", "held_limit", "queued_result_share"]

# Result bytes queued in the outbox (decided, not stored yet), shared by the --partitions, past which
# a partition pulls nothing more until its own drain: a request's results leave one send at a time,
# the ones behind it wait in memory, outside --max-total-bytes. Without it one request streaming
# ~1 MB chunks faster than its results were stored grew the processor to max_ack_pending x
# max_payload per partition (661 MiB peak RSS from 800 chunks, tests/test_durable_attack_review.py).
# Per partition, so the other partitions' requests are not held back. What the pulls already out
# bring comes on top.
MAX_QUEUED_RESULT_BYTES = 64 << 20


def queued_result_share(partitions: int, max_payload: int) -> int:
    """A partition's share of :data:`MAX_QUEUED_RESULT_BYTES`, and never less than four maximal
    results, however many partitions share it."""
    return max(MAX_QUEUED_RESULT_BYTES // partitions, 4 * max_payload)


class QueuedResultShare:
    """Whether a partition's queued result bytes (``outbox``'s, of the requests ``partition_of`` puts
    in it) pass its share ``cap``: then it pulls nothing more until they drain (the watchdog pulls
    again)."""

    __slots__ = ("outbox", "partition_of", "cap")

    def __init__(self, outbox: Outbox, partition_of: Callable[[str], int], cap: int) -> None:
        self.outbox = outbox
        self.partition_of = partition_of
        self.cap = cap

    def full(self, n: int) -> bool:
        """Partition ``n`` has more than its share queued. The cheap total first: the partition's
        bytes are at most that, and summing them walks every queued result."""
        cap = self.cap
        outbox = self.outbox
        if outbox.queued_bytes <= cap:
            return False
        of = self.partition_of
        return outbox.queued_bytes_of(lambda rid: of(rid) == n) > cap


class HeldLimit(msgspec.Struct, frozen=True):
    """How many unacknowledged chunks a partition may hold (prefill legs, reorder backlogs) before
    the requests holding chunks longest are ended: the server delivers nothing more to a partition
    once ``max_ack_pending`` of its chunks are unacknowledged, so held chunks must never reach it."""

    cap: int  # more than this many held: shed
    target: int  # ... down to this many

    def excess(self, held: int) -> int:
        """How many held chunks to shed from a partition holding ``held`` (0: none)."""
        return held - self.target if held > self.cap else 0


def held_limit(max_ack_pending: int) -> HeldLimit:
    """Past 3/4 of ``max_ack_pending``, shed down to 1/2: new chunks are always delivered, and a
    shedding leaves room for a quarter before the next."""
    return HeldLimit(max(1, max_ack_pending * 3 // 4), max_ack_pending // 2)
