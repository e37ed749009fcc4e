"""Durable input: JetStream pull consumers in, acknowledged results out, acks only after both.

The guarantees (``docs/operations.md`` has the full argument):

- **No input is lost.** A chunk is acknowledged only when everything it contributed to is stored:
  its own result's PubAck (decode and agg chunks), the request's final result (prefill chunks,
  which a decode chunk may need until then), or at once when it contributes to nothing
  (duplicates, late chunks) *and* no result of its request is still waiting for a PubAck. Chunks
  held longer than a moment get ``+WPI`` (in progress) before ``ack_wait`` runs out.
- **Results are stored once, in order.** Results carry ``Nats-Msg-Id: <request_id>.<seq>``. One
  result per request is in flight at a time (the next leaves when the previous one's PubAck is
  in), so a request's stored results are always ``0..k`` with no gap, whatever fails in between;
  a failed publish is retried with the same id until it is stored. A replay after a crash is
  collapsed by the stream's duplicate window and, beyond it, by the readers' seq check.
- **Recovery is exact.** An instance that sees a chunk of a request it does not know, when that
  chunk is not the first delivery of the request's first output chunk, reads the last stored
  result of ``P.results.<request_id>`` (a leader read, never a possibly stale follower) and resumes
  the request after it. In steady state that happens once per P/D request whose prefill arrives
  first and for out-of-order first chunks; after a failover, for the requests that moved.

Partitions (:mod:`streamproc.partitions`) are shared between instances through leases
(:mod:`streamproc.leases`). Each owned partition has its own inbox subscription and a credit-based
pull loop: a pull asks for ``fetch_batch`` messages, a new pull goes out when half are consumed,
and a watchdog re-issues pulls that the server forgot (server restart: nats-io/nats.py#504),
detected by missing idle heartbeats, by a reconnect, or by the pull's expiry.
"""

from __future__ import annotations

import logging
import os
from collections import deque
import secrets
import socket
from typing import Any, Awaitable, Callable

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import StorageType
from nats.js.errors import NotFoundError

from ..config import Settings
from ..core.correlator import Decision, Notice
from .input import Pipeline
from .leases import LeaseChange, LeaseTable
from .subscription import handled_all
from ..core.partitions import PartitionScheme
from .streams import (
    CHUNKS_STREAM,
    RESULTS_STREAM,
    ChunkStreamSpec,
    ensure_chunk_stream,
    ensure_consumer,
    ensure_results_stream,
    find_stream,
    partition_consumer_config,
    partition_consumer_name,
)
from ..core.wire import FINAL, SEQ, ContractError, Result, Role, result_headers

log = logging.getLogger("streamproc.durable")

PULL_EXPIRES = 10.0  # seconds a pull request lives on the server
HEARTBEAT = 1.0  # idle heartbeat the server sends for a waiting pull request
LOST_PULL_AFTER = 3 * HEARTBEAT  # no message and no heartbeat for this long: the server forgot our pulls
WATCHDOG_EVERY = 0.25
PUBLISH_TIMEOUT = 2.0  # first PubAck wait before a result is sent again (then doubling, up to the max)
MAX_PUBLISH_TIMEOUT = 10.0
RETRY_AFTER_ERROR = 0.5  # seconds before a result the server refused is sent again
LOOKUP_TIMEOUT = 2.0
HANDOVER_TIMEOUT = 2.0  # a released partition's results may take this long to be stored before hand-over

_ACK = b""  # an empty reply is a JetStream ack
_NAK = b"-NAK"
_WPI = b"+WPI"
_PREFILL = Role.PREFILL

Notify = Callable[[Notice], None]


class DurableStats(msgspec.Struct):
    """Counters of the durable input (merged into ``Processor.snapshot()``)."""

    partitions: int = 0  # gauge: partitions this instance serves now
    members: int = 0  # gauge: live instances sharing the partitions
    pulls: int = 0
    lost_pulls: int = 0  # pulls re-issued because the server stopped answering them
    consumer_repairs: int = 0
    acks: int = 0
    naks: int = 0
    in_progress: int = 0  # +WPI sent for chunks held past a third of ack_wait
    redelivered: int = 0  # messages delivered more than once
    recoveries: int = 0  # last-result lookups for requests this instance did not know
    resumed: int = 0  # lookups that found stored results (the request moved here)
    duplicate_results: int = 0  # PubAcks saying the result was already stored
    publish_retries: int = 0
    publish_errors: int = 0
    leases_acquired: int = 0
    leases_released: int = 0
    leases_lost: int = 0


