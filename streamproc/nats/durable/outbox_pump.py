"""The I/O pump around the pure durable outbox (:mod:`streamproc.core.outbox`).

It publishes what the outbox says to publish, with a reply subject of its own per result
(``<inbox>.<ticket>``: a plain ``publish`` with a reply inbox, since ``publish()`` per message is
RTT-bound and ``publish_async`` futures per message are costly), feeds the PubAcks and the time
back, and sends the acks, NAKs and in-progress acks the outbox decides. Every rule (ordering,
retries, settle order, give-up) lives in the outbox; nothing here decides. With a client that can
publish without awaiting (``FastClient.enqueue``) PubAcks are handled in nats-py's read loop
(``FastClient.deliver_inline``) and :meth:`OutboxPump.pump_nowait` sends.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Awaitable, Callable, Iterable

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ...core.correlator import UNSTORABLE_CHUNK
from ...core.events import Decision, Notice
from ...core.outbox import (ACK, BATCH_REFUSED, GIVEN_UP, PROGRESS, REFUSED, TERM, GiveUp, Nak, Outbox, Outgoing,
                           in_turn)
from ...core.wire import result_block, result_headers
from ...logs import LogLimiter, error_text, log_event
from ..fast_client import encode_header_block

log = logging.getLogger("streamproc.durable")

_ACK = b""  # an empty reply is a JetStream ack
_NAK = b"-NAK"
_WPI = b"+WPI"
_TERM = b"+TERM"

# nats-server's fast batch publish rides in the reply subject (server/stream.go getFastBatch:
# "<prefix>.<uuid>.<initial flow>.<gap mode>.<batch seq>.<operation>.$FI"; op 0 start, 1 append, 2 commit).
_START, _APPEND, _COMMIT = "0", "1", "2"


def batch_reply(batch: str, size: int, index: int) -> str:
    """The reply subject tail of message ``index`` (1-based) of fast batch ``batch`` of ``size``
    messages: initial flow ``size`` (one flow ack, then the PubAck), gap mode fail (a missing
    message ends the batch), the last message commits."""
    op = _START if index == 1 else _COMMIT if index == size else _APPEND
    return f"{batch}.{size}.fail.{index}.{op}.$FI"


Notify = Callable[[Notice], None]
GiveUpHandler = Callable[[GiveUp], None]


def _payload(action: object) -> bytes:
    if action is ACK:
        return _ACK
    if action is PROGRESS:
        return _WPI
    if action is TERM:
        return _TERM
    assert isinstance(action, Nak)
    return _NAK if action.delay <= 0 else _NAK + b' {"delay": %d}' % int(action.delay * 1e9)


class OutboxPump:
    """Moves the outbox's results to the results stream and its acks to the chunk stream."""

    def __init__(self, nc: NatsClient, results_head: str, outbox: Outbox, *, clock: Callable[[], float],
                 notify: Notify, give_up: GiveUpHandler,
                 publish: Callable[..., Awaitable[None]] | None = None, limited: LogLimiter | None = None,
                 fence: Callable[[], None] | None = None) -> None:
        """``publish``: ``nc.publish`` unless tracing wraps it (``Pipeline.publisher``); ``limited``: the
        pipeline's log limiter (a results stream that refuses everything gives up every result);
        ``fence``: called before any result is sent, to drop what may no longer be sent from here
        (the durable input's partitions whose lease may have run out); may be set later (``fence``
        attribute), by whoever the pump must exist for first."""
        self._nc = nc
        self.fence = fence
        self._publish = publish or nc.publish
        # Acks, NAKs and in-progress acks wait for the next write (FastClient.publish_deferred).
        self._control = getattr(nc, "publish_deferred", None) or nc.publish
        # FastClient.enqueue: publish without awaiting, from handlers run in the read loop. Not with a
        # tracing wrapper around publish (its spans are the wrapper's).
        enqueue = getattr(nc, "enqueue", None)
        self._enqueue = enqueue if publish is None or publish == nc.publish else None
        self._backlogged = getattr(nc, "backlogged", None)
        self._head = results_head
        self.outbox = outbox
        self._clock = clock
        self._notify = notify
        self._give_up = give_up
        self._limited = limited if limited is not None else LogLimiter(log)
        self._reply_prefix = ""
        self._cut = 0
        self._sub: Subscription | None = None
        self.closed = False
        self.staged = False  # results wait for the client's next write (stage_writes)
        # What the outbox has ready leaves with the next write: sent now (enqueued), or staged for
        # the client's next write after stage_writes (which replaces it). An attribute, not a method
        # replaced on the instance: mypyc's classes do not take that.
        self.release: Callable[[], None] = self.send_nowait

    async def start(self) -> None:
        # Not a name from the connection's NUID: this inbox is the reply of every result, and a stream
        # import keeps the reply, so every reader of results (the edge) reads it. nats-py's
        # ``NUID.next`` adds a fixed increment (96..333) per inbox, so from ``new_inbox()``'s name the
        # connection's other inboxes (the partitions' pull inboxes) were a few thousand guesses away,
        # and a push consumer the edge creates on the results stream delivers into any subject of
        # STREAMPROC someone subscribed to by name (docs/security.md,
        # tests/test_edge_consumer_injection.py). Same prefix (the permissions), random token.
        inbox = f"{self._nc.new_inbox().rpartition('.')[0]}.{secrets.token_hex(11)}"
        self._reply_prefix = inbox + "."
        self._cut = len(self._reply_prefix)
        # Fast batch ids are the stream's, not the connection's: the inbox's unique token makes ours unique.
        self.outbox.batch_prefix = inbox.rpartition(".")[2] + "-"
        self._sub = await self._nc.subscribe(self._reply_prefix + ">", cb=self._on_reply,
                                             pending_msgs_limit=-1, pending_bytes_limit=-1)
        if self.inline:  # PubAcks handled in the read loop, no hop through the callback task
            self._nc.deliver_inline(self._sub, self._on_reply_inline)  # type: ignore[attr-defined]

    @property
    def inline(self) -> bool:
        """Whether results, acks and PubAcks can be handled without awaiting (:meth:`pump_nowait`):
        a client with ``enqueue`` (FastClient) and no tracing wrapper around ``publish``."""
        return self._enqueue is not None

    async def stop(self) -> None:
        if self.staged and not self._nc.is_closed:
            self.flush_staged()  # staged acks and NAKs (a hand-over's) must not wait for a write that never runs
        self.closed = True
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    @property
    def pending(self) -> int:
        """Results not stored yet."""
        return self.outbox.pending

    def take(self, decisions: list[Decision], request_id: str | None, received: float | None = None) -> None:
        """Hand decisions to the outbox; ``request_id`` owns their Settles; ``received``: when the chunk
        that made them arrived (result latency). Notices go to the log."""
        notices = self.outbox.take(decisions, request_id, received)
        if notices:
            for n in notices:
                self._notify(n)

    async def wait_idle(self, timeout: float, belongs: Callable[[str], bool] | None = None, *,
                        drive: float | None = None) -> bool:
        """Wait until every queued result (of the requests ``belongs`` selects) is stored; False on timeout.

        ``drive``: also feed the time in and send what is due every ``drive`` seconds, for a caller
        whose watchdog no longer ticks (a stop): a refused result, an overdue one, or a fast batch's
        head sent again after a member over ``max_payload`` is sent again only by a tick, and waited
        for without one it held the stop for the whole timeout and was handed over unstored."""
        outbox = self.outbox
        clock = self._clock
        due = clock()
        with anyio.move_on_after(timeout):
            while not outbox.idle if belongs is None else outbox.busy(belongs):
                if drive is not None and clock() >= due:
                    due = clock() + drive
                    self.tick(clock(), False, None)
                    await self.pump()
                    continue
                await anyio.sleep(0.005)
            return True
        return False

    def tick(self, now: float, reconnected: bool, held: Callable[[], Iterable[object]] | None) -> None:
        """Feed the time in: overdue results are queued again, a progress round runs when due."""
        given_up = self.outbox.tick(now, reconnected, held)
        for o in self.outbox.overdue():
            # Nothing answered: a results stream with no_ack, a server too busy, an interest lost.
            self._limited.log(logging.WARNING, "result_puback_overdue", request_id=o.result.request_id,
                              seq=o.result.seq, attempts=o.failures, max_attempts=self.outbox.config.max_attempts,
                              overdue_total=self.outbox.stats.pubacks_overdue)
        for g in given_up:
            self._given_up(g)

    async def pump(self) -> None:
        """Send what is ready: results first (their order per request is already fixed), then acks."""
        if self._enqueue is not None and self.pump_nowait():
            return
        if self.fence is not None:
            self.fence()
        publish = self._publish
        head = self._head
        prefix = self._reply_prefix
        for o, batch in self._results_due():
            r = o.result
            reply = prefix + (o.ticket if batch is None else batch_reply(*batch))
            try:
                await publish(head + r.request_id, r.body, reply, result_headers(r))
            except Exception as exc:  # disconnected with a full buffer, closed: the next tick resends
                self._send_failed(o, exc)
        send = self._control
        for reply, payload in self._controls_due():
            try:
                await send(reply, payload)
            except Exception as exc:  # a lost ack means a redelivery, which is safe
                log_event(log, logging.DEBUG, "control_publish_failed", error=error_text(exc))

    def pump_nowait(self) -> bool:
        """:meth:`pump` without awaiting (only when :attr:`inline`): False, and nothing sent, when
        the client's write buffer is backlogged (then ``await pump()``, which waits for the flusher)."""
        if self._backlogged():  # type: ignore[misc]
            return False
        self.release()
        return True

    def stage_writes(self) -> bool:
        """Hand results to the client when it writes rather than when they are ready, if it writes
        from a timer (``FastClient.before_write``, a flush interval): the chunks read together then
        leave as one batch per request, its first result included, at no cost in latency (an
        enqueued result waited for that write anyway). Each write takes what fits before the
        client's write buffer is backlogged; the rest waits for the next one."""
        nc = self._nc
        if self._enqueue is None or getattr(nc, "flush_interval", 0) <= 0 or not hasattr(nc, "before_write"):
            return False
        self._stage = nc.stage_write  # type: ignore[attr-defined]
        self._room = nc.room_for_writes  # type: ignore[attr-defined]
        nc.before_write = self._before_write  # type: ignore[attr-defined]
        self.release = self._stage
        self.staged = True
        return True

    def _before_write(self) -> bool:
        """The client is about to write: hand it the results and acks that fit; True if some wait."""
        if self.closed:
            return False
        room = self._room()
        if room > 0:
            self.send_nowait(budget=room)
        return bool(self.outbox.ready)

    def flush_staged(self) -> None:
        """Hand the client what is staged now, without waiting for its next write (before a flush
        that must carry it: a stop's hand-over NAKs)."""
        try:
            self.send_nowait()
        except Exception as exc:  # noqa: BLE001  (closing: what is lost is redelivered)
            log_event(log, logging.DEBUG, "flush_staged_failed", error=error_text(exc))

    def send_nowait(self, budget: int | None = None) -> None:
        """The sending of :meth:`pump_nowait`, for a caller that checked the backlog itself
        (``budget``: result body bytes at most, the first result always)."""
        enqueue = self._enqueue
        if self.fence is not None:
            self.fence()
        head = self._head
        prefix = self._reply_prefix
        for o, batch in self._results_due(budget):
            r = o.result
            subject = head + r.request_id
            reply = prefix + (o.ticket if batch is None else batch_reply(*batch))
            try:
                block = result_block(r)
                if block is not None and " " not in r.request_id:
                    # A plain id (result_block: printable ASCII) without a space: no whitespace in the
                    # subject (the results head is checked at start-up), and the reply is our inbox
                    # and a ticket, so nats-py's subject checks could not fail (3 calls per result).
                    enqueue(subject, r.body, reply, block, checked=True)  # type: ignore[misc]
                else:
                    enqueue(subject, r.body, reply, block or encode_header_block(result_headers(r)))  # type: ignore[misc]
            except Exception as exc:  # disconnected with a full buffer, closed: the next tick resends
                self._send_failed(o, exc)
        for reply, payload in self._controls_due():
            try:  # the ack subject is the server's own reply subject: not checked again
                enqueue(reply, payload, checked=True, defer=True)  # type: ignore[misc]
            except Exception as exc:  # a lost ack means a redelivery, which is safe
                log_event(log, logging.DEBUG, "control_publish_failed", error=error_text(exc))

    def _results_due(self, budget: int | None = None) -> Iterable[tuple[Outgoing, tuple[str, int, int] | None]]:
        """The outbox's results to publish now, each with its batch (None: alone; the caller makes
        the subject and the reply subject, ``<inbox>.<ticket>`` or :func:`batch_reply`'s), a batch
        member whose batch ended while the earlier ones were published skipped
        (:func:`~streamproc.core.outbox.in_turn`). A plain function: a generator here cost one
        call per result more (docs/benchmarks.md, "Calls per chunk")."""
        outbox = self.outbox
        if not outbox.ready:
            return ()
        return in_turn(outbox.sending(self._clock(), budget))

    def _controls_due(self) -> list[tuple[str, bytes]]:
        """The acks, NAKs and in-progress acks to send now, as (ack subject, payload); a NAK or
        progress for a message without a reply subject is skipped."""
        out = []
        for token, action in self.outbox.control():
            reply = token.reply  # type: ignore[attr-defined]
            if action is ACK:
                out.append((reply, _ACK))
            elif reply:
                out.append((reply, _payload(action)))
        return out

    def _on_reply_inline(self, subject: str, reply: str, headers: dict[str, str] | None, data: bytes,
                         queued: bool = False) -> bool:
        """A PubAck (or a refusal) settled: in the read loop, where it declines (False) when the write
        buffer is backlogged and then has the client write what it made ready, or ``queued`` for
        :meth:`_on_reply`, which pumps after it. One function for both: the settling as a call of its
        own cost one Python call per PubAck read inline (docs/benchmarks.md, "Durable CPU, fourth pass")."""
        nc = self._nc
        # nc.backlogged(), its rule inline: one Python call per PubAck less (docs/benchmarks.md, "Durable
        # CPU, fifth pass")
        if not queued and nc._pending_data_size * 2 > nc._max_pending_size > 0:
            return False
        ticket = subject[self._cut:]
        if "." in ticket:  # a reply to a fast batch's message: <batch id>.<flow>.<gap>.<batch seq>.<op>.$FI
            tokens = ticket.split(".")
            commit = len(tokens) > 4 and tokens[4] == _COMMIT
            outcome = self.outbox.on_batch_reply(tokens[0], commit, data, self._clock())
        else:
            outcome = self.outbox.on_puback(ticket, data, self._clock())
        if outcome is REFUSED or outcome is BATCH_REFUSED:
            self._refused(headers, data, whole=outcome is BATCH_REFUSED)
        elif outcome is GIVEN_UP:
            for g in self.outbox.given_up():
                self._given_up(g)
        # Staged, release is FastClient.stage_write, which does nothing while a write is set: not called then
        if not queued and (not self.staged or nc._write_timer is None):  # type: ignore[attr-defined]
            self.release()
        return True

    async def _on_reply(self, msg: Msg) -> None:
        self._on_reply_inline(msg.subject, msg.reply, msg.headers, msg.data, queued=True)
        await self.pump()

    def _refused(self, headers: dict[str, str] | None, data: bytes, whole: bool) -> None:
        """Log a refusal (at powers of two); ``whole``: a batch's as a whole, not its result's."""
        outbox = self.outbox
        errors = outbox.stats.publish_errors
        if errors & (errors - 1) == 0:  # log at powers of two
            result = outbox.last_refused
            status = (headers or {}).get("Status", "")
            # a batch refused whole: its first result is sent again alone at once, the rest follow one by one
            wait: dict[str, Any] = ({"one_at_a_time_for": f"{outbox.config.batch_pause:g}s"} if whole
                    else {"retry_in": f"{outbox.config.retry_after_refusal:.1f}s"})
            log_event(log, logging.WARNING, "result_batch_refused" if whole else "result_not_stored",
                      request_id=result.request_id if result is not None else "-", status=status,
                      detail=data[:200].decode(errors="replace"), **wait, errors_total=errors)

    def _send_failed(self, o: Outgoing, exc: Exception) -> None:
        """A publish that did not leave: sent again at the next tick, unless it never can (a result
        over the server's ``max_payload`` with its header block: ``FastClient._append`` refuses it,
        as nats-server would by closing the connection), which is given up at once."""
        if isinstance(exc, nats.errors.MaxPayloadError):
            self._failed(o.result.request_id, exc)
            for g in self.outbox.unsendable(o, "larger than the server's max_payload"):
                self._given_up(g)
            return
        self.outbox.send_failed(o)
        self._failed(o.result.request_id, exc)

    def _failed(self, request_id: str, exc: Exception) -> None:
        errors = self.outbox.stats.publish_errors
        if errors & (errors - 1) == 0:
            log_event(log, logging.WARNING, "result_publish_failed", request_id=request_id, error=error_text(exc),
                      errors_total=errors)

    def _given_up(self, g: GiveUp) -> None:
        self._limited.log(logging.ERROR, "result_given_up", request_id=g.request_id, seq=g.seq, attempts=g.attempts,
                          reason=g.reason,
                          detail=("request ended: its chunks terminated, later ones dropped on arrival "
                                  f"({UNSTORABLE_CHUNK})") if g.ends
                          else "replaced by an internal error result that ends the request" if g.replace
                          else "inputs NAKed; recovered from what is stored when redelivered")
        self._give_up(g)
