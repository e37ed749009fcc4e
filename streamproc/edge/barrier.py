"""One PING for every SSE open of an event-loop pass: "the server has our SUB" without a round trip each.

A core-mode open must not answer its client before nats-server knows its subscription (the client
may make the worker publish at once). nats-py 2.16 ``Client.flush`` sends a PING per call and waits
for its PONG: with 50 clients opening together that was 50 PINGs, each its own socket write (a
loopback ``send`` costs the sender the receiver's work too; ~10% of the edge's CPU in a burst of
opens, docs/benchmarks.md "SSE open"), and 50 futures each behind ``asyncio.wait_for``.
:meth:`PongBarrier.wait` instead joins the current round; the round's PING goes out once, after
every open of the loop pass queued its SUB, so one PONG releases them all.

It also writes the commands still queued in the client (the SUBs) before the PING, in one
write. nats-py's ``Client._send_ping`` writes PING straight to the socket while ``subscribe`` left
its SUB in ``_pending`` for the flusher task, so the PING went out first and its PONG did not
strictly prove that the server had processed the SUB (it practically always had: the SUB follows
in the next write).
"""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.client import DEFAULT_FLUSH_TIMEOUT, PING_PROTO


class PongBarrier:
    """``await barrier.wait()``: every command written before it was processed by the server."""

    def __init__(self, nc: NatsClient, timeout: float = DEFAULT_FLUSH_TIMEOUT) -> None:
        self.nc = nc
        self.timeout = timeout
        self._waiters: list[asyncio.Future] | None = None  # the round not sent yet
        self.rounds = 0  # PINGs sent (tests: several opens share one)

    async def wait(self) -> None:
        """Raises ``nats.errors.FlushTimeoutError`` without a PONG in ``timeout`` seconds, and
        ``ConnectionClosedError`` when the connection closed; cancelling one waiter leaves the round."""
        nc = self.nc
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        if (not nc.is_connected or nc._reading_task is None or nc._reading_task.done()
                or nc._flusher_task is None or nc._flusher_task.done()):
            await nc.flush(self.timeout)  # nats-py's own fallbacks (buffered while reconnecting, dead loops)
            return
        loop = asyncio.get_running_loop()
        if self._waiters is None:
            self._waiters = []
            loop.call_soon(self._send)  # after the other opens of this loop pass queued their SUBs
        waiter = loop.create_future()
        self._waiters.append(waiter)
        await waiter

    def _send(self) -> None:
        waiters, self._waiters = self._waiters or [], None
        nc = self.nc
        if not nc.is_connected or nc._transport is None:
            _fail(waiters, nats.errors.ConnectionClosedError())
            return
        loop = asyncio.get_running_loop()
        pong = loop.create_future()  # never cancelled: Client._process_pong calls set_result on it
        timer = loop.call_later(self.timeout, _fail, waiters, nats.errors.FlushTimeoutError())
        pong.add_done_callback(lambda _: (timer.cancel(), _release(waiters)))
        # Client._send_ping, with the queued commands first (FastClient._send_ping does the same
        # when it defers writes): one write, and the PONG follows every SUB the waiters sent.
        pending = nc._pending
        nc._pending = []
        nc._pending_data_size = 0
        pending.append(PING_PROTO)
        nc._pongs.append(pong)
        nc._transport.writelines(pending)
        self.rounds += 1


def _release(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


def _fail(waiters: list[asyncio.Future], exc: Exception) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(exc)
