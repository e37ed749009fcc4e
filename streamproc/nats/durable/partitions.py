"""The partitions a durable input owns: taken and given up through leases, each read through its
own subscription and pull consumer, kept alive by a watchdog.

Which instance reads which partition is the lease table's (:mod:`streamproc.nats.durable.leases`); this
module opens a partition it was granted (its consumer, its inbox subscription with the handlers of
:mod:`streamproc.nats.durable.deliveries`, its first pull), hands one over when its lease goes, is
released or may have run out (the fence before any result leaves): its subscription drained, its
pulls forgotten by the server, then its requests' chunks NAKed in stream order
(:mod:`streamproc.core.handback`). The watchdog re-issues the pulls the server forgot, repairs
missing consumers, sheds the requests that hold a partition's chunks longest, and has the outbox
resend overdue results and extend held chunks' ack deadlines.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, ConsumerInfo

from ...config import Settings
from ...core.correlator import Correlator
from ...core.credit import PullCredit
from ...core.defaults import RETUNE_PER_STEP
from ...core.events import Result
from ...core.handback import UNKNOWN, HandBack, in_stream_order, stream_sequence
from ...core.lookups import Lookups
from ...core.outbox import Outbox
from ...core.partition_bounds import held_limit
from ...core.partitions import PartitionScheme
from ...core.seal_list import ALL_SEALED, AllSealed, SealList, seal_lists
from ...logs import error_text, log_event
from .pulls import REDELIVERY_SLACK, Pulls
from .recovery import HANDOVER_TIMEOUT
from .leases import LeaseChange, LeaseTable
from .migrations import SCAN_TIMEOUT, MigrationLedger
from .outbox_pump import OutboxPump
from ..subscription import handled_all
from ..streams import consumer_retuned, ensure_consumer, partition_consumer_config, partition_consumer_name

if TYPE_CHECKING:
    from .deliveries import Deliveries, Delivery
    from .input import DurableStats

log = logging.getLogger("streamproc.durable")

WATCHDOG_EVERY = 0.25
# Least seconds between two lease checks before results are sent (Partitions.fence): well inside the lease's
# margin (10% of lease_ttl, which is at least 1 s).
FENCE_EVERY = 0.02
# A hand-over's NAKs wait until the server has dropped the closing subscription's pulls (core/handback.py):
# the consumer info request that makes it drop them is bounded by this, and so is the wait of a new
# open of the same partition for them (under the lease lock: well inside a lease period).
FORGET_PULLS_TIMEOUT = 1.0


class Partition:
    """One owned partition: its consumer, inbox subscription and pull credit."""

    __slots__ = ("n", "consumer", "filter", "stored_head_length", "inbox", "sub", "credit", "active", "pull_subject",
                 "sealed", "opened", "lookups", "freed", "waiting", "handback", "handed_back")

    def __init__(self, n: int, consumer: str, filter_subject: str, stored_head_length: int, stream: str,
                 credit: PullCredit, sealed: SealList | AllSealed, opened: float,
                 lookups: Lookups[Delivery]) -> None:
        self.n = n
        self.opened = opened  # our clock when this instance took the partition
        self.consumer = consumer
        self.filter = filter_subject
        # Characters of a stored subject before its ``<request_id>.<role>`` (PartitionScheme.head): the
        # chunk subject a worker published is the chunks head and what follows them.
        self.stored_head_length = stored_head_length
        self.inbox = ""
        self.sub: Subscription | None = None
        self.credit = credit
        self.active = False
        self.pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        # Its requests with a seal record (core/seal_list.py): read from the migrations bucket before
        # the first pull, then our own seals.
        self.sealed = sealed
        # Recovery lookups in flight and the deliveries parked behind them; ``freed`` is set (and
        # replaced) whenever one ends or they are abandoned, for a callback waiting for room.
        self.lookups = lookups
        self.freed = anyio.Event()
        self.waiting = False  # the callback holds a delivery until parked bytes free (the watchdog's "behind")
        # Its NAKs once it is handed over (also the ones of deliveries that arrive while its subscription
        # drains), held until the server dropped its pulls, then sent in stream order (core/handback.py).
        self.handback: HandBack[Msg] = HandBack(reply_of)
        self.handed_back = anyio.Event()

    def wake(self) -> None:
        freed, self.freed = self.freed, anyio.Event()
        freed.set()

    def abandon_lookups(self) -> list[Msg]:
        """The partition is handed over: every parked delivery, for a NAK (their lookups' outcomes are
        dropped when they end); a callback waiting for room wakes and NAKs its own."""
        out = [d.msg for d in self.lookups.abandon()]
        self.wake()
        return out


def reply_of(msg: Msg) -> str | None:
    return getattr(msg, "reply", None)


def stored_message(msg: Msg) -> int:
    """The stream sequence a delivery's ``Msg`` delivers (a redelivery, also by a recreated consumer,
    names the same one); a token without one is its own (a negative, never a sequence)."""
    seq = stream_sequence(reply_of(msg))
    return -id(msg) if seq == UNKNOWN else seq


class Partitions:
    """The partitions this instance owns (``owned``), their leases, hand-overs and watchdog.

    ``leases``, ``ledger`` and ``chunks_stream`` are set once the input has opened them, and
    ``deliveries`` (the handlers a partition is opened with) once it is built; ``tasks()`` is the
    input's task group (None while it is stopped)."""

    def __init__(self, nc: NatsClient, settings: Settings, scheme: PartitionScheme, correlator: Correlator,
                 outbox: Outbox, outbox_pump: OutboxPump, pulls: Pulls, stats: DurableStats,
                 clock: Callable[[], float], instance: str, *,
                 tasks: Callable[[], anyio.abc.TaskGroup | None]) -> None:
        self.nc = nc
        self.settings = settings
        self.scheme = scheme
        self.correlator = correlator
        self.outbox = outbox
        self.outbox_pump = outbox_pump
        self.pulls = pulls
        self.stats = stats
        self.instance = instance
        self._clock = clock
        self._tasks = tasks
        self.leases: LeaseTable | None = None
        self.ledger: MigrationLedger | None = None
        self.chunks_stream = ""
        self.deliveries: Deliveries | None = None
        self.owned: dict[int, Partition] = {}
        self._retune_next = 0  # where retune_consumers goes on from
        self._lapsed: list[Partition] = []  # given up by fence, subscriptions not closed yet
        # Partition number -> the handed-over partition whose NAKs wait for its pulls to be gone (fence's):
        # a new open of the number waits for them first (core/handback.py).
        self._handing_back: dict[int, Partition] = {}
        self._fenced_at = 0.0
        # Held chunks count towards a partition's max_ack_pending: past 3/4 of it the partition sheds
        # its longest-idle holders (overloaded) down to 1/2, so new chunks are always delivered.
        self._held_limit = held_limit(settings.max_ack_pending)
        self._reconnects = 0
        self._wake = anyio.Event()  # set on a reconnect: the watchdog's next round runs at once
        self._lease_lock = anyio.Lock()
        self.migrating: dict[int, int] = {}  # partition -> migrates being answered for it
        self._seal_ttl = settings.results_max_age or float("inf")  # a seal record lives as long as the results

    async def start(self, tasks: anyio.abc.TaskGroup) -> None:
        """Take the partitions the leases grant now; then keep the leases and every partition's pulls
        alive in ``tasks``."""
        self._reconnects = self.nc.stats["reconnects"]
        await self.rebalance()
        tasks.start_soon(self.lease_loop)
        tasks.start_soon(self.watchdog)

    def unfinished(self) -> list[Partition]:
        """The owned partitions and the lapsed ones whose hand-over is not finished (the input stops)."""
        return list({id(p): p for p in (*self.owned.values(), *self._handing_back.values())}.values())

    def owns(self, request_id: str) -> bool:
        """Whether this instance holds the lease of the request's partition (it alone answers for it)."""
        return self.scheme.of(request_id) in self.owned

    async def rebalance(self) -> None:
        assert self.leases is not None
        async with self._lease_lock:
            # Leases end only in fence (LeaseTable.step gives none up, its KV requests awaited): before the
            # step, so no lapsed one counts in the share; during it, at each send; after it, what lapsed or
            # was found taken over meanwhile (tests/test_migration_crash.py, "lease step").
            self.fence(0)
            change: LeaseChange = await self.leases.step()
            self.fence(0)
            self.stats.members = self.leases.members
            self.stats.lease_bucket_changes = self.leases.bucket_ttl_changes
            self.stats.lease_bucket_recreations = self.leases.bucket_recreations
            for n in change.surplus:
                self.stats.leases_released += 1
                log_event(log, logging.INFO, "lease_released", partition=n, instance=self.instance,
                          members=self.leases.members)
                await self.lose(n, graceful=True)
                await self.leases.release(n)
            sealed: dict[int, SealList] | None = None
            if change.acquired:  # once per step, before any acquired partition is pulled from
                try:
                    sealed = await self._seal_snapshot()
                except Exception as exc:  # noqa: BLE001  (correct without it, only slower)
                    log_event(log, logging.WARNING, "seal_list_unreadable", error=error_text(exc),
                              detail="every first chunk of a new request on the partitions taken now is looked up")
            for n in change.acquired:
                seals = ALL_SEALED if sealed is None else sealed.get(n)
                if seals is None:  # no record on this partition
                    seals = SealList(self._seal_ttl)
                try:
                    await self.open(n, seals)
                except Exception as exc:  # e.g. the consumer's stream is electing a leader: try again later
                    log_event(log, logging.WARNING, "partition_open_failed", partition=n, error=error_text(exc))
                    await self.lose(n)
                    await self.leases.release(n)
                    continue
                self.stats.leases_acquired += 1
                log_event(log, logging.INFO, "lease_acquired", partition=n, instance=self.instance,
                          members=self.leases.members)
            self.stats.partitions = len(self.owned)

    async def lease_loop(self) -> None:
        while True:
            # A third of the lease's life: of --lease-ttl, or of the bucket's max age if it was shortened.
            await anyio.sleep(self.leases.period if self.leases is not None else self.settings.lease_ttl / 3)
            try:
                await self.rebalance()
                # Bounded: a consumer_info unanswered (the chunk stream electing a leader) must not
                # hold the next renewal past the leases' validity.
                with anyio.move_on_after(self.leases.period / 2 if self.leases is not None else 1.0):
                    await self.retune_consumers()
            except Exception as exc:  # never let lease trouble kill the processor; expiry is checked apart
                log_event(log, logging.WARNING, "lease_step_failed", error=error_text(exc))

    async def _seal_snapshot(self) -> dict[int, SealList]:
        """The seal list of every partition with seal records, each record's expiry on our clock.

        Read whenever partitions are taken, before their first pull: the previous owner (maybe
        dead) may have sealed a request whose sealed attempt's first output chunk reaches this
        instance only now, and the hot path looks such a chunk up only if its request is listed.
        Later seals of an owned partition are this instance's own (:meth:`note_sealed`)."""
        assert self.ledger is not None
        now = self._clock()
        # Bounded well inside a lease period: the lease lock is held meanwhile, renewals wait for it.
        records = await self.ledger.sealed(timeout=min(SCAN_TIMEOUT, self.settings.lease_ttl / 3))
        return seal_lists(records, self.scheme.of, self._seal_ttl, now)

    def note_sealed(self, rid: str) -> None:
        """``rid`` has a seal record now: its partition's later first chunks of it are looked up."""
        part = self.owned.get(self.scheme.of(rid))
        if part is not None:
            part.sealed.note(rid, self._clock())

    async def open(self, n: int, sealed: SealList | AllSealed) -> None:
        old = self._handing_back.get(n)
        if old is not None:
            # This instance's own lapsed subscription of the partition is still being handed over: its
            # NAKs first, or our first pulls would take later chunks before them (core/handback.py).
            with anyio.move_on_after(2 * FORGET_PULLS_TIMEOUT):
                await old.handed_back.wait()
        deliveries = self.deliveries
        assert deliveries is not None
        now = self._clock()
        credit = self.pulls.credit(now)
        part = Partition(n, partition_consumer_name(n), self.scheme.filter(n), len(self.scheme.head(n)),
                         self.chunks_stream, credit, sealed, now, deliveries.lookups(n))
        info = await self._ensure_consumer(part)
        if info.num_ack_pending or info.num_redelivered:
            # Chunks delivered before and not acknowledged (a previous owner's, NAKed or held) come back
            # within ack_wait: careful pulls until then (core/credit.py). None: a fresh start or a clean
            # backlog reads at full batches from the first pull.
            credit.expect_redeliveries(now + self.settings.ack_wait + REDELIVERY_SLACK)
        part.inbox = self.nc.new_inbox()
        on_message, on_message_inline = deliveries.handlers(part)
        part.sub = await self.nc.subscribe(part.inbox, cb=on_message,
                                           pending_msgs_limit=self.settings.pending_msgs_limit,
                                           pending_bytes_limit=self.settings.pending_bytes_limit)
        if self.outbox_pump.inline:  # the common chunk handled in the read loop (on_message_inline)
            # raw_headers: the chunk is read from its header block in one pass (chunk_from_block)
            self.nc.deliver_inline(part.sub, on_message_inline, raw_headers=True)
        part.active = True
        self.owned[n] = part
        await self.pulls.pull(part)

    def _consumer_config(self, part: Partition) -> ConsumerConfig:
        s = self.settings
        return partition_consumer_config(part.consumer, part.filter, ack_wait=s.ack_wait,
                                         max_ack_pending=s.max_ack_pending, max_deliver=s.max_deliver)

    async def _ensure_consumer(self, part: Partition) -> ConsumerInfo:
        return await ensure_consumer(self.nc.jetstream(timeout=10), self.chunks_stream, self._consumer_config(part))

    async def retune_consumers(self) -> None:
        """Bring the owned partitions' consumers back to our tuning if someone edited them since
        they were opened: an ``ack_wait`` shorter than ours redelivers held chunks between their
        in-progress acks, and at ``--max-deliver`` deliveries a healthy request ended as poison."""
        js = self.nc.jetstream(timeout=max(0.5, self.settings.lease_ttl / 4))
        parts = [part for part in self.owned.values() if part.active]
        if not parts:
            return
        # At most RETUNE_PER_STEP a step, in turn from where the last step stopped: the JetStream API
        # load is bounded whatever the partitions an instance owns (1,024 of them: 512 requests a second
        # at a check of each per step), and each is checked within ceil(owned / RETUNE_PER_STEP) steps.
        start = self._retune_next % len(parts)
        for part in (parts[start:] + parts[:start])[:RETUNE_PER_STEP]:
            self._retune_next += 1
            try:
                info = await js.consumer_info(self.chunks_stream, part.consumer)
                found = consumer_retuned(info.config, self._consumer_config(part))
                if not found:
                    continue
                self.stats.consumers_retuned += 1
                log_event(log, logging.ERROR, "consumer_retuned", partition=part.n, consumer=part.consumer,
                          found="; ".join(found), detail="edited under the running processor: set back")
                await self._ensure_consumer(part)
            except Exception as exc:  # noqa: BLE001  (deleted: the watchdog's repair; else the next step)
                log_event(log, logging.DEBUG, "consumer_check_failed", partition=part.n, error=error_text(exc))

    async def lose(self, n: int, graceful: bool = False) -> None:
        """Stop serving partition ``n``: later arrivals are NAKed, held chunks NAKed, state dropped."""
        part = self.owned.get(n)
        if part is not None:
            await self.close(part)
        parts = (part,) if part is not None else ()  # (a lapsed one is close_lapsed's)
        scheme = self.scheme

        def belongs(rid: str) -> bool:
            return scheme.of(rid) == n

        if graceful:  # let results already decided be stored, so the next owner's lookup sees them
            await self.outbox_pump.wait_idle(HANDOVER_TIMEOUT, belongs)
            # and seals already past their ownership check be recorded before the next owner reads them
            with anyio.move_on_after(HANDOVER_TIMEOUT):
                while self.migrating.get(n):
                    await anyio.sleep(0.01)
        self.hand_over(belongs, parts)
        await self.outbox_pump.pump()

    async def close(self, part: Partition) -> None:
        """Stop reading partition ``part``: its subscription drained and its pulls gone from the server.
        Its NAKs (parked deliveries, deliveries that arrive meanwhile) are held in ``part.handback``;
        the caller sends them with the hand-over's (:meth:`hand_over`), in stream order."""
        part.active = False
        self.outbox.nak(part.handback.hold(part.abandon_lookups()))
        if self.owned.get(part.n) is part:  # not a later open of the same partition (taken again)
            del self.owned[part.n]
            # Until _handed_back: a stop that cancels this hand-over (lose, in the lease loop) sends its NAKs.
            self._handing_back[part.n] = part
        sub, part.sub = part.sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                # UNSUB, a round trip (everything delivered before it has arrived), then what arrived
                # runs through the handler, whose NAKs part.handback holds.
                with anyio.move_on_after(5):
                    await sub.drain()
            except nats.errors.Error:
                pass
            await self._forget_pulls(part)

    async def _forget_pulls(self, part: Partition) -> None:
        """Make the server drop the pulls of ``part``'s drained subscription before its NAKs go out.

        After the UNSUB they stay in the consumer's waiting queue until something looks at them; were
        a NAK the first to, ``loopAndGatherMsgs`` would take that redelivery from the front of the
        redelivery queue, ``nextWaiting`` drop the uninterested pulls and return none, and the
        redelivery go to the back (``addToRedeliverQueue``): a gap in its request. A consumer info
        request drops them (``infoWithSnapAndReply`` calls ``o.processWaiting(false)``, which removes
        the waiting requests without interest; nats-server 2.10 to 2.15)."""
        with anyio.move_on_after(FORGET_PULLS_TIMEOUT):
            try:
                await self.nc.jetstream(timeout=FORGET_PULLS_TIMEOUT).consumer_info(self.chunks_stream, part.consumer)
            except Exception as exc:  # noqa: BLE001  (then the first redelivery may go to the back: logged)
                log_event(log, logging.DEBUG, "forget_pulls_failed", partition=part.n, error=error_text(exc))

    def fence(self, every: float = FENCE_EVERY) -> None:
        """Stop serving, at once, every partition whose lease may have run out: called before results
        leave (``OutboxPump``'s fence, at most every ``every`` seconds: one clock read per send
        otherwise) and by the watchdog (``every`` 0).

        Between two watchdog rounds a process that stalled past the lease's margin (a GC pause,
        SIGSTOP, a starved host) would, when it runs again, publish the results its PubAcks release,
        while the next owner may already have read the stored results and sealed a migrate on them:
        a stale attempt's result stored after the seal, under the id the resumed attempt's result
        then collides with. The partition's requests are handed over here (queued results dropped,
        nothing of it decided any more) and its subscription is closed in a task (or by the
        watchdog's next round), which then NAKs its inputs and what arrived meanwhile, in stream
        order, once the server has dropped its pulls (core/handback.py)."""
        leases = self.leases
        if leases is None:
            return
        now = self._clock()
        if now - self._fenced_at < every and not leases.taken_over:  # (a lease found taken: at once)
            return
        self._fenced_at = now
        expired = leases.expired(now)
        for n in expired:
            self.stats.leases_lost += 1
            log_event(log, logging.WARNING, "lease_expired", partition=n, instance=self.instance)
            part = self.owned.pop(n, None)
            scheme = self.scheme
            tokens = self._abandon(lambda rid, n=n: scheme.of(rid) == n)
            if part is None:
                self.outbox.nak(in_stream_order(tokens, reply_of))
                continue
            # Results dropped now; the NAKs wait until its subscription is closed (close_lapsed).
            part.active = False
            self.outbox.nak(part.handback.hold([*part.abandon_lookups(), *tokens]))  # held: nothing NAKed yet
            self._lapsed.append(part)
            self._handing_back[n] = part
        if expired:
            self.stats.partitions = len(self.owned)
            tasks = self._tasks()
            if tasks is not None:
                tasks.start_soon(self.close_lapsed)

    async def close_lapsed(self) -> None:
        """Close the subscriptions of the partitions :meth:`fence` gave up (their waiting pulls go too),
        then send their NAKs."""
        while self._lapsed:
            part = self._lapsed.pop()
            await self.close(part)
            self.outbox.nak(self._handed_back(part))
        await self.outbox_pump.pump()

    def _abandon(self, belongs: Callable[[str], bool]) -> list[Msg]:
        """Drop the queued results of the requests ``belongs`` picks and forget them; their chunks, to NAK."""
        # Requests whose results were given up before they were stored must be forgotten even when
        # the correlator holds them as finished: else, should the partition come back here, their
        # redelivered chunks would count as late (and be acked) instead of being recovered.
        tokens, unstored = self.outbox.abandon(belongs)
        tokens.extend(self.correlator.abandon(belongs, unstored))
        return tokens

    def hand_over(self, belongs: Callable[[str], bool], parts: Iterable[Partition] = ()) -> None:
        """NAK the chunks of the requests ``belongs`` picks, with what ``parts`` (closed: their pulls
        gone) held, in stream order (core/handback.py)."""
        tokens = self._abandon(belongs)
        for part in parts:
            tokens.extend(self._handed_back(part))
        self.outbox.nak(in_stream_order(tokens, reply_of))

    def _handed_back(self, part: Partition) -> list[Msg]:
        """What ``part`` held, to NAK now (its pulls are gone); what it is given later is NAKed at once."""
        out = part.handback.release()
        if self._handing_back.get(part.n) is part:
            del self._handing_back[part.n]
        part.handed_back.set()
        return out

    # ------------------------------------------------------------------------------ watchdog

    async def watchdog(self) -> None:
        """Keep every partition's pulls alive; resend overdue results; extend held chunks' ack deadlines.

        A chunk gets its first +WPI at the second progress round after it was first seen held, i.e.
        within ``2 * (ack_wait / 4 + interval) <= 3/4 * ack_wait`` of delivery: before redelivery.
        """
        interval = min(WATCHDOG_EVERY, self.settings.ack_wait / 8)
        while True:
            with anyio.move_on_after(interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self._watch()
            except Exception as exc:
                log_event(log, logging.WARNING, "watchdog_failed", error=error_text(exc))

    async def _watch(self) -> None:
        if not self.nc.is_connected:
            return  # nothing can be sent; a reconnect is noticed on the first round after it
        now = self._clock()
        reconnects = self.nc.stats["reconnects"]
        reconnected = reconnects != self._reconnects
        self._reconnects = reconnects
        self.fence(every=0)
        await self.close_lapsed()
        for part in list(self.owned.values()):
            if not part.active:
                continue
            credit = part.credit
            silent_for = now - credit.last_seen
            sub = part.sub
            # Deliveries waiting for the callback: the server answers, the partition is behind.
            behind = part.waiting or (sub is not None and sub.pending_msgs > 0)
            watch = credit.watch(now, reconnected, behind)
            if watch.lost:
                self.stats.lost_pulls += 1
                log_event(log, logging.INFO, "pull_lost", partition=part.n, silent_for=f"{silent_for:.1f}s")
            if watch.repair:
                self.stats.consumer_repairs += 1
                try:
                    await self._ensure_consumer(part)
                except Exception as exc:
                    log_event(log, logging.WARNING, "consumer_repair_failed", partition=part.n, error=error_text(exc))
                    continue
            if watch.pull:
                await self.pulls.pull(part)
        self._shed_held(now)
        self.outbox_pump.tick(now, reconnected, self._unsettled)
        await self.outbox_pump.pump()

    async def caught_up(self) -> None:
        """Return once every chunk delivered to any owned partition at the call has been handled
        (a control request must not overtake them)."""
        for part in list(self.owned.values()):
            sub = part.sub
            await handled_all(sub, lambda: part.sub is sub)
            # ... and decided: the ones parked behind a recovery lookup are, once it ends (woken by
            # each lookup's end; a lookup cancelled by a stop wakes nobody, hence the poll).
            lookups = part.lookups
            waiting = lookups.requests()
            while waiting and not lookups.closed:
                with anyio.move_on_after(0.05):
                    await part.freed.wait()
                waiting = [rid for rid in waiting if rid in lookups]

    def _unsettled(self) -> Iterator[object]:
        """Every delivery still held: the correlator's, and those parked behind recovery lookups."""
        yield from self.correlator.unsettled()
        for part in list(self.owned.values()):
            for d in part.lookups.tokens():
                yield d.msg

    def reconnected(self) -> None:
        """Run the watchdog's round now rather than up to an interval later: after an outage the
        server has forgotten our pulls, and the results readied meanwhile wait for that round (it
        sends them, and everything in flight, again)."""
        self._wake.set()

    def _shed_held(self, now: float) -> None:
        """Held prefill legs (and reorder backlogs) never stall a partition: the server delivers
        nothing more to a partition once ``max_ack_pending`` chunks are unacknowledged, so past 3/4
        of it the requests holding chunks longest without progress are ended (``overloaded``) until
        the partition holds 1/2 (:func:`~streamproc.core.partition_bounds.held_limit`); their chunks
        are acknowledged when the error results are stored."""
        limit = self._held_limit
        scheme = self.scheme
        for n, held in self.correlator.held_tokens(scheme.of, stored_message).items():
            excess = limit.excess(held)
            if not excess or n not in self.owned:
                continue
            reason = (f"processor overloaded: partition {n} holds {held} unacknowledged chunks (more than 3/4 of "
                      f"max_ack_pending {self.settings.max_ack_pending}); the requests waiting longest were ended")
            decisions = self.correlator.shed(lambda rid, n=n: scheme.of(rid) == n, excess, now,
                                             reason, stored_message)
            log_event(log, logging.WARNING, "partition_shed", partition=n, held=held,
                      requests=sum(1 for d in decisions if isinstance(d, Result)))
            self.outbox_pump.take(decisions, None)
