"""Where the edge reads results: :class:`ResultSource`, its one NATS connection and what reads on it.

It opens a :class:`~.feed.ResultFeed` per HTTP stream (:mod:`.feed`: the feed, and the records
that end a stream) and keeps its subscriptions and consumers, the recent ring's subscription
(what the ring remembers: :mod:`.recent`), the watch of the results stream, and the replay
consumers' slots.

With ``--recent`` > 0 the recent ring's subscription to every result hands each result to the
feeds open on its subject (:mod:`.fanout`): a core subscription (live only), or, when a JetStream
stream captures ``P.results.>``, one ordered consumer, each feed first reading from the stream what
was stored before it registered (:mod:`.replay`), so a client that attaches late loses nothing.
An edge user that may not read stored results by subject (:mod:`.msg_get`) has that history read
with consumers alone, in the read budget (:meth:`ResultSource._open_dispatched`).
With ``--recent 0`` each feed has its own: an ordered consumer of the subject from past the
stream's last sequence at the open, what is stored before it read first as a replay's (in the read
budget: :meth:`ResultSource._read_stored`), or a core subscription (live only). Either way :class:`SeqOrder` hands them out
in seq order, each once, and never mixes requests: a feed reads exactly one request's subject.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import functools
import logging
import time
from typing import Callable

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamInfo
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from ..logs import LogLimiter, error_text, log_event
from ..nats import connection
from ..nats.replay_pull import REPLAY_EDGE_CONSUMER_IDLE
from ..nats.streams import ensure_results_stream, find_results_stream
from ..core.reorder import MAX_PENDING_RESULTS, SeqOrder
from ..core.errors import StartupError
from ..core.wire import Subjects
from . import pending
from .barrier import PongBarrier
from .fanout import Fanout
from .feed import FeedMode, ResultFeed
from .msg_get import ApiPermission, Refused, State
from .probes import Probes
from .recent import RecentRequests
from .read_budget import ReadGate
from .replay import PULLS_LIMITED, Replay, stream_seq, subject_split
from .lookup import StreamLookup
from .metrics import EdgeMetrics
from .settings import EdgeSettings

log = logging.getLogger("streamproc.edge")

RECENT_PENDING_MSGS = 65_536
# Seconds a JetStream feed's ordered consumer outlives its subscription. nats-py's unsubscribe does
# not delete it, and nats-server keeps an ephemeral consumer without interest for 5 s by default:
# at 50 opens/s that was ~250 idle consumers on the results stream (each stored result matched
# against every one's filter), and a burst of 1,000 opens within 5 s got "maximum consumers limit
# reached" (benchmarks/edge_open.py --mode jetstream --burst 50). While the edge is connected its
# subscription is the interest, so this only bounds how long a consumer outlives a reconnect; then
# nats-py's ordered consumer creates a new one from the last sequence it delivered.
CONSUMER_LINGER = 1.0
REPLAY_TIMEOUT = 5.0  # seconds for one stored result to come back from the stream (replay.py)
# Seconds a replay's consumer still counts against --max-replay-consumers once the replay dropped it:
# nats-server deletes it CONSUMER_LINGER after its unsubscribe (which follows the drop at once).
REPLAY_SLOT_LINGER = CONSUMER_LINGER + 0.5
# The same for a pull consumer whose delete failed (lost answer, refused): nats-server keeps it until
# REPLAY_EDGE_CONSUMER_IDLE without a pull. Counted 1.5 s before, while the server could hold more
# than --max-replay-consumers such consumers for the 60 s threshold they then had.
REPLAY_PULL_SLOT_LINGER = REPLAY_EDGE_CONSUMER_IDLE + 0.5
# Seconds between the watch's checks of the results stream the ring reads (one STREAM.INFO each):
# how long a stream reading a deleted results stream waits for its error event, and how long
# results stored in a recreated one wait before the ring reads them (ResultSource._check_results_stream).
STREAM_CHECK = 1.0
RING_RESET_GRACE = 5.0  # seconds a ring consumer found deleted is left to nats-py's remake before asking again


def jetstream_hint(exc: BaseException) -> str:
    """What a failed JetStream API request at start-up most likely means."""
    if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError)):
        return ("a timeout here usually means nats-server refused the edge user a $JS.API subject (the "
                "edge's permissions: docs/security.md; the server's log names it)")
    if isinstance(exc, (nats.errors.NoRespondersError, ServiceUnavailableError)):
        return ("nobody answers the JetStream API: JetStream is not enabled on nats-server (or for the "
                "edge's account); enable it, or start the edge without --ensure-results-stream (it then "
                "serves live results only)")
    return "the server's answer above says why"


def _unsubscribed(task: asyncio.Task) -> None:
    """A consumer's unsubscribe ended (fall_back): its failure (a closed connection) is no news."""
    if not task.cancelled():
        task.exception()


def core_subscription(sub):
    """The nats-py Subscription a SlowConsumerError names: a JetStream PushSubscription wraps one
    (nats.js.client.JetStreamContext.PushSubscription.__init__ keeps it as ``_sub``)."""
    return sub._sub if isinstance(sub, JetStreamContext.PushSubscription) else sub


