"""Recovery lookups in flight on one partition, and the deliveries parked behind them (pure).

A durable partition decides a chunk of a request it does not know (that may continue one served
elsewhere) only after a recovery lookup of the request's stored results. Lookups of different
requests are independent, so a partition runs up to ``limit`` of them at once instead of one at a
time; what must stay sequential is a request's own chunks. While a request's lookup is in flight its
later deliveries park here, behind the chunk that started the lookup, and are handed back in
delivery order when it ends (:meth:`Lookups.finish`); a hand-over takes every parked delivery back at
once (:meth:`Lookups.abandon`) so the shell can NAK them for the next owner.

The shell asks before it adds anything from a new delivery: :meth:`Lookups.room` (another lookup may
start) and :meth:`Lookups.fits` (parked bytes stay within ``max_bytes``, unless nothing is parked:
one delivery always fits); when either says no it waits for a lookup to end, as a partition used to
wait for its one lookup. What a finished lookup hands back is parked again (behind a new lookup of
the same request) without asking: it was admitted once, and the slot its lookup freed is still free.
So at most ``limit`` lookups are in flight and the parked bytes never exceed ``max(max_bytes,
the largest delivery)``.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Lookups(Generic[T]):
    """The lookups of one partition (keyed by request id) and the tokens parked behind each: the
    first token of a request's entry started its lookup, the rest arrived while it ran, in order."""

    __slots__ = ("limit", "max_bytes", "parked_bytes", "closed", "by_request")

    def __init__(self, limit: int, max_bytes: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.max_bytes = max_bytes
        self.parked_bytes = 0
        self.closed = False  # abandoned: the partition was handed over, nothing parks here any more
        # Request id -> its parked tokens with their sizes. Public for the shell's hot path, which tests
        # ``rid in by_request`` (a dict lookup, not a method call); read-only there. Cleared in place.
        self.by_request: dict[str, list[tuple[T, int]]] = {}

    def __contains__(self, request_id: object) -> bool:
        """Whether a lookup of ``request_id`` is in flight (its later deliveries must park)."""
        return request_id in self.by_request

    def __len__(self) -> int:
        """Lookups in flight."""
        return len(self.by_request)

    def room(self) -> bool:
        """Whether another lookup may start."""
        return len(self.by_request) < self.limit

    def fits(self, size: int) -> bool:
        """Whether a delivery of ``size`` bytes may park now (one always may when nothing is parked)."""
        return not self.parked_bytes or self.parked_bytes + size <= self.max_bytes

    def begin(self, request_id: str, token: T, size: int) -> None:
        """A lookup of ``request_id`` starts for ``token``, the delivery that needs it."""
        if self.closed:
            raise RuntimeError("lookups of a partition handed over")
        if request_id in self.by_request:
            raise ValueError(f"a lookup of {request_id!r} is already in flight")
        self.by_request[request_id] = [(token, size)]
        self.parked_bytes += size

    def park(self, request_id: str, token: T, size: int) -> None:
        """``token``, a later delivery of ``request_id``, waits behind its lookup."""
        self.by_request[request_id].append((token, size))
        self.parked_bytes += size

    def finish(self, request_id: str, token: T) -> list[T] | None:
        """The lookup ``token`` started for ``request_id`` ended: the deliveries parked behind it, in
        order (``token`` itself is the caller's); None when the partition was handed over meanwhile
        (:meth:`abandon` returned them all, ``token`` too)."""
        entry = self.by_request.get(request_id)
        if entry is None or entry[0][0] is not token:
            return None
        del self.by_request[request_id]
        for _, size in entry:
            self.parked_bytes -= size
        return [t for t, _ in entry[1:]]

    def abandon(self) -> list[T]:
        """Every parked token, each once (the lookups' own first); nothing parks here afterwards."""
        out = list(self.tokens())
        self.by_request.clear()
        self.parked_bytes = 0
        self.closed = True
        return out

    def tokens(self) -> Iterator[T]:
        """Every parked token (for extending their ack deadlines)."""
        for entry in self.by_request.values():
            for t, _ in entry:
                yield t

    def requests(self) -> list[str]:
        """The request ids whose lookups are in flight."""
        return list(self.by_request)
