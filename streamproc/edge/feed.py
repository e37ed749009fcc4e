"""One HTTP stream's results: :class:`ResultFeed`, and the items its ``next`` hands out.

A feed reads exactly one request's subject and hands its results out through its :class:`SeqOrder`,
in seq order, each once; what ends a stream instead is one of the records here (:class:`Ended`,
:class:`Gap`, :class:`Lost`, :class:`Overrun`, :class:`StreamGone`), which the app frames as SSE.
Its results come from its inbox, filled by the recent ring's subscription (:mod:`.fanout`), with what
was stored before it registered read first (:mod:`.replay`), or from an ordered consumer or a core
subscription of its own. Which one, and the NATS work behind it (the connection, subscriptions,
consumers, replay slots), is :class:`~.source.ResultSource`'s, which the feed calls back. Apart from
it because the feed is the app's whole view of a stream and sits on the per-event path
(``Fanout.dispatch`` -> ``DirectFrames.offer`` -> its methods), where the source is not.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import time
from typing import TYPE_CHECKING, Any, Coroutine, Literal

import msgspec
import nats.errors

from ..core.errors import StoredHistoryUnreadable
from ..core.reorder import SeqOrder
from ..core.wire import ContractError, ResultInfo, result_from_message
from ..logs import error_text, log_event
from . import pending
from .msg_get import Refused

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from .direct import DirectFrames
    from .fanout import Inbox
    from .replay import Replay
    from .source import ResultSource

log = logging.getLogger("streamproc.edge")

FeedMode = Literal["jetstream", "core"]


class Ended(msgspec.Struct, frozen=True):
    """The request's final result was at or before the client's Last-Event-ID: nothing is left."""


class Gap(msgspec.Struct, frozen=True):
    """``missing`` never arrived while later seqs did: the stream cannot go on without splicing."""

    missing: int
    waiting: int


class StaleFinal(msgspec.Struct, frozen=True):
    """A final result at ``seq`` came after a later seq was seen (``SeqOrder.contradicted``): taken
    for the end, it would close the stream clean with results missing."""

    seq: int
    next_seq: int


class Lost(msgspec.Struct, frozen=True):
    """The subscription died under the feed (connection closed, server dropped it)."""

    reason: str


class Overrun(msgspec.Struct, frozen=True):
    """More than ``--stream-buffer-bytes`` of one stream's results waited in the edge: its client fell
    behind (nats-py dropped a result past its pending limit), or later seqs piled up in the reorder
    buffer behind a missing one. The stream cannot go on complete; ending it is what keeps the
    edge's memory bounded per stream."""

    limit: int


class StreamGone(msgspec.Struct, frozen=True):
    """The JetStream results stream this feed read was deleted: no result of it can come."""

    reason: str


FeedItem = ResultInfo | Ended | Gap | StaleFinal | Lost | Overrun | StreamGone


