"""Recovery lookups of one partition, the requests waiting for a lookup slot, and the deliveries
parked behind both (pure).

A durable partition decides a chunk of a request it does not know (that may continue one served
elsewhere) only after a recovery lookup of the request's stored results. Lookups of different
requests are independent, so a partition runs up to ``limit`` of them at once instead of one at a
time; what must stay sequential is a request's own chunks. While a request's lookup is in flight its
later deliveries park here, behind the chunk that started the lookup, and are handed back in
delivery order when it ends (:meth:`Lookups.finish`); a hand-over takes every parked delivery back at
once (:meth:`Lookups.abandon`) so the shell can NAK them for the next owner.

With ``limit`` lookups in flight, a delivery that needs one more waits here for a slot
(:meth:`Lookups.wait`: its request is *queued*, up to ``max_queued`` of them, in arrival order), its
request's later deliveries parked behind it as behind a lookup in flight, so the partition goes on
deciding the chunks of the requests it already holds instead of waiting for a slot with them behind
it. When a lookup ends the shell takes the oldest queued request back (:meth:`Lookups.next`) and
decides its deliveries again in order: the first starts the lookup (or, should its request have
become known meanwhile, is decided), the rest park behind it.

The shell asks before it adds anything from a new delivery: :meth:`Lookups.room` (another lookup may
start), :meth:`Lookups.queue_room` (another request may queue) and :meth:`Lookups.fits` (parked and
queued bytes stay within ``max_bytes``, unless nothing is parked: one delivery always fits); when
they say no it waits for a lookup to end (back-pressure). What a finished lookup or the queue hands
back is parked again without asking: it was admitted once, and the slot a lookup freed is still
free. So at most ``limit`` lookups are in flight, at most ``max_queued`` requests wait for a slot,
none waits while a slot is free, and the parked bytes never exceed ``max(max_bytes, the largest
delivery)``.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Lookups(Generic[T]):
    """The lookups of one partition (keyed by request id), the requests queued for a slot, and the
    tokens parked behind each: the first token of a request's entry started its lookup (or waits to
    start it), the rest arrived after it, in order."""

    __slots__ = ("limit", "max_queued", "max_bytes", "parked_bytes", "closed", "by_request", "queued")

    def __init__(self, limit: int, max_bytes: int, max_queued: int = 0) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        if max_queued < 0:
            raise ValueError("max_queued must not be negative")
        self.limit = limit
        self.max_queued = max_queued
        self.max_bytes = max_bytes
        self.parked_bytes = 0
        self.closed = False  # abandoned: the partition was handed over, nothing parks here any more
        # Request id -> its parked tokens with their sizes, for lookups in flight and queued ones. Public
        # for the shell's hot path, which tests ``rid in by_request`` (a dict lookup, not a method call);
        # read-only there. Cleared in place.
        self.by_request: dict[str, list[tuple[T, int]]] = {}
        self.queued: dict[str, None] = {}  # the request ids waiting for a slot, oldest first

    def __contains__(self, request_id: object) -> bool:
        """Whether a lookup of ``request_id`` is in flight or queued (its later deliveries must park)."""
        return request_id in self.by_request

    def __len__(self) -> int:
        """Lookups in flight."""
        return len(self.by_request) - len(self.queued)

    def room(self) -> bool:
        """Whether another lookup may start."""
        return len(self.by_request) - len(self.queued) < self.limit

    def queue_room(self) -> bool:
        """Whether another request may wait for a slot."""
        return len(self.queued) < self.max_queued

    def fits(self, size: int) -> bool:
        """Whether a delivery of ``size`` bytes may park now (one always may when nothing is parked)."""
        return not self.parked_bytes or self.parked_bytes + size <= self.max_bytes

    def begin(self, request_id: str, token: T, size: int) -> None:
        """A lookup of ``request_id`` starts for ``token``, the delivery that needs it."""
        self._add(request_id, token, size)

    def wait(self, request_id: str, token: T, size: int) -> None:
        """``token`` needs a lookup of ``request_id`` and there is no room: it waits for a slot."""
        self._add(request_id, token, size)
        self.queued[request_id] = None

    def _add(self, request_id: str, token: T, size: int) -> None:
        if self.closed:
            raise RuntimeError("lookups of a partition handed over")
        if request_id in self.by_request:
            raise ValueError(f"a lookup of {request_id!r} is already in flight or queued")
        self.by_request[request_id] = [(token, size)]
        self.parked_bytes += size

    def park(self, request_id: str, token: T, size: int) -> None:
        """``token``, a later delivery of ``request_id``, waits behind its lookup (in flight or queued)."""
        self.by_request[request_id].append((token, size))
        self.parked_bytes += size

    def finish(self, request_id: str, token: T) -> list[T] | None:
        """The lookup ``token`` started for ``request_id`` ended: the deliveries parked behind it, in
        order (``token`` itself is the caller's); None when the partition was handed over meanwhile
        (:meth:`abandon` returned them all, ``token`` too)."""
        entry = self.by_request.get(request_id)
        if entry is None or entry[0][0] is not token or request_id in self.queued:
            return None
        return [t for t, _ in self._take(request_id)[1:]]

    def next(self) -> list[T] | None:
        """The oldest queued request's tokens, in order, when a lookup may start (the shell decides
        them again: the first starts its lookup, the rest park behind it); None: none, or no room."""
        if not self.queued or not self.room():
            return None
        request_id = next(iter(self.queued))
        del self.queued[request_id]
        return [t for t, _ in self._take(request_id)]

    def _take(self, request_id: str) -> list[tuple[T, int]]:
        entry = self.by_request.pop(request_id)
        for _, size in entry:
            self.parked_bytes -= size
        return entry

    def abandon(self) -> list[T]:
        """Every parked token, each once (the lookups' own first, queued ones too); nothing parks here
        afterwards."""
        out = list(self.tokens())
        self.by_request.clear()
        self.queued.clear()
        self.parked_bytes = 0
        self.closed = True
        return out

    def tokens(self) -> Iterator[T]:
        """Every parked token (for extending their ack deadlines)."""
        for entry in self.by_request.values():
            for t, _ in entry:
                yield t

    def requests(self) -> list[str]:
        """The request ids whose lookups are in flight or queued."""
        return list(self.by_request)

    def in_flight(self) -> list[str]:
        """The request ids whose lookups are in flight."""
        queued = self.queued
        return [rid for rid in self.by_request if rid not in queued]
