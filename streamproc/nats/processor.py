"""The NATS shell around the sans-I/O correlator: messages in, decisions out, nothing clever.

Everything that decides lives in :mod:`streamproc.correlator`; this module only moves bytes
between NATS and it, reads the clock, fires timeouts and logs. The per-message path is kept
lean because aggregated passthrough is benchmarked against a bare nats-py relay: no logging,
no extra coroutines, no awaits other than ``nc.publish``.

Inputs are chosen by ``mode``: ``core`` is a plain subscription (at-most-once, nothing to
acknowledge) served by :meth:`Processor._on_message`; ``durable`` is
:class:`streamproc.nats.durable_input.DurableInput`, JetStream pull consumers whose chunks are acknowledged
only once the results they contributed to are stored. ``auto`` picks durable when the server has
JetStream. The core hot path is untouched by the durable one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import anyio
import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..catalog import Catalog
from ..core.codec import CodecOptions
from ..config import Settings
from .control import ControlPlane
from ..core.correlator import CodecResolver, Correlator, Decision, Notice, Settle, Stats, UnknownFormat
from .streams import StreamMismatch, jetstream_available
from ..core.wire import ChunkParser, ContractError, Result, result_headers

log = logging.getLogger("streamproc.processor")

Clock = Callable[[], float]
T = TypeVar("T")
MessageHandler = Callable[[Msg], Awaitable[None]]


class StartupError(RuntimeError):
    """The processor cannot start (unknown format, broken codec, NATS unreachable). A user error."""


class IOStats(msgspec.Struct):
    """Shell-side counters; the correlator's own are in :attr:`Processor.stats`."""

    unreadable: int = 0  # messages whose subject does not even name a request: nothing to answer
    publish_failures: int = 0  # results lost because NATS refused the publish (core mode)
    slow_consumer: int = 0  # input messages nats-py dropped because its pending queue was full
    disconnects: int = 0
    reconnects: int = 0
    timer_runs: int = 0


