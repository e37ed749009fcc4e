"""What nats-py does not expose about a subscription's queue, read (and, for inline dispatch, used) in one place."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import anyio
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..logs import error_text, log_event

log = logging.getLogger("streamproc.nats")


async def handled_all(sub: Subscription | None, still_current: Callable[[], bool]) -> None:
    """Return once every message ``sub`` had received at the call has been through its callback.

    A control request (migrate) runs on its own subscription; this keeps it from overtaking chunks
    the server delivered before it. nats-py 2.x counts deliveries in ``delivered`` and keeps the
    callback queue in the private ``_pending_queue`` (an ``asyncio.Queue`` whose
    ``_unfinished_tasks`` falls when a callback returns). Best effort: without those attributes it
    returns at once. Messages dropped as a slow consumer count as handled. ``still_current`` ends
    the wait early when the subscription is replaced or closed meanwhile.
    """
    queue = getattr(sub, "_pending_queue", None)
    if sub is None or not hasattr(queue, "_unfinished_tasks"):
        return
    target = sub.delivered
    while sub.delivered - queue._unfinished_tasks < target and still_current():  # type: ignore[union-attr]
        await anyio.sleep(0.0005)


class _InlineQueue(asyncio.Queue):
    """A subscription's callback queue that hands a message to a synchronous handler at once, in
    nats-py's read loop, when nothing is queued before it and no callback is running
    (``_unfinished_tasks == 0``: order kept). The handler returns False to decline (the message
    is queued for the subscription's own callback task, as without this); messages behind a
    declined one are queued too until the task has caught up."""

    _inline: Callable[[Msg], bool]
    _sub: Subscription

    def put_nowait(self, item: Msg) -> None:
        if self._unfinished_tasks == 0:
            size = len(item.data)
            sub = self._sub
            sub._pending_size -= size  # as Subscription._wait_for_msgs does when it takes one
            try:
                if self._inline(item):
                    return
            except Exception as exc:  # noqa: BLE001  (never into nats-py's read loop)
                # Handlers catch their own errors; one that escapes drops the message, which JetStream
                # redelivers after ack_wait (a chunk) or the outbox resends for (a PubAck).
                log_event(log, logging.ERROR, "inline_handler_failed", subject=item.subject, error=error_text(exc))
                return
            sub._pending_size += size
        super().put_nowait(item)


def dispatch_inline(sub: Subscription, handle: Callable[[Msg], bool]) -> bool:
    """Run ``handle`` on ``sub``'s messages in the client's read loop when it can (see
    :class:`_InlineQueue`), saving the per-message hop through the callback task (a queue put, a
    task wakeup, a loop iteration). ``handle`` must not await and must not block. nats-py 2.x's
    callback task awaits ``get()`` on the very queue object it started with, so the queue's class
    is changed in place rather than the queue replaced. False (nothing changed) when the queue is
    not the ``asyncio.Queue`` this relies on."""
    queue = getattr(sub, "_pending_queue", None)
    if type(queue) is not asyncio.Queue or not hasattr(queue, "_unfinished_tasks") or not hasattr(sub, "_pending_size"):
        return False
    queue.__class__ = _InlineQueue
    queue._inline = handle  # type: ignore[attr-defined]
    queue._sub = sub  # type: ignore[attr-defined]
    return True
