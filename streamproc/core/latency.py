"""A latency histogram the core can fill without a clock or a metrics library.

The core records durations it already knows (``now`` is an argument of every call); the shell
reads the buckets at scrape time and hands them to its metrics library. Recording is one bisect
and two additions, cheap enough for paths that run per result.
"""

from __future__ import annotations

from bisect import bisect_left

# Seconds: from sub-millisecond passthrough to the default 30 s prefill timeout.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


class LatencyHistogram:
    """Counts per upper bound (``le``, Prometheus semantics), plus the +Inf bucket and the sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bounds must be strictly increasing")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, the exposition's bucket form."""
        out, running = [], 0
        for bound, n in zip((*map(repr, map(float, self.bounds)), "+Inf"), self.counts):
            running += n
            out.append((bound, running))
        return out
