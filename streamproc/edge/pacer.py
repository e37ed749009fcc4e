"""A few SSE opens per event-loop pass, so a burst of opens does not hold back the open streams' events.

An open runs in one task step from the request to its response head (with the fan-out nothing in
it waits on NATS), about 150-300 µs of CPU here. Uvicorn starts the ASGI task of every request it
parsed in one read pass, so the 50 opens of a burst ran back to back in one loop pass, and the
NATS read and the direct writes of every open stream waited for all of them (docs/benchmarks.md,
"Opens in bursts"). :meth:`OpenPacer.turn` lets ``per_pass`` opens through per pass, in arrival
order; the others wait for the next passes, and the loop polls its sockets between them. An open
alone, or the first ``per_pass`` of a burst, does not wait at all. Each waiting open holds an
HTTP connection, so ``--max-connections`` (``connections.py``) bounds the waiting queue too.
"""

from __future__ import annotations

import asyncio
from collections import deque

OPENS_PER_PASS = 4  # against 1, 2, 8 and unbounded: benchmarks/edge_open.py --per-pass (docs/benchmarks.md)


class OpenPacer:
    """``await pacer.turn()`` before an open's work: at most ``per_pass`` opens proceed per loop pass."""

    __slots__ = ("per_pass", "used", "waiting", "scheduled", "paced")

    def __init__(self, per_pass: int = OPENS_PER_PASS) -> None:
        if per_pass < 1:
            raise ValueError("per_pass must be at least 1")
        self.per_pass = per_pass
        self.paced = 0  # opens that waited for a later pass (the edge's opens_paced counter)
        self.used = 0  # opens let through since the last pass began
        self.waiting: deque[asyncio.Future] = deque()
        self.scheduled = False

    async def turn(self) -> None:
        if self.used < self.per_pass and not self.waiting:
            self.used += 1
            self._schedule()
            return
        self.paced += 1
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        self._schedule()
        await waiter  # cancelled (the server stops): _next_pass skips it

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        """Runs once per loop pass while opens come or wait: resets the budget and wakes the next
        ``per_pass`` waiters (their tasks run in the following pass, after the loop's next poll)."""
        self.scheduled = False
        self.used = 0
        waiting = self.waiting
        while waiting and self.used < self.per_pass:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.used += 1
        if waiting or self.used:
            self._schedule()
