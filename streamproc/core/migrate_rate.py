"""How many migrates the processor answers, process-wide: a token bucket the control plane asks
before it touches a request.

Anyone allowed to publish on the control subjects can send migrates at will, and each one costs
the processor work a chunk does not: a wait for the message path to catch up and an exclusive turn
of the correlator, and in durable mode up to four JetStream reads (the seal record, the last stored
result, the last waiting chunk, the partition consumer) for an id it does not hold. An attack
(docs/operations.md, limits and abuse) sent them as fast as one connection could: unanswered
ones queued in the subscription and an honest request's one result waited seconds. Past the rate a
migrate is answered at once with ``unavailable`` and a ``retry_after`` (nothing moved; the
Migrator asks again then), and counted. Sans-I/O: the shell passes the clock in.
"""

from __future__ import annotations

from . import defaults

__all__ = ["MigrateRate"]


class MigrateRate:
    """A token bucket: ``rate`` migrates a second on average, ``burst`` at once (a failover's
    migrates of every request a lost worker served arrive together). ``rate`` 0: no limit.

    A refused migrate is told when its turn comes, not when the next token does: each refusal
    reserves the next free slot (one every ``1 / rate`` seconds, at most the burst's length ahead).
    Told the next token's time (at most ``1 / rate``: 2 ms at 500 a second), every refused Migrator
    asked again at its 10 ms floor: 3,000 migrates at once became ~100,000 in a simulation, the very
    flood the bucket is for (tests/test_control_flood.py)."""

    __slots__ = ("rate", "burst", "_tokens", "_at", "_next_free", "refused")

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = max(rate * defaults.MIGRATE_BURST_SECONDS if burst is None else burst, 1.0)
        self._tokens = self.burst
        self._at: float | None = None
        self._next_free = 0.0  # the latest slot a refusal reserved (monotonic seconds)
        self.refused = 0  # migrates refused by the rate (streamproc_control_migrates_throttled_total)

    def take(self, now: float) -> float | None:
        """Charge one migrate at ``now`` (monotonic seconds): None when it may be answered, else
        the seconds until its reserved turn (the refusal's ``retry_after``)."""
        if self.rate <= 0:
            return None
        if self._at is not None and now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        self.refused += 1
        step = 1.0 / self.rate
        first = now + (1.0 - self._tokens) * step  # when the next token is due
        slot = max(first, self._next_free + step)
        horizon = now + self.burst * step  # never further ahead than the bucket's length
        if slot > horizon:
            slot = horizon
        self._next_free = slot
        return slot - now
