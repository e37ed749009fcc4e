"""The seam between the processor and where chunks come from.

An :class:`Input` reads chunks from NATS, feeds them to the correlator and carries out its
decisions; the :class:`~streamproc.nats.processor.Processor` only chooses one, starts it, fires
the correlator's timers through :meth:`Input.dispatch` and answers control requests. Both inputs
(:class:`~streamproc.nats.core_input.CoreInput`, :class:`~streamproc.nats.durable.input.DurableInput`)
implement every member, so the processor never probes for one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any, Awaitable, Callable, Protocol

import msgspec
from msgspec import Meta
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..core.codec import ErrorKind
from ..core.correlator import Correlator, Decision, Notice, Settle, Work
from ..core.events import MigrateReply, MigrateRequest
from ..core.latency import LatencyHistogram
from ..core.wire import ATTEMPT, UNREADABLE_HEADERS, ChunkParser, ContractError, Subjects
from ..logs import LogLimiter, error_text, log_event

if TYPE_CHECKING:
    from ..core.outbox import Outbox
    from ..tracing import Tracing

log = logging.getLogger("streamproc.processor")

Clock = Callable[[], float]


def join_cpu_clock() -> Clock:
    """The clock an offloaded join's CPU is read with (``Work.run``, ``max_decode_cpu``): the
    process's CPU time minus that of the calling thread, the event loop. Joins take turns (one join
    thread behind a ``CapacityLimiter(1)``, and the correlator hands out one ``Work`` at a time), so
    over a join this counts the join thread and the threads the codec drives for it (sglang-zstd's
    compression workers, which ``time.thread_time`` missed: ~8 of ~75 ms of an expert join that
    recompresses at zstd level 6), and not the loop serving other requests meanwhile. A process
    whose other threads are busy (an embedding application's) would be charged for them too;
    ``streamproc run`` has none. Call on the loop thread. Falls back to ``time.thread_time`` where
    per-thread CPU clocks are missing."""
    try:
        loop_cpu = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return time.thread_time
    process_time, clock_gettime = time.process_time, time.clock_gettime
    return lambda: process_time() - clock_gettime(loop_cpu)


class IOStats(msgspec.Struct):
    """Shell-side counters; the correlator's own are in ``Correlator.stats``."""

    unreadable: Annotated[int, Meta(description="messages whose subject does not even name a request: "
                                                "nothing to answer")] = 0
    publish_failures: Annotated[int, Meta(description="results lost because NATS refused the publish (core "
                                                      "mode)")] = 0
    slow_consumer: Annotated[int, Meta(description="input messages nats-py dropped because its pending queue"
                                                   " was full")] = 0
    disconnects: Annotated[int, Meta(description="NATS disconnections (not counting a shutdown)")] = 0
    reconnects: Annotated[int, Meta(description="NATS reconnections after a lost connection")] = 0
    timer_runs: Annotated[int, Meta(description="runs of the timer that ends timed-out requests")] = 0
    foreign_messages: Annotated[int, Meta(description="messages dropped from a JetStream consumer's inbox because "
                                                      "they did not come from JetStream (forged: nats/robust.py)")] = 0


# Per-request events that are expected in normal operation (redeliveries, races at a seal).
QUIET_EVENTS = frozenset({"late_chunk", "rejected_after_finish", "sealed_chunk"})


class Pipeline:
    """What every input shares: the correlator, the clock, the chunk parser, counters and the
    two ways a message ends without a codec (a contract error, a notice for the log)."""

    def __init__(self, correlator: Correlator, subjects: Subjects, clock: Clock,
                 tracing: Tracing | None = None) -> None:
        self.correlator = correlator
        self.subjects = subjects
        self.clock = clock
        self.parse = ChunkParser(subjects)
        self.io = IOStats()
        # Lines any publisher can cause at will are rate limited per event name.
        self.limited = LogLimiter(log)
        # Receipt of a chunk -> the results it made ready handed to NATS, once per chunk (core mode
        # observes it after publishing, durable mode when the outbox first sends the last of them;
        # results a timer or control request releases are not counted: no chunk arrived for them).
        self.result_latency = LatencyHistogram()
        # The inputs call these; with tracing off they are the correlator's own bound methods, so
        # the message path is the same as without tracing (streamproc.tracing).
        self.tracing = tracing
        self.receive = correlator.receive if tracing is None else tracing.receive(correlator.receive)
        self.finish = correlator.finish if tracing is None else tracing.finish(correlator.finish)

    def publisher(self, publish: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        """``nc.publish`` itself, or with tracing on, wrapped in a publish span per result."""
        return publish if self.tracing is None else self.tracing.publisher(publish)

    def contract_error(self, exc: ContractError, msg: Msg, acknowledged: bool) -> list[Decision]:
        """Decisions for a message that broke the wire contract.

        With a request id, the request ends with an ``invalid_chunk`` error result; without one
        there is nobody to answer, so the message is only counted, logged and (``acknowledged``
        inputs) settled so it is not redelivered.
        """
        if exc.request_id is None:
            self.io.unreadable += 1
            self.limited.log(logging.WARNING, "unreadable_message", subject=msg.subject, reason=exc.reason)
            return [Settle((msg,))] if acknowledged else []
        return self.correlator.reject(exc.request_id, exc.reason, self.clock(), msg, attempt=_attempt_of(msg))

    def failed(self, exc: Exception, msg: Msg, acknowledged: bool, subject: str | None = None) -> list[Decision]:
        """Decisions for a message whose handling raised (a bug, never bad input alone): its request
        ends with an ``internal`` error result and the processor moves on; every message ends in a
        decision. Without a readable request id it is settled (``acknowledged``) and counted.
        ``subject``: the chunk subject when the message's own is another (durable: the stored,
        partitioned subject)."""
        subject = subject or msg.subject
        self.limited.log(logging.ERROR, "message_failed", subject=subject, error=error_text(exc))
        try:
            request_id, _ = self.subjects.parse_chunk_subject(subject)
        except ContractError as bad:
            return self.contract_error(bad, msg, acknowledged)
        try:
            return self.correlator.reject(request_id, f"internal error: {error_text(exc)}", self.clock(), msg,
                                          kind=ErrorKind.INTERNAL)
        except Exception as again:  # noqa: BLE001  (the correlator itself is broken for this request)
            log_event(log, logging.ERROR, "message_failed_twice", request_id=request_id, error=error_text(again),
                      exc_info=True)
            self.io.unreadable += 1
            return [Settle((msg,))] if acknowledged else []

    def notify(self, notice: Notice) -> None:
        if notice.event in QUIET_EVENTS:
            log_event(log, logging.DEBUG, notice.event, request_id=notice.request_id, detail=notice.detail)
        else:
            self.limited.log(logging.WARNING, notice.event, request_id=notice.request_id, detail=notice.detail)


# How much lower than the event loop's the join thread's scheduling priority is (nice, Linux only).
# A join that inflates 2 x 32 MiB keeps a core busy ~50-90 ms with the GIL released; on 2 shared cores
# the event loop then competes with it for CPU, not for the GIL, and at nice +10 the scheduler gives the
# loop's passthrough the core first. CPU time, and so ``max_decode_cpu``, is not affected.
JOIN_NICENESS = 10
_join_thread = threading.local()


def run_join(work: Work, clock: Clock) -> None:
    """Run an offloaded join, its CPU read with ``clock`` (:func:`join_cpu_clock`); called in the
    join thread, which first lowers its own priority by
    :data:`JOIN_NICENESS` (once per thread; Linux applies ``nice`` to the calling thread only, so the
    event loop keeps its priority)."""
    if not getattr(_join_thread, "lowered", False):
        _join_thread.lowered = True
        if sys.platform == "linux":
            try:
                os.nice(JOIN_NICENESS)
            except OSError:  # a sandbox that forbids it: joins run at the loop's priority
                pass
    work.run(clock)


class Input(Protocol):
    """Where chunks come from, and how the decisions they lead to reach NATS."""

    stats: msgspec.Struct | None  # the input's own counters, merged into the processor's snapshot
    outbox: Outbox | None  # durable mode: results leave through it (its latency histograms: /metrics)

    async def start(self) -> None:
        """Subscribe (and, durable, create or check streams); return once chunks can arrive."""

    async def stop(self, timeout: float) -> None:
        """Stop reading, finish what was received within ``timeout``, release what is held."""

    async def dispatch(self, decisions: list[Decision]) -> None:
        """Carry out decisions made off the message path (timer, control requests)."""

    async def caught_up(self) -> None:
        """Return once every chunk received before the call has been handled."""

    @property
    def reading(self) -> bool:
        """Whether chunks reach this input once started (``/readyz``; durable: it owns a partition)."""

    def owns(self, request_id: str) -> bool:
        """Whether this instance answers for the request (durable: holds its partition's lease)."""

    async def migrate(self, request_id: str, request: MigrateRequest,
                      seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        """Answer a migrate: ``seal`` the request once every chunk received before is handled (durable:
        the seal is recorded in JetStream before the reply, so it outlives this instance)."""

    def dropped(self, sub: Subscription | None, reply: str | None) -> None:
        """nats-py dropped a delivered message of ``sub`` as a slow consumer."""

    def reconnected(self) -> None:
        """The connection is back (nats-py has replayed the subscriptions); called from its callback."""


def snapshot(correlator: Correlator, io: IOStats, extra: msgspec.Struct | None) -> dict[str, Any]:
    """All counters plus gauges, for logs and tests."""
    out = msgspec.structs.asdict(correlator.stats)
    out["results"] = correlator.stats.results  # derived, not stored
    out.update(msgspec.structs.asdict(io))
    out["inflight"] = correlator.inflight
    if extra is not None:
        out.update(msgspec.structs.asdict(extra))
    return out


def _attempt_of(msg: Msg) -> int | None:
    """The attempt a malformed chunk names, when that header itself is readable (None otherwise): a
    chunk of a sealed attempt is dropped, however malformed, rather than ending the resumed request."""
    headers = msg.headers
    if not headers or UNREADABLE_HEADERS in headers:
        return None
    value = headers.get(ATTEMPT)
    if value is None:
        return 0
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        return None
    return int(value)