def kv(**fields: object) -> str:
    """``key=value`` log text; values with spaces or quotes are JSON-quoted so lines stay parseable."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = msgspec.json.encode(text).decode()
        parts.append(f"{key}={text}")
    return " ".join(parts)


class Input(Protocol):
    """Where chunks come from. ``settle`` releases input tokens once their results are published."""

    async def start(self) -> None: ...

    async def stop(self, timeout: float) -> None: ...

    settle: Callable[[tuple], None] | None


class CoreInput:
    """A plain NATS subscription on ``P.chunks.>``: at-most-once, so there is nothing to settle."""

    settle = None

    def __init__(self, nc: NatsClient, subject: str, handler: MessageHandler, settings: Settings) -> None:
        self._nc = nc
        self._subject = subject
        self._handler = handler
        self._settings = settings
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            self._subject, cb=self._handler,
            pending_msgs_limit=self._settings.pending_msgs_limit,
            pending_bytes_limit=self._settings.pending_bytes_limit,
        )
        await self._nc.flush()  # the server knows the interest before start() returns

    async def stop(self, timeout: float) -> None:
        sub, self._sub = self._sub, None
        if sub is None or self._nc.is_closed:
            return
        with anyio.move_on_after(timeout) as scope:
            # Unsubscribes, then waits until every message already received has been handled.
            await sub.drain()
        if scope.cancelled_caught:
            log.warning(kv(event="drain_timeout", timeout=timeout))

    async def caught_up(self) -> None:
        """Return once every message this subscription had received at the call has been handled.

        A control request (migrate) runs on its own subscription; this keeps it from overtaking
        chunks the server delivered before it. Reads nats-py's queue counters (best effort: without
        them it returns at once); messages dropped as a slow consumer count as handled.
        """
        sub = self._sub
        queue = getattr(sub, "_pending_queue", None)
        if sub is None or not hasattr(queue, "_unfinished_tasks"):
            return
        target = sub.delivered
        while sub.delivered - queue._unfinished_tasks < target and self._sub is sub:  # type: ignore[union-attr]
            await anyio.sleep(0.0005)


INPUTS: dict[str, Callable[[NatsClient, str, MessageHandler, Settings], Input]] = {"core": CoreInput}


class Processor:
    """``async with Processor(settings) as p:`` runs until the block exits; ``run()`` until a signal."""

    def __init__(self, settings: Settings, *, clock: Clock = time.monotonic,
                 catalog: CodecResolver | None = None) -> None:
        """``clock`` must be monotonic seconds (the timer sleeps real time); ``catalog`` resolves format names."""
        self.settings = settings
        self.subjects = settings.subjects
        self._clock = clock
        self.catalog = catalog or Catalog(CodecOptions(max_decompressed_bytes=settings.max_decompressed_bytes))
        try:
            self.correlator = Correlator(self.catalog, settings.format, settings.correlator_config())
        except UnknownFormat as exc:
            raise StartupError(str(exc)) from None
        except Exception as exc:  # a codec plugin that fails to import or construct
            raise StartupError(f"codec {settings.format!r} failed to load: {type(exc).__name__}: {exc}") from None
        self.io = IOStats()
        self.nc: NatsClient | None = None
        self._input: Input | None = None
        self.mode = settings.mode  # "auto" is resolved at start()
        self._control: ControlPlane | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._last_error: BaseException | None = None
        self._closing = False
        # Mutual exclusion between the message callback and the timer, so results of one request
        # can never interleave on the wire while a publish is suspended (only under back-pressure).
        # Plain flags instead of an asyncio.Lock: an uncontended lock costs ~0.4 us per message.
        self._dispatching = False
        self._timer_gate: anyio.Event | None = None
        self._parse = ChunkParser(self.subjects)
        self._receive = self.correlator.receive
        self._results_head = self.subjects.result("")  # + request id, without a call per message

    @property
    def stats(self) -> Stats:
        return self.correlator.stats

    @property
    def input(self) -> Input | None:
        """The running chunk input (core subscription or durable pull consumers)."""
        return self._input

    def snapshot(self) -> dict[str, Any]:
        """All counters plus gauges, for logs and tests."""
        out = msgspec.structs.asdict(self.stats)
        out["results"] = self.stats.results  # derived, not stored
        out.update(msgspec.structs.asdict(self.io))
        out["inflight"] = self.correlator.inflight
        durable = getattr(self._input, "stats", None)
        if durable is not None:
            out.update(msgspec.structs.asdict(durable))
        return out

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Processor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        settings = self.settings
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            self.nc = await self._connect()
            stack.push_async_callback(self._close_connection)
            self._tasks = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._tasks.cancel_scope.cancel)  # runs before the task group exits
            self.mode = await self._choose_mode()
            if self.mode == "durable":
                from .durable_input import DurableInput  # imported when used: core start-up stays lean

                self._input = DurableInput(self.nc, settings, self.correlator, clock=self._clock,
                                           notify=self._log_notice, contract_error=self._contract_error)
                self._dispatch = self._input.dispatch  # timer results also wait for their PubAck
            else:
                self._input = INPUTS["core"](self.nc, self.subjects.all_chunks, self._on_message, settings)
            self._publish = self.nc.publish
            self._settle = self._input.settle
            try:
                await self._input.start()
            except StreamMismatch as exc:
                raise StartupError(str(exc)) from None
            except nats.errors.Error as exc:  # JetStream unavailable or too slow while creating streams
                raise StartupError(f"cannot set up the {self.mode} input: {type(exc).__name__}: {exc}") from None
            self._control = ControlPlane(self)  # P.control.*.migrate (seal-then-resume)
            await self._control.start()
            self._tasks.start_soon(self._timer)
            if settings.stats_interval > 0:
                self._tasks.start_soon(self._report_stats)
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        self._stack = stack
        log.info(kv(event="started", nats_url=settings.nats_url, subject=self.subjects.all_chunks,
                    format=settings.format, mode=self.mode))

    async def stop(self) -> None:
        """Graceful stop: drain the input (handle what was received), publish what is due, close."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        try:
            if self._control is not None:
                await self._control.stop(self.settings.drain_timeout)
            if self._input is not None:
                await self._input.stop(self.settings.drain_timeout)
        finally:
            await stack.__aexit__(None, None, None)
        if self.correlator.inflight:
            log.warning(kv(event="stopped_with_inflight", requests=self.correlator.inflight))
        log.info(kv(event="stopped", **{k: v for k, v in self.snapshot().items() if v}))

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully."""
        import signal

        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with self:
                async for signum in signals:
                    log.info(kv(event="signal", signal=signal.Signals(signum).name))
                    return

    async def _connect(self) -> NatsClient:
        settings = self.settings
        servers = [s.strip() for s in settings.nats_url.split(",") if s.strip()]
        try:
            with anyio.fail_after(settings.connect_timeout if settings.connect_timeout > 0 else math.inf):
                return await nats.connect(
                    servers=servers,
                    name="streamproc",
                    max_reconnect_attempts=-1,  # a stream processor outlives NATS restarts
                    reconnect_time_wait=1,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    closed_cb=self._on_closed,
                    drain_timeout=int(math.ceil(settings.drain_timeout)),
                )
        except TimeoutError:
            detail = f": {self._last_error}" if self._last_error else ""
            raise StartupError(f"cannot connect to NATS at {settings.nats_url} within "
                               f"{settings.connect_timeout}s{detail}") from None
        except Exception as exc:
            raise StartupError(f"cannot connect to NATS at {settings.nats_url}: {exc}") from None

    async def _choose_mode(self) -> str:
        """``auto`` becomes durable when the account has JetStream; ``durable`` without it is a start-up error."""
        wanted = self.settings.mode
        if wanted == "core":
            return "core"
        assert self.nc is not None
        available = await jetstream_available(self.nc)
        if wanted == "durable" and not available:
            raise StartupError(f"--mode durable needs JetStream, which the NATS server at {self.settings.nats_url} "
                               "does not offer to this account (start nats-server with -js, or use --mode core)")
        chosen = "durable" if available else "core"
        if wanted == "auto":
            log.info(kv(event="mode_selected", mode=chosen,
                        reason="the server has JetStream" if available else "the server has no JetStream"))
        return chosen

    async def _close_connection(self) -> None:
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            with anyio.move_on_after(self.settings.drain_timeout):
                await nc.flush()
        await nc.close()

    # ------------------------------------------------------------ NATS callbacks

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.io.slow_consumer += 1  # counted always; logged sparsely (it comes in bursts)
            dropped = getattr(self._input, "dropped", None)
            if dropped is not None:  # durable: the dropped delivery used up pull credit
                dropped(exc.sub, exc.reply)
            if self.io.slow_consumer & (self.io.slow_consumer - 1) == 0:
                log.error(kv(event="slow_consumer", dropped_total=self.io.slow_consumer, subject=exc.subject))
            return
        log.warning(kv(event="nats_error", error=f"{type(exc).__name__}: {exc}"))

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        self.io.disconnects += 1
        log.warning(kv(event="disconnected"))

    async def _on_reconnected(self) -> None:
        self.io.reconnects += 1
        url = self.nc.connected_url.geturl() if self.nc and self.nc.connected_url else "?"
        log.info(kv(event="reconnected", server=url))

    async def _on_closed(self) -> None:
        log.debug(kv(event="connection_closed"))

    # ---------------------------------------------------------------- hot path

    async def _on_message(self, msg: Msg) -> None:
        while self._timer_gate is not None:  # the timer is publishing: keep per-request order
            await self._timer_gate.wait()
        self._dispatching = True
        try:
            try:
                chunk = self._parse(msg.subject, msg.headers, msg.data, msg)
            except ContractError as exc:
                decisions = self._contract_error(exc, msg)
            else:
                decisions = self._receive(chunk, self._clock())
            # _dispatch inlined: one coroutine less per message is measurable against a bare relay.
            settle = self._settle
            for d in decisions:
                if d.__class__ is Result:
                    try:
                        await self._publish(self._results_head + d.request_id, d.body, headers=result_headers(d))
                    except Exception as exc:
                        self._publish_failed(d, exc)
                        continue
                    if settle is not None:
                        settle(d.settles)
                elif d.__class__ is Notice:
                    self._log_notice(d)
                elif settle is not None:  # Settle: input that contributes to no result
                    settle(d.tokens)
        finally:
            self._dispatching = False

    async def _dispatch(self, decisions: list[Decision]) -> None:
        publish = self.nc.publish
        head = self._results_head
        settle = self._input.settle
        for d in decisions:
            if d.__class__ is Result:
                try:
                    await publish(head + d.request_id, d.body, headers=result_headers(d))
                except Exception as exc:
                    self._publish_failed(d, exc)
                    continue
                if settle is not None:
                    settle(d.settles)
            elif d.__class__ is Notice:
                self._log_notice(d)
            elif settle is not None:  # Settle: input that contributes to no result
                settle(d.tokens)

    def _contract_error(self, exc: ContractError, msg: Msg) -> list:
        if exc.request_id is None:
            self.io.unreadable += 1
            log.warning(kv(event="unreadable_message", subject=msg.subject, reason=exc.reason))
            return [] if self._input.settle is None else [Settle((msg,))]
        return self.correlator.reject(exc.request_id, exc.reason, self._clock(), msg)

    def _publish_failed(self, result: Result, exc: Exception) -> None:
        self.io.publish_failures += 1
        if self.io.publish_failures & (self.io.publish_failures - 1):  # log 1st, 2nd, 4th, 8th...: outages flood
            return
        log.error(kv(event="publish_failed", request_id=result.request_id, seq=result.seq,
                     failures_total=self.io.publish_failures, error=f"{type(exc).__name__}: {exc}"))

    def _log_notice(self, notice: Notice) -> None:
        event = notice.event
        level = logging.DEBUG if event in _QUIET_EVENTS else logging.WARNING
        if log.isEnabledFor(level):
            log.log(level, kv(event=event, request_id=notice.request_id, detail=notice.detail))

    # ------------------------------------------------------------------- timers

    async def _timer(self) -> None:
        """Fire the correlator's timeouts.

        Every deadline the correlator creates at time ``t`` is ``t`` plus one of its constant
        timeouts, so none can fall before ``now + min(timeouts)``. Sleeping until the earlier of
        that horizon and the current next deadline therefore never misses a deadline, and needs
        no wake-up call from the hot path.
        """
        cfg = self.correlator.config
        horizon = min(cfg.prefill_timeout, cfg.request_timeout, cfg.finished_grace)
        while True:
            now = self._clock()
            deadline = self.correlator.next_deadline()
            wake = now + horizon if deadline is None else min(deadline, now + horizon)
            await anyio.sleep(max(0.0, wake - now))
            await self._fire()

    async def caught_up(self) -> None:
        """Every chunk received so far has been handled (see ``CoreInput.caught_up``); inputs without
        that method give no such guarantee."""
        barrier = getattr(self._input, "caught_up", None)
        if barrier is not None:
            await barrier()

    async def exclusive(self, decide: Callable[[float], tuple[T, list[Decision]]]) -> T:
        """Run one correlator call off the message path (a control request) and dispatch its decisions
        as the timer does: never while a message's or the timer's results are mid-publish."""
        while self._dispatching or self._timer_gate is not None:
            await anyio.sleep(0.001)
        value, decisions = decide(self._clock())
        if decisions:
            gate = self._timer_gate = anyio.Event()
            try:
                await self._dispatch(decisions)
            finally:
                self._timer_gate = None
                gate.set()
        return value

    async def _fire(self) -> None:
        # A message's (or a control request's) results are mid-publish (back-pressure): let them finish.
        while self._dispatching or self._timer_gate is not None:
            await anyio.sleep(0.001)
        decisions = self.correlator.tick(self._clock())
        self.io.timer_runs += 1
        if not decisions:
            return
        gate = self._timer_gate = anyio.Event()
        try:
            await self._dispatch(decisions)
        finally:
            self._timer_gate = None
            gate.set()

    async def _report_stats(self) -> None:
        while True:
            await anyio.sleep(self.settings.stats_interval)
            log.info(kv(event="stats", **self.snapshot()))


_QUIET_EVENTS = frozenset({"late_chunk", "rejected_after_finish", "sealed_chunk"})

