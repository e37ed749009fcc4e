"""A partition's seal list: the requests with a seal record, each until that record expires.

A migrate records its seal in the migrations bucket before it replies. The sealed attempt's worker
may still be publishing; its first output chunk, reaching the partition's owner with nothing stored
for it, would otherwise start the request afresh. So an owner keeps the partition's sealed requests
and looks up such a chunk (:func:`streamproc.core.recovery.store_read`). The list is read once when
the partition is taken (each record's age), then grows with this instance's own seals. Entries stay
in expiry order, so the expired ones (their records are gone from the bucket too) are dropped from
the front. When the bucket could not be read, :data:`ALL_SEALED` stands in: every request is listed,
so every first chunk is looked up (exact, one round trip per request instead of none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["ALL_SEALED", "AllSealed", "SealList", "seal_lists"]


class SealList:
    """The requests of one partition with a seal record, in expiry order (our clock).

    ``ttl``: seconds a record lives (the results stream's ``max_age``; ``inf``: for ever)."""

    __slots__ = ("_expiry", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._expiry: dict[str, float] = {}  # request id -> when its record expires, oldest first

    def read(self, request_id: str, age: float, now: float) -> None:
        """A record found in the bucket, written ``age`` seconds ago (read oldest write first)."""
        self._expiry[request_id] = now + self.ttl - age

    def note(self, request_id: str, now: float) -> None:
        """``request_id``'s seal was recorded at ``now``; the records expired by then are dropped."""
        expiry = self._expiry
        expiry.pop(request_id, None)
        expiry[request_id] = now + self.ttl
        while expiry:
            oldest, until = next(iter(expiry.items()))
            if until >= now:
                break
            del expiry[oldest]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._expiry

    def listed(self) -> list[str]:
        """The listed request ids, in expiry order."""
        return list(self._expiry)


class AllSealed:
    """The seal list of a partition taken while the migrations bucket could not be read: every
    request is on it."""

    __slots__ = ()

    def note(self, request_id: str, now: float) -> None:
        """Nothing to add: every request is listed already."""

    def __contains__(self, request_id: object) -> bool:
        return True


ALL_SEALED = AllSealed()


def seal_lists(records: Iterable[tuple[str, float]], partition_of: Callable[[str], int], ttl: float,
               now: float) -> dict[int, SealList]:
    """The seal list of every partition that has records, from ``(request id, age)`` pairs read
    oldest write first."""
    out: dict[int, SealList] = {}
    for request_id, age in records:
        n = partition_of(request_id)
        seals = out.get(n)
        if seals is None:
            seals = out[n] = SealList(ttl)
        seals.read(request_id, age, now)
    return out
