"""Whether the edge may read stored results by subject (``$JS.API.STREAM.MSG.GET.<stream>``).

The edge's replay (:mod:`.replay`) needs that publish permission. A deployment whose edge user
was set up before it (the ``deploy/nats-server.conf`` of earlier releases) lacks it, and
nats-server answers such a request with nothing but an ``-ERR`` on the connection, which nats-py
hands to the error callback (:mod:`streamproc.nats.refusals`); the request itself would wait for
its whole timeout. So the refusal is read from the error callback
(:meth:`ApiPermission.note_error`), and a request made while the permission is not known to work is
raced against it (:meth:`ApiPermission.guard`): the open that finds out pays one round trip, not a
timeout.

Once refused, the edge reads each stream's stored history with consumers alone, in the read
budget (replay.py, ``by_consumer``; until 2026-12-06 an open had an ordered consumer of its own from
the stream's start, outside it), and asks again after ``reprobe`` seconds (one open tries MSG.GET),
so a permission granted later is used without a restart.

The same class tracks the replay's pulls (``$JS.API.CONSUMER.MSG.NEXT.<stream>.>``,
``ResultSource.pulls``): refused there, a replay reads with push consumers, and a pull is tried
again after ``reprobe``; a first pull answered "no responders" (the account lacks the import) counts
as refused too (replay.py, ``_renew``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Literal, TypeVar

from ..core.errors import StoredResultsRefused
from ..nats.refusals import refused_publish

T = TypeVar("T")
REPROBE = 60.0  # seconds between tries of a refused MSG.GET

State = Literal["unknown", "allowed", "refused"]


Refused = StoredResultsRefused  # defined with every other error in core/errors.py


class ApiPermission:
    """What the edge knows of its permission to publish one JetStream API request on the results
    stream: ``<api_prefix>.STREAM.MSG.GET.<stream>`` (``ResultSource.msg_get``), or (``api=
    "CONSUMER.MSG.NEXT"``, ``per_consumer``) its pulls ``<api_prefix>.CONSUMER.MSG.NEXT.<stream>.>``
    (``ResultSource.pulls``): refused, allowed or unknown, and when to try again. A refusal of
    either is read the same way (the connection's ``-ERR``). (Named ``MsgGetAccess`` before the
    pulls used it too.)"""

    def __init__(self, api_prefix: str, stream: str, on_change: Callable[[State, str], None] | None = None,
                 reprobe: float = REPROBE, clock: Callable[[], float] = time.monotonic,
                 api: str = "STREAM.MSG.GET", per_consumer: bool = False) -> None:
        self.stream = stream
        # the permission replay.py needs: MSG.GET, or (``per_consumer``) CONSUMER.MSG.NEXT.<stream>.<name>
        self.subject = f"{api_prefix}.{api}.{stream}"
        self._below_only = per_consumer  # pulls publish to <subject>.<consumer name>
        self.on_change = on_change  # (new state, reason) when a refusal starts or ends: log it once
        self.reprobe = reprobe
        self.clock = clock
        self.state: State = "unknown"
        self.refused_at = 0.0
        self.reason = ""
        self._refusal: asyncio.Future[str] | None = None  # resolved by note_error, for guard()

    def usable(self) -> bool:
        """Try MSG.GET for this open? After a refusal, no, except for one open every ``reprobe``
        seconds (the wait restarts with it, also when that open ends before its answer)."""
        if self.state != "refused":
            return True
        now = self.clock()
        if now - self.refused_at >= self.reprobe:
            self.refused_at = now
            return True
        return False

    @property
    def confirmed(self) -> bool:
        """MSG.GET answered and nothing refused it since: requests need no guard."""
        return self.state == "allowed"

    def allowed(self) -> None:
        """A MSG.GET got an answer (a re-probe found the permission: the refusal ends)."""
        was = self.state
        self.state, self.reason = "allowed", ""
        if was == "refused" and self.on_change is not None:
            self.on_change("allowed", "")

    def refused(self, reason: str) -> None:
        """A MSG.GET went unanswered: fall back until ``reprobe`` seconds from now."""
        was = self.state
        self.state, self.refused_at, self.reason = "refused", self.clock(), reason
        if was != "refused" and self.on_change is not None:
            self.on_change("refused", reason)

    def note_error(self, text: str) -> bool:
        """The connection's error callback: True (and waiting guards fail) when ``text`` is the
        server refusing a MSG.GET publish."""
        if not refused_publish(text, self.subject, below_only=self._below_only):
            return False
        refusal, self._refusal = self._refusal, None
        if refusal is not None and not refusal.done():
            refusal.set_result(text)
        return True

    async def guard(self, request: Awaitable[T]) -> T:
        """``await request`` unless the server refuses a MSG.GET meanwhile: then :class:`Refused`."""
        loop = asyncio.get_running_loop()
        if self._refusal is None:
            self._refusal = loop.create_future()
        refusal = self._refusal
        task = asyncio.ensure_future(request)
        try:
            await asyncio.wait((task, refusal), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        raise Refused(refusal.result(), denied=True)
