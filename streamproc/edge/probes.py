"""The opens' ``STREAM.MSG.GET`` probes, sent at the open and answered in the NATS read loop.

Every JetStream open dispatched from the ring asks the results stream once whether anything of its
subject was stored before it registered (:mod:`.replay`). Asked through ``nc.request``, the answer
went through nats-py's response subscription (a ``Msg``, its queue and callback task), then
``asyncio.wait_for``'s future and timer, then woke the stream's task, which resumed ~10 coroutine
frames to learn that nothing is stored: ~116 Python calls of edge CPU per open
(docs/benchmarks.md, "The durable open, step by step"). Here the request is published at the open,
its answer is handed to :meth:`~.replay.Replay.answered` by :class:`~streamproc.nats.fast_client.FastClient`'s
inline delivery, and the stream's task is woken only when there is something to replay or an error
to report. Same request, same answer, same errors: only the path of the answer changes.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

Answered = Callable[[bytes | None, BaseException | None], None]

NO_RESPONDERS = "503"  # the Status of nats-server's answer when nothing listens on the subject


class Probes:
    """One reply subscription (``<inbox>.<nuid>.*``) for every probe of one connection."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = ""
        self._waiting: dict[str, tuple[Answered, asyncio.TimerHandle]] = {}
        self.sub: Any = None

    @staticmethod
    def usable(nc: Any) -> bool:
        """Only a client that delivers inline (FastClient); else the replay asks with ``nc.request``."""
        return hasattr(nc, "deliver_inline")

    async def start(self) -> None:
        # Under the connection's inbox prefix, as nats-py's own requests (--inbox-prefix: the edge
        # user's permissions). The callback takes what inline delivery declines (a status answer).
        self.prefix = self.nc.new_inbox() + "."
        self.sub = await self.nc.subscribe(self.prefix + "*", cb=self._queued)
        self.nc.deliver_inline(self.sub, self._inline)

    async def ask(self, subject: str, payload: bytes, timeout: float, answered: Answered) -> str:
        """Publish the request; ``answered(data, None)`` once its answer is read, or ``answered(None,
        exc)`` (``TimeoutError`` after ``timeout`` s, ``LookupError`` when no responder): the token,
        for :meth:`forget`. A failed publish raises here, nothing left waiting."""
        # Unguessable, as nats-py's request tokens are (a NUID and 2 random bytes): an answer forged
        # by whoever may publish into this inbox would say "nothing stored" and lose those results.
        token = os.urandom(12).hex()
        timer = asyncio.get_running_loop().call_later(timeout, self._expire, token)
        self._waiting[token] = (answered, timer)
        try:
            await self.nc.publish(subject, payload, reply=self.prefix + token)
        except BaseException:
            self.forget(token)
            raise
        return token

    def forget(self, token: str) -> None:
        """The asker does not want the answer any more (its stream closed)."""
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            waiting[1].cancel()

    def _expire(self, token: str) -> None:
        waiting = self._waiting.pop(token, None)
        if waiting is not None:
            waiting[0](None, TimeoutError())

    def _inline(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes) -> bool:
        waiting = self._waiting.pop(subject[len(self.prefix):], None)
        if waiting is not None:
            answered, timer = waiting
            timer.cancel()
            if headers is not None and headers.get("Status") == NO_RESPONDERS:
                answered(None, LookupError(subject))
            else:
                answered(data, None)
        return True

    async def _queued(self, msg: Any) -> None:
        self._inline(msg.subject, msg.reply, msg.headers, msg.data)
