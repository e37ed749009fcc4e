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
creates it): a pull consumer of the request's subject reads it from its first result on, then
follows live ones, so an edge may attach at any time; repeats (a replay after a processor crash)
are dropped by the same seq check. It needs publish permission on ``$JS.API.STREAM.NAMES`` (the
stream lookup) and on ``$JS.API.CONSUMER.CREATE``, ``.MSG.NEXT`` and ``.DELETE`` of the results
stream: the ``edge`` user of ``deploy/nats-server.conf`` has them, the ``frontend`` user not
(docs/security.md, "Replaying with follow"). nats-server drops a refused publish and says so only on the connection (``-ERR
'Permissions Violation ...'``, nats-py's ``last_error`` and error callback), never to the request:
the stream raises :class:`~streamproc.core.errors.ReplayRefused`, naming the subject and the
permission, one or two round trips after such a request, instead of waiting out a timeout. A
pull answered "no responders" (``503``) before any consumer answered one is refused too: the
account may publish it but lacks the import of ``$JS.API.CONSUMER.MSG.NEXT.<stream>.>`` (the
message says so). A consumer made again ``REPLAY_RENEWALS_MAX`` times in a row without an answer
(gone, pulls lost) ends the stream with ``TimeoutError``, whatever ``timeout``, as at the edge.

What one request's results may hold in the reader is bounded by ``max_buffered_bytes`` of results
received and not yet taken (each charged its body, the header values it keeps, ``error`` and
``traceparent``, and a fixed cost: ``ResultInfo.held_bytes``, so results with empty bodies count; the
values are read as ASCII, an ``error`` with ``?`` for each character past it, a ``traceparent`` past
it dropped, so their length is the memory they hold: ``wire.held_error_text``), as
the edge bounds a stream by ``--stream-buffer-bytes``. Bodies kept
behind a missing seq past it end the stream with :class:`~streamproc.core.errors.ResultsOverrun`
(one forged request cannot grow a reader); so do in-order bodies a slow loop has not taken on a
live stream (the processor does not wait for it). A replay instead asks the server for no more
than the bound holds: each pull's ``max_bytes`` is the room left, and the next pull goes out once
the loop has taken half of it, so a slow reader is sent each stored result once, at its own pace
(a push consumer that the bound only paused kept sending, and what it sent was thrown away and
read again: 1.5 GB on the wire for a 250 MiB history read by a loop 2 ms a result). ``timeout``
is a deadline for the final result that holds while results are waiting too (a producer that
never ends, faster than its reader, is ended).

A live subscription (``replay=False``) misses what is published while the NATS connection is
down: after a reconnect the stream waits for results that will never come, until ``timeout``
(whose ``TimeoutError`` then says the connection reconnected). A replaying one reads on from the
first stored result it has not received (a new consumer after a reconnect, a gap in its delivery
sequence, or a pull gone unanswered), so in durable mode ``replay=True`` survives a reconnect.
The consumer is deleted when the stream is closed; a reader that vanishes without closing (its
process killed) leaves it to the server, which removes it after ``REPLAY_CONSUMER_IDLE`` seconds
without a pull.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from typing import Awaitable, Iterable, NoReturn, Self, TypeVar

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DEFAULT_PREFIX as JS_API_PREFIX

from ..core.defaults import CLIENT_BUFFER_BYTES, RESULT_HELD_OVERHEAD
from ..core.errors import MalformedResult, ReplayRefused, ResultsOverrun
from ..core.reorder import SeqOrder, stale_final_text
from ..core.replay_pull import PullState
from ..core.wire import (MAX_REQUEST_ID_LEN, ContractError, ResultInfo, Subjects, check_request_id,
                         result_from_message)
from ..nats.refusals import refused_publish
from ..nats.replay_pull import (
    REPLAY_CONSUMER_IDLE,
    REPLAY_PULL_BATCH,
    REPLAY_PULL_HEARTBEAT,
    REPLAY_PULL_LOST_AFTER,
    REPLAY_RENEWALS_MAX,
    encode,
    pull_request,
    pull_status,
    pull_subject,
    replay_consumer_config,
    replay_consumer_name,
)
from ..nats.robust import flush_queued
from ..nats.streams import find_stream
from .connection import check_client

T = TypeVar("T")
def _refused(nc: NatsClient, mark: object, subject: str) -> str | None:
    """The server's refusal of a publish to ``subject`` (or below it), if one arrived since ``mark``
    (``nc.last_error`` before the publish): the ``-ERR`` comes before the PONG of a later flush."""
    error = nc.last_error
    if error is None or error is mark or not refused_publish(str(error), subject):
        return None
    return str(error)


def _parse(subjects: Subjects, msg: Msg) -> ResultInfo:
    try:
        return result_from_message(subjects, msg.subject, msg.headers, msg.data)
    except (ContractError, ValueError) as exc:
        raise MalformedResult(f"malformed result on {msg.subject!r}: {exc}") from None


# A replay's pulls (``$JS.API.CONSUMER.MSG.NEXT``, sized as streamproc/nats/replay_pull.py says, with
# its heartbeat and its silence after which a pull is over): how long one waits on the server for
# results not stored yet. REPLAY_CONSUMER_IDLE (replay_pull.py) is read from here at each creation
# (tests shorten it).
REPLAY_PULL_EXPIRES = 5.0
_DELETE_WAIT = 2.0  # seconds close() waits for the consumer's deletion (shielded from a cancellation)


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
        self._ready_bytes = 0  # held_bytes of _ready
        self._waiting_bytes = 0  # held_bytes of what SeqOrder holds behind a missing seq
        self._error: MalformedResult | ResultsOverrun | ReplayRefused | TimeoutError | None = None
        self._arrived = anyio.Event()
        self._sub: Subscription | None = None  # live: the result subject; replay: the consumer's inbox
        self._deadline = math.inf
        self._reconnects = 0  # the connection's reconnect count when the subscription was made
        self._ended = False  # final result, error or timeout: nothing more to wait for
        # replay: the results stream (found once), the pull consumer and where it delivers
        self._stream: str | None = None
        self._consumer: str | None = None
        self._inbox = ""
        self._next_stored = 0  # the stream sequence after the last result received (0: none yet)
        self._consumer_reconnects = 0  # reconnect count when the consumer was made: a reconnect makes a new one
        self._renew = False  # make the consumer again from _next_stored before the next pull
        # the pull out, the one that did not fit, silence, renewals in a row; its delivery sequence
        # (a gap makes a new consumer)
        self._pull_state = PullState(REPLAY_PULL_BATCH, REPLAY_PULL_LOST_AFTER, REPLAY_RENEWALS_MAX)
        self._closes = 0  # close() calls: a consumer made while one happened is deleted at once
        self._next_allowed = False  # a pull was answered: MSG.NEXT is not refused (no round trip to check)
        self._gone_why = ""  # why the last consumer was made again

    async def subscribe(self) -> None:
        """Register interest on the server (returns once the server has it); nothing once the stream ended."""
        if self._sub is not None or self._ended:
            return
        if self.timeout is not None and self._deadline == math.inf:
            # from the first attempt: a retry after a failed open (the consumer's create, a lookup)
            # does not give the caller more time
            self._deadline = anyio.current_time() + self.timeout
        # one result always fits, whatever the server's max_payload (known once connected): its body
        # and header block are within max_payload, its id and fixed cost outside it
        self.max_buffered_bytes = max(self.max_buffered_bytes, (getattr(self.nc, "max_payload", 0) or 0)
                                      + MAX_REQUEST_ID_LEN + RESULT_HELD_OVERHEAD)
        subject = self.subjects.result(self.request_id)
        if self.replay:
            if self._stream is None:
                names = f"{JS_API_PREFIX}.STREAM.NAMES"
                self._stream = await self._guarded(names, names, find_stream(self.nc.jetstream(), subject))
                if self._stream is None:
                    raise LookupError(f"no JetStream stream stores {subject!r}: nothing to replay")
            await self._open_consumer()
        else:
            self._sub = await self.nc.subscribe(subject, cb=self._on_msg)
            await flush_queued(self.nc)
        self._reconnects = self._reconnect_count()

    async def _open_consumer(self) -> None:
        """A pull consumer of the request's subject from the first result not received yet, and its
        inbox subscription; the one before, if any, deleted. Nothing is sent until a pull asks
        (:meth:`_pull`). Closed meanwhile (another task), the new consumer is deleted at once."""
        await self._drop_consumer()
        closes = self._closes
        nc = self.nc
        js = nc.jetstream()
        inbox = nc.new_inbox()
        name = replay_consumer_name(inbox)
        # What arrives is at most what the pulls asked for (the bound), plus one result fetched alone.
        room = 2 * self.max_buffered_bytes + (getattr(nc, "max_payload", 0) or 1 << 20)
        sub = await nc.subscribe(inbox, cb=self._on_delivery, pending_bytes_limit=max(room, 64 << 20))
        config = replay_consumer_config(name, self.subjects.result(self.request_id), self._next_stored,
                                        REPLAY_CONSUMER_IDLE)
        reconnects = self._reconnect_count()
        try:
            create = f"{JS_API_PREFIX}.CONSUMER.CREATE.{self._stream}"
            await self._guarded(f"{create}.{name}", f"{create}.>", js.add_consumer(self._stream, config=config))
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await self._delete_consumer(name)  # it may exist: the answer, not the request, was lost
            raise
        self._sub, self._consumer, self._inbox = sub, name, inbox
        self._consumer_reconnects = reconnects
        self._renew = False
        self._pull_state.consumer_made()
        if self._closes != closes or self._ended:
            await self._drop_consumer()

    async def _guarded(self, subject: str, permission: str, request: Awaitable[T]) -> T:
        """``await request``, a JetStream API request on ``subject`` (or below it), unless the server
        refuses its publish: then :class:`ReplayRefused` (the stream ended) after one or two round
        trips, not the request's timeout. The first flush's PING may leave before the request's PUB
        (the request runs as a task); the second follows it."""
        nc = self.nc
        mark = nc.last_error
        task = asyncio.ensure_future(request)
        try:
            await asyncio.sleep(0)  # the request queues its PUB before its first real suspension
            for _ in range(2):
                if task.done():
                    break
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    await nc.flush(timeout=REPLAY_PULL_LOST_AFTER)
                refusal = _refused(nc, mark, permission.removesuffix(".>"))
                if refusal is not None:
                    task.cancel()
                    await self._refuse(subject, permission, refusal)
            return await task
        finally:
            if not task.done():
                task.cancel()

    async def _refuse(self, subject: str, permission: str, refusal: str) -> NoReturn:
        await self._end()
        raise ReplayRefused(subject, permission, refusal)

    async def _drop_consumer(self) -> None:
        sub, self._sub = self._sub, None
        name, self._consumer = self._consumer, None
        self._pull_state.over()
        if sub is not None and not self.nc.is_closed:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if name is not None:
            await self._delete_consumer(name)

    async def _delete_consumer(self, name: str) -> None:
        """Best effort, bounded, and done even by a cancelled task (its ``async with`` exits):
        otherwise the server keeps the consumer ``REPLAY_CONSUMER_IDLE`` seconds."""
        if self.nc.is_closed or self._stream is None:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(_DELETE_WAIT), contextlib.suppress(Exception):
            await self.nc.jetstream().delete_consumer(self._stream, name)

    async def _pull(self) -> None:
        """Ask for the next results when the bound has room for half of it (or the one that did
        not fit, alone, once everything before it was taken); make the consumer again first when a
        reconnect, a delivery gap, a deleted consumer or a lost pull calls for it. A failure
        (raised) loses nothing: the next step tries again from the same place."""
        if self._consumer is None or self._order.done or self._error is not None:
            return
        if self._reconnect_count() != self._consumer_reconnects:
            self._renew, self._gone_why = True, "a reconnect"
        elif self._pull_state.silent(anyio.current_time()):
            self._renew, self._gone_why = True, f"a pull unanswered for {REPLAY_PULL_LOST_AFTER} s"
        if self._renew:
            if not self._pull_state.renew():  # as the edge's replay: an error, not a loop
                await self._end()
                raise TimeoutError(
                    f"results of {self.request_id!r}: the replay's consumer was made again {REPLAY_RENEWALS_MAX} "
                    f"times without an answer (last: {self._gone_why or 'gone'}); "
                    f"{self._order.next_seq} results received")
            await self._open_consumer()
            if self._consumer is None:
                return
        room = self.max_buffered_bytes - self._ready_bytes - self._waiting_bytes
        pull = self._pull_state.ask(room, self.max_buffered_bytes, held=bool(self._ready))
        if pull is None:
            return  # one is out, or the loop takes what it holds first
        if self._waiting_bytes and (pull.room is None or room <= 0):
            # held behind a missing seq, which does not fit what is left: the bound is passed
            self._overrun()
            self._arrived.set()
            return
        # nothing held, one that did not fit comes alone: the bound (at least max_payload) holds it
        request = pull_request(pull.room, pull.batch, expires=REPLAY_PULL_EXPIRES,
                               heartbeat=REPLAY_PULL_HEARTBEAT)
        self._pull_state.sent(pull, anyio.current_time())
        subject = pull_subject(JS_API_PREFIX, self._stream, self._consumer)
        mark = self.nc.last_error
        try:
            await self.nc.publish(subject, encode(request), reply=self._inbox)
        except BaseException:
            # Raised or cancelled inside publish, the pull may be queued all the same: a second one
            # on this consumer could bring twice the room. The next step makes the consumer again.
            self._pull_state.over()
            self._renew = True
            raise
        if not self._next_allowed:  # until a pull is answered: refused? (-ERR before the PONG)
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await self.nc.flush(timeout=REPLAY_PULL_LOST_AFTER)
            refusal = _refused(self.nc, mark, subject)
            if refusal is not None:
                await self._refuse(subject, self._pull_permission(), refusal)

    def _pull_permission(self) -> str:
        return pull_subject(JS_API_PREFIX, self._stream, ">")

    async def _on_delivery(self, msg: Msg) -> None:
        """A message on the replay's inbox: a stored result of the current consumer, or a status
        that ends the pull out (``404``/``408``/``409``), says the consumer is gone (``503``, ``409
        Consumer Deleted``) or that the next result did not fit the pull's ``max_bytes``."""
        reply = msg.reply or ""
        if reply.startswith("$JS.ACK."):
            try:
                meta = msg.metadata
            except Exception:  # noqa: BLE001 - no delivery after all: not ours
                return
            if meta.consumer != self._consumer or self._renew:  # an earlier consumer's, or a renewal is due
                return
            if meta.sequence.consumer != self._pull_state.delivered + 1:  # one was lost (a reconnect): on from it
                self._renew = True
                self._arrived.set()
                return
            self._pull_state.took(anyio.current_time())
            self._next_allowed = True  # a pull got here: MSG.NEXT is allowed
            self._next_stored = meta.sequence.stream + 1
            await self._on_msg(msg)  # (never suspends)
            return
        status = pull_status(msg.headers)
        if status is None or reply or msg.subject != self._inbox:
            return  # a stray (nobody else may publish here)
        self._pull_state.status(status, anyio.current_time())  # the pull out ends, but for a heartbeat
        if status == "completed":  # after a filled batch's last result, which ended its pull already
            return
        if status == "refused":  # the consumer exists and MSG.NEXT is allowed, but the pull brought nothing:
            self._next_allowed = True  # no answer (PullState.renew), or a consumer refusing every pull
            if self._pull_state.stuck:  # is made again without end; refused even for one result alone
                self._renew, self._gone_why = True, (msg.headers or {}).get("Description") or "pull refused"
        elif status != "gone":  # the consumer answered: MSG.NEXT is allowed and imported
            self._next_allowed = True
            self._pull_state.answered()
            if status == "heartbeat":  # the pull out still waits on the server
                return
        elif (msg.headers or {}).get("Status") == "503" and not self._next_allowed and (
                self._reconnect_count() == self._consumer_reconnects):
            # No responders to a pull before any consumer answered one: nothing in this account
            # serves MSG.NEXT (the publish is allowed; an import is missing), as the edge reads it
            # (edge/replay.py, _renew). Renewing would loop for ever: refused.
            self._error = ReplayRefused(
                pull_subject(JS_API_PREFIX, self._stream or "", self._consumer or ""), self._pull_permission(),
                "no responders", imported=True)
        else:  # no consumer (idle too long, deleted): a new one
            self._renew, self._gone_why = True, (msg.headers or {}).get("Description") or "consumer gone"
        self._arrived.set()

    def _reconnect_count(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return stats.get("reconnects", 0) if isinstance(stats, dict) else 0

    async def close(self) -> None:
        self._closes += 1
        if self.replay:
            await self._drop_consumer()
            return
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
        if self._error is not None:  # failed: what came before is all it yields
            return
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
                size = sum(r.held_bytes for r in ready)
                self._ready_bytes += size
            if order.done:  # SeqOrder let go of whatever waited
                self._waiting_bytes = 0
                if order.contradicted is not None:  # what came before is handed out, then this
                    self._error = MalformedResult(
                        stale_final_text(self.request_id, order.contradicted, order.next_seq - 1))
            elif ready:
                self._waiting_bytes -= size - result.held_bytes
            elif order.duplicates == duplicates:  # kept behind a missing seq
                self._waiting_bytes += result.held_bytes
            if self._ready_bytes + self._waiting_bytes > self.max_buffered_bytes and not order.done:
                self._overrun()
        self._arrived.set()

    def _overrun(self) -> None:
        self._error = ResultsOverrun(
            f"results of {self.request_id!r}: more than {self.max_buffered_bytes} bytes received and not "
            f"yet read ({self._ready_bytes} ready, {self._waiting_bytes} behind seq {self._order.next_seq})")
        self._ready.clear()  # the bound: nothing more is handed out of a stream that passed it
        self._ready_bytes = self._waiting_bytes = 0

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
            if self.replay:
                await self._pull()  # before a result is handed out: if it fails, nothing is lost
            if self._ready:  # results that arrived before an error are still handed out, in order
                result = self._ready.popleft()
                self._ready_bytes -= result.held_bytes
                return result
            if self._error is not None:
                await self._end()
                raise self._error
            if self._order.done:
                await self._end()
                raise StopAsyncIteration
            self._arrived = anyio.Event()
            wake = self._deadline
            if self.replay:  # a lost pull, a reconnect: looked at once a pull's time is up
                pulls = self._pull_state
                wake = min(wake, pulls.until if pulls.out else anyio.current_time() + REPLAY_PULL_EXPIRES)
            with anyio.move_on_after(wake - anyio.current_time()):
                await self._arrived.wait()
            if not self._arrived.is_set() and anyio.current_time() >= self._deadline:
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
            if order.contradicted is not None and order.contradicted == result.seq and result.final:
                self._refuse(stale_final_text(rid, result.seq, order.next_seq - 1))
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