def new_instance_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


# --------------------------------------------------------------------------------- publisher

class _Outgoing:
    """One result on its way to the results stream, with the input tokens its PubAck releases."""

    __slots__ = ("request_id", "subject", "body", "headers", "reply", "settles", "sent_at", "timeout",
                 "abandoned")

    def __init__(self, request_id: str, subject: str, body: bytes, headers: dict, reply: str,
                 settles: list) -> None:
        self.request_id = request_id
        self.subject = subject
        self.body = body
        self.headers = headers
        self.reply = reply
        self.settles = settles
        self.sent_at = 0.0
        self.timeout = PUBLISH_TIMEOUT
        self.abandoned = False


class ResultPublisher:
    """Stores results through JetStream and acknowledges their inputs once they are stored.

    ``take`` is synchronous, so the order of decisions is the order of each request's queue no
    matter which task (message handler or timer) produced them; ``pump`` does the I/O.
    """

    def __init__(self, nc: NatsClient, results_head: str, stats: DurableStats, notify: Notify,
                 clock: Callable[[], float]) -> None:
        self._nc = nc
        self._head = results_head
        self._stats = stats
        self._notify = notify
        self._clock = clock
        self._queues: dict[str, list[_Outgoing]] = {}  # per request; [0] is in flight
        self._inflight: dict[str, _Outgoing] = {}  # by reply token
        self._send: deque[_Outgoing] = deque()
        self._control: list[tuple[str, bytes]] = []  # acks, naks, in-progress: (reply subject, payload)
        self._reply_prefix = ""
        self._cut = 0
        self._next = 0
        self._sub: Subscription | None = None
        self.closed = False
        self._idle = anyio.Event()
        self._idle.set()

    async def start(self) -> None:
        self._reply_prefix = self._nc.new_inbox() + "."
        self._cut = len(self._reply_prefix)
        self._sub = await self._nc.subscribe(self._reply_prefix + "*", cb=self._on_reply,
                                             pending_msgs_limit=-1, pending_bytes_limit=-1)

    async def stop(self) -> None:
        self.closed = True
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    @property
    def pending(self) -> int:
        """Results not stored yet."""
        return sum(len(q) for q in self._queues.values())

    def tokens(self):
        """Input tokens waiting for a PubAck (for in-progress acks)."""
        for queue in self._queues.values():
            for o in queue:
                yield from o.settles

    # ------------------------------------------------------------------ decisions in

    def take(self, decisions: list[Decision], request_id: str | None) -> None:
        """Queue results, release or attach settled tokens, log notices. ``request_id`` owns the Settles."""
        queues = self._queues
        for d in decisions:
            cls = d.__class__
            if cls is Result:
                rid = d.request_id
                self._next += 1
                o = _Outgoing(rid, self._head + rid, d.body, result_headers(d),
                              self._reply_prefix + str(self._next), [t for t in d.settles if t is not None])
                queue = queues.get(rid)
                if queue is None:
                    queues[rid] = [o]
                    self._send.append(o)
                    self._idle = anyio.Event() if self._idle.is_set() else self._idle
                else:
                    queue.append(o)
            elif cls is Notice:
                self._notify(d)
            else:  # Settle: contributes to nothing, but must not overtake a result still in flight
                queue = queues.get(request_id) if request_id is not None else None
                if queue:
                    queue[-1].settles.extend(t for t in d.tokens if t is not None)
                else:
                    self.ack(d.tokens)

    def ack(self, tokens) -> None:
        control = self._control
        for t in tokens:
            if t is not None:
                control.append((t.reply, _ACK))
                self._stats.acks += 1

    def nak(self, tokens, delay: float = 0.0) -> None:
        payload = _NAK if delay <= 0 else _NAK + b' {"delay": %d}' % int(delay * 1e9)
        for t in tokens:
            if t is not None and t.reply:
                self._control.append((t.reply, payload))
                self._stats.naks += 1

    def in_progress(self, tokens) -> None:
        for t in tokens:
            self._control.append((t.reply, _WPI))
            self._stats.in_progress += 1

    def abandon(self, belongs: Callable[[str], bool]) -> tuple[list, list[str]]:
        """Drop the queued results of matching requests; return every token they would have acked,
        and the ids of those requests (their results may not be stored).

        Used when a partition moves to another instance: its tokens are NAKed so the new owner gets
        them at once and recovers from what is stored. A result already sent may still be stored
        (the new owner then collapses its own copy through the Msg-Id); it acks nothing any more.
        """
        tokens: list = []
        dropped = [rid for rid in self._queues if belongs(rid)]
        for rid in dropped:
            for o in self._queues.pop(rid):
                tokens.extend(o.settles)
                o.settles = []
                o.abandoned = True
        self._send = deque(o for o in self._send if not o.abandoned)
        if not self._queues:
            self._idle.set()
        return tokens, dropped

    async def wait_idle(self, timeout: float, belongs: Callable[[str], bool] | None = None) -> bool:
        """Wait until every queued result (of matching requests) is stored; False on timeout."""
        with anyio.move_on_after(timeout):
            while True:
                if belongs is None:
                    if not self._queues:
                        return True
                    await self._idle.wait()
                elif not any(belongs(rid) for rid in self._queues):
                    return True
                else:
                    await anyio.sleep(0.01)
        return False

    # ------------------------------------------------------------------------------ I/O

    async def pump(self) -> None:
        """Send what is ready: results first (their order per request is already fixed), then acks."""
        publish = self._nc.publish
        send = self._send
        if send:
            inflight = self._inflight
            now = self._clock()
            while send:
                o = send.popleft()
                o.sent_at = now
                inflight[o.reply[self._cut:]] = o
                try:
                    await publish(o.subject, o.body, o.reply, o.headers)
                except Exception as exc:  # disconnected with a full buffer, closed: the sweep resends
                    o.sent_at = -1e18
                    self._failed(o, exc)
        control = self._control
        while control:
            subject, payload = control.pop()
            try:
                await publish(subject, payload)
            except Exception as exc:  # a lost ack means a redelivery, which is safe
                log.debug("control publish failed: %s", exc)

    async def _on_reply(self, msg: Msg) -> None:
        o = self._inflight.pop(msg.subject[self._cut:], None)
        if o is None or o.abandoned:
            return
        data = msg.data
        if not data or b'"error":' in data:  # 503 no responders (stream unavailable) or an API error
            self._stats.publish_errors += 1
            if self._stats.publish_errors & (self._stats.publish_errors - 1) == 0:
                status = (msg.headers or {}).get("Status", "")
                log.warning("event=result_not_stored request_id=%s status=%s detail=%s retry_in=%.1fs "
                            "errors_total=%d", o.request_id, status, data[:200].decode(errors="replace"),
                            RETRY_AFTER_ERROR, self._stats.publish_errors)
            o.sent_at = self._clock() + RETRY_AFTER_ERROR - o.timeout  # the sweep resends it then
            self._inflight[o.reply[self._cut:]] = o
            return
        if b'"duplicate":true' in data:
            self._stats.duplicate_results += 1
        queue = self._queues.get(o.request_id)
        if o.settles:
            self.ack(o.settles)
        if queue:
            del queue[0]
            if queue:
                self._send.append(queue[0])
            else:
                del self._queues[o.request_id]
                if not self._queues:
                    self._idle.set()
        await self.pump()

    def _failed(self, o: _Outgoing, exc: Exception) -> None:
        self._stats.publish_errors += 1
        if self._stats.publish_errors & (self._stats.publish_errors - 1) == 0:
            log.warning("event=result_publish_failed request_id=%s error=%s errors_total=%d", o.request_id,
                        f"{type(exc).__name__}: {exc}", self._stats.publish_errors)

    def sweep(self, now: float, reconnected: bool) -> None:
        """Send again every result whose PubAck is overdue (or all in flight after a reconnect)."""
        again = [o for o in self._inflight.values() if reconnected or now - o.sent_at > o.timeout]
        for o in again:
            del self._inflight[o.reply[self._cut:]]
            if o.abandoned:
                continue
            o.timeout = min(o.timeout * 2, MAX_PUBLISH_TIMEOUT)
            self._stats.publish_retries += 1
            self._send.append(o)


