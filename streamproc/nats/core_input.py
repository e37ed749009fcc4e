"""``--mode core``: a plain subscription on ``P.chunks.>``, results published at most once.

This is the passthrough hot path, benchmarked against a bare nats-py relay: no logging, no extra
coroutines, no awaits other than one publish per result. With a
:class:`~streamproc.nats.fast_client.FastClient`, aggregated chunks in their common cases take the
fused path (:class:`~streamproc.core.passthrough.PassthroughPath`): no Chunk, Result, list or header
dict, and a pre-formatted header block (``publish_header_block``); everything else, and every
message on a stock-path client, takes the general path below it. While nothing is queued, the
fused path runs in the client's read loop (``_inline``, ``FastClient.deliver_inline``).
"""

from __future__ import annotations

import asyncio
import logging

from typing import Awaitable, Callable

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..config import Settings
from ..core.correlator import Decision, Notice, Work
from ..core.errors import over_max_payload
from ..core.events import MigrateReply, MigrateRequest
from ..core.passthrough import PassthroughPath
from ..core.wire import FORMAT, SEQ, ContractError, Result, result_headers
from ..logs import error_text, log_event
from .gate import DispatchGate
from .input import Pipeline, join_cpu_clock, run_join
from .subscription import handled_all

log = logging.getLogger("streamproc.processor")


