"""The processor's control plane: request/reply on ``P.control.<request_id>.migrate``.

The shell side of migration, nothing clever: decode the request, let the correlator decide
(:meth:`~streamproc.correlator.Correlator.migrate`), publish what it decided through the
processor's dispatch path, then reply. The decision and its dispatch run exclusively of the
message path and the timer, so a refusal's error result cannot interleave on the wire with a
result of the same request, and the reply is sent only once the seal is in effect: a chunk of
the sealed attempt that arrives after the reply is dropped.

Migrates of different requests are answered concurrently (up to :data:`CONCURRENCY`), one
request's one at a time and in the order received: in durable mode a migrate of a request the
instance does not hold waits on JetStream reads, and answered strictly one after another, a burst
of them for made-up ids held up every genuine migrate behind it (an attack session measured 24.6 s
behind 3,000).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from typing import NamedTuple, Protocol

import anyio
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..core.wire import (
    ContractError,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    MigrateRequest,
    Sealed,
    Subjects,
    decode_migrate_request,
    encode_control,
)
from ..core import defaults
from ..core.migrate_rate import MigrateRate
from ..core.errors import shown
from ..logs import LogLimiter, error_text, log_event
from .robust import flush_queued

log = logging.getLogger("streamproc.control")
# The processor's and the edge's own inboxes (pull requests, PubAcks): an answer there would be read
# as a pull status or a PubAck, so they are no migrate's reply, whatever --control-reply-prefix says.
_OWN_INBOXES = defaults.OWN_INBOX_PREFIX + "."
# Requests whose migrates are answered at once (one slot each): past it the subscription's callback
# waits, so a burst queues in nats-py's pending queue, within its limits, not here.
CONCURRENCY = 64
# One request's migrates waiting behind its running one, at most. They do not hold a slot: many
# migrates of one (made-up) request, answered in order, would otherwise hold every slot and stall
# the other requests' as strictly serial answering did. Past it a migrate is answered at once with
# ``unavailable`` (nothing moved; the Migrator asks again).
MAX_WAITING_PER_REQUEST = 16


class _Ask(NamedTuple):
    """A migrate as it waits for its turn: its reply subject, and its request (or the answer to a
    malformed one), with the free-text ``reason`` already cut to what the log shows."""

    reply: str
    request: MigrateRequest | MigrateError
    reason: str  # shown; "" for none


def _read(request_id: str, msg: Msg) -> _Ask:
    try:
        request = decode_migrate_request(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _Ask(msg.reply, MigrateError(request_id, MigrateErrorCode.BAD_REQUEST,
                                            f"malformed migrate request: {exc}"), "")
    reason = shown(request.reason) if request.reason else ""
    return _Ask(msg.reply, msgspec.structs.replace(request, reason=""), reason)


class MigrateTarget(Protocol):
    """What the control plane needs from the processor, and nothing more."""

    def owns(self, request_id: str) -> bool:
        """Whether this instance answers for the request."""

    def holds(self, request_id: str) -> bool:
        """Whether the request is active here (its migrates are bounded by ``--max-migrations``)."""

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateReply:
        """Seal the request's current attempt, in order with the chunks received before the call."""


