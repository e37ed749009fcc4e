"""What nats-py does not expose about a subscription's queue: whether its callback has caught up
(control requests; inline dispatch, ``FastClient.deliver_inline``, counts as handled)."""

from __future__ import annotations

from typing import Callable

import anyio
from nats.aio.subscription import Subscription


async def handled_all(sub: Subscription | None, still_current: Callable[[], bool]) -> None:
    """Return once every message ``sub`` had received at the call has been through its callback.

    A control request (migrate) runs on its own subscription; this keeps it from overtaking chunks
    the server delivered before it. nats-py 2.x counts deliveries in ``delivered`` and keeps the
    callback queue in the private ``_pending_queue`` (an ``asyncio.Queue`` whose
    ``_unfinished_tasks`` falls when a callback returns). Without those attributes it would return at
    once (a migrate could overtake chunks): no client is made then
    (``internals.STOCK_CLIENT_INTERNALS``). Messages dropped as a slow consumer count as handled.
    ``still_current`` ends the wait early when the subscription is replaced or closed meanwhile.
    """
    queue = getattr(sub, "_pending_queue", None)
    if sub is None or not hasattr(queue, "_unfinished_tasks"):
        return
    target = sub.delivered
    while sub.delivered - queue._unfinished_tasks < target and still_current():  # type: ignore[union-attr]
        await anyio.sleep(0.0005)