class CoreInput:
    """At-most-once input: nothing to acknowledge, so its chunks carry no token (and Settle decisions,
    of a contract error's message, are simply dropped)."""

    stats = None
    outbox = None  # results are published as decided, through no outbox
    reading = True  # subscribed from start() on: chunks reach it whenever the connection is up

    def __init__(self, nc: NatsClient, settings: Settings, pipeline: Pipeline, gate: DispatchGate) -> None:
        self._nc = nc
        self._settings = settings
        self._pipeline = pipeline
        self._gate = gate
        self._sub: Subscription | None = None
        self._publish = pipeline.publisher(nc.publish)
        self._results_head = pipeline.subjects.result("")  # + request id, without a call per message
        # Bound once: the hot path pays no attribute chain per message.
        self._parse = pipeline.parse
        self._receive = pipeline.receive
        self._clock = pipeline.clock
        # Joins that decode sequence data run in one worker thread (codec instances share their
        # decompression contexts, which are not thread safe); the loop keeps passing others through.
        pipeline.correlator.offload_joins = True
        self._limiter = anyio.CapacityLimiter(1)
        self._join_clock = join_cpu_clock()  # the join thread and the codec's helper threads
        self._works: set[asyncio.Task] = set()
        self._observe = pipeline.result_latency.observe
        publish_block = getattr(nc, "publish_header_block", None)  # FastClient only (fast_client.py)
        self._publish_block = publish_block
        # Tracing on: chunks whose spans would be recorded take the general path. A sampler that
        # records nothing for unsampled worker traces (the default, parent-based) leaves the fused
        # path to those (their general path records nothing either: streamproc.tracing).
        tracing = pipeline.tracing
        fused = publish_block is not None and (tracing is None or tracing.skips_unsampled)
        self._fused = PassthroughPath(pipeline.subjects, pipeline.correlator,
                                      unsampled_only=tracing is not None) if fused else None
        # The fused path's messages handled in the client's read loop (FastClient.deliver_inline):
        # (data, exception) when the fused path raised there; the queue path then handles that
        # message (the next it sees) as _on_message would have.
        self._inline_error: tuple[bytes, Exception] | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            self._pipeline.subjects.all_chunks, cb=self._on_message,
            pending_msgs_limit=self._settings.pending_msgs_limit,
            pending_bytes_limit=self._settings.pending_bytes_limit,
        )
        if self._fused is not None:
            self._send_block = self._nc.publish_block_nowait
            self._nc.deliver_inline(self._sub, self._inline)
        await self._nc.flush()  # the server knows the interest before start() returns

    async def stop(self, timeout: float) -> None:
        sub, self._sub = self._sub, None
        if sub is None or self._nc.is_closed:
            return
        if self._fused is not None:  # from here on every message goes through the queue: drain() waits for it
            self._nc.stop_inline(sub)
        with anyio.move_on_after(timeout) as scope:
            # Unsubscribes, then waits until every message already received has been handled.
            await sub.drain()
            while self._works:  # ... and every join it started elsewhere has been published
                await asyncio.wait(set(self._works))
        if scope.cancelled_caught:
            log_event(log, logging.WARNING, "drain_timeout", timeout=timeout)

    async def caught_up(self) -> None:
        sub = self._sub
        await handled_all(sub, lambda: self._sub is sub)

    def owns(self, request_id: str) -> bool:
        return True  # one core instance sees every chunk

    async def migrate(self, request_id: str, request: MigrateRequest,
                      seal: Callable[[], Awaitable[MigrateReply]]) -> MigrateReply:
        """Core mode: the seal is the correlator's alone (nothing outlives this instance), made once
        every chunk received before the migrate has been handled."""
        await self.caught_up()
        return await seal()

    def dropped(self, sub: Subscription | None, reply: str | None) -> None:
        pass  # nothing was promised for a dropped core message

    def reconnected(self) -> None:
        pass  # nats-py replays the subscription; nothing was held across the outage

    async def dispatch(self, decisions: list[Decision]) -> None:
        publish = self._publish
        head = self._results_head
        for d in decisions:
            if d.__class__ is Result:
                try:
                    await publish(head + d.request_id, d.body, headers=result_headers(d))
                except Exception as exc:
                    self._publish_failed(d.request_id, d.seq, exc)
            elif d.__class__ is Notice:
                self._pipeline.notify(d)
            elif d.__class__ is Work:
                self._start(d, None)
            # Settle: nothing to acknowledge in core mode

    def _start(self, work: Work, received: float | None) -> None:
        """``received``: when the chunk whose result this work makes arrived (None: a timer or control
        decision), for the result-latency histogram."""
        self._track(self._run(work, received))

    def _track(self, coro) -> None:
        """Run ``coro`` as a task that :meth:`stop` waits for (joins, and error results published later)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._works.add(task)
        task.add_done_callback(self._works.discard)

    async def _run(self, work: Work, received: float | None) -> None:
        """Run a join off the loop, then apply it exclusively of the message path (result order)."""
        await anyio.to_thread.run_sync(run_join, work, self._join_clock, limiter=self._limiter)
        pipeline = self._pipeline

        async def finish() -> None:
            decisions = pipeline.finish(work, pipeline.clock())
            await self.dispatch(decisions)
            if received is not None and any(d.__class__ is Result for d in decisions):
                self._observe(self._clock() - received)  # receipt -> its results handed to NATS

        await self._gate.exclusive(finish)

    def _inline(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes) -> bool:
        """The fused path in the client's read loop (FastClient.deliver_inline): a message whose
        result it publishes, while nothing else of the subscription is queued or being handled and
        no off-path dispatch holds the gate, needs no Msg, queue entry or coroutine. Never suspends.
        False: the message goes through the queue to _on_message, which decides exactly as here."""
        gate = self._gate
        if gate.busy or gate.held is not None:
            return False
        now = self._clock()
        try:
            routed = self._fused(subject, headers, data, now)  # type: ignore[misc]
        except Exception as exc:
            self._inline_error = (data, exc)  # _on_message handles it: the next message it sees
            return False
        if routed is None:
            return False
        result_subject, block = routed
        try:
            self._send_block(result_subject, data, block)
        except Exception as exc:
            self._publish_failed(result_subject[len(self._results_head):], int(headers[SEQ]), exc,  # type: ignore[index]
                                 headers.get(FORMAT))  # type: ignore[union-attr]
        else:
            self._observe(self._clock() - now)
        return True

    async def _on_message(self, msg: Msg) -> None:
        gate = self._gate
        if gate.held is not None:  # the timer or a control request is publishing: keep per-request order
            await gate.wait_turn()
        gate.busy = True
        try:
            now = self._clock()
            routed = None
            try:  # every message ends in a decision, whatever raises while it is handled
                fused = self._fused
                if fused is not None:
                    failed = self._inline_error
                    if failed is not None and failed[0] is msg.data:  # it raised in _inline: same handling
                        self._inline_error = None
                        raise failed[1]
                    routed = fused(msg.subject, msg.headers, msg.data, now)
                if routed is None:
                    try:
                        # No token: core mode settles nothing, and a token is what the correlator
                        # holds with a held chunk's every repeat (a prefill leg's, up to
                        # --request-timeout): uncounted here, each copy's Msg was held, ~270 bytes
                        # (tests/test_durable_worker_attack.py, ..._in_core_mode_however_many).
                        chunk = self._parse(msg.subject, msg.headers, msg.data)
                    except ContractError as exc:
                        decisions = self._pipeline.contract_error(exc, msg, acknowledged=False)
                    else:
                        # the format as parsed, for _publish_failed below
                        msg.headers = None if chunk.format is None else {FORMAT: chunk.format}
                        decisions = self._receive(chunk, now)
            except Exception as exc:
                decisions = self._pipeline.failed(exc, msg, acknowledged=False)
            if routed is not None:  # the fused path's one passthrough result
                subject, block = routed
                try:
                    await self._publish_block(subject, msg.data, block)
                except Exception as exc:
                    self._publish_failed(subject[len(self._results_head):], int(msg.headers[SEQ]), exc,
                                         msg.headers.get(FORMAT))
                else:
                    self._observe(self._clock() - now)
                return
            # dispatch() inlined: one coroutine less per message is measurable against a bare relay.
            published = False
            for d in decisions:
                if d.__class__ is Result:
                    try:
                        await self._publish(self._results_head + d.request_id, d.body,
                                            headers=result_headers(d))
                        published = True
                    except Exception as exc:
                        self._publish_failed(d.request_id, d.seq, exc, (msg.headers or {}).get(FORMAT))
                elif d.__class__ is Notice:
                    self._pipeline.notify(d)
                elif d.__class__ is Work:
                    self._start(d, now)
            if published:  # message received -> its results handed to the NATS client
                self._observe(self._clock() - now)
        finally:
            gate.busy = False

    def _publish_failed(self, request_id: str, seq: int, exc: Exception, format: str | None = None, *,
                        replace: bool = True) -> None:
        """Count and log (rate limited) a result that could not be published; one too large for the
        server is replaced by an error result, unless it is that error result (``replace=False``): on a
        server whose ``max_payload`` is below an error result's size each replacement was refused in
        turn and replaced again, a loop at full CPU from one hostile chunk."""
        io = self._pipeline.io
        io.publish_failures += 1
        if io.publish_failures & (io.publish_failures - 1) == 0:  # log 1st, 2nd, 4th, 8th...: outages flood
            log_event(log, logging.ERROR, "publish_failed", request_id=request_id, seq=seq,
                      failures_total=io.publish_failures, error=error_text(exc))
        if replace and isinstance(exc, nats.errors.MaxPayloadError):
            self._replace_unpublishable(request_id, seq, format)

    def _replace_unpublishable(self, request_id: str, seq: int, format: str | None) -> None:
        """Result ``seq`` is larger than the server takes (``FastClient``/``RobustClient`` refuse it
        before it is written: nats-server would close the connection): an ``internal`` error result
        takes its place (``Correlator.unpublishable``; ``format``, the chunk's, shapes it if the
        request has finished), published from a task, since this may run in the client's read loop.
        The request is finished from here on, so no later chunk of it makes a result; results of
        higher seqs already published (chunks that came out of order) come before the error on the
        wire, and a reader ordering by seq (the edge) ends the stream at the error."""
        pipeline = self._pipeline
        limit = getattr(self._nc, "max_payload", 0)
        reason = over_max_payload(seq, limit)
        for d in pipeline.correlator.unpublishable(request_id, seq, reason, pipeline.clock(), format):
            if d.__class__ is Result:
                self._start_publish(d)
            elif d.__class__ is Notice:
                pipeline.notify(d)

    def _start_publish(self, result: Result) -> None:
        async def publish() -> None:
            try:
                await self._publish(self._results_head + result.request_id, result.body,
                                    headers=result_headers(result))
            except Exception as exc:  # noqa: BLE001 - counted and logged, never replaced again
                self._publish_failed(result.request_id, result.seq, exc, replace=False)

        self._track(publish())