class ControlPlane:
    def __init__(self, nc: NatsClient, subjects: Subjects, target: MigrateTarget,
                 limited: LogLimiter | None = None, reply_prefix: str = defaults.CONTROL_REPLY_PREFIX,
                 rate: MigrateRate | None = None) -> None:
        """``limited``: the pipeline's limiter (its timer flushes the suppressed counts).
        ``reply_prefix``: what a migrate's reply subject must start with (``--control-reply-prefix``).
        ``rate``: migrates of requests not active here answered per second (``--max-migrate-rate``)."""
        self._nc = nc
        self._subjects = subjects
        self._target = target
        self._reply_prefix = reply_prefix
        self.replies_refused = 0  # migrates refused for their reply subject (/metrics)
        self.dropped = 0  # migrates nats-py dropped unread, past the control queue's bound (/metrics)
        self.rate = rate if rate is not None else MigrateRate(defaults.MIGRATE_RATE)
        self._sub: Subscription | None = None
        # Anyone allowed to publish on the control subjects can send bad ones (and migrates, each
        # logged) at will: every per-request line here is rate limited per event name.
        self._limited = limited if limited is not None else LogLimiter(log)
        self._slots = asyncio.Semaphore(CONCURRENCY)
        self._waiting: dict[str, deque[_Ask]] = {}  # request id -> its later migrates, while one of it runs
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False  # set before stop's cancels, which a migrate's JetStream answer can swallow

    def dropped_from(self, sub: object) -> bool:
        """Whether ``sub`` (a slow consumer's subscription) is this plane's, its drop then counted here
        (logged at the 1st, 2nd, 4th... drop): dropped migrates (the Migrator asks again), not chunks."""
        if sub is None or sub is not self._sub:
            return False
        self.dropped += 1
        if self.dropped & (self.dropped - 1) == 0:
            log_event(log, logging.WARNING, "control_migrates_dropped", dropped_total=self.dropped)
        return True

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subjects.all_migrate, cb=self._on_migrate,
                                             pending_msgs_limit=defaults.CONTROL_PENDING_MSGS,
                                             pending_bytes_limit=defaults.CONTROL_PENDING_BYTES)
        # A migrate sent (from any connection) once start() returns is heard: the PONG must follow the
        # SUB, which a stock nats-py client's flush() does not ensure (robust.flush_queued).
        await flush_queued(self._nc)

    async def stop(self, timeout: float) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with anyio.move_on_after(timeout):
                await sub.drain()  # answer the migrates already received
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
        # Also on a closed connection (NATS lost, or closed before the stop): nothing can be answered
        # any more, and a running migrate must not go on to decide the ones waiting behind it.
        self._stopped = True
        for task in self._tasks:
            task.cancel()

    def _answerable(self, reply: str) -> bool:
        """A requester's inbox: under ``--control-reply-prefix`` (and more than it), never ours."""
        prefix = self._reply_prefix
        return reply.startswith(prefix) and len(reply) > len(prefix) and not reply.startswith(_OWN_INBOXES)

    async def _on_migrate(self, msg: Msg) -> None:
        try:
            request_id = self._subjects.request_id_of_migrate(msg.subject)
        except ContractError as exc:
            self._limited.log(logging.WARNING, "bad_control_subject", subject=msg.subject, reason=exc.reason)
            return
        if msg.reply and not self._answerable(msg.reply):
            # The answer would go out with the processor's rights: to a result subject, a KV bucket
            # or the JetStream API, wherever the sender may not publish itself. Refused before the
            # request is touched (nothing sealed), and not answered.
            self.replies_refused += 1
            self._limited.log(logging.WARNING, "control_reply_refused", request_id=request_id,
                              reply=shown(msg.reply), expected_prefix=self._reply_prefix)
            return
        if not self._target.owns(request_id):
            # Durable mode: every instance hears the control subject, but only the owner of the
            # request's partition answers for it; the others stay silent so the owner's answer is
            # the one the requester gets (with no owner, e.g. mid-failover, the request times out
            # and the Migrator tries again: the next owner reads the state from JetStream).
            return
        # Only migrates of requests without state here are charged: those of a held request are
        # bounded by --max-migrations, and a flood of made-up ids must not refuse them (a genuine
        # migrate of a request whose worker was lost).
        wait = None if self._target.holds(request_id) else self.rate.take(time.monotonic())
        if wait is not None:  # before the request is read or waited on: a refusal costs one reply
            self._limited.log(logging.WARNING, "migrate_throttled", request_id=request_id,
                              rate=self.rate.rate)
            await self._reply(request_id, msg.reply, MigrateError(
                request_id, MigrateErrorCode.UNAVAILABLE,
                f"migrate rate limit: this processor answers {self.rate.rate:g} migrates a second of requests "
                f"not active here "
                f"(--max-migrate-rate); nothing moved, ask again", retry_after=math.ceil(wait * 1000) / 1000))
            # nats-py calls back from a loop that does not yield while its queue holds messages: a
            # flood answered this fast would otherwise starve the chunk subscriptions and the flusher.
            await asyncio.sleep(0)
            return
        ask = _read(request_id, msg)  # before it waits: a body (up to max_payload) is not held meanwhile
        later = self._waiting.get(request_id)
        if later is not None:  # one of this request's migrates runs: this one is answered after it
            if len(later) < MAX_WAITING_PER_REQUEST:
                later.append(ask)
            else:
                await self._reply(request_id, ask.reply, MigrateError(
                    request_id, MigrateErrorCode.UNAVAILABLE,
                    f"{MAX_WAITING_PER_REQUEST} migrates of this request are waiting already; nothing moved, ask again"))
            return
        await self._slots.acquire()
        # Only this callback adds entries (nats-py runs it one message at a time): none appeared meanwhile.
        self._waiting[request_id] = deque()
        task = asyncio.get_running_loop().create_task(self._serve(request_id, ask))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request_id: str, ask: _Ask) -> None:
        """Answer ``ask`` and then the request's migrates received meanwhile, in order; the request's
        slot is given back once none is left. Once :meth:`stop` gave up waiting, the rest go
        unanswered (the Migrator asks again), also when its cancel did not reach here: nats-py awaits
        each JetStream answer (a durable seal record) with ``asyncio.wait_for``, which on Python 3.11
        returns an answer that came in the loop pass of the cancel and swallows the cancel."""
        later = self._waiting[request_id]
        try:
            while True:
                try:
                    await self._answer(request_id, ask)
                except Exception as exc:  # this migrate goes unanswered (the Migrator retries); not the others
                    self._limited.log(logging.ERROR, "migrate_failed", request_id=request_id, error=error_text(exc))
                if not later or self._stopped:
                    return
                ask = later.popleft()
        finally:
            del self._waiting[request_id]
            self._slots.release()

    async def _answer(self, request_id: str, ask: _Ask) -> None:
        reply: MigrateReply
        if isinstance(ask.request, MigrateError):
            reply = ask.request
        else:
            reply = await self._target.migrate(request_id, ask.request)
            if ask.reason:
                self._limited.log(logging.INFO, "migrate_requested", request_id=request_id, reason=ask.reason)
        if isinstance(reply, Sealed):
            self._limited.log(logging.INFO, "attempt_sealed", request_id=request_id, attempt=reply.attempt,
                              emitted_tokens=reply.emitted_tokens, result_seq=reply.result_seq)
        else:
            self._limited.log(logging.INFO, "migrate_error", request_id=request_id, code=reply.code.value,
                              detail=reply.message)
        await self._reply(request_id, ask.reply, reply)

    async def _reply(self, request_id: str, subject: str, reply: MigrateReply) -> None:
        if subject:
            try:
                await self._nc.publish(subject, encode_control(reply))
            except Exception as exc:  # the requester gave up or NATS is gone; the decision stands
                log_event(log, logging.WARNING, "control_reply_failed", request_id=request_id,
                          error=error_text(exc))