class ResultSource:
    """The edge's NATS side: connection, health, the recent-requests ring, and per-request feeds."""

    def __init__(self, settings: EdgeSettings, metrics: EdgeMetrics) -> None:
        self.settings = settings
        self.subjects: Subjects = settings.subjects
        self.metrics = metrics
        self.recent = RecentRequests(settings.recent)
        self.nc: NatsClient | None = None
        self.barrier: PongBarrier | None = None  # set on connect
        self.recent_mode: FeedMode | None = None  # how the recent ring reads (None: --recent 0)
        self._closing = False
        # nats-py subscription -> its feed, to end the feed whose client fell behind (SlowConsumerError)
        self._feeds: dict[int, ResultFeed] = {}
        # a late attach's temporary consumer -> its feed, to pause that replay instead (replay.py)
        self._replays: dict[int, ResultFeed] = {}
        # Stored-result bytes all replays together have asked of nats-server and not yet received
        # (read_budget.py): well under the server's max_pending for the edge's one connection.
        self.read_gate = ReadGate(settings.replay_read_budget)
        self._stored_max = 0  # the results stream's max_msg_size (0: none; the server's max_payload bounds it)
        # Consumers allowed by _may_replay_with_consumer still being created: counted against
        # --max-replay-consumers too (50 catch-ups at once each saw none yet and made 39 at once).
        self._replays_creating = 0
        # Consumers replays dropped that nats-server still keeps (REPLAY_SLOT_LINGER, REPLAY_PULL_SLOT_LINGER): counted too.
        self._replays_lingering = 0
        # Catch-ups waiting for a replay consumer (_may_replay_with_consumer), first come first: a
        # freed slot is kept for the first waiting in next() for it (slot_reserved) and wakes it
        # (replay_slot). Each keeps its place until it has the slot, also between its client's
        # keep-alives and while its handler writes (then a slot goes to the next one in next(), not
        # kept idle for it); free slots are the queue's, so a replay that may read by subject does
        # while any waits (a woken catch-up lost the slot to such late attaches, which ask at each
        # result, and went back to the end of the queue).
        self._slot_waiters: collections.OrderedDict[ResultFeed, None] = collections.OrderedDict()
        self._slots_reserved = 0  # freed slots kept for catch-ups that waited, counted as held
        # Lines any client or results publisher can cause at will (per request or per result) are
        # rate limited per event name, as in the processor; flushed every interval so the suppressed
        # counts are reported when a flood stops.
        self.limited = LogLimiter(log)
        self._flush_task: asyncio.Task | None = None
        self.streams = StreamLookup(self.subjects)  # the results stream, asked once per ttl (lookup.py)
        self._attaching: set[asyncio.Task] = set()  # consumers being created (open)
        self.fanout: Fanout | None = None  # the recent ring's subscription feeds the streams (fanout.py)
        self._told_late_stream = False
        self._closing_replays: set[asyncio.Task] = set()
        # stream -> its creation time, from the last STREAM.INFO answer about it (_created_of); only
        # the names feeds read with consumers of their own are kept (_check_own_consumers).
        self._created: dict[str, datetime.datetime] = {}
        self.msg_get: ApiPermission | None = None  # may the replay read by subject (msg_get.py)
        self.pulls: ApiPermission | None = None  # may the replay pull (CONSUMER.MSG.NEXT; replay.py)
        self.acks: ApiPermission | None = None  # may a push replay acknowledge its results ($JS.ACK; replay.py)
        self._recent_sub = None
        # The ring consumer last found deleted (its name, stream) and when: not asked about again
        # while its new one is being made (RING_RESET_GRACE), then again (a failed remake keeps the name).
        self._ring_reset: tuple[str, str, float] | None = None
        self._ring_check_off = False  # CONSUMER.INFO went unanswered: the check is off
        # The ring consumer's name and its subscription's sid at the watch's last look: the same name
        # on a new sid is nats-py's own reset under way (_check_ring_consumer).
        self._ring_seen: tuple[str, int] | None = None
        # The results stream the ring reads, as the watch knows it: its name and creation time, once
        # the ring has read one (before, an edge without a results stream never asks).
        self._ring_stream: tuple[str, datetime.datetime | None] | None = None
        self._watch_task: asyncio.Task | None = None
        self.results_stream_missing: str | None = None  # for /healthz: the ring's stream was deleted
        # For /healthz: streams read by ordered consumers of their own found deleted (name -> what),
        # each until a stream of its name exists again (_check_own_consumers).
        self.own_streams_missing: dict[str, str] = {}
        self.after_read: Callable[[], None] | None = None  # run at the end of each NATS read (the Edge's WriteBatch.flush)
        # True once the client runs ``after_read`` at the end of every read (FastClient on its fast
        # parser); else the Edge's WriteBatch schedules its own flush for the next loop pass.
        self.after_read_hooked = False
        # The reason of the nats-py internals check once it passed (pending.require_support): set by start,
        # or before it by `streamproc edge`, which checks before it sets up its server.
        self.support: str | None = None
        # The recent ring's clock (time.time()) for the results of the NATS read under way, read by the
        # fan-out's first result of the read and cleared at its end (run_after_read): one clock read per
        # read, not per SSE event (docs/benchmarks.md, "seventh pass"). Kept only while after_read_hooked
        # (else no read end clears it: each result reads the clock).
        self.read_stamp: float | None = None
        self._js: JetStreamContext | None = None  # self.nc's, made once (jetstream())
        self.probes: Probes | None = None  # the opens' MSG.GET probes, answered in the read loop (probes.py)

    def jetstream(self) -> JetStreamContext:
        """``self.nc.jetstream()``, made once per connection: each call builds a new
        ``JetStreamContext`` (a header parser, an ``asyncio.Event``, an ``asyncio.Semaphore``; nats-py
        2.x ``JetStreamContext.__init__``), which every open did (docs/benchmarks.md, "SSE lifecycle").
        It holds nothing per request: its API calls take their subjects and timeouts as arguments."""
        nc = self.nc
        assert nc is not None
        js = self._js
        if js is None or js._nc is not nc:
            js = self._js = nc.jetstream()
        return js

    def run_after_read(self) -> None:
        """``after_read`` (the edge's WriteBatch.flush), its failures logged: at the end of each NATS
        read (FastClient.read_done), and after results dispatched outside one (Fanout.rebind). The
        read's ring stamp ends with it (read_stamp), also if ``after_read`` fails."""
        self.read_stamp = None
        try:
            self.after_read()  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - never into the read loop: nats-py's would stop reading for good
            self.limited.log(logging.ERROR, "after_read_failed", exc_info=True)

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def start(self) -> None:
        """Connect (retrying until NATS answers, at most ``connect_timeout``; a refused credential
        at once), check the results stream, start the recent ring. First the nats-py internals check
        (:func:`pending.require_support`): every way of starting an edge passes here, and checks here
        unless ``support`` already holds the reason of a check passed in this process (``streamproc
        edge`` checks before it sets up its server), so one start-up checks once."""
        reason = self.support if self.support is not None else pending.require_support()
        self.support = reason
        log_event(log, logging.INFO, "nats_pending_path", path="internals", reason=reason)
        self.nc = await connection.connect(
            self.settings,
            name="streamproc-edge",
            reconnect=True,
            # Never a migrate's reply (nats/control.py), not the processor's; each edge's own when
            # the deployment gives each its NATS user (--inbox-prefix, docs/security.md).
            inbox_prefix=self.settings.inbox_prefix,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        self.metrics.nats_connected = 1
        if hasattr(self.nc, "on_foreign"):  # a RobustClient (connect() makes one; typed as nats-py's Client)
            self.nc.on_foreign = self._count_foreign
        if getattr(self.nc, "calls_read_done", False) and self.after_read is not None:
            self.nc.read_done = self.run_after_read  # FastClient: the direct frames of a read leave at its end
            self.after_read_hooked = True
        self.barrier = PongBarrier(self.nc)
        url = self.nc.connected_url
        # host and port only: the URL's user part may hold a password or token
        log_event(log, logging.INFO, "connected", server=f"{url.hostname}:{url.port}" if url else "?")
        try:
            if self.settings.ensure_results_stream:
                s = self.settings
                info = await ensure_results_stream(
                    self.nc.jetstream(), self.subjects, max_age=s.results_max_age,
                    duplicate_window=s.duplicate_window, storage=StorageType(s.stream_storage),
                    replicas=s.stream_replicas,
                )
                log_event(log, logging.INFO, "results_stream_ready", stream=info.config.name,
                          subjects=self.subjects.all_results)
            if self.settings.recent > 0:
                await self._subscribe_recent()
                await self._start_probes()
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            # A JetStream API request nats-server does not let the edge user publish is dropped, and
            # the request times out: a traceback said no more than "nats: timeout".
            raise StartupError(f"cannot read or create the JetStream results stream at start-up: "
                               f"{error_text(exc)}; {jetstream_hint(exc)}") from None
        loop = asyncio.get_running_loop()
        self._flush_task = loop.create_task(self._flush_limited())
        self._watch_task = loop.create_task(self._watch_results_stream())

    async def _start_probes(self) -> None:
        """The opens' probe replies (probes.py), once the ring reads a results stream."""
        if self.probes is None and self.fanout is not None and self.fanout.stream is not None and Probes.usable(self.nc):
            probes = Probes(self.nc)
            await probes.start()
            self.probes = probes

    async def _flush_limited(self) -> None:
        while True:
            await asyncio.sleep(self.limited.interval)
            self.limited.flush()

    async def _subscribe_recent(self) -> None:
        """The recent ring's subscription to every result, which also feeds the open streams
        (fanout.py): a core subscription, or, when a JetStream stream stores the results, an ordered
        consumer of new results (with bodies: before, it was headers-only and every stream had an
        ordered consumer of its own, so every body crossed twice). Either way each result is read
        once; before, under a burst, the doubling made nats-server drop the edge's connection as a
        slow consumer (64 MiB pending)."""
        assert self.nc is not None
        js = self.nc.jetstream()
        stream = await self.streams.find(js, self.subjects.all_results)
        info = await js.stream_info(stream) if stream is not None else None
        # New results only: from the stream's last sequence now.
        sub = await self._ring_subscription(info, info.state.last_seq + 1 if info is not None else 0)
        self._recent_sub = sub
        self.fanout = Fanout(self, core_subscription(sub), self._on_inbox_full, stream=stream)
        self._reading(info)

    async def _ring_subscription(self, info: StreamInfo | None, start: int):
        """The ring's subscription: an ordered consumer of the stream from sequence ``start``, or a
        core subscription (live before return: the fan-out's opens need no round trip)."""
        assert self.nc is not None
        # The page's list may lose a result when the edge is starved; it must never buffer without bound.
        limits = {"pending_msgs_limit": RECENT_PENDING_MSGS, "pending_bytes_limit": self.settings.stream_buffer_bytes}
        if info is None:
            sub = await self.nc.subscribe(self.subjects.all_results, **limits)
            await self.nc.flush()
            return sub
        # nats-py's ordered consumer resumes after the last sequence it delivered
        # (JetStreamContext._JSI.reset_ordered_consumer), which is 0 until a first result: set to
        # the one before ``start``, or a reset would replay the whole stream.
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
        sub = await self.nc.jetstream().subscribe(self.subjects.all_results, stream=info.config.name,
                                                  config=config, ordered_consumer=True, **limits)
        jsi = core_subscription(sub)._jsi
        jsi._sseq = max(jsi._sseq, start - 1)
        return sub

    def _permissions(self, prefix: str, stream: str) -> None:
        """What the edge knows of its JetStream permissions on ``stream`` (msg_get.py), kept while
        it is the same name (what it learnt holds): MSG.GET, pulls, and acks of a push replay."""
        if self.msg_get is None or self.msg_get.stream != stream:
            self.msg_get = ApiPermission(prefix, stream, self._msg_get_changed)
        if self.pulls is None or self.pulls.stream != stream:
            self.pulls = ApiPermission(prefix, stream, self._pulls_changed, api="CONSUMER.MSG.NEXT", per_consumer=True)
        if self.acks is None or self.acks.stream != stream:  # $JS.ACK.<stream>.<consumer>...: not under the API prefix
            self.acks = ApiPermission("$JS", stream, self._acks_changed, api="ACK", per_consumer=True)

    def _reading(self, info: StreamInfo | None) -> None:
        """What the ring reads now: ``info``'s stream (its identity for the watch), or live results."""
        if info is None:
            self.recent_mode = "core"
            return
        assert self.nc is not None
        name, prefix = info.config.name, self.nc.jetstream()._prefix
        self._permissions(prefix, name)
        self._ring_stream = (name, info.created)
        self._stored_max = max(info.config.max_msg_size or 0, 0)
        self.results_stream_missing = None
        self.recent_mode = "jetstream"

    async def _watch_results_stream(self) -> None:
        """Ask once per ``STREAM_CHECK`` whether the results stream the ring reads is still the one
        it subscribed to (:meth:`_check_results_stream`). Nothing else would tell: nats-py 2.16's
        ordered consumer notices a deleted stream only by its missing idle heartbeats
        (``_JSI.activity_check``: two intervals, 10 s), then recreates its consumer from the last
        sequence it delivered (``reset_ordered_consumer(self._sseq + 1)``), which fails with
        "stream not found" every 10 s while the stream is missing (``recreate_consumer`` hands
        the error to the error callback), and, once a stream of that name exists again, succeeds
        at that old sequence, which the new stream (counting again from 1) reaches only after as
        many results as the old one held: the open streams stayed silent until their timeout.

        Ends when :meth:`stop` took the connection, also when its cancel did not reach here: nats-py
        awaits each answer with ``asyncio.wait_for``, which on Python 3.11 returns an answer that came
        in the loop pass of the cancel and swallows the cancel."""
        while True:
            await asyncio.sleep(STREAM_CHECK)
            if self.nc is None:
                return
            if not self.connected:
                continue
            try:
                if self.fanout is not None:
                    await self._check_results_stream()
                    await self._check_ring_consumer()
                await self._check_own_consumers()
            except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:  # asked again next time
                log_event(log, logging.DEBUG, "results_stream_check_failed", error=error_text(exc))
            except Exception:
                if self.nc is None:  # stopped within a check (its cancel swallowed): it found no connection
                    return
                raise

    async def _stream_info(self, name: str | None) -> StreamInfo | None:
        assert self.nc is not None
        if name is None:
            return None
        try:
            info = await self.nc.jetstream().stream_info(name)
        except NotFoundError:  # JSStreamNotFoundErr (10059): deleted
            self._created.pop(name, None)
            return None
        if info.created is not None:
            self._created[name] = info.created
        return info

    async def _created_of(self, stream: str) -> datetime.datetime | None:
        """``stream``'s creation time for a feed whose consumer is about to be made (:meth:`_attach`):
        the last one any STREAM.INFO answer gave (the watch asks once a second while such feeds are
        open), asked only when none is known. Learnt before the consumer is made, an older value
        than the consumer's stream only costs that feed a needless new consumer at the watch's next
        check (:meth:`_carry_on`; its seqs already sent are dropped), never silence; one newer than
        it (asked after the consumer was made) would hide a recreation. None: unknown (the watch
        adopts what it sees next)."""
        known = self._created.get(stream)
        if known is not None:
            return known
        with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
            info = await self._stream_info(stream)
            return info.created if info is not None else None
        return None

    async def _check_results_stream(self) -> None:
        """Deleted: every stream reading it ends with :class:`StreamGone` (an error event and
        ``[DONE]``) and the ring reads live results, as for an edge started without a stream, until
        a results stream exists again. Recreated (its ``created`` time changed, or its last sequence
        is below what the ring delivered: a new history, counting from 1 again): the ring reads the
        new stream from its first sequence, so the streams open on it get what is stored there, in
        seq order (their ``SeqOrder`` drops seqs they were sent already); the feeds that read it
        with an ordered consumer of their own get a new one there, from the same first sequence
        (:meth:`_carry_on`)."""
        assert self.nc is not None and self.fanout is not None
        if self._ring_stream is None:  # the edge has never read a results stream: nothing to watch
            return
        name = self.fanout.stream
        if name is None:  # deleted: wait for one to exist again
            info = await self._stream_info(await find_results_stream(self.nc.jetstream(), self.subjects.all_results))
            if info is not None:
                await self._reread(info, None, ended=0)
            return
        # What the ring had delivered before asking: every one of those sequences was stored before the
        # server reads the request, so the stream it describes holds them. Read after the answer, it
        # may count results stored after the server computed the answer but read by the ring before
        # the answer arrived (a consumer's pushes and an API reply come separately): taken for a new
        # history, a busy stream was reread from its start once in a while (440 us per SSE event in
        # a durable benchmark instead of 120, streams' p99 2 s).
        delivered = self.fanout.delivered()
        info = await self._stream_info(name)
        # STREAM.INFO's ``created`` is nats-server's ``(mset *stream) createdTime()`` (server/stream.go:
        # ``mset.created``, set when the stream is added), so a stream of the same name added again
        # differs; a purge leaves it, the sequence and the consumers as they were.
        if info is not None and (info.created, info.config.name) == (self._ring_stream[1], name) \
                and info.state.last_seq >= delivered:
            return  # the same stream (a purge keeps its sequence and its consumers)
        if info is None:
            reason = (f"the results stream {name} was deleted; the edge reads live results only until "
                      "a results stream exists again")
            ended = self._end_stream_feeds(reason)
            self.results_stream_missing = f"{name} was deleted; serving live results only"
            self.metrics.results_stream_deleted += 1
            log_event(log, logging.WARNING, "results_stream_deleted", stream=name, streams_ended=ended,
                      hint="recreate it (or restart the edge with --ensure-results-stream); docs/edge.md")
            # Another stream may store P.results.> now (the namespace moved): read that one.
            info = await self._stream_info(await find_results_stream(self.nc.jetstream(), self.subjects.all_results))
            await self._reread(info, name, ended=None)
            return
        self._stop_replays()
        await self._reread(info, name, ended=0, resumed=await self._carry_on(name, info.config.name, None))

    async def _check_ring_consumer(self) -> None:
        """Is the ring's ordered consumer still on the server? Deleted (by an operator, by another
        edge sharing this one's NATS user, or lost with the server that held it), nats-py 2.16
        notices only when two idle heartbeats are missing (``_JSI.activity_check``, 10 s; a test
        measured its live streams silent 18.4 s). Asked here once per ``STREAM_CHECK``; a consumer
        found gone is made again from the last sequence the ring delivered, as nats-py would
        (``_JSI.reset_ordered_consumer``), so nothing is missed and the stall is about a second."""
        assert self.nc is not None and self.fanout is not None
        sub, stream = self._recent_sub, self.fanout.stream
        if stream is None or not isinstance(sub, JetStreamContext.PushSubscription) or self._ring_check_off:
            return
        name = sub._consumer
        # nats-py remakes it too (_JSI.reset_ordered_consumer, from its heartbeat check or a missed
        # delivery), moving the subscription to a new sid at once and naming the new consumer when
        # the server answers: a name seen before on another sid is such a reset under way, which a
        # second reset would leave pushing to nobody until its inactive threshold.
        sid = core_subscription(sub)._id
        seen, self._ring_seen = self._ring_seen, (name, sid)
        if seen is not None and seen[0] == name and seen[1] != sid:
            self._ring_reset = (name, stream, time.monotonic())
            return
        reset = self._ring_reset
        if not name or (reset is not None and reset[:2] == (name, stream)
                        and time.monotonic() - reset[2] < RING_RESET_GRACE):
            return  # being made again: its new name comes with the answer

        try:
            await self.nc.jetstream()._jsm.consumer_info(stream, name, timeout=STREAM_CHECK)
            return
        except NotFoundError:
            pass
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError) as exc:
            # No answer: most likely a NATS user without $JS.API.CONSUMER.INFO (docs/security.md).
            # Said once; nats-py's heartbeat check remains.
            self._ring_check_off = True
            log_event(log, logging.WARNING, "ring_consumer_check_off", error=error_text(exc),
                      hint=f"grant the edge user $JS.API.CONSUMER.INFO.{stream}.> (docs/security.md)")
            return
        if sub is not self._recent_sub or sub._consumer != name or core_subscription(sub)._id != sid:
            return  # replaced meanwhile, or nats-py's reset began
        jsi = core_subscription(sub)._jsi
        self._ring_reset = (name, stream, time.monotonic())
        self.metrics.ring_consumers_lost += 1
        log_event(log, logging.WARNING, "ring_consumer_lost", stream=stream, consumer=name,
                  read_from_seq=jsi._sseq + 1)
        await jsi.reset_ordered_consumer(jsi._sseq + 1)
        self._ring_seen = (name, core_subscription(sub)._id)  # our reset's sid, not nats-py's
        # nats-py's heartbeat check (every 10 s) saw nothing from the deleted consumer: it would
        # remake this one too before its first heartbeat (5 s). A full interval for it.
        jsi._active = True

    async def _check_own_consumers(self) -> None:
        """The streams other than the ring's that feeds read with an ordered consumer of their own
        (``--recent 0``, or a refused MSG.GET), asked about only while such feeds are open: deleted,
        its feeds end with :class:`StreamGone`; created anew since a feed's consumer was made (each
        feed knows the stream's ``created`` from just before, :meth:`_attach`), that feed goes on
        from the new stream's first sequence (:meth:`_carry_on`), as the ring's streams do. One found
        deleted is asked about until a stream of its name exists again (/healthz says it is missing
        meanwhile: the requests it stored get live results only)."""
        ring = self.fanout.stream if self.fanout is not None else None
        names = {f.stream for f in self._feeds.values()
                 if f.stream is not None and f.stream != ring and not f.closed and f.gone is None}
        for name in [n for n in self._created if n not in names]:
            del self._created[name]  # asked again by the next feed that reads it
        for name in list(self.own_streams_missing):
            if name == ring:  # the ring reads a stream of that name now: it watches it
                del self.own_streams_missing[name]
                continue
            info = await self._stream_info(name)
            if info is not None:
                del self.own_streams_missing[name]
                self._recreated(name, ended=0, resumed=0, start=max(info.state.first_seq, 1),
                                previous=f"{name} was deleted")
        for name in names:
            info = await self._stream_info(name)
            if info is not None:
                resumed = await self._carry_on(name, name, info.created)
                if resumed:  # a new history: those feeds read it from its first sequence
                    self.streams.forget()
                    self._recreated(name, ended=0, resumed=resumed, start=max(info.state.first_seq, 1))
                continue
            self.streams.forget()
            reason = f"the results stream {name} was deleted; reconnect with Last-Event-ID to read it again"
            feeds = {id(f): f for f in self._feeds.values() if f.stream == name and f.gone is None and not f.closed}
            for feed in feeds.values():
                feed.end(reason)
            self.own_streams_missing[name] = "was deleted; the requests it stored get live results only"
            self.metrics.results_stream_deleted += 1
            log_event(log, logging.WARNING, "results_stream_deleted", stream=name, streams_ended=len(feeds),
                      hint="recreate it; docs/edge.md")

    def _recreated(self, name: str, *, ended: int, resumed: int, start: int, **previous: str | None) -> None:
        """Count and log a results stream found created anew (the ring's or one read by own consumers)."""
        self.metrics.results_stream_recreated += 1
        log_event(log, logging.WARNING, "results_stream_recreated", stream=name, streams_ended=ended,
                  streams_resumed=resumed, read_from_seq=start, **previous)

    async def _carry_on(self, name: str, stream: str, created: datetime.datetime | None) -> int:
        """The feeds reading ``name`` with an ordered consumer of their own made before a new stream
        of that name existed: each gets a new one on ``stream``, replaying its subject from the new
        stream's first sequence, as the ring does (:meth:`_reread`). ``created`` is the new stream's
        creation time, and a feed whose consumer was made on a stream of that time stays; a feed
        that does not know its stream's (STREAM.INFO failed before its consumer was made) takes it
        as its own. None (the ring's watch found a new history): every such feed goes on. Their
        ``SeqOrder`` drops the seqs they were sent already; a seq the new stream lacks is a gap
        (``--gap-timeout``). What the old consumer had queued (results of the old stream its client
        was not given yet) is taken first. The old consumer is unsubscribed: left, nats-py would
        make it again at the old stream's sequence once it misses two heartbeats
        (:meth:`_watch_results_stream`). The count."""
        feeds = {id(f): f for f in self._feeds.values()
                 if f.stream == name and f.inbox is None and f._sub is not None and f.gone is None and not f.closed}
        for key, feed in list(feeds.items()):
            if created is None:
                break
            if feed.stream_created is None:
                feed.stream_created = created
            if feed.stream_created == created:
                del feeds[key]  # its consumer reads that stream already
        for feed in feeds.values():
            old, feed._sub = feed._sub, None
            assert old is not None
            feed.cut = None  # behind on the old stream: the new consumer reads the new one from its start
            self._feeds.pop(id(core_subscription(old)), None)
            with contextlib.suppress(nats.errors.Error):  # a closed connection: the feed learns it below
                while (msg := pending.take(old)) is not None:
                    feed._accept(msg)
            self.metrics.jetstream_replays -= 1  # counted again by _attach, once its consumer exists
            self._consume(feed, stream, feed.limits)
            pending.wake(old)  # a next() waiting on the old consumer waits for the new one
            with contextlib.suppress(nats.errors.Error, OSError):
                await old.unsubscribe()
            pending.drop(old)
        return len(feeds)

    def _jetstream_feeds(self) -> list[ResultFeed]:
        """The open JetStream feeds: the fan-out's and those with an ordered consumer of their own."""
        feeds = {id(f): f for f in self._feeds.values() if f.mode == "jetstream"}
        if self.fanout is not None:
            for subject_feeds in self.fanout.feeds.values():
                feeds.update((id(f), f) for f in subject_feeds if f.mode == "jetstream")
        return [f for f in feeds.values() if not f.closed and f.gone is None]

    def _end_stream_feeds(self, reason: str) -> int:
        """The results stream was deleted: every JetStream feed ends (:class:`StreamGone`). The count."""
        feeds = self._jetstream_feeds()
        for feed in feeds:
            feed.end(reason)
        return len(feeds)

    def _stop_replays(self) -> None:
        """The results stream was recreated: the fan-out's feeds' replays of the old one stop (the
        ring rereads the new stream from its start, these feeds included)."""
        for feed in self._jetstream_feeds():
            if feed.inbox is not None and feed.replay is not None:
                replay, feed.replay = feed.replay, None
                self.wake_slot_waiter(feed)  # a catch-up waiting for a consumer goes on without one
                self._closing_replays.add(task := asyncio.get_running_loop().create_task(replay.close()))
                task.add_done_callback(self._closing_replays.discard)

    async def _reread(self, info: StreamInfo | None, old: str | None, *, ended: int | None,
                      resumed: int = 0) -> None:
        """Point the ring at ``info``'s stream from its first sequence (None: live results)."""
        assert self.fanout is not None and self.nc is not None
        previous = self._recent_sub
        was = f"{old} (another history)" if old is not None else self.results_stream_missing
        start = max(info.state.first_seq, 1) if info is not None else 0
        sub = await self._ring_subscription(info, start)
        self._recent_sub = sub
        self.fanout.rebind(core_subscription(sub), info.config.name if info is not None else None)
        self._reading(info)
        self.streams.forget()
        if info is not None:
            self._recreated(info.config.name, ended=ended or 0, resumed=resumed, start=start, previous=was)
        if previous is not None:
            stop_inline = getattr(self.nc, "stop_inline", None)
            if stop_inline is not None:
                stop_inline(core_subscription(previous))
            with contextlib.suppress(nats.errors.Error, OSError):
                await previous.unsubscribe()
            pending.drop(previous)
        # An edge started without a results stream has no probe replies yet; until they exist,
        # opens ask from their tasks (replay.py).
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._start_probes()

    async def stop(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            self._flush_task = None
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        self.limited.flush()
        nc, self.nc = self.nc, None
        self._closing = True  # the disconnect that closing causes is not news
        self.metrics.nats_connected = 0
        if nc is not None and not nc.is_closed:
            await nc.close()

    async def open(self, request_id: str, *, after: int | None = None) -> ResultFeed:
        """One request's results. A core feed is live on the server on return. A JetStream feed
        reads what was stored before it from the stream on its first ``next`` (dispatched: replay.py;
        with ``--recent 0`` its own ordered consumer, still being created on return, replaying the
        subject from the stream's start), so nothing is missed; a failure there ends it with Lost."""
        assert self.nc is not None
        subject = self.subjects.result(request_id)
        stream = await self.streams.find(self.jetstream(), subject)
        order = SeqOrder(after)
        # Bounded per stream: nats-py's default would hold up to 128 MiB for a client that stopped
        # reading (DEFAULT_SUB_PENDING_BYTES_LIMIT); past our bound it drops and reports a
        # SlowConsumerError, which ends this feed (_on_error).
        limits = {"pending_msgs_limit": MAX_PENDING_RESULTS * 4,
                  "pending_bytes_limit": self.settings.stream_buffer_bytes}
        if self.fanout is not None and self.fanout.stream == stream:  # the recent ring's source reads it
            return await self._open_dispatched(request_id, subject, order, limits)
        if self.fanout is not None and self.results_stream_missing is not None:
            # The ring's stream was deleted: live results, and once the watch sees a results stream
            # again the ring reads it from its start (_check_results_stream), this feed included.
            return await self._open_dispatched(request_id, subject, order, limits)
        if self.fanout is not None and stream is not None and not self._told_late_stream:  # created after start-up
            self._told_late_stream = True
            log_event(log, logging.WARNING, "results_stream_not_read_by_ring", stream=stream,
                      hint="each stream opens its own ordered consumer; restart the edge to read the "
                           "results stream through one (docs/edge.md)")
        if stream is not None:
            feed = ResultFeed(self, request_id, None, "jetstream", order)
            if self.fanout is None:  # --recent 0: its history in the read budget, then its own consumer
                self._read_stored(feed, stream, limits)
            else:
                self._consume(feed, stream, limits)
            return feed
        sub = await self.nc.subscribe(subject, **limits)
        pending.hold(sub)  # its byte limit counts headers too, not bodies alone (pending.HeldQueue)
        try:
            assert self.barrier is not None
            await self.barrier.wait()  # one PING for the opens of this loop pass (barrier.py)
        except BaseException:
            with contextlib.suppress(nats.errors.Error, OSError):  # not left subscribed for nobody
                await sub.unsubscribe()
            raise
        self.metrics.core_subscriptions += 1
        feed = ResultFeed(self, request_id, sub, "core", order)
        self._feeds[id(core_subscription(sub))] = feed
        return feed

    async def _open_dispatched(self, request_id: str, subject: str, order: SeqOrder,
                               limits: dict[str, int]) -> ResultFeed:
        """A live feed from the wildcard subscription: registered now, so every result read from
        here on reaches it (fanout.py). Connected, that is the whole open; while reconnecting it
        waits, as a SUB's PING did, until the server has the wildcard subscription again."""
        assert self.fanout is not None and self.nc is not None
        stream = self.fanout.stream
        feed = ResultFeed(self, request_id, None, "core" if stream is None else "jetstream", order,
                          inbox=self.fanout.inbox(limits["pending_bytes_limit"], limits["pending_msgs_limit"]))
        self.fanout.add(subject, feed)
        if stream is not None:
            # Every result after the consumer's last delivered sequence reaches the inbox; the earlier
            # ones are read from the stream (replay.py). The ordered consumer resumes after a reconnect.
            # Where the edge may not read stored results by subject (msg_get.py), the history is read
            # with consumers alone, in the read budget (replay.py, ``by_consumer``), as a catch-up's:
            # True while refused (the re-probe's open, once per interval, asks MSG.GET first); None
            # while MSG.GET never answered, so that a refusal turns it to consumers too. Until
            # 2026-12-06 such an open had an ordered consumer from the stream's start, outside the
            # budget, and many slow late attaches had the edge's connection cut
            # (tests/test_edge_replay_budget.py).
            access = self.msg_get
            refused = access is not None and access.state == "refused" and not access.usable()
            by_consumer: bool | None = False  # MSG.GET known to answer (or never asked of this stream)
            if refused:
                by_consumer = True
            elif access is not None and not access.confirmed:
                by_consumer = None
            feed.replay = replay = self._replay(feed, stream, subject, 1, by_consumer)
            if order.next_seq > 0:  # a resume: the stored result of its Last-Event-ID is looked for first
                replay.seek = order.next_seq - 1
            if refused:
                self.metrics.streams_fallback += 1
            else:
                replay.turned = self._history_without_msg_get
            self.metrics.jetstream_replays += 1
            probes = self.probes
            if probes is not None and probes.nc is self.nc and (self.msg_get is None or self.msg_get.confirmed):
                # Asked now, answered in the read loop (probes.py). Until MSG.GET is known to
                # answer, the replay asks from the stream's task, guarded against a refusal (msg_get.py).
                try:
                    await replay.ask(probes, feed._replayed, feed._wake_reader)
                except BaseException:  # cancelled while its publish waited on a flush: not opened
                    replay.close_now()
                    self.fanout.remove(subject, feed)
                    raise
            return feed
        if not self.nc.is_connected:
            try:
                assert self.barrier is not None
                await self.barrier.wait()
            except BaseException:
                self.fanout.remove(subject, feed)
                raise
        self.metrics.core_subscriptions += 1
        return feed

    def _replay(self, feed: ResultFeed, stream: str, subject: str, start: int,
                by_consumer: bool | None = False, expect: int | None = None) -> Replay:
        """The results of ``subject`` stored from sequence ``start`` up to what the ring has
        delivered: those the dispatch did not give ``feed`` (replay.py; ``by_consumer`` there)."""
        assert self.fanout is not None and self.nc is not None and feed.inbox is not None
        limits = {"pending_msgs_limit": feed.inbox.msgs_limit, "pending_bytes_limit": feed.inbox.bytes_limit}
        return self._stored_reader(feed, stream, subject, start, self.fanout.delivered(), limits, by_consumer,
                                   expect)

    def _read_stored(self, feed: ResultFeed, stream: str, limits: dict[str, int], start: int = 1) -> None:
        """A feed that reads with an ordered consumer of its own (``--recent 0``), at its open or
        on from ``start`` after it fell behind (:meth:`read_on`): its consumer is made from past the
        stream's last sequence now, and what is stored of its subject before that is read first as
        a replay's (replay.py: pulls or by subject, in the read budget). Made from ``start``, as
        before 2026-12-06, that push consumer sent the whole history at its flow control's pace
        (2 MiB, doubling to 32 MiB) past the budget, and many slow late attaches had the edge's
        connection cut (tests/test_edge_replay_budget.py). Where MSG.GET is refused (msg_get.py)
        the replay reads with consumers alone (``by_consumer``): pulls, or push consumers held to
        the budget by ``max_ack_pending`` (replay.py, ``_push_consumer``); until 2026-12-06 the
        consumer from ``start``, outside the budget."""
        assert self.nc is not None
        feed.stream, feed.limits = stream, limits
        self._permissions(self.jetstream()._prefix, stream)
        feed.attaching = asyncio.get_running_loop().create_task(self._split_at_last(feed, stream, limits, start))
        self._attaching.add(feed.attaching)
        feed.attaching.add_done_callback(self._attaching.discard)

    async def _split_at_last(self, feed: ResultFeed, stream: str, limits: dict[str, int], start: int) -> None:
        """:meth:`_read_stored`'s split: the stream's last sequence now and how many results of the
        subject it holds (one STREAM.INFO with ``subjects_filter``, a small answer, uncharged); the
        replay reads the subject up to that sequence, the consumer from the next one. Every result
        of the subject is in one or the other, once. nats-server takes the last sequence before the
        subject's count (``jsStreamInfoRequest``: ``stateWithDetail``, then ``SubjectsTotals``), so a
        count of 0 says nothing is stored up to it: no replay, no MSG.GET waiting its turn in the
        budget (the usual open, before its request starts, is live at once)."""
        assert self.nc is not None
        subject = self.subjects.result(feed.request_id)
        try:
            info = await subject_split(self.nc, self.jetstream()._prefix, stream, subject, REPLAY_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - unanswered, refused, the stream gone: as before 2026-12-06
            # its consumer from ``start`` (which fails with its own reason if the stream is gone)
            self.limited.log(logging.WARNING, "stored_history_unsplit", request_id=feed.request_id,
                             error=error_text(exc), fallback="its consumer from the stream's start, unbudgeted")
            if not feed.closed:
                await self._attach(feed, self.jetstream(), subject, stream, limits, start)
            return
        if info.created:  # the consumer reads this one (_created_of): parsed as nats-py's StreamInfo does
            self._created[stream] = StreamInfo._parse_utc_iso(info.created)
        last = info.state.last_seq
        if feed.closed:
            return
        if last >= start and info.state.subjects.get(subject, 0) > 0:
            # MSG.GET refused: consumers alone; not known to answer: a refusal (or silence) turns
            # it to consumers alone too (replay.py), not to the consumer from ``start``
            refused = self.msg_get is not None and not self.msg_get.usable()
            if refused:
                self.metrics.streams_fallback += 1
            feed.replay = replay = self._stored_reader(feed, stream, subject, start, last, limits,
                                                       True if refused else None, start if start > 1 else None)
            if start == 1 and feed.order.next_seq > 0:  # a resume's open: its Last-Event-ID's result first
                replay.seek = feed.order.next_seq - 1
        await self._attach(feed, self.jetstream(), subject, stream, limits, max(start, last + 1))

    def _stored_reader(self, feed: ResultFeed, stream: str, subject: str, start: int, upto: int,
                       limits: dict[str, int], by_consumer: bool | None, expect: int | None) -> Replay:
        assert self.nc is not None

        def watch(sub, live: bool, deleted: bool | None = None) -> None:  # its temporary consumer's SlowConsumerError pauses it (_on_error)
            if live:
                self._replays[id(core_subscription(sub))] = feed
            elif self._replays.pop(id(core_subscription(sub)), None) is not None:
                if deleted:  # a pull consumer the server said it deleted: its slot is free now
                    self._replay_slot_freed()
                    return
                self._replays_lingering += 1  # until the server has dropped it too
                asyncio.get_running_loop().call_later(REPLAY_SLOT_LINGER if deleted is None else REPLAY_PULL_SLOT_LINGER,
                                                      self._replay_consumer_gone)

        return Replay(self.nc, self.jetstream()._prefix, stream, subject, upto,
                      REPLAY_TIMEOUT, {**limits, "inactive_threshold": CONSUMER_LINGER}, watch, self.msg_get,
                      functools.partial(self._may_replay_with_consumer, feed), start,
                      by_consumer, expect, self._replay_consumer_made, self.pulls, self.read_gate,
                      self._largest_stored, self._replay_read_by_subject, self.acks)

    def _history_without_msg_get(self) -> None:
        """An open's replay turned to consumers alone at a MSG.GET refusal (replay.py)."""
        self.metrics.streams_fallback += 1

    def _replay_read_by_subject(self) -> None:
        self.metrics.replay_reads_by_subject += 1

    def _largest_stored(self) -> int:
        """The largest result the results stream may hold: its max_msg_size, else the server's max_payload."""
        payload = self.nc.max_payload if self.nc is not None else 0
        return min(x for x in (self._stored_max, payload, 1 << 26) if x > 0)

    def catch_up(self, feed: ResultFeed) -> None:
        """A dispatched JetStream feed that fell behind (:meth:`_on_inbox_full`) has handed out what
        its inbox held: it rejoins the dispatch now and reads the results it did not take from the
        stream, from the first of them up to what the ring has delivered (the argument of an open:
        every later one reaches its inbox). Its next ``next`` reads them before the inbox's.

        Where MSG.GET is refused (msg_get.py) the replay reads with consumers alone (replay.py,
        ``by_consumer``), as an open's does: an ordered consumer from the stream's start with the
        same bound would push at least a bound's worth at once to a client known to be slower, and
        end its stream with an overrun."""
        inbox = feed.inbox
        assert inbox is not None and inbox.behind is not None and self.fanout is not None
        start, inbox.behind = inbox.behind, None
        if feed.mode != "jetstream" or self.fanout.stream is None:  # the stream went meanwhile: gone
            return
        refused = self.msg_get is not None and self.msg_get.state == "refused"
        feed.replay = self._replay(feed, self.fanout.stream, self.subjects.result(feed.request_id), start,
                                   True if refused else None,
                                   # a result of its subject; 1 is also the start of a recreated stream
                                   start if start > 1 else None)

    def _consume(self, feed: ResultFeed, stream: str, limits: dict[str, int], start: int = 1) -> None:
        """Give a JetStream feed an ordered consumer of its own (:meth:`_attach`). It replays the
        subject from the stream's start (or ``start``: :meth:`read_on`), so nothing published
        before it exists is missed: the client gets its headers now, and the consumer's creation (a
        JetStream API round trip, tens of ms behind a busy server) overlaps them."""
        assert self.nc is not None
        subject = self.subjects.result(feed.request_id)
        feed.stream = stream
        feed.limits = limits
        feed.attaching = asyncio.get_running_loop().create_task(
            self._attach(feed, self.jetstream(), subject, stream, limits, start))
        self._attaching.add(feed.attaching)
        feed.attaching.add_done_callback(self._attaching.discard)

    def fall_back(self, feed: ResultFeed, refused: Refused) -> None:
        """A dispatched feed's replay got no answer from ``STREAM.MSG.GET`` where it could not read
        with consumers alone (a timeout after MSG.GET did answer: a busy server, not a permission;
        a result larger than the bound): it leaves the fan-out and reads its subject with an
        ordered consumer of its own from the stream's start (what it had queued comes again;
        repeats are dropped by seq). A refusal turns later opens to consumers alone until the
        re-probe (msg_get.py, :meth:`_open_dispatched`).
        A ``--recent 0`` feed's replay (:meth:`_read_stored`) had no fan-out: its consumer from where
        that replay was."""
        access = self.msg_get
        if access is not None and (refused.denied or not access.confirmed):
            access.refused(refused.reason)
        if feed.inbox is None:
            # Its consumer reads from past the replay's end: made again from where the replay was
            replay, feed.replay = feed.replay, None
            old, feed._sub = feed._sub, None
            assert replay is not None and feed.stream is not None
            self.metrics.streams_fallback += 1
            if old is not None:
                self._feeds.pop(id(core_subscription(old)), None)
                pending.drop(old)
                self.metrics.jetstream_replays -= 1  # counted again by _attach, once its consumer exists
                task = asyncio.get_running_loop().create_task(old.unsubscribe())
                self._closing_replays.add(task)
                task.add_done_callback(self._closing_replays.discard)
                task.add_done_callback(_unsubscribed)
            self._consume(feed, feed.stream, feed.limits, replay.next_seq)
            return
        assert self.fanout is not None and self.fanout.stream is not None
        feed.replay = None  # it failed on a MSG.GET, so before making a consumer: nothing to close
        inbox, feed.inbox = feed.inbox, None
        self.fanout.remove(self.subjects.result(feed.request_id), feed)
        inbox.clear()
        self.metrics.jetstream_replays -= 1  # counted again by _attach, once its consumer exists
        self.metrics.streams_fallback += 1
        limits = {"pending_msgs_limit": inbox.msgs_limit, "pending_bytes_limit": inbox.bytes_limit}
        self._consume(feed, self.fanout.stream, limits)

    def _pulls_changed(self, state: State, reason: str) -> None:
        """Said once per change: replays read with push consumers (as before 2026-12-05) meanwhile."""
        assert self.pulls is not None
        if state == "refused":
            limited = reason.startswith(PULLS_LIMITED)  # a request limit, not the permission
            log_event(log, logging.WARNING, "replay_pulls_refused", permission=f"{self.pulls.subject}.>",
                      error=reason, fallback="each result by subject (STREAM.MSG.GET, in the read budget; "
                                             "push consumers where that is refused too)",
                      retry_after=self.pulls.reprobe,
                      hint="the server or account limits pull requests (max_request_batch, "
                           "max_request_max_bytes, max_request_expires): raise them above the edge's pulls"
                      if limited else
                      "export and import it with response_type stream and grant the edge user publish "
                      "on it (docs/security.md, 'Upgrading: the edge pulls stored results')")
        else:
            log_event(log, logging.INFO, "replay_pulls_allowed", permission=f"{self.pulls.subject}.>")

    def _acks_changed(self, state: State, reason: str) -> None:
        """Said once per change: push replays make a consumer per window of results meanwhile."""
        assert self.acks is not None
        if state == "refused":
            log_event(log, logging.WARNING, "replay_acks_refused", permission=f"{self.acks.subject}.>",
                      error=reason, fallback="a new push consumer per max_ack_pending results",
                      retry_after=self.acks.reprobe,
                      hint="grant the edge user publish on it, or the replay permissions it lacks "
                           "(docs/edge.md, 'The read budget of stored results')")
        else:
            log_event(log, logging.INFO, "replay_acks_allowed", permission=f"{self.acks.subject}.>")

    def _msg_get_changed(self, state: State, reason: str) -> None:
        """Said once per change, not per open: the deployment lacks (or got) the permission."""
        assert self.msg_get is not None
        subject = self.msg_get.subject
        if state == "refused":
            self.metrics.stored_reads_refused = 1
            log_event(log, logging.WARNING, "stored_results_unreadable", permission=subject, error=reason,
                      fallback="stored results read with consumers, in the read budget",
                      retry_after=self.msg_get.reprobe,
                      hint="grant the edge user publish on that subject (docs/security.md, "
                           "'Upgrading: the edge reads stored results by subject')")
        else:
            self.metrics.stored_reads_refused = 0
            log_event(log, logging.INFO, "stored_results_readable", permission=subject)

    def _on_inbox_full(self, feed: ResultFeed, reply: str) -> None:
        """A dispatched feed's client fell behind (its inbox is full). When the ring reads a
        JetStream stream, the result is stored: the feed goes behind (fanout.py) and catches up from
        the stream once its client took what it holds (:meth:`catch_up`). In core mode, what a
        SlowConsumerError did for its own subscription (_on_error), without an await in the read path."""
        inbox = feed.inbox
        assert inbox is not None
        if inbox.behind is not None:  # behind already: it reads this one from the stream too
            return
        if self.fanout is not None and self.fanout.stream is not None and feed.mode == "jetstream":
            # The stream sequence of the result it did not take; no ack subject: from the stream's
            # start (dups dropped)
            inbox.behind = stream_seq(reply) or 1
            self.metrics.streams_behind += 1
            # Its task may be parked in Inbox.wait: a result larger than the bound finds the inbox
            # empty, and nothing else would wake it before its wait's timeout (the keep-alive).
            inbox.wake()
            return
        if not feed.overrun:
            feed.overrun = True
            self.metrics.streams_overrun += 1
            self.limited.log(logging.WARNING, "stream_overrun", request_id=feed.request_id,
                             limit=self.settings.stream_buffer_bytes)
        self.forget(feed)
        assert feed.inbox is not None
        feed.inbox.clear()
        feed.inbox.wake()

    async def _attach(self, feed: ResultFeed, js: JetStreamContext, subject: str, stream: str,
                      limits: dict[str, int], start: int = 1) -> None:
        """Create a JetStream feed's ordered consumer. A failure ends the feed with :class:`Lost`
        (its client has its headers already); a feed closed meanwhile gets it unsubscribed. The
        stream's creation time is taken first (:meth:`_created_of`): asked after, a stream recreated
        in between would be taken for the one the consumer reads, and its feed would wait silently."""
        ring = self.fanout.stream if self.fanout is not None else None
        # The ring's stream is watched by the ring's check, which gives every such feed a new
        # consumer when it finds a new history (_carry_on with None): no identity needed there.
        feed.stream_created = await self._created_of(stream) if stream != ring else None
        config = (ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start)
                  if start > 1 else None)
        try:
            sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=config,
                                     inactive_threshold=CONSUMER_LINGER, **limits)
        except Exception as exc:  # noqa: BLE001 - NATS refused the consumer: the stream ends with its reason
            self.streams.forget()  # deleted or changed since it was looked up
            feed.attach_failed = f"cannot subscribe to results: {error_text(exc)}"
            self.limited.log(logging.WARNING, "subscribe_failed", request_id=feed.request_id, error=error_text(exc))
            return
        pending.hold(sub)  # its byte limit counts headers too, not bodies alone (pending.HeldQueue)
        if start > 1:
            # nats-py's ordered consumer resumes after the last sequence it delivered, 0 until a first
            # result: a reset (a missed heartbeat) would push the subject's whole history (as the ring's)
            jsi = core_subscription(sub)._jsi
            jsi._sseq = max(jsi._sseq, start - 1)
        self.metrics.jetstream_replays += 1
        if feed.closed:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
            pending.drop(sub)
            return
        feed._sub = sub
        self._feeds[id(core_subscription(sub))] = feed

    def forget(self, feed: ResultFeed) -> None:
        if feed.inbox is not None and self.fanout is not None:
            self.fanout.remove(self.subjects.result(feed.request_id), feed)
            return
        sub = feed._sub
        if sub is not None:
            self._feeds.pop(id(core_subscription(sub)), None)

    def _may_replay_with_consumer(self, feed: ResultFeed, by_consumer: bool) -> bool:
        """``feed``'s replay may make a consumer for its history (below --max-replay-consumers, the
        consumers being made, those the server still keeps and the slots kept for waiting catch-ups
        counted; or in the slot kept for it; free slots go to the queue first); else it reads the
        next stored result by subject (replay.py), or, reading with consumers alone (``by_consumer``:
        MSG.GET refused), waits for one (:meth:`replay_slot`) in the queue, counted once per
        consumer it waits for."""
        if self._unreserve_slot(feed):
            self._replays_creating += 1  # until _replay_consumer_made: its creation awaits a round trip
            return True
        free = self.settings.max_replay_consumers - self._replay_consumers_held()
        # A slot left free while the queued catch-ups were not waiting in next() (_replay_slot_freed)
        # is the first of them to look again's; others may take only what the queue leaves.
        if free > (0 if feed in self._slot_waiters else len(self._slot_waiters)):
            self._slot_waiters.pop(feed, None)
            self._replays_creating += 1
            return True
        if not by_consumer:
            self.metrics.replay_reads_by_subject += 1
        elif feed not in self._slot_waiters:
            self._slot_waiters[feed] = None
            self.metrics.replay_consumer_waits += 1
        return False

    def _replay_consumers_held(self) -> int:
        return len(self._replays) + self._replays_creating + self._replays_lingering + self._slots_reserved

    def _replay_consumer_made(self) -> None:
        """A consumer :meth:`_may_replay_with_consumer` allowed exists (in ``_replays`` now, as the
        replay's watch put it there first) or failed (its slot is free)."""
        self._replays_creating -= 1
        self._replay_slot_freed()

    def _replay_consumer_gone(self) -> None:
        """A consumer a replay dropped is gone from the server too (REPLAY_SLOT_LINGER, REPLAY_PULL_SLOT_LINGER)."""
        self._replays_lingering -= 1
        self._replay_slot_freed()

    def _replay_slot_freed(self) -> None:
        """Each free slot goes to the catch-up that has waited longest among those waiting in
        :meth:`replay_slot`: kept for it, and it is woken (one per slot: waking every waiter made a
        free cost a wake and a retry per waiter). One not waiting there (its handler writes to its
        client, up to --write-timeout, or its next() was cancelled) keeps its place, and no slot is
        kept idle for it: kept for the next one, or left free for the queue (its next look takes it)."""
        while self._slot_waiters and self._replay_consumers_held() < self.settings.max_replay_consumers:
            for feed in self._slot_waiters:
                waiter = feed.slot_waiter
                if waiter is not None and not waiter.done():
                    break
            else:
                return
            del self._slot_waiters[feed]
            feed.slot_reserved = True
            self._slots_reserved += 1
            waiter.set_result(None)

    async def replay_slot(self, feed: ResultFeed, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for a replay consumer slot kept for ``feed`` (a replay
        reading with consumers alone past --max-replay-consumers: :attr:`Replay.waiting`), or for
        ``feed`` to have no more use for one (:meth:`wake_slot_waiter`). Its place in the queue
        stays when it returns without one: its next look asks for the slot again. Cancelled (its
        client left, or a caller's timeout around :meth:`ResultFeed.next`), it keeps its place and
        gives a slot kept for it meanwhile to the next one waiting: it may read again, or never."""
        if feed.slot_reserved or feed not in self._slot_waiters:
            return
        waiter = feed.slot_waiter = asyncio.get_running_loop().create_future()
        self._replay_slot_freed()  # a slot left free while it was not waiting here: its own at once
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await waiter
        except asyncio.CancelledError:
            feed.slot_waiter = None
            if self._unreserve_slot(feed):
                self._slot_waiters[feed] = None
                self._slot_waiters.move_to_end(feed, last=False)
                self._replay_slot_freed()
            raise
        finally:
            feed.slot_waiter = None

    def _unreserve_slot(self, feed: ResultFeed) -> bool:
        """Whether a slot was kept for ``feed`` (_replay_slot_freed); it is not any more: taken by
        its replay, or given back by the caller."""
        if not feed.slot_reserved:
            return False
        feed.slot_reserved = False
        self._slots_reserved -= 1
        return True

    def wake_slot_waiter(self, feed: ResultFeed) -> None:
        """``feed`` has no more use for a replay consumer (stream gone, replay stopped, closed): it
        leaves the queue, a slot kept for it goes to the next catch-up, and it is woken to look at
        its state again."""
        self._slot_waiters.pop(feed, None)
        if self._unreserve_slot(feed):
            self._replay_slot_freed()
        waiter = feed.slot_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _fell_behind(self, feed: ResultFeed, exc: nats.errors.SlowConsumerError) -> None:
        """A feed's own ordered consumer dropped a result (its client is its bound behind): stop
        the consumer at once, inside nats-py's read loop, so nothing more is taken in (left, nats-py
        would see the dropped delivery's gap and make a new consumer per message); :meth:`ResultFeed.next`
        hands out what was queued before the drop, then :meth:`read_on` goes on from it. (nats-py's
        ordered consumer counts a dropped message as delivered: going on with it would skip it.)"""
        seq = stream_seq(exc.reply) or 1  # unreadable: read on from the stream's start (dups dropped)
        if feed.cut is not None:
            feed.cut = min(feed.cut, seq)
            return
        feed.cut = seq
        self.metrics.streams_behind += 1
        # The JetStream subscription, not the plain one the error names: its unsubscribe also stops
        # nats-py's heartbeat check, which otherwise found the stopped consumer idle within 20 s and
        # made it again (reset_ordered_consumer), pushing the history into a queue nobody reads.
        sub = feed._sub if feed._sub is not None else exc.sub
        with contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()
        pending.wake(sub)  # a reader waiting for more: look again

    def read_on(self, feed: ResultFeed) -> None:
        """The feed handed out what its stopped consumer had queued before the drop (:meth:`_fell_behind`):
        a new ordered consumer of its subject from the first result dropped."""
        old, feed._sub = feed._sub, None
        assert old is not None and feed.cut is not None and feed.stream is not None
        self._feeds.pop(id(core_subscription(old)), None)
        pending.drop(old)
        start, feed.cut = feed.cut, None
        self.metrics.jetstream_replays -= 1  # counted again by _attach, once its consumer exists
        if self.fanout is None:  # --recent 0: what it did not take in the read budget first (_read_stored)
            self._read_stored(feed, feed.stream, feed.limits, start)
        else:
            self._consume(feed, feed.stream, feed.limits, start)

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            replaying = self._replays.get(id(exc.sub))
            if replaying is not None:  # a history read faster than its client takes it: paused (replay.py)
                replay = replaying.replay
                if replay is not None and await replay.overflowed(exc.reply):
                    self.metrics.replay_pauses += 1
                return
            feed = self._feeds.get(id(exc.sub))
            if feed is not None and feed.mode == "jetstream" and feed.stream is not None:
                await self._fell_behind(feed, exc)  # its results are stored: it reads on later
                return
            if feed is not None:
                if not feed.overrun:
                    feed.overrun = True
                    self.metrics.streams_overrun += 1
                    self.limited.log(logging.WARNING, "stream_overrun", request_id=feed.request_id,
                                      limit=self.settings.stream_buffer_bytes)
                # The stream cannot go on: stop its subscription now, before the next message. An
                # ordered consumer would otherwise see the dropped dseq and recreate its consumer
                # (nats/aio/client.py _process_msg -> _JSI.reset_ordered_consumer), be dropped again,
                # and so on: a new server-side consumer per message until the client's write times out.
                await feed.close()
            elif self._recent_sub is not None and exc.sub is core_subscription(self._recent_sub):
                self.metrics.recent_dropped += 1  # the ring's wildcard: the page misses a result, nobody's stream breaks
            # else a subscription the edge stopped already (a feed's, a replay's): nothing is missed
            return
        if self.msg_get is not None and self.msg_get.note_error(str(exc)):
            self.msg_get.refused(str(exc))  # said once (_msg_get_changed), not per open
            return
        if self.pulls is not None and self.pulls.note_error(str(exc)):
            self.pulls.refused(str(exc))  # said once (_pulls_changed), not per replay
            for feed in list(self._replays.values()):  # a replay waiting for its first pull: on with push
                replay = feed.replay
                if replay is not None and replay.sub is not None and replay.pull_refused():
                    pending.wake(replay.sub)
            return
        if self.acks is not None and self.acks.note_error(str(exc)):
            self.acks.refused(str(exc))  # said once (_acks_changed), not per result
            # a push replay waiting past its window: on with a new consumer (only those: a wake is
            # a timeout to a reader waiting for its consumer's next result, as feed.end relies on)
            for feed in list(self._replays.values()):
                replay = feed.replay
                if replay is not None and replay.sub is not None and replay.window and replay.taken >= replay.window:
                    pending.wake(replay.sub)
            return
        if "permissions violation" in str(exc).lower():
            # Rate limited: a refused permission is reported once per request that hits it, and any
            # client can make requests (an open per line, unbounded, before). Other errors (a lost
            # connection's) are not: a flood of refusals must not hide them.
            self.limited.log(logging.WARNING, "nats_error", error=error_text(exc))
            return
        log_event(log, logging.WARNING, "nats_error", error=error_text(exc))

    def _count_foreign(self) -> None:
        self.metrics.nats_foreign_messages += 1

    async def _on_disconnected(self) -> None:
        self.metrics.nats_connected = 0
        if self._closing:
            return
        self.metrics.nats_disconnects += 1
        log_event(log, logging.WARNING, "disconnected")

    async def _on_reconnected(self) -> None:
        self.metrics.nats_connected = 1
        self.metrics.nats_reconnects += 1
        log_event(log, logging.INFO, "reconnected")
