"""Reading a nats-py subscription's pending messages without a task per message.

nats-py 2.16's ``Subscription.next_msg(timeout)`` creates a uuid4 task name, a task for
``asyncio.wait_for(queue.get(), timeout)`` and, inside ``wait_for``, a second task and a timer, for
every message; the profile of the edge at 2,000 events/s put that at ~15 µs per SSE event
(docs/benchmarks.md). :func:`next_msg` does the same thing with one future and one timer, and only
when the queue is empty; a queued message is taken at once. The subscription, its pending
limits (the per-stream bound: past them nats-py reports a SlowConsumerError) and the JetStream
flow-control reply stay nats-py's.

These functions read and replace nats-py internals, so the edge starts only where
:func:`pending_support` finds exactly those internals in a nats-py of ``SUPPORTED_NATS_PY``; nats-py's
public API cannot keep the held-bytes bound (:class:`HeldQueue`), so elsewhere it refuses to start
(docs/operations.md, "Supported dependency versions").
"""

from __future__ import annotations

import asyncio
import collections
import os
import types
from sys import getsizeof
from typing import Any, Callable

import nats.aio.client as _client
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext

from ..core.defaults import RESULT_HELD_OVERHEAD
from ..core.errors import NatsPyUnsupported
from ..nats.fast_client import STOCK_CLIENT_ENV, outside_supported_range, supported_range
from ..nats.internals import EDGE_INTERNALS, missing


