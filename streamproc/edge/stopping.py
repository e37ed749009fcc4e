"""Ending the open result streams when the edge stops, before the server's graceful timeout cuts them.

Uvicorn's stop (0.54 ``Server.shutdown``) closes the listeners, asks each connection to close after
its current response, waits ``timeout_graceful_shutdown`` (1 s, command.py) and then cancels every
request task still running. An SSE stream has no end in sight, so each client saw its chunked body
cut (``incomplete chunked read``), a unary request waiting for its final result got no answer, and
Uvicorn logged "Exception in ASGI application" with a traceback per stream.

The edge's Uvicorn ``Server`` calls :meth:`Stopping.stop` first. Every request task that waits on
results registered itself (:meth:`Stopping.enter`); it is cancelled, and, finding the cancel to be
the stop's (:meth:`Stopping.claims`), ends its response itself: an SSE stream with an ``overloaded``
error event saying how to resume (``Last-Event-ID``), ``[DONE]`` and the chunked body's end; a unary
request with ``503``. So a client can tell a stop from a cut connection, and reconnects to another
edge. A cancel is used, not a flag the stream polls, because it reaches every place a stream can
wait (its feed, a replay, a consumer being created, a write blocked by flow control) without a
check on the per-event path; a cancel that such a wait swallows is sent again (:meth:`Stopping._again`).
"""

from __future__ import annotations

import asyncio

# The message of the error a stream or unary request ends with when the edge stops.
MESSAGE = ("the edge is stopping: open the stream again (with Last-Event-ID set to the id of the last event "
           "received, to resume after it)")
FINAL_WRITE_TIMEOUT = 0.5  # seconds the last frame may wait for a client that stopped reading; then cut
RECANCEL_INTERVAL = 0.2  # seconds between cancels of a task the stop has not ended yet (Stopping._again)
RECANCEL_ROUNDS = 3  # then Uvicorn's own timeout (1 s, command.py) has the last word


class Stopping:
    """The request tasks that wait on results, and whether the edge is stopping."""

    __slots__ = ("active", "_tasks", "_cancels", "_rounds")

    def __init__(self) -> None:
        self.active = False
        self._tasks: set[asyncio.Task] = set()
        self._cancels: dict[asyncio.Task, int] = {}  # cancels the stop sent to each task, not yet claimed
        self._rounds = 0

    def enter(self, task: asyncio.Task) -> None:
        """``task`` waits on results from now on; during a stop it is cancelled at once."""
        self._tasks.add(task)
        if self.active:
            self._cancel(task)

    def leave(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._cancels.pop(task, None)

    def stop(self) -> int:
        """Cancel every registered task (each ends its response itself); how many there were."""
        self.active = True
        tasks = list(self._tasks)
        for task in tasks:
            self._cancel(task)
        if tasks:
            asyncio.get_running_loop().call_later(RECANCEL_INTERVAL, self._again)
        return len(tasks)

    def _cancel(self, task: asyncio.Task) -> None:
        self._cancels[task] = self._cancels.get(task, 0) + 1
        task.cancel()

    def _again(self) -> None:
        """Cancel again the tasks that have not ended: a cancel can be lost. Python 3.11's
        ``asyncio.wait_for`` returns the result and drops a cancel that arrives when the awaited
        reply is already in (nats-py's ``request``, e.g. a stored result read for a replay), without
        ``uncancel``: the task goes on waiting, with ``cancelling()`` still counting the lost one."""
        self._rounds += 1
        for task in list(self._tasks):
            if not task.done():
                self._cancel(task)
        if self._tasks and self._rounds < RECANCEL_ROUNDS:
            asyncio.get_running_loop().call_later(RECANCEL_INTERVAL, self._again)

    def claims(self, task: asyncio.Task) -> bool:
        """Whether the cancel ``task`` is handling is the stop's, and only the stop's: then it is
        absorbed (one ``uncancel`` per cancel the stop sent, lost ones included), the task is no
        longer cancelled again, and it ends its response. Any other cancel pending (the client
        left, the server's own timeout) is not: the caller re-raises."""
        sent = self._cancels.pop(task, 0)
        if not self.active or not sent or task not in self._tasks:
            return False
        self._tasks.discard(task)
        remaining = task.cancelling()
        for _ in range(sent):
            remaining = task.uncancel()
        return remaining == 0
