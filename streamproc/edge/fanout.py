"""Every result read once: the recent ring's wildcard subscription hands results to the open streams.

With ``--recent`` > 0 and no JetStream results stream, the edge subscribes to ``P.results.>`` for
the page's request list anyway. Before, each SSE stream also had its own ``P.results.<id>``
subscription, so every result crossed the edge's socket, nats-py's parser and a pending queue twice,
and every open cost a SUB, a PING/PONG round trip and an UNSUB (docs/benchmarks.md, "Fan-out").
Here the wildcard subscription's pending queue is replaced by :class:`DispatchQueue`, whose
``put_nowait`` (called by nats-py's read path, ``Client._process_msg``, for each message) parses the
result once, notes it in the recent ring and appends it to the :class:`Inbox` of each stream open on
its subject: an open is a dict insert, a result one dict lookup. A stream whose writer is idle
gets the result written to its client from here instead (:mod:`.direct`).
:class:`~streamproc.nats.fast_client.FastClient` hands each result to :meth:`Fanout.dispatch` from
its read loop before it builds a ``Msg`` (``deliver_inline``), and so does a JetStream results
stream's ordered consumer; what it declines comes through the queue, to the same method.

Why nothing is missed: the wildcard subscription is live on the server before the edge serves
(``ResultSource.start`` flushes it), an open registers its inbox before its response headers are
written, and nats-server delivers on one connection in order; so a result published after the
client saw its headers reaches the inbox. As before, core mode has no replay: a result published
before the open is not seen (the stream reports a gap). While the connection is down an open waits
for the reconnect (``PongBarrier.wait`` falls back to nats-py's ``flush``), as a SUB did.

Bounds are those of the per-stream subscription it replaces (nats-py 2.16 ``Client._process_msg``):
an inbox holding ``pending_bytes_limit`` bytes or ``pending_msgs_limit`` results not yet taken by its
stream drops the result. Its bytes are what each result holds (``ResultInfo.held_bytes``: body, kept
header values, id and a fixed cost), not nats-py's bodies alone, so empty results count too. In core
mode the stream then ends with an overrun (nats-py reported SlowConsumerError): what was dropped is
gone. When the ring reads a JetStream stream, what was dropped is stored: the inbox goes *behind* (it takes nothing more), its stream hands out what it
holds, then reads on from the first result it did not take, from the stream, and rejoins the
dispatch (``ResultSource.catch_up``, as an open does: :mod:`.replay`). So a slow or paused client
is held to the bound and gets every result (issue 11.4).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Callable

import nats.errors
from nats.aio.msg import Msg

from ..core.defaults import RESULT_HELD_OVERHEAD
from ..core.wire import ContractError, ResultInfo, result_from_message
from ..nats.fast_client import result_from_block

if TYPE_CHECKING:
    from .feed import ResultFeed
    from .source import ResultSource

log = logging.getLogger("streamproc.edge")


class Inbox:
    """One stream's results not yet taken, filled by :meth:`Fanout.dispatch` (no await, no task)."""

    __slots__ = ("sub", "bytes_limit", "msgs_limit", "_items", "_bytes", "_waiter", "behind")

    def __init__(self, sub, bytes_limit: int, msgs_limit: int) -> None:
        self.sub = sub  # the wildcard subscription: its connection and nats-py's close hook
        self.bytes_limit, self.msgs_limit = bytes_limit, msgs_limit
        self._items: collections.deque[tuple[ResultInfo, int]] = collections.deque()
        self._bytes = 0
        self._waiter: asyncio.Future | None = None
        # A JetStream stream whose client fell the bound behind: the stream sequence of the first
        # result it did not take. It takes no more until its stream caught up from the results
        # stream (ResultSource.catch_up); None while it is live.
        self.behind: int | None = None

    def put(self, result: ResultInfo, size: int) -> bool:
        """False when the result does not fit (nats-py's checks, in its order: bytes, then count),
        or while the stream is behind."""
        if (self.bytes_limit > 0 and self._bytes + size >= self.bytes_limit or len(self._items) >= self.msgs_limit
                or self.behind is not None):
            return False
        self._items.append((result, size))
        self._bytes += size
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def take(self) -> ResultInfo | None:
        """A queued result or None; ``ConnectionClosedError`` once the connection is closed (as
        :func:`streamproc.edge.pending.take`)."""
        if self.sub._conn.is_closed:
            raise nats.errors.ConnectionClosedError
        if not self._items:
            return None
        result, size = self._items.popleft()
        self._bytes -= size
        return result

    async def wait(self, timeout: float) -> None:
        """Until a result is queued, ``timeout`` passes or the inbox is woken (:meth:`wake`).
        Registered where nats-py's ``Client._close`` cancels a subscription's ``next_msg`` calls,
        so a closed connection ends the wait with ``ConnectionClosedError``."""
        if self.sub._conn.is_closed:
            raise nats.errors.ConnectionClosedError
        if self._items:
            return
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        calls = self.sub._pending_next_msgs_calls
        calls[id(waiter)] = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.sub._conn.is_closed and not (task is not None and task.cancelling()):
                raise nats.errors.ConnectionClosedError from None  # Client._close cancelled the waiter
            raise
        finally:
            self._waiter = None
            timer.cancel()
            calls.pop(id(waiter), None)

    def queued(self) -> bool:
        """Results wait to be taken."""
        return bool(self._items)

    def parked(self) -> bool:
        """Its stream's task waits in :meth:`wait` with nothing queued: every earlier result was
        taken and written, and nothing is between the wire and that task (direct.py)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._items and self.behind is None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Fanout:
    """The open streams by result subject, fed from the one wildcard subscription."""

    def __init__(self, source: ResultSource, sub, on_overflow: Callable[[ResultFeed, str], None],
                 stream: str | None = None) -> None:
        self.source = source
        self.sub = sub  # nats-py's core Subscription (a JetStream ordered consumer's ``_sub``)
        self.stream = stream  # the JetStream stream the ordered consumer reads, or None (core)
        self.on_overflow = on_overflow
        self.feeds: dict[str, list[ResultFeed]] = {}
        self._take(sub)

    def _take(self, sub) -> None:
        queued, sub._pending_queue = sub._pending_queue, DispatchQueue(self, sub)
        # What arrived before the queue was replaced: the messages a new ordered consumer pushes
        # while nats-py's subscribe still waits for the consumer's creation (a stream reread from
        # its start, source.py, has them at once). Dispatched first, in their order.
        moved = not queued.empty()
        while not queued.empty():
            sub._pending_queue.put_nowait(queued.get_nowait())
        if moved and self.source.after_read is not None:
            # Dispatched outside a NATS read (rebind runs in a task): the direct SSE frames they made
            # are written now, not at the connection's next read (edge/direct.py WriteBatch).
            self.source.run_after_read()
        # Nothing waits in it, so its own limits only mattered for one message over the byte limit:
        # dropped for every stream. Each inbox applies them per stream instead (an overrun, as before).
        sub._pending_bytes_limit = 0
        # FastClient hands each result to dispatch from its read loop before it builds a Msg
        # (deliver_inline), the ordered consumer's too (FastClient._ordered_now, also after nats-py
        # remade it); the messages it declines (while reconnecting, control messages, a delivery
        # gap) still come through the queue above.
        deliver_inline = getattr(sub._conn, "deliver_inline", None)
        if deliver_inline is not None:
            deliver_inline(sub, self.dispatch, raw_headers=True)

    def rebind(self, sub, stream: str | None) -> None:
        """Read from another subscription (the results stream was deleted or recreated: source.py).
        The open streams stay registered; until the old subscription is unsubscribed both dispatch
        (a result read twice is dropped by its stream's ``SeqOrder``)."""
        self.sub, self.stream = sub, stream
        self._take(sub)
        for feeds in self.feeds.values():
            for feed in feeds:
                if feed.inbox is not None:
                    feed.inbox.sub = sub  # where nats-py's close finds its waiter (Inbox.wait)
                if stream is not None:  # its results come from the stream now: its deletion ends it
                    feed.mode = "jetstream"
                    if feed.inbox is not None and feed.inbox.behind is not None:
                        feed.inbox.behind = 1  # a new history: it catches up from that stream's start

    def delivered(self) -> int:
        """The stream sequence up to which the ordered consumer has dispatched every result (nats-py
        2.16 ``Client._process_msg`` sets ``_JSI._sseq`` before the message is queued, i.e. dispatched)."""
        return self.sub._jsi._sseq

    def inbox(self, bytes_limit: int, msgs_limit: int) -> Inbox:
        return Inbox(self.sub, bytes_limit, msgs_limit)

    def add(self, subject: str, feed: ResultFeed) -> None:
        self.feeds.setdefault(subject, []).append(feed)
        self.source.metrics.streams_dispatched += 1

    def remove(self, subject: str, feed: ResultFeed) -> None:
        feeds = self.feeds.get(subject)
        if feeds is not None and feed in feeds:
            feeds.remove(feed)
            self.source.metrics.streams_dispatched -= 1
            if not feeds:
                del self.feeds[subject]

    def dispatch(self, subject: str, reply: str, headers: dict[str, str] | bytes | None, data: bytes) -> bool:
        """One result off the wire: the recent ring, then each stream open on its subject. ``reply``
        is its ``$JS.ACK`` subject when the ring reads a JetStream stream (its stream sequence, for a
        stream that cannot take it: ``on_overflow``). Never raises: it runs in the read loop
        (``FastClient``'s inline handler, hence True: taken) or under nats-py's (``DispatchQueue``),
        and an exception there would drop the connection. The guard is here rather than in a wrapper:
        one Python call less per SSE event (docs/benchmarks.md, "Calls per SSE event"). ``headers``
        is the raw header block where ``FastClient`` has one unparsed (``deliver_inline``'s
        ``raw_headers``): read by ``result_from_block``, the same result or error without the dict."""
        source = self.source
        try:
            feeds = self.feeds.get(subject)
            try:
                if type(headers) is bytes:
                    result = result_from_block(source.subjects, subject, headers, data)
                else:
                    result = result_from_message(source.subjects, subject, headers, data)  # type: ignore[arg-type]
            except (ContractError, ValueError) as exc:
                if feeds:  # as each stream's own subscription counted it
                    source.metrics.malformed_results += len(feeds)
                    for feed in feeds:
                        source.limited.log(logging.WARNING, "malformed_result", request_id=feed.request_id,
                                           error=str(exc))
                return True
            source.metrics.results_seen += 1
            # One wall-clock read per NATS read for the ring's last_seen (as WriteBatch.flush stamps
            # sent_at), cleared at the read's end (ResultSource.run_after_read); where no read end
            # clears it (the stock client), one per result as before.
            now = source.read_stamp
            if now is None:
                now = time.time()
                if source.after_read_hooked:
                    source.read_stamp = now
            source.recent.note(result, now)
            if feeds:
                # A copy when several: an overflow removes its feed from the list (on_overflow). Alone,
                # its removal just ends the loop.
                for feed in (feeds if len(feeds) == 1 else tuple(feeds)):
                    direct = feed.direct
                    if direct is not None and direct.offer(result):  # written at once (direct.py)
                        continue
                    # What it holds, not its body alone (empty bodies with long header values grew
                    # an inbox without bound): ResultInfo.held_bytes, inline (a property is a Python
                    # call per event), C calls only for the header values present (ASCII as read, so
                    # len is their bytes: wire.held_error_text); tests/test_edge_held_bytes.py pins that
                    # the two agree.
                    size = len(data) + len(result.request_id) + RESULT_HELD_OVERHEAD
                    if result.traceparent is not None:
                        size += len(result.traceparent)
                    if result.error is not None:
                        size += len(result.error)
                    if not feed.inbox.put(result, size):  # type: ignore[union-attr]
                        self.on_overflow(feed, reply)
        except Exception:  # noqa: BLE001 - never into the read loop
            source.limited.log(logging.ERROR, "dispatch_failed", subject=subject, exc_info=True)
        return True


class DispatchQueue(asyncio.Queue):
    """The wildcard subscription's pending queue: ``put_nowait`` dispatches at once, so it stays
    empty (``Subscription.unsubscribe``/``drain`` see an empty queue). nats-py 2.16
    ``Client._process_msg`` (and ``FastClient._process_msg``) count the message in the
    subscription's ``_pending_size`` before ``put_nowait``; it is given back here."""

    def __init__(self, fanout: Fanout, sub) -> None:
        super().__init__()
        self.fanout = fanout
        self.sub = sub  # its own: after Fanout.rebind the old one may still deliver until unsubscribed

    def put_nowait(self, item: Msg) -> None:
        self.sub._pending_size -= len(item.data)
        self.fanout.dispatch(item.subject, item.reply, item.headers, item.data)  # never raises
