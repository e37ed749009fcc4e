"""Mutual exclusion between the message path and off-path dispatches (timer, control requests)."""

from __future__ import annotations

from typing import Awaitable, Callable, TypeVar

import anyio

T = TypeVar("T")


class DispatchGate:
    """Keeps one request's results from interleaving on the wire while a publish is suspended.

    Publishes only suspend under back-pressure, but then a timer result (a timeout) or a control
    decision could otherwise slip between two results the message path is sending. The message
    path sets ``busy`` around its dispatch and waits while ``held`` is set; an off-path dispatch
    waits until the message path is idle, then holds the gate. Plain flags instead of an
    ``asyncio.Lock``: an uncontended lock costs about 0.4 µs per message on the hot path.
    """

    __slots__ = ("busy", "held")

    def __init__(self) -> None:
        self.busy = False  # the message path is dispatching
        self.held: anyio.Event | None = None  # an off-path dispatch is running; set when it ends

    async def wait_turn(self) -> None:
        """Message path: wait while an off-path dispatch holds the gate."""
        while self.held is not None:
            await self.held.wait()

    async def exclusive(self, run: Callable[[], Awaitable[T]]) -> T:
        """Off path: run ``run()`` once the message path is idle, holding the gate meanwhile."""
        while self.busy or self.held is not None:
            await anyio.sleep(0.001)
        held = self.held = anyio.Event()
        try:
            return await run()
        finally:
            self.held = None
            held.set()