def take(sub) -> Msg | None:
    """A queued message, or None; ``nats.errors.ConnectionClosedError`` once the connection is closed. The accounting of nats-py 2.16 ``Subscription.next_msg`` after its
    ``get`` (``_pending_size``, ``task_done``), then ``JetStreamContext.PushSubscription.next_msg``'s
    flow-control check, which needs an await only when a reply is due (:func:`flow_control_due`)."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    if core._conn.is_closed:
        raise nats.errors.ConnectionClosedError
    queue = core._pending_queue
    if queue.empty():
        return None
    msg = queue.get_nowait()
    core._pending_size -= len(msg.data)
    queue.task_done()
    return msg


def flow_control_due(sub) -> str | None:
    """The JetStream flow-control reply to publish now, as ``PushSubscription.next_msg`` does after
    each message it hands out (nats-py 2.16 nats/js/client.py): once every delivered message was read."""
    if not isinstance(sub, JetStreamContext.PushSubscription):
        return None
    jsi = sub._sub._jsi
    if jsi is None:
        return None
    jsi._active = True
    if jsi.get_js_delivered() >= jsi._fciseq and jsi._fcr:
        reply, jsi._fcr = jsi._fcr, None
        return reply
    return None


async def wait(sub, timeout: float) -> bool:
    """Wait until a message is queued (True) or ``timeout`` seconds pass (False). Raises
    ``nats.errors.ConnectionClosedError`` when the connection is closed, like ``next_msg``.

    The getter is registered as ``asyncio.Queue.get`` registers its own (CPython 3.8-3.13
    ``Queue.get``: a future in ``_getters``, woken by ``put_nowait``'s ``_wakeup_next``)."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    if core._conn.is_closed:
        raise nats.errors.ConnectionClosedError
    queue = core._pending_queue
    if not queue.empty():
        return True
    loop = asyncio.get_running_loop()
    getter = loop.create_future()
    queue._getters.append(getter)
    timer = loop.call_later(timeout, _expire, getter)
    # Client._close cancels what a sync subscription has here, to unblock its next_msg calls.
    calls = core._pending_next_msgs_calls
    calls[id(getter)] = getter
    try:
        await getter
    except BaseException as exc:
        getter.cancel()
        _forget(queue, getter)
        if not queue.empty() and not getter.cancelled():  # Queue.get: pass a wake-up we took on
            queue._wakeup_next(queue._getters)
        if isinstance(exc, asyncio.CancelledError) and core._conn.is_closed:
            raise nats.errors.ConnectionClosedError from None  # next_msg's answer when Client._close cancels it
        raise
    finally:
        timer.cancel()
        calls.pop(id(getter), None)
    _forget(queue, getter)  # on a timeout it is still registered
    if core._conn.is_closed:
        raise nats.errors.ConnectionClosedError
    return not queue.empty()


def wake(sub) -> None:
    """End a :func:`wait` on ``sub`` now (it returns False, as on a timeout, unless a message is queued)."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    for getter in list(core._pending_queue._getters):
        if not getter.done():
            getter.set_result(None)


def _expire(getter: asyncio.Future) -> None:
    if not getter.done():
        getter.set_result(None)


def _forget(queue: asyncio.Queue, getter: asyncio.Future) -> None:
    """Unregister a getter that timed out; a woken one was popped already. (Not ``remove`` in a
    ``try``: Python 3.11's ValueError formats the future's repr, ~10 µs.)"""
    getters = queue._getters
    if getters and getter in getters:
        getters.remove(getter)


def drop(sub) -> None:
    """Free the results nats-py still queues for a subscription we stopped, at once.

    ``Subscription.unsubscribe`` (nats/aio/subscription.py) leaves the undelivered messages in
    ``_pending_queue``, and a Subscription is in a reference cycle with its
    ``_SubscriptionMessageIterator`` (``sub._message_iterator._sub is sub``; a JetStream
    PushSubscription also with its ``_JSI``), so they lived until the cyclic GC's next full
    collection: up to ``--stream-buffer-bytes`` per slow stream that had left. Measured with
    tests/test_edge_memory.py: RSS 111 MiB after three rounds against a 59 MiB baseline, the
    garbage being 256 queued ``Msg`` (16 MiB of bodies) in 19 unreachable Subscriptions."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    queue = getattr(core, "_pending_queue", None)
    if queue is None:  # a nats-py without it: the GC frees the messages, later
        return
    while not queue.empty():
        queue.get_nowait()
        queue.task_done()  # Subscription._drain joins this queue
    core._pending_size = 0


class _NotingQueue(asyncio.Queue):
    """A subscription's pending queue that tells ``arrived`` of each message nats-py puts in it, in
    the NATS read loop (every path of nats-py and FastClient queues with ``put_nowait``)."""

    arrived = None

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        arrived = self.arrived
        if arrived is not None:
            arrived(item)


def on_arrival(sub, arrived) -> None:
    """Call ``arrived(msg)`` for each message queued for ``sub`` from now on, as it arrives (not as
    it is read): the replay's read budget is given back when the server's bytes reached the edge,
    however slowly its client reads them. ``sub`` must have nothing queued yet."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    queue = core._pending_queue
    assert queue.empty()
    noting = _NotingQueue(maxsize=queue.maxsize)
    noting.arrived = arrived
    core._pending_queue = noting


class HeldQueue(asyncio.Queue):
    """A feed's own subscription's pending queue (``--recent 0``) that counts in the subscription's
    ``_pending_size`` what each queued ``Msg`` holds beyond its body: its subject, reply, its headers
    (the dict and every name and value string, by ``sys.getsizeof``: 126 empty headers are 3.3 kB of
    dict for 0.5 kB of names, one non-Latin-1 character makes a value 2 or 4 bytes a character), and
    ``RESULT_HELD_OVERHEAD``. nats-py and FastClient count bodies only
    (``_pending_size += len(data)``, checked against ``pending_bytes_limit`` before ``put_nowait``),
    so results with empty bodies and long headers filled the queue up to its 16,384 messages
    unseen by ``--stream-buffer-bytes``. Counted here, the next message's check sees them: the
    bound holds within one message. ``_put``/``_get`` replace ``Queue``'s own, so a message costs no
    Python call more (``sum``, ``map`` and ``getsizeof`` over the headers are C calls)."""

    def __init__(self, core, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.core = core  # the nats-py Subscription whose _pending_size this counts in
        self._extra: collections.deque[int] = collections.deque()  # each queued Msg's, in order

    def _put(self, item: Msg) -> None:
        self._queue.append(item)
        headers = item.headers
        extra = len(item.subject) + len(item.reply) + RESULT_HELD_OVERHEAD
        if headers:  # the dict and its strings as Python holds them, not their characters
            extra += getsizeof(headers) + sum(map(getsizeof, headers)) + sum(map(getsizeof, headers.values()))
        self._extra.append(extra)
        self.core._pending_size += extra

    def _get(self) -> Msg:
        self.core._pending_size -= self._extra.popleft()
        return self._queue.popleft()


def hold(sub) -> None:
    """Have ``sub``'s pending bytes count what each queued message holds (:class:`HeldQueue`), with
    what it queued already moved over in order."""
    core = sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub
    queue = core._pending_queue
    held = HeldQueue(core, queue.maxsize)
    while not queue.empty():
        held.put_nowait(queue.get_nowait())
    core._pending_queue = held
    if core is not sub:  # PushSubscription keeps its own reference (nats-py 2.16 js/client.py __init__)
        sub._pending_queue = held


def _names(func: Any) -> set[str]:
    """The attribute and global names ``func``'s code (nested functions included) reads or sets."""
    found: set[str] = set()
    todo = [getattr(getattr(func, "fget", func), "__code__", None)]
    while todo:
        code = todo.pop()
        if isinstance(code, types.CodeType):
            found.update(code.co_names)
            todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _uses(func: Any, *names: str) -> bool:
    return set(names) <= _names(func)


def _made(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception:  # noqa: BLE001  (another constructor, or what it reads is gone: checked by name below)
        return None


def _objects_agree() -> dict[str, bool]:
    """A sync Subscription, its PushSubscription and _JSI as nats-py makes them hold what this module reads."""
    sub = _made(lambda: Subscription(types.SimpleNamespace()))
    psub = _made(lambda: JetStreamContext.PushSubscription(None, sub, "", "")) if sub is not None else None
    jsi = _made(lambda: JetStreamContext._JSI(None, None, "", False, psub, sub, None))  # type: ignore[arg-type]
    queue = _made(asyncio.Queue)
    return {
        "Subscription()": sub is not None,
        "Subscription._pending_queue": isinstance(getattr(sub, "_pending_queue", None), asyncio.Queue),
        "Subscription._pending_size": getattr(sub, "_pending_size", None) == 0,
        "Subscription._pending_next_msgs_calls": getattr(sub, "_pending_next_msgs_calls", None) == {},
        "Subscription._conn": hasattr(sub, "_conn"),
        "PushSubscription()": psub is not None,
        "PushSubscription._sub": sub is not None and getattr(psub, "_sub", None) is sub,
        "PushSubscription._pending_queue": sub is not None and getattr(psub, "_pending_queue", None) is getattr(
            sub, "_pending_queue", 0),
        "_JSI()": jsi is not None,
        "_JSI._fcr": hasattr(jsi, "_fcr") and jsi._fcr is None,
        "_JSI._fciseq": getattr(jsi, "_fciseq", None) == 0,
        "_JSI._active": hasattr(jsi, "_active"),
        "asyncio.Queue._getters": isinstance(getattr(queue, "_getters", None), collections.deque),
        "asyncio.Queue._queue": isinstance(getattr(queue, "_queue", None), collections.deque),
    }


def pending_support(version: str | None = None) -> tuple[bool, str]:
    """(usable, reason): the installed nats-py is in ``SUPPORTED_NATS_PY`` (fast_client.py, its one
    home) and has every internal this module reads or replaces, as nats-py 2.16 has them."""
    if version is None and os.environ.get(STOCK_CLIENT_ENV):
        return False, f"{STOCK_CLIENT_ENV} is set"
    version = _client.__version__ if version is None else version
    outside = outside_supported_range(version)
    if outside:
        return False, outside
    push, jsi, queue = JetStreamContext.PushSubscription, getattr(JetStreamContext, "_JSI", None), asyncio.Queue
    checks = {
        **_objects_agree(),
        "Client.is_closed": isinstance(getattr(_client.Client, "is_closed", None), property),
        "Client._process_msg queues with put_nowait, counting _pending_size": _uses(
            getattr(_client.Client, "_process_msg", None), "_pending_size", "_pending_bytes_limit", "_pending_queue",
            "put_nowait"),
        "Client._close cancels _pending_next_msgs_calls": _uses(
            getattr(_client.Client, "_close", None), "_pending_next_msgs_calls"),
        "Subscription.next_msg accounting": _uses(
            getattr(Subscription, "next_msg", None), "_pending_queue", "_pending_size", "task_done"),
        "PushSubscription.next_msg flow control": _uses(
            getattr(push, "next_msg", None), "_jsi", "_active", "get_js_delivered", "_fciseq", "_fcr"),
        "_JSI.get_js_delivered": _uses(getattr(jsi, "get_js_delivered", None), "_fciseq", "_pending_queue", "qsize"),
        "_JSI.schedule_flow_control_response": _uses(
            getattr(jsi, "schedule_flow_control_response", None), "_fcr", "_fciseq"),
        "asyncio.Queue.put_nowait": _uses(getattr(queue, "put_nowait", None), "_put", "_wakeup_next", "_getters"),
        "asyncio.Queue.get_nowait": _uses(getattr(queue, "get_nowait", None), "_get"),
        "asyncio.Queue._wakeup_next": callable(getattr(queue, "_wakeup_next", None)),
    }
    # Every internal the edge's modules touch (nats/internals.py, the one list), then the behaviour above.
    wrong = list(dict.fromkeys([*missing(EDGE_INTERNALS), *(name for name, ok in checks.items() if not ok)]))
    if wrong:
        return False, f"nats-py {version} internals differ: {', '.join(wrong)}"
    return True, f"nats-py {version}"


def require_support() -> str:
    """:func:`pending_support`'s reason, or :class:`NatsPyUnsupported`. Run once per edge start-up:
    by ``streamproc edge`` before it sets up its server (the reason handed to ``ResultSource.support``),
    else by ``ResultSource.start`` (an edge built in-process by ``create_app``)."""
    usable, reason = pending_support()
    if not usable:  # nats-py's public API cannot keep the held-bytes bound: refuse
        raise NatsPyUnsupported(
            f"installed nats-py {_client.__version__} cannot run the edge ({reason}); it needs nats-py "
            f"{supported_range()} with the internals it reads, and STOCK_NATS_PY unset "
            "(docs/operations.md, Supported dependency versions)")
    return reason
