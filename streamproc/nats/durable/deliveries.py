"""The message handlers of a durable input's partitions: every delivery ends in a decision.

A chunk delivery is parsed, counted against its partition's pull credit and decided by the
correlator (:mod:`streamproc.core.correlator`), or first waits for a recovery lookup
(:meth:`~streamproc.nats.durable.recovery.Recovery.recover`) when it may continue a request served
elsewhere; the lookups run as tasks, a request's later deliveries parked behind its own
(:mod:`streamproc.core.lookups`). The common chunk is decided in nats-py's read loop
(``on_message_inline``, :meth:`~streamproc.nats.fast_client.FastClient.deliver_inline`); whatever
needs an await goes to the subscription's callback (``on_message``). A chunk on its
``max_deliver``-th delivery is poison: its request ends with an error.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from ...config import Settings
from ...core.codec import ErrorKind
from ...core.errors import shown
from ...core.correlator import Work
from ...core.events import Chunk, Decision
from ...core.defaults import LOOKUP_ATTEMPTS
from ...core.lookups import Lookups, LookupSlots
from ...core.outbox import Outbox
from ...core.recovery import StoreRead, delivery_count, store_read
from ...core.wire import ContractError
from ...logs import error_text, log_event
from .pulls import Pulls
from .recovery import Recovery
from ..fast_client import chunk_from_block
from ..input import Pipeline
from .outbox_pump import OutboxPump

if TYPE_CHECKING:
    from .input import DurableStats
    from .partitions import Partition

log = logging.getLogger("streamproc.durable")

# Recovery lookups run at once, of different requests (a request's own later chunks park behind its
# lookup and are decided in order after it, core/lookups.py): up to --max-lookups across the owned
# partitions (core/defaults.py MAX_LOOKUPS), the partitions taking turns for a free slot. One at a
# time, 3,000 chunks that each needed one (`Streamproc-Attempt: 1` on fresh ids, a microsecond each to
# publish) held the partition's next request back 2.4-3.1 s on the 2-vCPU machine
# (tests/test_durable_attack_review.py), linear in the flood; several at once keep the read loop busy
# while the server answers, and more than a few only make each (a whole stored result) slower.
#
# Requests of a partition whose chunk needs a lookup while every slot is taken: they wait in
# core/lookups.py for a slot, with their later chunks parked behind them, and the partition goes on
# deciding the chunks of the requests it holds. Before, the partition's callback waited for a slot, and
# every chunk delivered behind it with it: a request already served here waited 4.0 s behind 160 new
# requests' chunks while lookups took 1 s (tests/test_durable_lookups_review.py), a few ms now. Past
# the bound (or PARKED_BYTES) the callback waits for a lookup to end, as before: back-pressure, not a
# NAK, which would bring a legitimate moved request's chunk one delivery nearer max_deliver each time
# (poison: its request ended) and have the server send the flood round again. At most a quarter of
# --max-ack-pending: queued and parked chunks are unacknowledged, and a partition with max_ack_pending
# of them is sent nothing more by the server, its held requests' chunks included.
LOOKUPS_QUEUED = 512
# Bytes of the deliveries parked behind lookups in flight (theirs included), shared by the --partitions
# like PULL_MAX_BYTES: parked chunks have left nats-py's queue, so its pending_bytes_limit no longer
# bounds them. Past it a partition waits for a lookup to end before it parks more (one always parks).
# Each delivery is charged its payload, its headers and PARKED_OVERHEAD (Msg, Chunk, list slots).
PARKED_BYTES = 16 << 20
PARKED_OVERHEAD = 512


class Delivery:
    """A chunk delivery whose decision waits for a recovery lookup (its own or its request's)."""

    __slots__ = ("msg", "deliveries", "parsed", "rid", "_size")

    def __init__(self, msg: Msg, deliveries: int, parsed: Chunk | ContractError, rid: str) -> None:
        self.msg = msg
        self.deliveries = deliveries
        self.parsed = parsed  # the chunk, or the contract it broke (which names the request)
        self.rid = rid
        self._size = -1

    @property
    def size(self) -> int:
        """What parking it costs; counted only for a delivery that parks (most are decided at once)."""
        if self._size < 0:
            parsed, headers = self.parsed, self.msg.headers
            # a parsed chunk's body is its own (the Msg keeps only its ack subject), else the Msg's
            body = parsed.body if isinstance(parsed, Chunk) else self.msg.data
            self._size = len(body) + PARKED_OVERHEAD + (
                sum(len(k) + len(v) for k, v in headers.items()) if headers else 0)
        return self._size


class Deliveries:
    """The handlers of every partition of a durable input, and the recovery lookups each runs.

    ``chunks_stream`` is set once the input has opened it; ``tasks()`` is the input's task group
    (None while it is stopped), where lookups run; ``unstored``, shared with the input's give-up
    hook, says why a request's last result was given up (for its poison error); ``offload`` starts
    the joins among decisions off the loop."""

    def __init__(self, nc: NatsClient, settings: Settings, pipeline: Pipeline, outbox: Outbox, outbox_pump: OutboxPump,
                 pulls: Pulls, recovery: Recovery, stats: DurableStats, clock: Callable[[], float], *,
                 unstored: dict[str, str], offload: Callable[..., list[Decision]],
                 tasks: Callable[[], anyio.abc.TaskGroup | None]) -> None:
        self.nc = nc
        self.settings = settings
        self.pipeline = pipeline
        self.correlator = pipeline.correlator
        self.outbox = outbox
        self.outbox_pump = outbox_pump
        self.pulls = pulls
        self.recovery = recovery
        self.stats = stats
        self._clock = clock
        self._parse = pipeline.parse
        self._chunks_head = f"{settings.prefix}.chunks."
        self._unstored = unstored
        self._offload = offload
        self._tasks = tasks
        self.chunks_stream = ""
        max_payload = getattr(nc, "max_payload", 0) or (1 << 20)
        self._parked_cap = max(PARKED_BYTES // settings.partitions, 2 * max_payload)
        self._queued_cap = max(1, min(LOOKUPS_QUEUED, settings.max_ack_pending // 4))
        # The lookup slots every partition shares, and per partition (its number) what takes a free one.
        self.slots: LookupSlots[Delivery] = LookupSlots(settings.max_lookups)
        self._resume: dict[int, Callable[[Lookups[Delivery], list[Delivery], bool], None]] = {}

    def lookups(self, n: int = 0) -> Lookups[Delivery]:
        """The recovery lookups of partition ``n``, just taken (none yet)."""
        return Lookups(self.slots, self._parked_cap, self._queued_cap, attempts=LOOKUP_ATTEMPTS, key=n)

    def start_queued(self) -> None:
        """Lookups ended: the queued requests take the free slots, the partitions in turn, each one's
        oldest first (core/lookups.py)."""
        while (turn := self.slots.next()) is not None:
            lookups, tokens, retry = turn
            resume = self._resume.get(lookups.key)
            if resume is not None:
                resume(lookups, tokens, retry)
            elif retry:  # no handlers (cannot happen: a partition's lookups exist with its handlers)
                lookups.release(tokens[0].rid, tokens[0])

    def handlers(self, part: Partition) -> tuple[Callable[[Msg], Awaitable[None]], Callable[..., bool]]:
        """A partition's two message handlers, sharing every step of a chunk's decision:

        - ``on_message``, the subscription's callback, decides every message (status messages,
          chunks of a partition being handed over, contract errors, recovery lookups included);
        - ``on_message_inline`` runs in nats-py's read loop
          (:meth:`~streamproc.nats.fast_client.FastClient.deliver_inline`) for the common chunk: a delivery of
          a request this instance knows, or the first chunk of a new one. Whatever needs an await
          (a round trip, a backlogged write buffer) or is not a plain chunk it declines (False)
          before anything changes, and ``on_message`` decides it. Same decisions, same order: a
          partition's messages come here only while nothing of it waits in the callback queue."""
        clock = self._clock
        parse = self._parse
        chunks_head = self._chunks_head
        stored_head_length = part.stored_head_length

        def chunk_subject(stored: str) -> str:
            """The subject a worker published a chunk on, from the one the chunk stream stored it under."""
            return chunks_head + stored[stored_head_length:]

        correlator = self.correlator
        receive = self.pipeline.receive
        failed = self.pipeline.failed
        knows = correlator.knows
        outbox_pump = self.outbox_pump
        pump = outbox_pump.pump
        outbox = self.outbox
        queue = outbox.take  # the outbox itself on the common path: one call less per message
        notify = self.pipeline.notify
        delivered = part.credit.delivered
        redelivered = part.credit.redelivered
        max_deliver = self.settings.max_deliver
        poisoned = self.poisoned
        offload = self._offload
        stats = self.stats
        sealed = part.sealed
        # A first delivery read without splitting the ack subject (v1 form, our stream and consumer;
        # anything else goes through delivery_count).
        ack_head = f"$JS.ACK.{self.chunks_stream}.{part.consumer}."
        first_at = len(ack_head)

        def deliveries_of(reply: str) -> int:
            if reply.startswith("1.", first_at) and reply.startswith(ack_head):
                return 1
            return delivery_count(reply)

        def decide(chunk: Chunk, msg: Msg, deliveries: int, now: float) -> list[Decision]:
            try:  # every message ends in a decision, whatever raises while it is handled
                return poisoned(chunk, msg, deliveries, now) if deliveries >= max_deliver else receive(chunk, now)
            except Exception as exc:  # noqa: BLE001
                return failed(exc, msg, acknowledged=True, subject=chunk_subject(msg.subject))

        def take(decisions: list[Decision] | None, rid: str | None, now: float) -> None:
            if decisions:
                notices = queue(offload(decisions, now), rid, now)
                if notices:
                    for n in notices:
                        notify(n)

        lookups = part.lookups
        looking_up = lookups.by_request  # request ids whose lookups are in flight (the inline path's test)
        contract_error = self.pipeline.contract_error

        def begin(d: Delivery, format: str | None, retake: bool, now: float) -> None:
            """Start the recovery lookup ``d`` needs, or, every slot taken, queue it for the next free one
            (:func:`start_queued`); its request's later deliveries park behind it either way."""
            tasks = self._tasks()
            if tasks is None or not part.active:  # stopping, or handed over: the next owner looks it up
                outbox.nak(part.handback.hold((d.msg,)) if not part.active else (d.msg,))
                return
            if not lookups.room():  # only a new delivery, which asked queue_room() (settle)
                lookups.wait(d.rid, d, d.size)
                stats.lookups_queued += 1
                return
            if retake:  # the stores know the seal: take the request again
                self.recovery.forget(d.rid)
            lookups.begin(d.rid, d, d.size)
            tasks.start_soon(lookup, d, format, now)

        def settle(d: Delivery, now: float, admit: bool) -> bool:
            """Decide ``d``, park it behind its request's lookup or start the lookup it needs. With
            ``admit`` (a new delivery) False, and nothing done, when there is no room for it yet."""
            rid = d.rid
            if rid in lookups:
                if admit and not lookups.fits(d.size):
                    return False
                lookups.park(rid, d, d.size)
                if admit:  # counted once: one handed back by a lookup may park again, behind the next
                    stats.lookups_parked += 1
                return True
            parsed = d.parsed
            msg = d.msg
            decisions: list[Decision] | None = None
            try:  # every message ends in a decision, whatever raises while it is handled
                if isinstance(parsed, ContractError):
                    # A request this instance does not hold may live on in the stores (served
                    # elsewhere, maybe migrated): taken for a new one, it would be ended at seq 0.
                    trip: StoreRead | None = None if knows(rid) else StoreRead.LOOKUP
                else:
                    trip = store_read(correlator, parsed, msg.reply, sealed)
                if trip is None:
                    decisions = conclude(d, now)
                else:
                    if admit and not (lookups.fits(d.size) and (lookups.room() or lookups.queue_room())):
                        return False
                    begin(d, None if isinstance(parsed, ContractError) else parsed.format,
                          trip is StoreRead.RETAKE, now)
            except Exception as exc:  # noqa: BLE001
                decisions = failed(exc, msg, acknowledged=True, subject=chunk_subject(msg.subject))
            take(decisions, rid, now)
            return True

        def conclude(d: Delivery, now: float) -> list[Decision]:
            """``d``'s decisions once nothing more is to be read from the stores for it."""
            parsed = d.parsed
            if isinstance(parsed, ContractError):
                return contract_error(parsed, d.msg, acknowledged=True)
            return decide(parsed, d.msg, d.deliveries, now)

        def resume(taker: Lookups[Delivery], waiting: list[Delivery], retry: bool) -> None:
            """A free slot went to this partition's oldest queued request (:meth:`Deliveries.start_queued`).
            A retry's lookup starts again for its first delivery, the rest still parked; otherwise its
            deliveries are settled again in order: the first starts its lookup (or is decided, should
            its request have become known meanwhile), the rest park behind it."""
            now = clock()
            if taker is not lookups:  # a partition taken again since (its old lookups were abandoned)
                if retry:
                    taker.release(waiting[0].rid, waiting[0])
                return
            if retry:
                d = waiting[0]
                tasks = self._tasks()
                if tasks is None:  # stopping: the stop's hand-over NAKs it with what parked behind it
                    lookups.release(d.rid, d)
                else:
                    tasks.start_soon(lookup, d, None if isinstance(d.parsed, ContractError) else d.parsed.format,
                                     now)
            else:
                for b in waiting:
                    settle(b, now, admit=False)
            part.wake()

        self._resume[part.n] = resume
        start_queued = self.start_queued

        async def lookup(d: Delivery, format: str | None, now: float) -> None:
            """:func:`looked_up` as a task of the input's task group, which an exception escaping it
            would end, and with it every partition: a bug there costs this request a retry instead
            (its deliveries NAKed, unless a decision already took them) and is logged."""
            flight = lookups.flight(d.rid)
            try:
                await looked_up(d, format, now)
            except Exception as exc:  # noqa: BLE001  (store errors are _recover's: this is a bug)
                # (unless it raised after its lookup ended: then its request is settled, or queued again)
                later = lookups.finish(d.rid, d) if lookups.flight(d.rid) is flight else None
                if later is not None:
                    outbox.nak([d.msg, *(b.msg for b in later)], delay=1.0)
                with contextlib.suppress(Exception):  # the free slot goes to the queue (a bug: logged below)
                    start_queued()
                part.wake()
                log_event(log, logging.ERROR, "lookup_task_failed", partition=part.n, request_id=shown(d.rid),
                          error=error_text(exc))
                with contextlib.suppress(Exception):
                    await pump()
            finally:  # cancelled (a stop): its slot is free, its deliveries stay parked for the hand-over
                lookups.cancel(d.rid, flight)

        async def looked_up(d: Delivery, format: str | None, now: float) -> None:
            """A recovery lookup: then ``d`` is decided and the deliveries parked behind it in order. If
            it failed, ``d`` and those behind it stay held (in-progress acks) and the request waits for a
            slot again, up to LOOKUP_ATTEMPTS lookups (core/lookups.py); after the last failure, if
            ``d`` may come back, all are NAKed for a retry in 1 s (a delivery spent)."""
            rid = d.rid
            retry = d.deliveries < max_deliver

            def then() -> str:
                """What follows a failure, for its log line: read once the lookup has ended, since
                the partition may have been handed over meanwhile (its chunks NAKed by the hand-over)."""
                if lookups.closed:
                    return "handed over"
                return "queued again" if lookups.retries_left(rid) else "1s" if retry else "-"

            # A retry's request may have been adopted meanwhile (a migrate reads the stores too).
            ok = knows(rid) or await self.recovery.recover(
                rid, format, now, retry_in=then, current=lambda: rid in lookups,
                role=d.parsed.role if isinstance(d.parsed, Chunk) else None)
            if not ok and lookups.retry(rid, d):
                stats.lookup_retries += 1
                start_queued()  # its slot to the next in line (itself, if nobody else waits)
                await pump()
                return
            later = lookups.finish(rid, d)
            part.wake()
            if later is None:  # handed over meanwhile: NAKed then, and nothing of the lookup was kept
                start_queued()  # its slot to another partition's queue
                return
            if not ok and retry:
                # NAKed for the retry, with what parked behind it; not one on its last delivery, which
                # nats-server would never deliver again: that one is decided now, as it would have been
                # alone (looked up without a retry), the later ones of those parking behind it.
                outbox.nak([d.msg, *(b.msg for b in later if b.deliveries < max_deliver)], delay=1.0)
                for b in later:
                    if b.deliveries >= max_deliver:
                        settle(b, clock(), admit=False)
            else:
                try:
                    decisions = conclude(d, now)
                except Exception as exc:  # noqa: BLE001
                    decisions = failed(exc, d.msg, acknowledged=True, subject=chunk_subject(d.msg.subject))
                take(decisions, rid, now)
                for b in later:  # in delivery order; an earlier one may start another lookup of rid
                    settle(b, clock(), admit=False)
            start_queued()
            await pump()

        async def on_message(msg: Msg) -> None:
            reply = msg.reply
            if not reply or not reply.startswith("$JS.ACK."):  # a delivery has its ack subject
                if self.pulls.on_status(part, msg) and part.active:
                    await self.pulls.pull(part)
                return
            if not part.active:  # partition handed over: NAKed with the hand-over's, in stream order
                outbox.nak(part.handback.hold((msg,)))
                await pump()
                return
            now = clock()
            deliveries = deliveries_of(reply)
            if deliveries > 1:  # every redelivery, of known requests too (a metric)
                stats.redelivered += 1
                redelivered(now)  # more may wait in the redelivery queue: the pull below is careful
            size = len(msg.data) + len(msg.subject) + len(reply)
            try:
                try:
                    # chunk_subject(msg.subject), inline: one Python call less on every chunk of this path
                    parsed: Chunk | ContractError = parse(chunks_head + msg.subject[stored_head_length:],
                                                          msg.headers, msg.data, msg)
                    # parsed; its token (this Msg) may be held: a worker's 64 KiB of headers, in no budget,
                    # and its body, which the chunk holds (charged) unless it is a repeat held as a token only
                    msg.headers = None
                    msg.data = b""
                except ContractError as exc:
                    parsed = exc
                rid = parsed.request_id
            except Exception as exc:  # noqa: BLE001  (every message ends in a decision)
                take(failed(exc, msg, acknowledged=True, subject=chunk_subject(msg.subject)), None, now)
            else:
                if rid is None:  # a contract error without a request: nobody to look up
                    take(contract_error(parsed, msg, acknowledged=True), None, now)  # type: ignore[arg-type]
                else:
                    d = Delivery(msg, deliveries, parsed, rid)
                    while not settle(d, now, admit=True):  # no room: wait for a lookup to end (back-pressure)
                        part.waiting = True
                        try:
                            await part.freed.wait()
                        finally:
                            part.waiting = False
                        if not part.active:
                            outbox.nak(part.handback.hold((msg,)))
                            break
                        now = clock()
            # Counted as delivered once decided or parked, not before: a delivery waiting above for parked
            # bytes to free stays charged to its pull's credit, so no further pull is sent meanwhile and
            # what the partition's pulls brought (this one, the queue behind it) stays within their
            # max_bytes (PULL_MAX_BYTES). Counted before the wait, each partition held one ~1 MB chunk
            # more than its budgets (tests/test_durable_attack_review.py, the lookup flood).
            if delivered(clock(), size) and part.active:
                await self.pulls.pull(part)
            await pump()

        nc = self.nc

        def on_message_inline(subject: str, reply: str, headers: Any, data: bytes) -> bool:
            """``headers``: the raw header block (partitions.py registers this with ``raw_headers``), or
            the parsed dict or None where the read loop has no block left to hand over."""
            # nc.backlogged(), its rule inline (one Python call per chunk less; a flag kept current instead
            # would need nats-py's own writers of _pending_data_size hooked: docs/benchmarks.md, "Durable
            # CPU, fifth pass")
            if (not reply or not reply.startswith("$JS.ACK.") or not part.active
                    or nc._pending_data_size * 2 > nc._max_pending_size > 0):
                return False  # on_message decides it
            # The chunk's token: the outbox acks its reply. Its headers are dropped once parsed (it may be
            # held: a worker's 64 KiB of headers, as in on_message), so it never holds them.
            msg = Msg(nc, subject, reply, data, None)
            try:  # chunk_subject(subject), inline; parse(..., parse_header_block(headers), ...) in one read
                chunk = chunk_from_block(parse, chunks_head + subject[stored_head_length:], headers, data,
                                         msg)
            except Exception:  # noqa: BLE001  (ContractError or a bug: on_message decides it)
                return False
            msg.data = b""
            rid = chunk.request_id
            # store_read() is None for a first attempt's chunk of a known request, the common case:
            # not called then (this path's calls per chunk: docs/benchmarks.md, "Calls per chunk").
            if rid in looking_up or ((chunk.attempt or not knows(rid))
                                     and store_read(correlator, chunk, reply, sealed) is not None):
                return False  # its request's lookup is in flight (it parks), or it needs one
            now = clock()
            # deliveries_of(reply), its first-delivery test inline
            deliveries = 1 if reply.startswith("1.", first_at) and reply.startswith(ack_head) else delivery_count(reply)
            if deliveries > 1:
                stats.redelivered += 1
                redelivered(now)  # before the pull below: it must be a careful one
            if delivered(now, len(data) + len(subject) + len(reply)):
                self.pulls.pull_nowait(part)
            # decide(chunk, msg, deliveries, now), inline (one Python call per chunk less; docs/benchmarks.md,
            # "Durable CPU, seventh pass")
            try:  # every message ends in a decision, whatever raises while it is handled
                decisions = (poisoned(chunk, msg, deliveries, now) if deliveries >= max_deliver
                             else receive(chunk, now))
            except Exception as exc:  # noqa: BLE001
                decisions = failed(exc, msg, acknowledged=True, subject=chunk_subject(msg.subject))
            if decisions:  # take(decisions, rid, now), inline
                # offload(decisions, now) only when a Work is among them: it returns the list itself
                # otherwise (one Python call per chunk less; docs/benchmarks.md, "Durable CPU, seventh pass")
                for d in decisions:
                    if d.__class__ is Work:
                        decisions = offload(decisions, now)
                        break
                notices = queue(decisions, rid, now)
                if notices:
                    for n in notices:
                        notify(n)
            # Looked up each time: stage_writes() replaces it after start-up. Staged, it is
            # FastClient.stage_write, which does nothing while a write is already set (a timer or the
            # read's end): not called then (one Python call per chunk less; docs/benchmarks.md, "Durable
            # CPU, fifth pass").
            if not outbox_pump.staged or nc._write_timer is None:  # type: ignore[attr-defined]
                outbox_pump.release()
            return True

        return on_message, on_message_inline

    def poisoned(self, chunk: Chunk, msg: Msg, deliveries: int, now: float) -> list[Decision]:
        """A chunk on its ``max_deliver``-th delivery: whatever kept it from being settled before
        (a crash while handling it, results that cannot be stored), its request ends with an error
        result now and the chunk is terminated once that result is stored. Unless its request already
        ended because its results can never be stored (its subject is full): then it is dropped on
        arrival as ``unstorable`` as that request's every later chunk is, not reported as poison."""
        if self.correlator.is_unstorable(chunk.request_id):
            return self.correlator.receive(chunk, now)
        self.stats.poisoned += 1
        self.pipeline.limited.log(logging.ERROR, "chunk_poisoned", request_id=chunk.request_id,
                                  role=chunk.role.value, seq=chunk.seq, deliveries=deliveries)
        self.outbox.terminate(msg)
        cause = self._unstored.pop(chunk.request_id, None)
        return self.correlator.reject(
            chunk.request_id, f"{chunk.role.value} chunk seq {chunk.seq} was delivered {deliveries} times without "
            f"being settled (max_deliver {self.settings.max_deliver}): dropped as poison"
            + (f"; {cause}" if cause else ""), now, msg, kind=ErrorKind.INTERNAL)
