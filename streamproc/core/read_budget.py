"""The edge's budget of stored-result bytes asked of nats-server and not yet received.

Every read of stored results (a replay's pull, a ``STREAM.MSG.GET``) makes nats-server queue its
answer towards the edge's one connection; past that connection's ``max_pending`` (64 MiB by
default) the server cuts it, and every client of the edge loses its stream. One late attach's pull
asks for up to ``--stream-buffer-bytes`` (8 MiB) and up to ``--max-replay-consumers`` pull at once,
so 32 streams of one client did it (2026-12-06). :class:`ReadBudget` keeps the books of one
edge-wide bound on what is out: a read is charged before it is sent, released as its bytes arrive
and the rest when it ends. Pure: the shell (``edge/read_budget.py``) does the waiting.

- First come, first served: while anyone waits, a newcomer waits behind it (no starving a big read
  with small ones).
- A read may be granted less than it wants (a smaller pull) but never less than ``least`` (what
  it needs to bring anything: for a pull, the largest result the stream may hold).
- Never a deadlock: with nothing out, the first in line gets its ``least`` even past the limit (a
  single result larger than the whole budget is still read, alone).

A push consumer (where the edge may neither pull nor read by subject) cannot be asked for bytes:
its flow control lets nats-server send 2 MiB and more whatever the edge reads. What bounds it is
``max_ack_pending``: nats-server sends no message past that many unacknowledged (``consumer.go``
``getNextMsg``: ``errMaxAckPending``). :func:`push_window` picks that count and its charge.
"""

from __future__ import annotations

from typing import Hashable

__all__ = ["PUSH_MESSAGE_OVERHEAD", "ReadBudget", "push_window"]

# What a delivery costs past its payload and headers (bounded by the stream's max_msg_size or the
# server's max_payload): its subject, its ``$JS.ACK`` reply subject and the ``HMSG`` line.
PUSH_MESSAGE_OVERHEAD = 1024


def push_window(largest: int, bound: int, budget: int, most: int) -> tuple[int, int]:
    """A push consumer's ``max_ack_pending`` for a stored history and what it is charged while it
    exists: at most that many deliveries of at most ``largest`` bytes each (plus their overhead) are
    out towards the edge or queued there. As many as fit the reader's pending bound ``bound`` (so
    nats-py never drops one) and a quarter of the ``budget`` (so several histories are read at
    once), at most ``most`` (the bound's message count), never fewer than one: a result larger than
    either is still read, one at a time, charged its size."""
    each = max(1, largest) + PUSH_MESSAGE_OVERHEAD
    room = budget // 4 if bound <= 0 else min(bound, budget // 4)
    window = max(1, min(room // each, most if most > 0 else 1 << 20))
    return window, window * each


class ReadBudget:
    """``limit`` bytes out at most (but see the module docstring); ``out`` what is out now."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.out = 0
        self._waiting: dict[Hashable, tuple[int, int]] = {}  # in arrival order: want, least
        self.waits = 0  # reads that had to wait (metrics, tests)
        self.peak = 0  # the most ever out (tests)
        self.granted_total = 0  # bytes ever granted (metrics: what the budget let replays ask for)

    def take(self, want: int, least: int) -> int:
        """Bytes granted now (charged), or 0: then queue the read (:meth:`wait`) or do without."""
        return 0 if self._waiting else self._grant(want, least)

    def wait(self, key: Hashable, want: int, least: int) -> None:
        """``key`` waits for ``want`` bytes (at least ``least``): :meth:`granted` says when."""
        if key not in self._waiting:
            self.waits += 1
        self._waiting[key] = (want, least)

    def leave(self, key: Hashable) -> None:
        """``key`` waits no more (cancelled, closed): the next in line may now go first."""
        self._waiting.pop(key, None)

    def release(self, size: int) -> None:
        """``size`` bytes of what was charged arrived, or will not come any more."""
        self.out = max(0, self.out - size)

    def granted(self) -> list[tuple[Hashable, int]]:
        """The waiting reads that can go now, first come first, each with its grant (charged)."""
        grants = []
        while self._waiting:
            key, (want, least) = next(iter(self._waiting.items()))
            grant = self._grant(want, least)
            if not grant:
                break
            del self._waiting[key]
            grants.append((key, grant))
        return grants

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def _grant(self, want: int, least: int) -> int:
        want = max(want, 1)
        least = max(1, min(least, want))
        free = self.limit - self.out
        if free >= least:
            grant = min(want, free)
        elif self.out == 0:
            grant = least  # past the limit, alone: never a read that cannot go at all
        else:
            return 0
        self.out += grant
        self.granted_total += grant
        self.peak = max(self.peak, self.out)
        return grant
