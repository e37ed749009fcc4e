"""Recovery lookups of a durable input's partitions: the lookup slots they share, the requests
waiting for a slot, and the deliveries parked behind both (pure).

A durable partition decides a chunk of a request it does not know (that may continue one served
elsewhere) only after a recovery lookup of the request's stored results. Lookups of different
requests are independent, so several run at once; what must stay sequential is a request's own
chunks. While a request's lookup is in flight its later deliveries park here, behind the chunk that
started the lookup, and are handed back in delivery order when it ends (:meth:`Lookups.finish`); a
hand-over takes every parked delivery back at once (:meth:`Lookups.abandon`) so the shell can NAK
them for the next owner.

Every partition of one input draws on one :class:`LookupSlots`: at most ``limit`` lookups in flight
across them all, since a lookup reads a whole stored result (up to ``max_payload``) and many at once
only make each one slower, past its timeout. A delivery that needs a lookup while every slot is
taken waits in its partition's queue (:meth:`Lookups.wait`: its request is *queued*, up to
``max_queued`` of them, in arrival order), its request's later deliveries parked behind it, so the
partition goes on deciding the chunks of the requests it already holds. When a slot frees the shell
asks :meth:`LookupSlots.next` who takes it: the partitions with queued requests in turn (round
robin), each one's oldest request first, so one flooded partition delays another's lookups by one
turn per slot, not by its whole queue. The shell decides the deliveries handed back again in order:
the first starts the lookup (or, should its request have become known meanwhile, is decided), the
rest park behind it.

A lookup that fails (a timeout: the stores slow or busy) need not cost its chunk a delivery: up to
``attempts`` lookups are made per delivery, each failed one queued again behind the partition's
queue with its deliveries still parked (:meth:`Lookups.retry`; the shell keeps them with in-progress
acks), and only the last failure hands them back for a NAK (:meth:`Lookups.finish`).

The shell asks before it adds anything from a new delivery: :meth:`Lookups.room` (another lookup may
start), :meth:`Lookups.queue_room` (another request may queue) and :meth:`Lookups.fits` (parked and
queued bytes stay within ``max_bytes``, unless nothing is parked: one delivery always fits); when
they say no it waits for a lookup to end (back-pressure). What a finished lookup or the queue hands
back is parked again without asking: it was admitted once, and the slot a lookup freed is still
free. So at most ``limit`` lookups are in flight across the partitions, at most ``max_queued``
requests of a partition wait for a slot (plus those queued again for a retry, at most as many as
were in flight), none waits while a slot is free, and a partition's parked bytes never exceed
``max(max_bytes, the largest delivery)``.
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class LookupSlots(Generic[T]):
    """The lookup slots every partition of one durable input shares, and the partitions whose
    requests wait for one (each partition once, in the order their turns come)."""

    __slots__ = ("limit", "running", "turns")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.running = 0  # lookups in flight, of every partition (a handed-over one's included until they end)
        self.turns: dict[Lookups[T], None] = {}

    def free(self) -> bool:
        """Whether another lookup may start."""
        return self.running < self.limit

    def next(self) -> tuple[Lookups[T], list[T], bool] | None:
        """Who takes a free slot: the partition whose turn it is, with its oldest queued request's
        tokens and whether they are a retry (see :meth:`Lookups.next`); that partition goes to the
        back of the line. None: no free slot, or nothing queued."""
        while self.running < self.limit and self.turns:
            lookups = next(iter(self.turns))
            del self.turns[lookups]
            taken = lookups.next()
            if lookups.queued:
                self.turns[lookups] = None
            if taken is not None:
                return lookups, taken[0], taken[1]
        return None


class Lookups(Generic[T]):
    """The lookups of one partition (keyed by request id), the requests queued for a slot, and the
    tokens parked behind each: the first token of a request's entry started its lookup (or waits to
    start it), the rest arrived after it, in order. ``key`` names the partition to the shell."""

    __slots__ = ("slots", "key", "max_queued", "max_bytes", "attempts", "parked_bytes", "closed", "by_request",
                 "queued", "flying")

    def __init__(self, slots: LookupSlots[T], max_bytes: int, max_queued: int = 0, *, attempts: int = 1,
                 key: int = 0) -> None:
        if max_queued < 0:
            raise ValueError("max_queued must not be negative")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.slots = slots
        self.key = key
        self.max_queued = max_queued
        self.max_bytes = max_bytes
        self.attempts = attempts  # lookups per delivery before a failure hands its tokens back
        self.parked_bytes = 0
        self.closed = False  # abandoned: the partition was handed over, nothing parks here any more
        # Request id -> its parked tokens with their sizes, for lookups in flight and queued ones. Public
        # for the shell's hot path, which tests ``rid in by_request`` (a dict lookup, not a method call);
        # read-only there. Cleared in place.
        self.by_request: dict[str, list[tuple[T, int]]] = {}
        # The request ids waiting for a slot, oldest first, with the lookups of theirs that failed.
        self.queued: dict[str, int] = {}
        # The lookups in flight: request id -> the token that started it and the failed ones before it (a
        # tuple made at each start: its identity tells a retry from the flight before it, :meth:`cancel`).
        # Kept through a hand-over until each ends: its slot is taken until then.
        self.flying: dict[str, tuple[T, int]] = {}

    @property
    def limit(self) -> int:
        """Lookups in flight at most, across the partitions."""
        return self.slots.limit

    def __contains__(self, request_id: object) -> bool:
        """Whether a lookup of ``request_id`` is in flight or queued (its later deliveries must park)."""
        return request_id in self.by_request

    def __len__(self) -> int:
        """This partition's lookups in flight."""
        return len(self.flying)

    def room(self) -> bool:
        """Whether another lookup may start."""
        return self.slots.running < self.slots.limit

    def queue_room(self) -> bool:
        """Whether another request may wait for a slot."""
        return len(self.queued) < self.max_queued

    def fits(self, size: int) -> bool:
        """Whether a delivery of ``size`` bytes may park now (one always may when nothing is parked)."""
        return not self.parked_bytes or self.parked_bytes + size <= self.max_bytes

    def begin(self, request_id: str, token: T, size: int) -> None:
        """A lookup of ``request_id`` starts for ``token``, the delivery that needs it."""
        self._add(request_id, token, size)
        self.flying[request_id] = (token, 0)
        self.slots.running += 1

    def wait(self, request_id: str, token: T, size: int) -> None:
        """``token`` needs a lookup of ``request_id`` and there is no room: it waits for a slot."""
        self._add(request_id, token, size)
        self.queued[request_id] = 0
        self.slots.turns.setdefault(self, None)

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
        """The lookup ``token`` started for ``request_id`` ended (found, or failed for the last time):
        its slot is free, and the deliveries parked behind it come back, in order (``token`` itself is
        the caller's); None when the partition was handed over meanwhile (:meth:`abandon` returned them
        all, ``token`` too) or ``token`` has no lookup in flight."""
        if not self.release(request_id, token) or self.closed:
            return None
        return [t for t, _ in self._take(request_id)[1:]]

    def retry(self, request_id: str, token: T) -> bool:
        """The lookup ``token`` started for ``request_id`` failed: True when another attempt is left,
        and then the request waits for a slot again, behind the partition's queue, its tokens still
        parked; False (nothing changed) when it was the last attempt (the caller finishes it)."""
        entry = self.flying.get(request_id)
        if entry is None or entry[0] is not token or not self.retries_left(request_id):
            return False
        self.release(request_id, token)
        self.queued[request_id] = entry[1] + 1
        self.slots.turns.setdefault(self, None)
        return True

    def retries_left(self, request_id: str) -> bool:
        """Whether a failure of ``request_id``'s lookup in flight would be retried (:meth:`retry`)."""
        entry = self.flying.get(request_id)
        return entry is not None and not self.closed and entry[1] + 1 < self.attempts

    def release(self, request_id: str, token: T) -> bool:
        """Free the slot of the lookup ``token`` started for ``request_id`` (one never started: its
        tokens stay parked for :meth:`abandon`); False when it has none."""
        entry = self.flying.get(request_id)
        if entry is None or entry[0] is not token:
            return False
        del self.flying[request_id]
        self.slots.running -= 1
        return True

    def flight(self, request_id: str) -> object | None:
        """What identifies the lookup of ``request_id`` in flight now (a retry of it is another)."""
        return self.flying.get(request_id)

    def cancel(self, request_id: str, flight: object | None) -> None:
        """The task of ``flight`` (:meth:`flight`) ends: if that lookup is still in flight (the task
        was cancelled: a stop), its slot is free; its tokens stay parked for :meth:`abandon`."""
        if flight is not None and self.flying.get(request_id) is flight:
            del self.flying[request_id]
            self.slots.running -= 1

    def next(self) -> tuple[list[T], bool] | None:
        """The oldest queued request, when a lookup may start, and whether it is a retry. A retry's
        lookup is in flight at once for its first token (the shell starts it; the rest stay parked):
        ``([token], True)``. Otherwise every token, in order, is handed back (the shell decides them
        again: the first starts its lookup, the rest park behind it): ``(tokens, False)``. None: none
        queued, or no room. :meth:`LookupSlots.next` chooses the partition; called alone it skips
        the partitions' turns."""
        if not self.queued or not self.room():
            return None
        request_id = next(iter(self.queued))
        failed = self.queued.pop(request_id)
        if failed:
            token = self.by_request[request_id][0][0]
            self.flying[request_id] = (token, failed)
            self.slots.running += 1
            return [token], True
        return [t for t, _ in self._take(request_id)], False

    def _take(self, request_id: str) -> list[tuple[T, int]]:
        entry = self.by_request.pop(request_id)
        for _, size in entry:
            self.parked_bytes -= size
        return entry

    def abandon(self) -> list[T]:
        """Every parked token, each once (the lookups' own first, queued ones too); nothing parks here
        afterwards. The lookups in flight keep their slots until they end (:meth:`finish`)."""
        out = list(self.tokens())
        self.by_request.clear()
        self.queued.clear()
        self.slots.turns.pop(self, None)
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
        """The request ids whose lookups are in flight (of a partition not handed over)."""
        return [] if self.closed else list(self.flying)
