"""The edge side of the wire contract: read a request's results back, in order, exactly once.

The processor publishes each request's results in seq order on a core subject, so in practice
they arrive in order; the helpers still reorder and drop repeats, because an edge must not
depend on that (a JetStream-backed edge may see redeliveries).

Subscribe before the request's chunks are published, or early results are missed::

    async with follow(nc, subjects, request_id, timeout=30) as results:
        await publisher.publish_leg(request_id, "agg", bodies)
        async for result in results:
            ...

With ``replay=True`` the results come from the JetStream stream that stores them (durable mode
creates it): an ordered consumer replays the request's subject from its first result, then
follows live ones, so an edge may attach at any time; repeats (a replay after a processor crash)
are dropped by the same seq check.

What one request's results may hold in the reader is bounded by ``max_buffered_bytes`` of bodies
received and not yet taken, as the edge bounds a stream by ``--stream-buffer-bytes``. Bodies kept
behind a missing seq past it end the stream with :class:`~streamproc.core.errors.ResultsOverrun`
(one forged request cannot grow a reader); so do in-order bodies a slow loop has not taken on a
live stream (the processor does not wait for it). A replay instead stops its consumer there and
reads on from the next stored result once the loop has taken half of them: JetStream pushes a
stored history at its own pace, not the loop's. ``timeout`` is a deadline for the final result
that holds while results are waiting too (a producer that never ends, faster than its reader, is
ended).

A live subscription (``replay=False``) misses what is published while the NATS connection is
down: after a reconnect the stream waits for results that will never come, until ``timeout``
(whose ``TimeoutError`` then says the connection reconnected). A replaying one resumes where it
was (nats-py's ordered consumer), so in durable mode ``replay=True`` survives a reconnect.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import Iterable, NoReturn, Self

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from ..core.defaults import CLIENT_BUFFER_BYTES
from ..core.errors import MalformedResult, ResultsOverrun
from ..core.reorder import SeqOrder
from ..nats.robust import flush_queued
from .connection import check_client
from ..nats.streams import find_stream
from ..core.wire import ContractError, ResultInfo, Subjects, check_request_id, result_from_message


def _parse(subjects: Subjects, msg: Msg) -> ResultInfo:
    try:
        return result_from_message(subjects, msg.subject, msg.headers, msg.data)
    except (ContractError, ValueError) as exc:
        raise MalformedResult(f"malformed result on {msg.subject!r}: {exc}") from None


class ResultStream:
    """Results of one request as an async iterator; ``timeout`` bounds the wait for the final one.

    A message on the request's subject that breaks the contract (or a gap that never closes) ends
    the stream: the results that arrived in order before it are yielded, then
    :class:`~streamproc.core.errors.MalformedResult` is raised. An ended stream (final result,
    error, timeout) is exhausted: iterating it again yields nothing and subscribes to nothing.
    """

    def __init__(self, nc: NatsClient, subjects: Subjects, request_id: str, *, timeout: float | None = None,
                 replay: bool = False, max_buffered_bytes: int = CLIENT_BUFFER_BYTES) -> None:
        check_client(nc)
        self.nc = nc
        self.subjects = subjects
        self.request_id = check_request_id(request_id)
        self.timeout = timeout
        self.replay = replay
        self.max_buffered_bytes = max_buffered_bytes
        self._order = SeqOrder()
        self._ready: deque[ResultInfo] = deque()
        self._ready_bytes = 0  # bodies in _ready
        self._waiting_bytes = 0  # bodies SeqOrder holds behind a missing seq
        self._error: MalformedResult | ResultsOverrun | None = None
        self._arrived = anyio.Event()
        self._sub: Subscription | None = None
        self._stream: str | None = None  # replay: the results stream, found once
        self._next_stored = 0  # replay: the stream sequence to read on from after a pause
        self._paused = False  # replay: over the bound, consumer stopped until the loop catches up
        self._closes = 0  # close() calls: a read-on that a close overtook releases its consumer
        self._deadline = math.inf
        self._reconnects = 0  # the connection's reconnect count when the subscription was made
        self._ended = False  # final result, error or timeout: nothing more to wait for

    async def subscribe(self) -> None:
        """Register interest on the server (returns once the server has it); nothing once the stream ended."""
        if self._sub is not None or self._ended or self._paused:
            return
        subject = self.subjects.result(self.request_id)
        if self.replay:
            js = self.nc.jetstream()
            self._stream = await find_stream(js, subject)
            if self._stream is None:
                raise LookupError(f"no JetStream stream stores {subject!r}: nothing to replay")
            self._sub = await js.subscribe(subject, stream=self._stream, ordered_consumer=True, cb=self._on_msg)
        else:
            self._sub = await self.nc.subscribe(subject, cb=self._on_msg)
            await flush_queued(self.nc)
        # one result always fits, whatever the server's max_payload (known once connected)
        self.max_buffered_bytes = max(self.max_buffered_bytes, getattr(self.nc, "max_payload", 0) or 0)
        if self.timeout is not None:
            self._deadline = anyio.current_time() + self.timeout
        self._reconnects = self._reconnect_count()

    async def _read_on(self) -> None:
        """A paused replay reads on from the first stored result it did not keep (a new ordered
        consumer; its repeats, if any, are dropped by the seq check). If that fails (NATS away, a
        cancellation), the stream stays paused and the next step tries again; closed meanwhile,
        the new consumer is released at once."""
        old, self._sub = self._sub, None
        if old is not None and not self.nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await old.unsubscribe()
        closes = self._closes
        self._paused = False  # (no subscription now: nothing is delivered until the new one)
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._next_stored)
        try:
            sub = await self.nc.jetstream().subscribe(self.subjects.result(self.request_id), stream=self._stream,
                                                      ordered_consumer=True, config=config, cb=self._on_msg)
        except BaseException:
            self._paused = True
            raise
        if self._closes != closes or self._ended:
            await sub.unsubscribe()
            self._paused = True  # a later iteration (after a re-subscribe) reads on from the same place
            return
        self._sub = sub

    def _reconnect_count(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return stats.get("reconnects", 0) if isinstance(stats, dict) else 0

    async def close(self) -> None:
        self._closes += 1
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            await sub.unsubscribe()

    async def __aenter__(self) -> ResultStream:
        await self.subscribe()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    aclose = close  # so ``contextlib.aclosing(stream)`` releases the subscription of a bare ``async for``

    async def _on_msg(self, msg: Msg) -> None:
        if self._error is not None or self._paused:  # failed: what came before is all it yields; paused: read again
            return
        if self.replay:
            try:
                self._next_stored = msg.metadata.sequence.stream + 1
            except Exception:  # noqa: BLE001  (no JetStream delivery: a stock client's foreign message)
                pass
        order = self._order
        try:
            result = _parse(self.subjects, msg)
            duplicates = order.duplicates
            ready = order.push(result)
        except MalformedResult as exc:
            self._error = exc
        except OverflowError as exc:  # a gap that never closes: fail the stream, bounded
            self._error = MalformedResult(f"results of {self.request_id!r}: {exc}")
        else:
            size = 0
            if ready:  # this result (the next seq) and what waited for it
                self._ready.extend(ready)
                size = sum(len(r.body) for r in ready)
                self._ready_bytes += size
            if order.done:  # SeqOrder let go of whatever waited
                self._waiting_bytes = 0
            elif ready:
                self._waiting_bytes -= size - len(result.body)
            elif order.duplicates == duplicates:  # kept behind a missing seq
                self._waiting_bytes += len(result.body)
            if self._ready_bytes + self._waiting_bytes > self.max_buffered_bytes and not order.done:
                if self.replay and self._waiting_bytes <= self.max_buffered_bytes // 2:
                    self._paused = True  # in order, ahead of the loop: __anext__ reads on later
                    self._arrived.set()
                    return
                self._error = ResultsOverrun(
                    f"results of {self.request_id!r}: more than {self.max_buffered_bytes} bytes received and not "
                    f"yet read ({self._ready_bytes} ready, {self._waiting_bytes} behind seq {order.next_seq})")
                self._ready.clear()  # the bound: nothing more is handed out of a stream that passed it
                self._ready_bytes = self._waiting_bytes = 0
        self._arrived.set()

    def __aiter__(self) -> ResultStream:
        return self

    async def _end(self) -> None:
        self._ended = True
        await self.close()

    async def __anext__(self) -> ResultInfo:
        if self._ended:
            raise StopAsyncIteration
        await self.subscribe()
        while True:
            if not self._order.done and anyio.current_time() >= self._deadline:  # waiting ones or not
                await self._time_out()
            if self._paused and self._ready_bytes + self._waiting_bytes <= self.max_buffered_bytes // 2:
                await self._read_on()  # before a result is handed out: if it fails, nothing is lost
            if self._ready:  # results that arrived before an error are still handed out, in order
                result = self._ready.popleft()
                self._ready_bytes -= len(result.body)
                return result
            if self._error is not None:
                await self._end()
                raise self._error
            if self._order.done:
                await self._end()
                raise StopAsyncIteration
            self._arrived = anyio.Event()
            with anyio.move_on_after(self._deadline - anyio.current_time()):
                await self._arrived.wait()
            if not self._arrived.is_set():
                await self._time_out()

    async def _time_out(self) -> NoReturn:
        await self._end()
        hint = ""
        reconnects = self._reconnect_count() - self._reconnects
        if reconnects and not self.replay:
            hint = (f"; the connection reconnected {reconnects} time(s) meanwhile: results published while "
                    "it was disconnected are lost to a live subscription (follow with replay=True "
                    "against a results stream survives a reconnect)")
        raise TimeoutError(f"no final result for request {self.request_id!r} within {self.timeout}s "
                           f"({self._order.next_seq} results received){hint}")

    async def collect(self) -> list[ResultInfo]:
        """Every result up to the final one; the subscription is released however it ends."""
        try:
            return [result async for result in self]
        finally:
            await self.close()


def follow(nc: NatsClient, subjects: Subjects, request_id: str, *, timeout: float | None = None,
           replay: bool = False, max_buffered_bytes: int = CLIENT_BUFFER_BYTES) -> ResultStream:
    """One request's results in seq order until the final one::

        async with follow(nc, subjects, request_id, timeout=30) as results:
            async for r in results: ...

    ``async with`` releases the subscription however the loop ends. A bare ``async for r in
    follow(...)`` releases it only when the stream ends (final result, error, timeout): a ``break``,
    an exception in the loop body or a cancellation leaves it on the connection (wrap it in
    ``contextlib.aclosing`` then). ``replay`` reads them from the results stream, from the first
    one on (late attach). ``max_buffered_bytes``: the module doc.
    """
    return ResultStream(nc, subjects, request_id, timeout=timeout, replay=replay,
                        max_buffered_bytes=max_buffered_bytes)


async def collect(nc: NatsClient, subjects: Subjects, request_id: str, *, timeout: float | None = None
                  ) -> list[ResultInfo]:
    """Every result of one request, in order. Subscribes now: only results published later are seen."""
    async with follow(nc, subjects, request_id, timeout=timeout) as results:
        return await results.collect()


MAX_MALFORMED_KEPT = 1000


class AllResults:
    """Every result on a prefix through one wildcard subscription, as an async context: the SUB is
    at the server once entered, and nats-py's queue is unbounded (a tool that must see each result).
    Subclasses set ``nc``, ``subjects`` and ``_sub = None`` and handle each message in ``_on_msg``."""

    nc: NatsClient
    subjects: Subjects
    _sub: Subscription | None

    async def _on_msg(self, msg: Msg) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._sub = await self.nc.subscribe(self.subjects.all_results, cb=self._on_msg,
                                            pending_msgs_limit=-1, pending_bytes_limit=-1)
        await flush_queued(self.nc)
        return self

    async def __aexit__(self, *exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            await sub.unsubscribe()


class ResultCollector(AllResults):
    """Results of many requests through one wildcard subscription (demo, tests).

    It keeps every result it sees, of every request on the prefix, for as long as it is open: a
    tool for bounded runs (the demo's migrations, tests), not for a long-lived reader, which follows
    its own requests (:func:`follow`); ``streamproc simulate --verify`` forgets each request once
    checked (``streamproc.sim.verification.Verifier``)."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        check_client(nc)
        self.nc = nc
        self.subjects = subjects
        self.results: dict[str, list[ResultInfo]] = {}
        self.malformed: list[str] = []  # the first MAX_MALFORMED_KEPT refused messages, why
        self.malformed_total = 0
        self._orders: dict[str, SeqOrder] = {}
        # one entry per wait_for in progress: the finals it still needs, and its wake-up (a collector
        # shared by tasks has several at once; one shared set made each call answer for another's)
        self._waiters: list[tuple[set[str], anyio.Event]] = []
        self._sub: Subscription | None = None

    async def _on_msg(self, msg: Msg) -> None:
        try:
            result = _parse(self.subjects, msg)
        except MalformedResult as exc:
            self._refuse(str(exc))
            return
        rid = result.request_id
        order = self._orders.get(rid)
        if order is None:
            order = self._orders[rid] = SeqOrder()
            self.results[rid] = []
        try:
            self.results[rid].extend(order.push(result))
        except OverflowError as exc:
            self._refuse(f"results of {rid!r}: {exc}")
            return
        if order.done:
            for missing, done in self._waiters:
                if rid in missing:
                    missing.discard(rid)
                    if not missing:
                        done.set()

    def _refuse(self, text: str) -> None:
        self.malformed_total += 1
        if len(self.malformed) < MAX_MALFORMED_KEPT:  # the first ones say what; the count says how many
            self.malformed.append(text)

    def finished(self, request_id: str) -> bool:
        order = self._orders.get(request_id)
        return order is not None and order.done

    def duplicates(self, request_id: str) -> int:
        """Results for ``request_id`` that repeated a seq or came after its final one."""
        order = self._orders.get(request_id)
        return order.dropped if order is not None else 0

    async def wait_for(self, request_ids: Iterable[str], *, timeout: float) -> dict[str, list[ResultInfo]]:
        """Wait until every request has its final result; raise TimeoutError naming the missing ones."""
        wanted = list(request_ids)
        waiter = ({rid for rid in wanted if not self.finished(rid)}, anyio.Event())
        if waiter[0]:
            self._waiters.append(waiter)
            try:
                with anyio.move_on_after(timeout):
                    await waiter[1].wait()
            finally:
                self._waiters.remove(waiter)
        missing = sorted(waiter[0])
        if missing:
            raise TimeoutError(f"{len(missing)} of {len(wanted)} requests had no final result within {timeout}s "
                               f"(first: {missing[:5]})")
        return {rid: self.results[rid] for rid in wanted}