# ---------------------------------------------------------------------------------- partitions

class _Partition:
    """One owned partition: its consumer, inbox subscription and pull credit."""

    __slots__ = ("n", "consumer", "filter", "cut", "inbox", "sub", "requested", "expires_at", "last_seen",
                 "retry_at", "misses", "active", "pull_subject")

    def __init__(self, n: int, consumer: str, filter_subject: str, cut: int, stream: str) -> None:
        self.n = n
        self.consumer = consumer
        self.filter = filter_subject
        self.cut = cut  # stored subject -> chunk subject: drop this many leading characters
        self.inbox = ""
        self.sub: Subscription | None = None
        self.requested = 0  # messages asked for and not delivered yet
        self.expires_at = 0.0
        self.last_seen = 0.0
        self.retry_at = 0.0
        self.misses = 0
        self.active = False
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def delivery_count(reply: str) -> int:
    """How often JetStream delivered this message (from its ack subject, v1 or v2 format)."""
    tokens = reply.split(".")
    try:
        return int(tokens[4] if len(tokens) == 9 else tokens[6])
    except (IndexError, ValueError):
        return 1


class DurableInput:
    """The durable input of :class:`~streamproc.processor.Processor` (``--mode durable``)."""

    def __init__(self, nc: NatsClient, settings: Settings, pipeline: Pipeline, *,
                 instance: str | None = None) -> None:
        self.nc = nc
        self.settings = settings
        self.pipeline = pipeline
        self.correlator = pipeline.correlator
        clock, notify = pipeline.clock, pipeline.notify
        self.instance = instance or new_instance_id()
        self.stats = DurableStats()
        self.scheme = PartitionScheme(settings.subjects, settings.partitions)
        self._clock = clock
        self._notify = notify
        self._jsm = nc.jsm(timeout=LOOKUP_TIMEOUT)
        self._storage = StorageType(settings.stream_storage)
        self.chunks_stream = ""
        self.results_stream = ""
        self.leases: LeaseTable | None = None
        self.publisher = ResultPublisher(nc, settings.subjects.result(""), self.stats, notify, clock)
        self._partitions: dict[int, _Partition] = {}
        self._parse = pipeline.parse
        self._chunks_head = f"{settings.prefix}.chunks."
        # Outstanding credit reaches 1.5 batches; kept under nats-py's queue limit it can never make
        # the client drop deliveries (bytes can still overflow: the dropped() hook accounts for that).
        self._batch = max(1, min(settings.fetch_batch, settings.pending_msgs_limit * 2 // 3))
        self._low = self._batch // 2
        self._pull_body = msgspec.json.encode({
            "batch": self._batch, "expires": int(PULL_EXPIRES * 1e9), "idle_heartbeat": int(HEARTBEAT * 1e9)})
        self._tasks: anyio.abc.TaskGroup | None = None
        self._reconnects = 0
        self._progress_seen: set[int] = set()
        self._next_progress = 0.0
        self._lease_lock = anyio.Lock()

    def owns(self, request_id: str) -> bool:
        """Whether this instance holds the lease of the request's partition (it alone answers for it)."""
        return self.scheme.of(request_id) in self._partitions

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        s = self.settings
        js = self.nc.jetstream(timeout=10)
        subjects = s.subjects
        self.results_stream = await find_stream(js, subjects.all_results) or RESULTS_STREAM
        await ensure_results_stream(js, subjects, name=self.results_stream, max_age=s.results_max_age,
                                    duplicate_window=s.duplicate_window, storage=self._storage,
                                    replicas=s.stream_replicas)
        self.chunks_stream = await find_stream(js, self.scheme.source) or CHUNKS_STREAM
        await ensure_chunk_stream(js, ChunkStreamSpec(
            self.chunks_stream, self.scheme, s.chunks_max_age, s.duplicate_window, self._storage,
            s.stream_replicas, s.chunks_max_bytes))
        if self._batch < s.fetch_batch:
            log.warning("event=fetch_batch_reduced fetch_batch=%d used=%d detail=%s", s.fetch_batch,
                        self._batch, "pending_msgs_limit is too small for the pull credit")
        await self.publisher.start()
        self.leases = LeaseTable(self.nc, f"{self.chunks_stream}_LEASES", s.partitions, self.instance,
                                 s.lease_ttl,
                                 replicas=s.stream_replicas, storage=self._storage, clock=self._clock)
        await self.leases.open()
        self._reconnects = self.nc.stats["reconnects"]
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            await self._rebalance()
            self._tasks.start_soon(self._lease_loop)
            self._tasks.start_soon(self._watchdog)
        except BaseException:
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)
            raise
        log.info("event=durable_started instance=%s chunks_stream=%s results_stream=%s partitions=%s "
                 "owned=%s",
                 self.instance, self.chunks_stream, self.results_stream, s.partitions,
                 ",".join(map(str, sorted(self._partitions))) or "-")

    async def stop(self, timeout: float) -> None:
        """Hand everything over: stop reading, let results finish storing, NAK the rest, release leases."""
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            tasks.cancel_scope.cancel()
            await tasks.__aexit__(None, None, None)
        if self.nc.is_closed:
            return
        with anyio.move_on_after(timeout):
            for part in list(self._partitions.values()):
                await self._close_partition(part)
            if not await self.publisher.wait_idle(timeout):
                log.warning("event=stop_with_unstored_results results=%d", self.publisher.pending)
        self._hand_over(lambda rid: True)
        await self.publisher.pump()
        with anyio.move_on_after(timeout):
            if self.leases is not None:
                await self.leases.leave()
            await self.nc.flush()
        await self.publisher.stop()
        self.stats.partitions = 0

    async def dispatch(self, decisions: list[Decision]) -> None:
        """Results decided by the timer (timeouts) take the same acknowledged path."""
        if self.publisher.closed:
            return
        self.publisher.take(decisions, None)
        await self.publisher.pump()

    async def caught_up(self) -> None:
        """Return once every chunk delivered to any owned partition at the call has been handled
        (a control request must not overtake them)."""
        for part in list(self._partitions.values()):
            sub = part.sub
            await handled_all(sub, lambda: part.sub is sub)

    def dropped(self, sub: Subscription | None, reply: str | None) -> None:
        """nats-py dropped a delivered message (slow consumer): it used up pull credit, and comes back
        after ``ack_wait``. Without this the credit would stay spent until the pull expires."""
        if not reply:
            return  # a status message: no credit
        for part in self._partitions.values():
            if part.sub is sub:
                part.requested = max(0, part.requested - 1)
                return

    # -------------------------------------------------------------------------- partitions

    async def _rebalance(self) -> None:
        assert self.leases is not None
        async with self._lease_lock:
            change: LeaseChange = await self.leases.step()
            self.stats.members = self.leases.members
            for n in change.lost:
                self.stats.leases_lost += 1
                log.warning("event=lease_lost partition=%d instance=%s", n, self.instance)
                await self._lose(n)
            for n in change.surplus:
                self.stats.leases_released += 1
                log.info("event=lease_released partition=%d instance=%s members=%d", n, self.instance,
                         self.leases.members)
                await self._lose(n, graceful=True)
                await self.leases.release(n)
            for n in change.acquired:
                try:
                    await self._open(n)
                except Exception as exc:  # e.g. the consumer's stream is electing a leader: try again later
                    log.warning("event=partition_open_failed partition=%d error=%s", n,
                                f"{type(exc).__name__}: {exc}")
                    await self._lose(n)
                    await self.leases.release(n)
                    continue
                self.stats.leases_acquired += 1
                log.info("event=lease_acquired partition=%d instance=%s members=%d", n, self.instance,
                         self.leases.members)
            self.stats.partitions = len(self._partitions)

    async def _lease_loop(self) -> None:
        interval = self.settings.lease_ttl / 3
        while True:
            await anyio.sleep(interval)
            try:
                await self._rebalance()
            except Exception as exc:  # never let lease trouble kill the processor; expiry is checked apart
                log.warning("event=lease_step_failed error=%s", f"{type(exc).__name__}: {exc}")

    async def _open(self, n: int) -> None:
        part = _Partition(n, partition_consumer_name(n), self.scheme.filter(n), len(self.scheme.head(n)),
                          self.chunks_stream)
        await self._ensure_consumer(part)
        part.inbox = self.nc.new_inbox()
        part.sub = await self.nc.subscribe(part.inbox, cb=self._handler(part),
                                           pending_msgs_limit=self.settings.pending_msgs_limit,
                                           pending_bytes_limit=self.settings.pending_bytes_limit)
        part.active = True
        part.last_seen = self._clock()
        self._partitions[n] = part
        await self._pull(part)

    async def _ensure_consumer(self, part: _Partition) -> None:
        s = self.settings
        config = partition_consumer_config(part.consumer, part.filter, ack_wait=s.ack_wait,
                                           max_ack_pending=s.max_ack_pending)
        await ensure_consumer(self.nc.jetstream(timeout=10), self.chunks_stream, config)

    async def _lose(self, n: int, graceful: bool = False) -> None:
        """Stop serving partition ``n``: later arrivals are NAKed, held chunks NAKed, state dropped."""
        part = self._partitions.get(n)
        if part is not None:
            await self._close_partition(part)
        scheme = self.scheme

        def belongs(rid: str) -> bool:
            return scheme.of(rid) == n

        if graceful:  # let results already decided be stored, so the next owner's lookup sees them
            await self.publisher.wait_idle(HANDOVER_TIMEOUT, belongs)
        self._hand_over(belongs)
        await self.publisher.pump()

    async def _close_partition(self, part: _Partition) -> None:
        part.active = False
        self._partitions.pop(part.n, None)
        sub, part.sub = part.sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                # Unsubscribing makes the server drop our waiting pulls; what was already
                # delivered runs through the handler, which NAKs it for the next owner.
                with anyio.move_on_after(5):
                    await sub.drain()
            except nats.errors.Error:
                pass

    def _hand_over(self, belongs: Callable[[str], bool]) -> None:
        # Requests whose results were given up before they were stored must be forgotten even when
        # the correlator holds them as finished: else, should the partition come back here, their
        # redelivered chunks would count as late (and be acked) instead of being recovered.
        tokens, unstored = self.publisher.abandon(belongs)
        tokens.extend(self.correlator.abandon(belongs, unstored))
        self.publisher.nak(tokens)

    # ------------------------------------------------------------------------------- pulls

    async def _pull(self, part: _Partition) -> None:
        part.requested += self._batch
        part.expires_at = self._clock() + PULL_EXPIRES
        self.stats.pulls += 1
        try:
            await self.nc.publish(part.pull_subject, self._pull_body, part.inbox)
        except Exception as exc:
            part.requested -= self._batch
            part.retry_at = self._clock() + RETRY_AFTER_ERROR
            log.debug("pull for partition %d failed: %s", part.n, exc)

    def _on_status(self, part: _Partition, msg: Msg) -> None:
        headers = msg.headers or {}
        code = headers.get("Status", "")
        part.last_seen = self._clock()
        if code == "100":  # idle heartbeat
            return
        pending = headers.get("Nats-Pending-Messages")
        description = headers.get("Description", "")
        if code in ("408", "409") and pending is not None and pending.isdigit():
            part.requested = max(0, part.requested - int(pending))  # a pull ended unfilled
            if code == "408":
                return
        else:
            part.requested = 0
            part.retry_at = part.last_seen + RETRY_AFTER_ERROR
        lowered = description.lower()
        if "consumer deleted" in lowered or code == "503" or "no responders" in lowered:
            part.misses += 1  # the watchdog repairs the consumer
        if code not in ("408", "404"):
            log.info("event=pull_status partition=%d status=%s description=%s", part.n, code, description)

    async def _watchdog(self) -> None:
        """Keep every partition's pulls alive; resend overdue results; extend held chunks' ack deadlines.

        A chunk gets its first +WPI at the second progress round after it was first seen held, i.e.
        within ``2 * (ack_wait / 4 + interval) <= 3/4 * ack_wait`` of delivery: before redelivery.
        """
        interval = min(WATCHDOG_EVERY, self.settings.ack_wait / 8)
        progress_every = self.settings.ack_wait / 4
        while True:
            await anyio.sleep(interval)
            try:
                await self._watch(progress_every)
            except Exception as exc:
                log.warning("event=watchdog_failed error=%s", f"{type(exc).__name__}: {exc}")

    async def _watch(self, progress_every: float) -> None:
        if not self.nc.is_connected:
            return  # nothing can be sent; a reconnect is noticed on the first round after it
        now = self._clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected = reconnects != self._reconnects
        self._reconnects = reconnects
        if self.leases is not None:
            for n in self.leases.expired(now):
                self.stats.leases_lost += 1
                log.warning("event=lease_expired partition=%d instance=%s", n, self.instance)
                await self._lose(n)
        for part in list(self._partitions.values()):
            if not part.active:
                continue
            lost = part.requested > 0 and now - part.last_seen > LOST_PULL_AFTER
            if reconnected or lost or now >= part.expires_at:
                if lost:
                    self.stats.lost_pulls += 1
                    part.misses += 1
                    log.info("event=pull_lost partition=%d silent_for=%.1fs", part.n, now - part.last_seen)
                part.requested = 0
                part.last_seen = now
            if part.misses >= 2:
                part.misses = 0
                self.stats.consumer_repairs += 1
                try:
                    await self._ensure_consumer(part)
                except Exception as exc:
                    log.warning("event=consumer_repair_failed partition=%d error=%s", part.n, exc)
                    continue
            if part.requested <= self._low and now >= part.retry_at:
                await self._pull(part)
        self.publisher.sweep(now, reconnected)
        if now >= self._next_progress:
            self._next_progress = now + progress_every
            self._extend_held()
        await self.publisher.pump()

    def _extend_held(self) -> None:
        """+WPI for every chunk that was already held at the previous round (a third of ack_wait ago)."""
        current: dict[int, Any] = {}
        for t in self.correlator.unsettled():
            current[id(t)] = t
        for t in self.publisher.tokens():
            current[id(t)] = t
        seen = self._progress_seen
        self.publisher.in_progress([t for key, t in current.items() if key in seen and t.reply])
        self._progress_seen = set(current)

    # ----------------------------------------------------------------------------- hot path

    def _handler(self, part: _Partition) -> Callable[[Msg], Awaitable[None]]:
        clock = self._clock
        parse = self._parse
        head = self._chunks_head
        cut = part.cut
        correlator = self.correlator
        receive = correlator.receive
        knows = correlator.knows
        publisher = self.publisher
        take = publisher.take
        pump = publisher.pump
        low = self._low

        async def on_message(msg: Msg) -> None:
            reply = msg.reply
            if not reply:
                self._on_status(part, msg)
                if part.active and part.requested <= low and part.last_seen >= part.retry_at:
                    await self._pull(part)
                return
            if not part.active:  # partition handed over: the next owner gets it at once
                publisher.nak((msg,))
                await pump()
                return
            now = clock()
            part.last_seen = now
            part.requested -= 1
            if part.requested <= low:
                await self._pull(part)
            try:
                chunk = parse(head + msg.subject[cut:], msg.headers, msg.data, msg)
            except ContractError as exc:
                take(self.pipeline.contract_error(exc, msg, acknowledged=True), exc.request_id)
                await pump()
                return
            rid = chunk.request_id
            if not knows(rid) and (chunk.seq or chunk.role is _PREFILL or delivery_count(reply) > 1):
                if not await self._recover(rid, chunk.format, msg, now):
                    await pump()
                    return
            take(receive(chunk, now), rid)
            await pump()

        return on_message

    async def _recover(self, rid: str, format: str | None, msg: Msg, now: float) -> bool:
        """Resume after the last stored result of ``rid``; False (and a delayed NAK) if it cannot be read."""
        self.stats.recoveries += 1
        if delivery_count(msg.reply) > 1:
            self.stats.redelivered += 1
        try:
            stored = await self._jsm.get_last_msg(self.results_stream, self.settings.subjects.result(rid))
        except NotFoundError:
            return True  # nothing stored: every chunk of it is still unacknowledged, start afresh
        except Exception as exc:
            log.warning("event=recovery_lookup_failed request_id=%s error=%s retry_in=1s", rid,
                        f"{type(exc).__name__}: {exc}")
            self.publisher.nak((msg,), delay=1.0)
            return False
        headers = stored.headers or {}
        seq = headers.get(SEQ, "")
        if not seq.isdigit():
            return True
        final = headers.get(FINAL) == "true"
        self.correlator.resume(rid, int(seq) + 1, final, now, format)
        self.stats.resumed += 1
        log.info("event=request_resumed request_id=%s next_seq=%d final=%s", rid, int(seq) + 1, final)
        return True

