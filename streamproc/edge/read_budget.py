"""The waiting side of :class:`~streamproc.core.read_budget.ReadBudget`: one per edge connection.

A replay about to pull (or ask ``STREAM.MSG.GET``) awaits :meth:`ReadGate.acquire`; bytes are given
back with :meth:`ReadGate.release` as they arrive (in the NATS read loop) and when a read ends,
which wakes the waiting reads that now fit, first come first (as ``pending.wake`` wakes a reader).
"""

from __future__ import annotations

import asyncio

from ..core.read_budget import ReadBudget


class ReadGate:
    def __init__(self, limit: int) -> None:
        self.budget = ReadBudget(limit)
        self._futures: dict[object, asyncio.Future[int]] = {}

    def try_acquire(self, want: int, least: int) -> int:
        """Bytes granted now, or 0 (nothing queued: the caller reads some other way, or later)."""
        return self.budget.take(want, least)

    async def acquire(self, want: int, least: int) -> int:
        """Bytes granted (at least ``least``, at most ``want``), waiting for them first come first.
        Cancelled, nothing is charged (a grant that raced the cancel is given back)."""
        granted = self.budget.take(want, least)
        if granted:
            return granted
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        key = object()
        self._futures[key] = future
        self.budget.wait(key, want, least)
        try:
            return await future
        except BaseException:
            self._futures.pop(key, None)
            self.budget.leave(key)
            if future.done() and not future.cancelled():
                self.release(future.result())
            else:
                self._wake()  # it may have held up the reads behind it
            raise

    def release(self, size: int) -> None:
        if size > 0:
            self.budget.release(size)
            self._wake()

    def _wake(self) -> None:
        for key, grant in self.budget.granted():
            future = self._futures.pop(key, None)
            if future is None or future.done():
                self.budget.release(grant)
                continue
            future.set_result(grant)

    @property
    def out(self) -> int:
        return self.budget.out