class ResultFeed:
    """The results of one request for one HTTP client. ``close`` frees the subscription at once."""

    def __init__(self, source: ResultSource, request_id: str, sub, mode: FeedMode, order: SeqOrder,
                 inbox: Inbox | None = None) -> None:
        self.source = source
        self.request_id = request_id
        self.mode = mode
        self.order = order
        self._sub = sub  # None while a JetStream feed's consumer is being created (ResultSource.open)
        self.inbox = inbox  # results dispatched from the wildcard subscription (fanout.py); then no _sub
        self.direct: DirectFrames | None = None  # writes results to the client from the fan-out (direct.py)
        self.replay: Replay | None = None  # a dispatched JetStream feed's results stored before it registered
        self.attaching: asyncio.Task | None = None
        self.attach_failed: str | None = None
        self.closed = False
        # Results in order not yet taken by the stream. Public: DirectFrames.offer tests it per SSE
        # event (a result must not pass them), as an attribute, not a method call (docs/benchmarks.md,
        # "seventh pass").
        self.ready: collections.deque[ResultInfo] = collections.deque()
        self._gap_since: float | None = None
        self.overrun = False  # set by the connection's error callback when nats-py dropped a result
        self.gone: str | None = None  # why its results stream is gone (ResultSource._check_results_stream)
        self.stream: str | None = None  # the stream its own ordered consumer reads (ResultSource._consume)
        # That stream's creation time (STREAM.INFO ``created``) as known just before its consumer was
        # made, so a stream recreated right after is told apart (ResultSource._created_of,
        # _check_own_consumers).
        self.stream_created: datetime.datetime | None = None
        self.limits: dict[str, int] = {}  # its subscription's pending limits (ResultSource._consume)
        # Its own consumer dropped a result because the client fell its bound behind: the stream
        # sequence of the first one dropped. What was queued before it is handed out, then a new
        # consumer reads on from there (ResultSource.read_on); None while it keeps up.
        self.cut: int | None = None
        self._held_bytes = 0  # held_bytes of the results waiting in the reorder buffer (order.pending)
        # A result stored for it was gone when it caught up (Replay.lost): its next seq may never
        # come, so the gap clock runs until a result in order does, also with nothing pending.
        self.lost_stored = False
        # Later results filled the reorder buffer behind that lost one: the stream ends with this
        # gap (not an Overrun: its client did not fall behind, and a resume meets the same hole).
        self.hole: Gap | None = None
        # Set while its catch-up waits for a replay consumer (ResultSource.replay_slot): what wakes it.
        self.slot_waiter: asyncio.Future[None] | None = None
        # A freed replay consumer slot kept for its waiting catch-up (ResultSource._replay_slot_freed):
        # counted as held until its replay makes the consumer, so nobody else takes it meanwhile.
        self.slot_reserved = False

    async def next(self, timeout: float) -> FeedItem | None:
        """The next item, or None when ``timeout`` seconds pass without one."""
        deadline = time.monotonic() + timeout
        gap_timeout = self.source.settings.gap_timeout
        inbox = self.inbox
        if self._sub is None and inbox is None and not self.closed:
            attached = await self._attached(timeout)
            if attached is not True:
                return attached
        while True:
            if self.gone is not None:
                return StreamGone(self.gone)
            if self.hole is not None:
                return self.hole
            if self.overrun:
                return Overrun(self.source.settings.stream_buffer_bytes)
            if self.ready:
                return self.ready.popleft()
            if self.order.done:
                contradicted = self.order.contradicted
                return Ended() if contradicted is None else StaleFinal(contradicted, self.order.next_seq)
            now = time.monotonic()
            if self.order.pending or self.lost_stored:
                if self._gap_since is None:
                    self._gap_since = now
                if now - self._gap_since >= gap_timeout:
                    return Gap(self.order.next_seq, len(self.order.pending))
                wait = min(deadline, self._gap_since + gap_timeout) - now
            else:
                self._gap_since = None
                wait = deadline - now
            replay = self.replay
            if replay is not None:  # before the dispatched ones: what was stored before the open
                if replay.asking and inbox is not None and not inbox.queued():
                    # Its probe is out (replay.py, ask): wait as for a result; the answer wakes this
                    # only when there is something stored to read, else drops the replay.
                    if wait <= 0:
                        return None
                    try:
                        await inbox.wait(wait)
                    except nats.errors.Error as exc:  # the connection closed: as the inbox's own wait below
                        return Lost(str(exc) or type(exc).__name__)
                    continue
                try:
                    stored = await replay.next()
                except Refused as exc:  # may not read by subject: an ordered consumer from the start
                    self.source.fall_back(self, exc)
                    inbox = None
                    attached = await self._attached(max(deadline - time.monotonic(), 0.0))
                    if attached is not True:
                        return attached
                    continue
                except (nats.errors.Error, msgspec.DecodeError, ValueError, StoredHistoryUnreadable) as exc:
                    if self.gone is not None:  # its temporary consumer was woken: the stream is gone
                        return StreamGone(self.gone)
                    if self.overrun:  # its consumer was stopped because the client fell behind
                        return Overrun(self.source.settings.stream_buffer_bytes)
                    return Lost(f"cannot read the results stream: {error_text(exc)}")
                if replay.lost:  # a result it did not take expired before it caught up (catch_up)
                    replay.lost, self.lost_stored = False, True
                if replay.waiting:  # no consumer to read with (MSG.GET refused, --max-replay-consumers held)
                    replay.waiting = False
                    now = time.monotonic()
                    if now >= deadline:
                        return None
                    await self.source.replay_slot(self, min(deadline, now + wait) - now)
                    if self.replay is not replay:  # taken meanwhile (_stop_replays): no slot for it
                        self.source.wake_slot_waiter(self)
                    continue
                if stored is None:  # done, or closed meanwhile (close() or an overrun took it)
                    if self.replay is replay:
                        self.replay = None
                    await replay.close()
                else:
                    self._accept_parts(*stored)
                continue
            if inbox is not None:
                try:
                    result = inbox.take()
                    if result is None:
                        if inbox.behind is not None:  # it handed out what it held: on from the stream
                            self.source.catch_up(self)
                            continue
                        if wait <= 0:
                            return None
                        await inbox.wait(wait)
                        continue
                except nats.errors.Error as exc:
                    return Lost(str(exc) or type(exc).__name__)
                self._accept_result(result)
                continue
            if self._sub is None and not self.closed:  # its consumer is made again (ResultSource._carry_on)
                attached = await self._attached(max(wait, 0.0))
                if attached is not True:
                    return attached if self.gone is None else StreamGone(self.gone)
                continue
            # What Subscription.next_msg(timeout) does, without its tasks per message (pending.py)
            try:
                msg = pending.take(self._sub)
                if self.cut is not None and (msg is None or msg.metadata.sequence.stream >= self.cut):
                    self.source.read_on(self)  # what was queued before the drop is out: a new consumer
                    continue
                if msg is None:
                    if wait <= 0:
                        return None
                    await pending.wait(self._sub, wait)
                    continue
                reply = pending.flow_control_due(self._sub)
                if reply is not None:
                    await self.source.nc.publish(reply)
            except nats.errors.Error as exc:
                return Lost(str(exc) or type(exc).__name__)
            self._accept(msg)

    def end(self, reason: str) -> None:
        """Its results stream is gone: :meth:`next` returns :class:`StreamGone` now, also if it waits."""
        self.gone = reason
        self.source.metrics.streams_gone += 1
        if self.inbox is not None:
            self.inbox.wake()
        replay = self.replay
        for sub in (self._sub, replay.sub if replay is not None else None):
            if sub is not None:
                pending.wake(sub)
        self.source.wake_slot_waiter(self)  # its catch-up waiting for a consumer: no more to wait for

    def _replayed(self, replay: Replay) -> None:
        """Its open's probe found nothing stored (replay.py, ``settled``): no replay left. Its task is
        not woken, unless its inbox went behind meanwhile (it catches up now, as it would have after
        awaiting the answer itself)."""
        if self.replay is replay:
            self.replay = None
            if self.inbox is not None and self.inbox.behind is not None:
                self.inbox.wake()

    def _wake_reader(self) -> None:
        """Its open's probe found something, or failed: its task, parked in the inbox, reads it."""
        if self.inbox is not None:
            self.inbox.wake()

    async def _attached(self, timeout: float) -> Lost | None | bool:
        """Wait for the consumer :meth:`ResultSource.open` is creating: True once it exists, None
        when ``timeout`` passed first, :class:`Lost` when it could not be created."""
        if self.attaching is not None and not self.attaching.done():
            done, _ = await asyncio.wait((self.attaching,), timeout=timeout)  # not cancelled with us
            if not done:
                return None
        if self.attach_failed is not None:
            return Lost(self.attach_failed)
        return True

    def _accept(self, msg: Msg) -> None:
        self._accept_parts(msg.subject, msg.headers, msg.data)

    def _accept_parts(self, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
        metrics = self.source.metrics
        try:
            result = result_from_message(self.source.subjects, subject, headers, data)
        except (ContractError, ValueError) as exc:
            metrics.malformed_results += 1
            self.source.limited.log(logging.WARNING, "malformed_result", request_id=self.request_id, error=str(exc))
            return
        self._accept_result(result)

    def _accept_result(self, result: ResultInfo) -> None:
        metrics = self.source.metrics
        if result.request_id != self.request_id:  # cannot happen with one subject per feed; never mix
            metrics.malformed_results += 1
            return
        before, waiting = self.order.duplicates, len(self.order.pending)
        try:
            ready = self.order.push(result)
        except OverflowError:  # more results than SeqOrder keeps wait for a missing seq
            self._overrun()
            return
        metrics.duplicates_dropped += self.order.duplicates - before
        # Each result kept behind a missing seq is charged what it holds (ResultInfo.held_bytes), not
        # its body alone. In order (ready[0] is this result, never charged) nothing is read: the
        # property is a Python call, paid only by results that wait or are let go after a gap.
        if self.order.done:
            self._held_bytes = 0
        elif ready:
            if len(ready) > 1:  # what waited behind this one leaves the buffer
                self._held_bytes -= sum(r.held_bytes for r in ready[1:])
        elif len(self.order.pending) > waiting:  # kept behind a missing seq, not a duplicate
            self._held_bytes += result.held_bytes
        if ready:
            self.lost_stored = False
        self.ready.extend(ready)
        if self._held_bytes > self.source.settings.stream_buffer_bytes:
            self._overrun()

    def _overrun(self) -> None:
        """Give the held results back at once; :meth:`next` reports :class:`Overrun`, or the
        :class:`Gap` they waited behind when that result is known to be gone (``lost_stored``)."""
        if self.lost_stored and self.hole is None and not self.overrun:
            self.hole = Gap(self.order.next_seq, len(self.order.pending))
        self.order.pending.clear()
        self._held_bytes = 0
        if not self.overrun and self.hole is None:
            self.overrun = True
            self.source.metrics.streams_overrun += 1

    async def close(self) -> None:
        """Unsubscribe and free what nats-py still queues for this feed (also after an overrun).
        A consumer still being created is unsubscribed by its creator once it exists."""
        rest = self.close_now()
        if rest is not None:
            await rest

    def close_now(self) -> Coroutine[Any, Any, None] | None:
        """:meth:`close`, done at once where nothing needs a round trip (a dispatched feed with no
        replay left: every core open, and a JetStream one whose stored results were read): None.
        Else the close as a coroutine to await. An SSE stream's end then needs no shielded cancel
        scope and no coroutines (docs/benchmarks.md, "SSE lifecycle")."""
        # Its place in the queue for a replay consumer, or the slot kept for it, goes: also on the
        # fast path (a replay taken by _stop_replays can still have queued it before it closed).
        self.source.wake_slot_waiter(self)
        replay = self.replay
        if replay is not None and replay.close_now():  # nothing to drop (its probe, if out, forgotten)
            self.replay = None
        if self.replay is not None or self._sub is not None:
            return self._close()
        self.closed = True
        self.source.forget(self)
        if self.inbox is not None:
            self.inbox.clear()
        return None

    async def _close(self) -> None:
        self.closed = True
        replay, self.replay = self.replay, None
        if replay is not None:
            await replay.close()  # its temporary consumer, if a late attach had one
        self.source.forget(self)
        if self.inbox is not None:
            self.inbox.clear()
        sub, self._sub = self._sub, None
        if sub is None:
            return
        try:
            if self.source.nc is not None and not self.source.nc.is_closed:
                await sub.unsubscribe()
        except (nats.errors.Error, OSError) as exc:  # connection gone: the server forgot it anyway
            log_event(log, logging.DEBUG, "unsubscribe_failed", request_id=self.request_id, error=error_text(exc))
        finally:
            pending.drop(sub)
