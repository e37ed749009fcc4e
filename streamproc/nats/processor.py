"""The NATS shell around the sans-I/O correlator: messages in, decisions out, nothing clever.

Everything that decides lives in :mod:`streamproc.core.correlator`; the processor connects,
picks an input, fires the correlator's timers and answers control requests
(:mod:`streamproc.nats.control`). The per-message path lives in the inputs.

Inputs (:mod:`streamproc.nats.input`) are chosen by ``mode``: ``core`` is
:class:`~streamproc.nats.core_input.CoreInput`, a plain subscription (at-most-once, nothing to
acknowledge); ``durable`` is :class:`~streamproc.nats.durable.input.DurableInput`, JetStream pull
consumers whose chunks are acknowledged only once the results they contributed to are stored.
``auto`` picks durable when the server has JetStream.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import anyio
import nats
from nats.aio.client import Client as NatsClient

from ..catalog import Catalog, codec_names
from ..config import Settings, redact_url
from ..core import defaults
from ..core.correlator import CodecResolver, Correlator, Decision, Stats
from ..core.errors import StartupError, StreamMismatch, StreamprocError, UnknownFormat
from ..core.migrate_rate import MigrateRate
from ..core.codec import ErrorKind
from ..core.wire import MigrateReply, MigrateRequest, max_error_result_size
from ..logs import error_text, log_event
from . import connection
from .control import ControlPlane
from .core_input import CoreInput
from .gate import DispatchGate
from .input import Clock, Input, IOStats, Pipeline, snapshot
from .streams import jetstream_available

if TYPE_CHECKING:
    from ..tracing import Tracing

log = logging.getLogger("streamproc.processor")

T = TypeVar("T")

FROM_ENVIRONMENT: Any = object()  # Processor(tracing=...): configured by the OTEL_* variables
TIMER_GRAIN = 0.05  # seconds: least time between two runs of the correlator's timer (at most 20 wakeups/s)


# The header block of a seal record's write (nats-py 2.16 ``KeyValue._update``: ``hdrs[
# api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)``, encoded as ``Client._send_publish`` does) with
# the longest revision (a uint64): nats-server counts it against max_payload with the record.
RECORD_HEADER_ROOM = len(b"NATS/1.0\r\nNats-Expected-Last-Subject-Sequence: " + b"9" * 20 + b"\r\n\r\n")


def record_limit(max_payload: int) -> int:
    """The most bytes a seal record may take (``Correlator.migrate``'s ``max_record_bytes``)."""
    return max(0, max_payload - RECORD_HEADER_ROOM)


class Processor:
    """``async with Processor(settings) as p:`` runs until the block exits; ``run()`` until a signal."""

    def __init__(self, settings: Settings, *, clock: Clock = time.monotonic,
                 catalog: CodecResolver | None = None, tracing: Tracing | None = FROM_ENVIRONMENT) -> None:
        """``clock`` must be monotonic seconds (the timer sleeps real time); ``catalog`` resolves format names;
        ``tracing`` (None: off) defaults to what the ``OTEL_*`` variables configure (streamproc.tracing)."""
        self.settings = settings
        self.subjects = settings.subjects
        self._clock = clock
        self.catalog = catalog or Catalog(settings.codec_options(), clock=clock)
        try:
            self.correlator = Correlator(self.catalog, settings.format, settings.correlator_config())
            self.correlator.join_clock = time.thread_time  # streamproc_join_seconds: inline joins' CPU
        except UnknownFormat as exc:
            raise StartupError(str(exc)) from None
        except Exception as exc:  # a codec plugin that fails to import or construct
            raise StartupError(f"codec {settings.format!r} failed to load: {error_text(exc)}") from None
        if tracing is FROM_ENVIRONMENT:
            from ..tracing import from_environment

            tracing = from_environment("streamproc")  # ConfigError for OTEL_* naming nothing installed
        self.tracing = tracing
        self.pipeline = Pipeline(self.correlator, self.subjects, clock, tracing)
        self.io: IOStats = self.pipeline.io
        self.gate = DispatchGate()
        self.nc: NatsClient | None = None
        self._input: Input | None = None
        self.mode = settings.mode  # "auto" is resolved at start()
        self._control: ControlPlane | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._last_error: BaseException | None = None
        self._closing = False
        self._error_result_bytes = 0  # the largest error result (error_result_size), measured at start()
        self._serving = False  # between a finished start() and the beginning of stop()
        self.http_port: int | None = None  # bound port of the status server (--http-port), once listening
        self.status_server: Any = None  # the StatusServer, once listening (its connection counters)

    @property
    def stats(self) -> Stats:
        return self.correlator.stats

    @property
    def control_replies_refused(self) -> int:
        """Migrates refused for a reply subject outside --control-reply-prefix (control.py)."""
        return self._control.replies_refused if self._control is not None else 0

    @property
    def control_migrates_throttled(self) -> int:
        """Migrates answered unavailable past --max-migrate-rate (core/migrate_rate.py)."""
        return self._control.rate.refused if self._control is not None else 0

    @property
    def control_migrates_dropped(self) -> int:
        """Migrates nats-py dropped unread past the control queue's bound (control.py)."""
        return self._control.dropped if self._control is not None else 0

    @property
    def input(self) -> Input | None:
        """The running chunk input (core subscription or durable pull consumers)."""
        return self._input

    @property
    def connected(self) -> bool:
        """``/healthz``: the NATS connection is up."""
        return self.nc is not None and self.nc.is_connected

    @property
    def ready(self) -> bool:
        """``/readyz``: connected and reading chunks (core: subscribed; durable: owning partitions)."""
        if not (self._serving and self.connected and self._input is not None):
            return False
        return self._input.reading

    def snapshot(self) -> dict[str, Any]:
        """All counters plus gauges, for logs and tests."""
        return snapshot(self.correlator, self.io, self._input.stats if self._input is not None else None)

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
            if settings.http_port:
                # First, so /healthz answers (503) while NATS is still being reached.
                await self._start_status_server(stack)
            self.nc = await self._connect()
            if hasattr(self.nc, "on_foreign"):  # a RobustClient (connect() makes one; typed as nats-py's Client)
                self.nc.on_foreign = self._count_foreign
            stack.push_async_callback(self._close_connection)
            self._check_max_payload()
            self.mode = await self._choose_mode()
            self._tasks = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._tasks.cancel_scope.cancel)  # runs before the task group exits
            self._input = self._make_input(self.mode)
            try:
                await self._input.start()
            except StreamMismatch as exc:
                raise StartupError(str(exc)) from None
            except nats.errors.Error as exc:  # JetStream unavailable or too slow while creating streams
                raise StartupError(f"cannot set up the {self.mode} input: {error_text(exc)}") from None
            rate = MigrateRate(settings.max_migrate_rate)
            self._control = ControlPlane(self.nc, self.subjects, self, self.pipeline.limited,
                                         settings.control_reply_prefix, rate)  # P.control.*.migrate
            await self._control.start()
            self._tasks.start_soon(self._timer)
            if settings.stats_interval > 0:
                self._tasks.start_soon(self._report_stats)
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        self._stack = stack
        self._serving = True
        log_event(log, logging.INFO, "started", nats_url=redact_url(settings.nats_url),
                  subject=self.subjects.all_chunks,
                  format=settings.format, mode=self.mode)

    async def _start_status_server(self, stack: contextlib.AsyncExitStack) -> None:
        from ..metrics import CONTENT_TYPE, ProcessorCollector, exposition, registry_for
        from ..status_server import StatusServer

        registry = registry_for(ProcessorCollector(self))

        def probe(ok: bool, what: str) -> tuple[int, bytes, str]:
            return (200, b"ok\n", "text/plain") if ok else (503, f"not {what}\n".encode(), "text/plain")

        server = self.status_server = StatusServer(self.settings.http_host, self.settings.http_port, {
            "/metrics": lambda: (200, exposition(registry), CONTENT_TYPE),
            "/healthz": lambda: probe(self.connected, "connected to NATS"),
            "/readyz": lambda: probe(self.ready, "ready"),
        })
        tasks = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tasks.cancel_scope.cancel)
        try:
            self.http_port = await tasks.start(server.serve)
        except OSError as exc:
            raise StartupError(f"cannot listen on --http-host {self.settings.http_host} --http-port "
                               f"{self.settings.http_port}: {exc.strerror or exc}") from None

    def _make_input(self, mode: str) -> Input:
        assert self.nc is not None
        if mode == "durable":
            from .durable.input import DurableInput  # imported when used: core start-up stays lean

            return DurableInput(self.nc, self.settings, self.pipeline)
        return CoreInput(self.nc, self.settings, self.pipeline, self.gate)

    async def stop(self) -> None:
        """Graceful stop: drain the input (handle what was received), publish what is due, close."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._serving = False
        try:
            if self._control is not None:
                await self._control.stop(self.settings.drain_timeout)
            if self._input is not None:
                await self._input.stop(self.settings.drain_timeout)
        finally:
            await stack.__aexit__(None, None, None)
            if self.tracing is not None:
                self.tracing.shutdown()  # flush spans still batched (a provider handed in is left alone)
        if self.correlator.inflight:
            log_event(log, logging.WARNING, "stopped_with_inflight", requests=self.correlator.inflight)
        log_event(log, logging.INFO, "stopped", **{k: v for k, v in self.snapshot().items() if v})

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully. A signal while connecting stops at
        once: there is nothing to drain yet."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            signalled = anyio.Event()
            started = False

            async def watch(tasks: anyio.abc.TaskGroup) -> None:
                async for signum in signals:
                    log_event(log, logging.INFO, "signal", signal=signal.Signals(signum).name)
                    signalled.set()
                    if not started:  # still reaching NATS: stop waiting (start() cleans up)
                        tasks.cancel_scope.cancel()
                    return

            failed: StreamprocError | None = None
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(watch, tasks)
                try:
                    await self.start()
                except StreamprocError as exc:  # re-raised below, not wrapped in an exception group
                    failed = exc
                    tasks.cancel_scope.cancel()
                else:
                    started = True
                    try:
                        await signalled.wait()
                    finally:
                        await self.stop()
            if failed is not None:
                raise failed

    def error_result_size(self) -> int:
        """The most bytes an error result may take (``wire.max_error_result_size``) in the shape of
        the default codec or of any installed one a chunk's ``Streamproc-Format`` may name."""
        codecs = [self.catalog(self.settings.format)]
        for name in codec_names():
            try:
                codecs.append(self.catalog(name))
            except Exception:  # noqa: BLE001 - one that cannot load: its requests get the default codec's shape
                continue
        return max_error_result_size([c.error_body for c in codecs], list(ErrorKind))

    def _check_max_payload(self) -> None:
        """Refuse a server whose ``max_payload`` cannot take every error result: one it refuses is
        never replaced, so its request would wait out its client's timeout (durable mode: its chunk
        NAKed until ``--max-deliver``)."""
        max_payload = getattr(self.nc, "max_payload", 0)
        needed = self._error_result_bytes = self.error_result_size()
        if max_payload and max_payload < needed:
            raise StartupError(
                f"the NATS server's max_payload is {max_payload} bytes, below the {needed} bytes an error "
                f"result may take (headers and body): the server would refuse some error results, and one is never "
                f"replaced; raise max_payload to at least {needed}")
        # No check for migrates: an error result's header block alone is larger than the smallest first
        # seal record with its write's headers (tests/test_migrate_small_max_payload.py pins it).

    async def _connect(self) -> NatsClient:
        return await connection.connect(
            self.settings,
            name="streamproc",
            reconnect=True,  # a stream processor outlives NATS restarts
            inbox_prefix=defaults.OWN_INBOX_PREFIX,  # never a migrate's reply (control.py)
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed,
            drain_timeout=int(math.ceil(self.settings.drain_timeout)),
        )

    async def _choose_mode(self) -> str:
        """``auto`` becomes durable when the account has JetStream; ``durable`` without it is a start-up error."""
        wanted = self.settings.mode
        if wanted == "core":
            return "core"
        assert self.nc is not None
        available = await jetstream_available(self.nc)
        if wanted == "durable" and not available:
            where = redact_url(self.settings.nats_url)
            raise StartupError(f"--mode durable needs JetStream, which the NATS server at {where} "
                               "does not offer to this account (start nats-server with -js, or use --mode core)")
        chosen = "durable" if available else "core"
        if wanted == "auto":
            log_event(log, logging.INFO, "mode_selected", mode=chosen,
                      reason="the server has JetStream" if available else "the server has no JetStream")
        return chosen

    async def _close_connection(self) -> None:
        nc = self.nc
        if nc is None or nc.is_closed:
            return
        self._closing = True
        with contextlib.suppress(Exception):
            with anyio.move_on_after(self.settings.drain_timeout):
                await nc.flush()
        try:
            await nc.close()
        except Exception as exc:  # noqa: BLE001 - the server went away under the stop: nothing left to flush
            # nats-py's close drains a transport whose peer is gone (ConnectionResetError): a stop the
            # operator asked for still exits 0, without a traceback (docs/configuration.md, exit codes).
            log_event(log, logging.WARNING, "close_failed", error=error_text(exc))

    # ------------------------------------------------------------ NATS callbacks

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        if isinstance(exc, nats.errors.SlowConsumerError):
            if self._control is not None and self._control.dropped_from(exc.sub):  # a migrate flood, not lost input
                return
            self.io.slow_consumer += 1  # counted always; logged sparsely (it comes in bursts)
            if self._input is not None:
                self._input.dropped(exc.sub, exc.reply)
            if self.io.slow_consumer & (self.io.slow_consumer - 1) == 0:
                log_event(log, logging.ERROR, "slow_consumer", dropped_total=self.io.slow_consumer,
                          subject=exc.subject)
            return
        log_event(log, logging.WARNING, "nats_error", error=error_text(exc))

    def _count_foreign(self) -> None:
        self.io.foreign_messages += 1

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        self.io.disconnects += 1
        log_event(log, logging.WARNING, "disconnected")

    async def _on_reconnected(self) -> None:
        self.io.reconnects += 1
        url = redact_url(self.nc.connected_url.geturl()) if self.nc and self.nc.connected_url else "?"
        log_event(log, logging.INFO, "reconnected", server=url)
        max_payload = getattr(self.nc, "max_payload", 0)
        if max_payload and max_payload < self._error_result_bytes:
            # A server restarted with a lower max_payload: refused at start-up, but here the processor
            # serves on; error results past it are logged (publish_failed) and given up, never sent.
            log_event(log, logging.WARNING, "max_payload_below_error_results", max_payload=max_payload,
                      needed=self._error_result_bytes, detail="some error results cannot be sent: raise max_payload")
        if self._input is not None:
            self._input.reconnected()

    async def _on_closed(self) -> None:
        log_event(log, logging.DEBUG, "connection_closed")

    # ------------------------------------------------------------------- timers

    async def _timer(self) -> None:
        """Fire the correlator's timeouts.

        Every deadline the correlator creates at time ``t`` is ``t`` plus one of its constant
        timeouts, so none can fall before ``now + min(timeouts)``. Sleeping until the earlier of
        that horizon and the current next deadline therefore never misses a deadline, and needs
        no wake-up call from the hot path. Deadlines fire up to ``TIMER_GRAIN`` late.
        """
        cfg = self.correlator.config
        horizon = min(cfg.prefill_timeout, cfg.request_timeout, cfg.finished_grace)
        while True:
            now = self._clock()
            deadline = self.correlator.next_deadline()
            wake = now + horizon if deadline is None else min(deadline, now + horizon)
            # At least TIMER_GRAIN apart: in steady state a finished request expires every few ms
            # (finished_grace after it finished), and a wakeup per expiry is a wakeup per request.
            await anyio.sleep(max(TIMER_GRAIN, wake - now))
            self.io.timer_runs += 1
            await self.exclusive(lambda now: (None, self.correlator.tick(now)))
            self.pipeline.limited.flush()  # suppressed-line counts are reported even when a flood stops

    # ------------------------------------------------------------ control plane

    def owns(self, request_id: str) -> bool:
        """Whether this instance answers control requests for the request."""
        return self._input is None or self._input.owns(request_id)

    def holds(self, request_id: str) -> bool:
        """Whether the request is active here (its migrates are not rate limited). A finished one
        is not: in durable mode its migrate still reads the seal record."""
        return self.correlator.attempt_of(request_id) is not None

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateReply:
        """Seal the request's current attempt (see ``Correlator.migrate``), after every chunk the
        server delivered before the control request has been handled."""
        # The reply (sent without headers), and in durable mode the seal record holding it (with its
        # write's headers), must each fit one NATS message.
        max_payload = getattr(self.nc, "max_payload", 0) or 1 << 20
        record = record_limit(max_payload) if self.mode == "durable" else None

        async def seal() -> MigrateReply:
            return await self.exclusive(lambda now: self.correlator.migrate(
                request_id, now, expected_attempt=request.expected_attempt, refuse=request.refuse,
                id=request.id, max_seal_bytes=max_payload, max_record_bytes=record))

        if self._input is None:
            return await seal()
        # Durable: the seal must outlive this instance, so it is recorded in JetStream first.
        return await self._input.migrate(request_id, request, seal)

    async def exclusive(self, decide: Callable[[float], tuple[T, list[Decision]]]) -> T:
        """Run one correlator call off the message path and dispatch its decisions through the
        input, never while a message's (or another off-path call's) results are mid-publish."""

        async def run() -> T:
            value, decisions = decide(self._clock())
            if decisions and self._input is not None:
                await self._input.dispatch(decisions)
            return value

        return await self.gate.exclusive(run)

    async def _report_stats(self) -> None:
        while True:
            await anyio.sleep(self.settings.stats_interval)
            log_event(log, logging.INFO, "stats", **self.snapshot())
