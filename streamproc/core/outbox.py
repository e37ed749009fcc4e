"""The durable outbox: results out to a stream that acknowledges storage, input acks only after.

A pure synchronous state machine in the h11 manner: the I/O shell feeds it decisions, PubAck
bodies and the time, and drains what to do (results to publish, acks, NAKs, in-progress acks).
It never touches a socket, so every guarantee below is checked by property tests
(``tests/test_outbox.py``) as well as against a live server.

- **One send per request in flight.** A request's results leave in seq order; the next send
  leaves when the previous one's PubAck is in. So a request's stored results are always ``0..k``
  with no gap, whatever is lost in between, and results of different requests pipeline freely.
  A send is one result, or (``batch_limit`` > 1, a results stream with ``allow_batched``) the
  results queued behind a stored one as one nats-server fast batch in gap-fail mode: the server
  stores a prefix of it, in order, and its PubAck's ``count`` says how long (pinned against the
  server by ``tests/test_fast_batch_server.py``). Batches are not ordered against each other, so
  a batch starts only at a result whose predecessor is stored, and a retry is a new batch.
- **Same id until stored.** A result is published again, under its ``Nats-Msg-Id``, when its
  PubAck is overdue (first after ``first_wait``, doubling up to ``max_wait``), ``retry_after_refusal``
  after the stream refused it, and at once after a reconnect; the stream's duplicate window
  collapses copies that were stored after all.
- **Acks follow storage.** An input token is acknowledged when the PubAck of the result that
  settles it is in. A :class:`~streamproc.core.correlator.Settle` (a token that contributes to
  nothing) waits behind the last queued result of its request: a redelivered copy of a chunk is the
  same stored message, and acking it early would release the original before its result is stored.
- **Bounded.** After ``max_attempts`` refusals or overdue PubAcks a result is given up: its request's
  queued results are dropped, their tokens NAKed (JetStream redelivers them, and the next owner
  recovers from what is stored) and a :class:`GiveUp` tells the shell to forget the request, log
  and count it. Nothing retries for ever inside one instance. A result refused because its
  request's subject is full (``max_msgs_per_subject``, discard new per subject) can never be
  followed by another of that request: its give-up ``ends`` the request, and its tokens are
  terminated instead (NAKed, they came back ``max_deliver`` times, each refused again, and the
  request's later chunks were held behind the gap until its timeout).

Tokens are opaque (the shell's ack handles; the ``decided`` hook lets the shell drop what a token
holds beyond its ack handle once its chunk is decided); tickets are strings the shell turns into
reply subjects. The recovery decisions for a chunk of a request this instance does not know are
:mod:`streamproc.core.recovery`'s.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Any, Callable, Iterable, Iterator

import msgspec
from msgspec import Meta

from . import defaults
from .events import Decision, Notice, Result, Settle
from .latency import LatencyHistogram

__all__ = [
    "ACK", "NAK", "PROGRESS", "TERM", "Nak", "Outbox", "OutboxConfig", "OutboxStats", "Outgoing", "GiveUp",
    "STORED", "DUPLICATE", "REFUSED", "BATCH_REFUSED", "GIVEN_UP", "UNMATCHED", "PENDING",
    "classify", "in_turn", "wire_size",
]


class OutboxConfig(msgspec.Struct, frozen=True):
    """Retry timing and bounds (the shell's defaults; tests shrink them)."""

    first_wait: float = 2.0  # first PubAck wait before a result is sent again
    max_wait: float = 10.0  # the wait doubles per resend up to this
    retry_after_refusal: float = 0.5  # seconds before a refused result is sent again
    max_attempts: int = defaults.MAX_RESULT_ATTEMPTS  # refusals + overdue PubAcks of one result, then give up
    progress_every: float = defaults.ACK_WAIT / 4  # seconds between in-progress rounds
    # Results of one request that may leave together as one nats-server fast batch (1: one at a time).
    # The shell sets it only for a results stream that allows batches (see the module docstring).
    batch_limit: int = 1
    # Body bytes of a batch beyond its first result: what one PubAck may release into the client's
    # write buffer at once (one result alone is never held back; it left alone before batches too).
    batch_bytes: int = defaults.RESULT_BATCH_BYTES
    # After a batch refused whole, results go one at a time for this long (then batches are tried again).
    batch_pause: float = defaults.RESULT_BATCH_PAUSE


class OutboxStats(msgspec.Struct):
    """Counters of the outbox (merged into the durable input's statistics)."""

    acks: Annotated[int, Meta(description="chunks acknowledged once the results they made were stored")] = 0
    naks: Annotated[int, Meta(description="chunks negatively acknowledged for a redelivery (their result "
                                          "could not be stored yet, or a handover)")] = 0
    in_progress: Annotated[int, Meta(description="+WPI sent for tokens held at two consecutive progress "
                                                 "rounds")] = 0
    duplicate_results: Annotated[int, Meta(description="PubAcks saying the result was already stored")] = 0
    publish_retries: Annotated[int, Meta(description="result publishes sent again (no PubAck in time, or a "
                                                     "retryable refusal)")] = 0
    publish_errors: Annotated[int, Meta(description="refusals and publishes that did not leave")] = 0
    results_given_up: Annotated[int, Meta(description="results given up: after max_attempts or over "
                                                      "max_payload (inputs NAKed, or settled by an error "
                                                      "result in its place), or refused by a full subject "
                                                      "(inputs terminated)")] = 0
    pubacks_overdue: Annotated[int, Meta(description="sends of a result whose PubAck did not come in time "
                                                     "(then sent again)")] = 0
    terminated: Annotated[int, Meta(description="inputs settled with +TERM (poison messages past "
                                                "max_deliver, the chunks of a request whose results the "
                                                "stream refuses for good), not counted in acks")] = 0
    result_batches: Annotated[int, Meta(description="fast batches sent (each with 2 to batch_limit results "
                                                    "of one request)")] = 0
    batch_pauses: Annotated[int, Meta(description="batches refused whole (batches off on the stream, no "
                                                  "batch slot): one at a time a while")] = 0


class Nak(msgspec.Struct, frozen=True):
    """Negative acknowledgement: redeliver after ``delay`` seconds (0: at once)."""

    delay: float = 0.0


ACK = "ack"
PROGRESS = "progress"  # still working on it: reset the redelivery timer
TERM = "term"  # settled for good, but never redeliver (a poison message past max_deliver)
NAK = Nak()
Action = str | Nak

# PubAck outcomes (what on_puback did), for the shell's logs and counters.
STORED = "stored"
DUPLICATE = "duplicate"
REFUSED = "refused"  # will be sent again
BATCH_REFUSED = "batch_refused"  # a batch refused as a whole: its first result leaves again alone at once
GIVEN_UP = "given_up"  # see given_up()
UNMATCHED = "unmatched"  # not a ticket in flight (a late copy, an abandoned request)
PENDING = "pending"  # a reply inside a fast batch that changes nothing (a flow ack, an error before its PubAck)


class GiveUp(msgspec.Struct, frozen=True):
    """A result that could not be stored within ``max_attempts``; its request was dropped."""

    request_id: str
    seq: int
    attempts: int
    reason: str  # "refused", "timeout", or why it can never be stored
    # No later result of the request can be stored either (its subject is full): its tokens were
    # terminated, not NAKed, and the shell ends the request for good (Correlator.unstorable).
    ends: bool = False
    # The result can never leave as it is (over the server's max_payload), and a redelivery makes it
    # again: its request's tokens were neither NAKed nor terminated but are ``tokens``, which the error
    # result the shell puts in its place settles (Correlator.unpublishable). NAKed, each such chunk came
    # back max_deliver times, ~1 MiB a delivery, filling max_ack_pending meanwhile: 300 of them held
    # their partition's other requests 16 s (tests/test_durable_worker_attack.py).
    replace: bool = False
    tokens: tuple = ()
    format: str | None = None  # the result's format (Result.format): the error result's shape


class Outgoing:
    """One result on its way to the stream, with the input tokens its PubAck releases."""

    __slots__ = ("result", "ticket", "settles", "due", "wait", "failures", "refused", "sent", "received", "timed",
                 "flight", "members", "batch_seq", "size", "alone", "full", "handed", "solo")

    def __init__(self, result: Result, ticket: str, settles: list, wait: float,
                 received: float | None = None) -> None:
        self.result = result
        self.ticket = ticket
        self.settles = settles
        self.due = 0.0  # when the PubAck is overdue (or, after a refusal, when to send again)
        self.sent = 0.0  # when it was last handed to NATS (sending())
        self.received = received  # when the chunk that made it ready arrived (None: a timer or control call)
        # The last result its chunk made ready: its first send is when that chunk's results are all
        # handed to NATS (observed once, into the outbox's handed_latency).
        self.timed = False
        self.wait = wait
        self.failures = 0
        self.refused = False  # due is a retry time after a refusal, not a PubAck deadline
        # In a fast batch: ``flight`` is the batch's ticket (None: sent alone under ``ticket``),
        # ``batch_seq`` its place in it (1-based); the first member holds the list and the retry state.
        self.flight: str | None = None
        self.members: list[Outgoing] | None = None
        self.batch_seq = 0
        self.size = 0
        self.alone = False  # its batch ended short at it: sent alone next time
        # Never taken into a batch behind another result: it could not be sent as a batch's later member
        # (over max_payload), and only as its request's first unstored result can an error replace it.
        self.solo = False
        # A batch's first member: a reply during its flight said the request's subject is full. The
        # batch's PubAck (or the commit's 10208 after a refused start) does not repeat why.
        self.full: bytes | None = None
        # Sends handed to NATS that did not fail to leave (sending() counts, send_failed() and
        # unsendable() take back): one that may have left may be stored, so no error result under
        # its Nats-Msg-Id may take its place (the server would deduplicate that against it).
        self.handed = 0

    @property
    def batch(self) -> tuple[str, int, int] | None:
        """``(batch ticket, batch size, batch seq)`` when it leaves in a fast batch, else None: the
        shell builds the reply subject from it (the last batch seq is the commit)."""
        flight = self.flight
        if flight is None:
            return None
        return flight, self.size, self.batch_seq


# nats-server's refusal of a message whose header block passes 65,535 bytes (JSStreamHeaderExceedsMaximumErr):
# the same message is refused every time.
_HEADERS_TOO_LARGE = b'"err_code":10097'
# Its refusal of a message over the stream's max_msg_size (JSStreamMessageExceedsMaximumErr): start-up
# refuses a max_msg_size below max_payload, but a stream edited under the running processor has one.
_MESSAGE_TOO_LARGE = b'"err_code":10054'
# Its refusal of a request's result past the stream's max_msgs_per_subject with discard new per subject
# (JSStreamStoreFailedF, 10077, worded as store.go's ErrMaxMsgsPerSubject): a request's results share one
# subject, so every later result of the request is refused too, until its results age out. The stream-wide
# ErrMaxMsgs / ErrMaxBytes (same code) are not this: results of every request are refused alike, and age
# out (max_age), so retrying them is how anything gets stored again.
_SUBJECT_FULL = b"maximum messages per subject exceeded"


def classify(data: bytes) -> str:
    """What a PubAck body says. An empty body is a status reply (503 no responders: no stream)."""
    if not data or b'"error":' in data:
        return REFUSED
    if b'"duplicate"' in data:  # nats-server writes '"duplicate": true', with a space (processJetStreamMsg)
        return DUPLICATE
    return STORED


class Outbox:
    """Per-request result queues between the correlator and the results stream.

    Feed it :meth:`take` (decisions), :meth:`on_puback` (replies by ticket), :meth:`send_failed`
    and :meth:`tick` (time); drain :meth:`sending` (results to publish now) and :meth:`control`
    (``(token, action)`` pairs). Synchronous, so the order of decisions is the order of each
    request's queue whichever task produced them.
    """

    def __init__(self, config: OutboxConfig = OutboxConfig(), stats: OutboxStats | None = None,
                 handed_latency: LatencyHistogram | None = None,
                 decided: Callable[[object], None] | None = None) -> None:
        """``decided``: called with each input token as it enters the outbox (queued behind a result,
        acked or NAKed: its chunk is decided, only settling it is left, which needs nothing but the
        token itself; a token the outbox handed back may come again with its NAK), so the shell can drop
        what the token holds beyond that (the durable shell: the chunk's body, which its ``Msg``
        kept alive until the ack was written, outside every budget, for as long as PubAcks lag)."""
        self.config = config
        self._decided = decided
        self.stats = stats if stats is not None else OutboxStats()
        self._queues: dict[str, list[Outgoing]] = {}  # per request; [0] is in flight or about to be
        # Bytes of result bodies queued (not stored yet): the shell stops pulling chunks past a bound,
        # since a request's results leave one send at a time and the ones behind wait here.
        self.queued_bytes = 0
        self._inflight: dict[str, Outgoing] = {}  # by ticket
        self.ready: deque[Outgoing] = deque()  # to publish; the shell reads its length, sending() drains it
        self._first_wait = config.first_wait
        self._control: list[tuple[object, Action]] = []
        self._given_up: list[GiveUp] = []
        # nats-server keys an open fast batch by its id alone, whoever publishes it: the shell makes the
        # ids unique on the stream with a prefix of its own (its reply inbox's unique token).
        self.batch_prefix = ""
        self.last_refused: Result | None = None  # the result of the last refusal (for the shell's log)
        self._overdue: list[Outgoing] = []  # results whose PubAck was overdue at the last tick (for the log)
        self._next = 0
        self._batches_from = 0.0  # no batch before this time (a batch was refused whole: _refused_whole)
        self._progress_seen: set[int] = set()
        self._next_progress = 0.0
        # Tokens to terminate instead of acknowledging, by id (kept alive here until settled).
        self._terminate: dict[int, object] = {}
        # Filled on every stored PubAck; the shell reads the buckets at scrape time (metrics).
        self.puback_latency = LatencyHistogram()  # last publish of a result -> its PubAck
        self.result_latency = LatencyHistogram()  # its chunk received -> the result stored (end to end)
        # A chunk received -> the results it made ready handed to NATS (the last one's first send),
        # once per chunk: the definition core mode records (Pipeline.result_latency,
        # streamproc_result_latency_seconds); the shell passes that histogram in, so both modes fill
        # the same metric with the same meaning.
        self.handed_latency = handed_latency if handed_latency is not None else LatencyHistogram()

    # ---------------------------------------------------------------------- state

    @property
    def pending(self) -> int:
        """Results not stored yet."""
        return sum(len(q) for q in self._queues.values())

    @property
    def idle(self) -> bool:
        return not self._queues

    def busy(self, belongs: Callable[[str], bool]) -> bool:
        """Whether a result of a request ``belongs`` selects is not stored yet."""
        return any(belongs(rid) for rid in self._queues)

    def queued_bytes_of(self, belongs: Callable[[str], bool]) -> int:
        """Bytes of queued result bodies of the requests ``belongs`` selects (O(queued results))."""
        return sum(len(o.result.body) for rid, queue in self._queues.items() if belongs(rid) for o in queue)

    def tokens(self) -> Iterator[object]:
        """Input tokens waiting for a PubAck."""
        for queue in self._queues.values():
            for o in queue:
                yield from o.settles

    # ---------------------------------------------------------------------- in

    def take(self, decisions: list[Decision], request_id: str | None = None,
             received: float | None = None) -> list[Notice]:
        """Queue results and place settled tokens; return the notices (for the shell's log).

        ``received``: when the chunk whose handling made these decisions arrived (the shell's
        clock), for the end-to-end latency observed when each result is stored, and once, when the
        last of them is first handed to NATS (``handed_latency``).

        ``request_id`` owns the Settles: they wait behind that request's last queued result. Off the
        message path (a seal, the timer) it is None; the Settles then belong to the one request the
        other decisions name, if they name exactly one, else nothing is queued ahead of them.
        """
        queues = self._queues
        decided = self._decided
        notices: list[Notice] | None = None
        o = None
        d: Any  # narrowed by its class below, which mypy does not follow (`is Result`, not isinstance)
        for d in decisions:
            cls = d.__class__
            if cls is Result:
                rid = d.request_id
                self._next += 1
                settles = []  # a loop, not a comprehension: that is a call of its own per result (Python 3.11)
                for t in d.settles:
                    if t is not None:
                        settles.append(t)
                        if decided is not None:
                            decided(t)
                o = Outgoing(d, str(self._next), settles, self._first_wait, received)
                self.queued_bytes += len(d.body)
                queue = queues.get(rid)
                if queue is None:
                    queues[rid] = [o]
                    self.ready.append(o)
                else:
                    queue.append(o)
            elif cls is Notice:
                if notices is None:
                    notices = [d]
                else:
                    notices.append(d)
            else:  # Settle
                if request_id is None:
                    request_id = _sole_request(decisions)
                queue = queues.get(request_id) if request_id is not None else None
                if queue:
                    settles = [t for t in d.tokens if t is not None]
                    if decided is not None:
                        for t in settles:
                            decided(t)
                    queue[-1].settles.extend(settles)
                else:
                    self.ack(d.tokens)
        if o is not None and received is not None:
            o.timed = True  # the last queued: a chunk's results are its request's, sent in order, so it leaves last
        return notices if notices is not None else _NO_NOTICES

    def ack(self, tokens: Iterable[object]) -> None:
        control = self._control
        decided = self._decided
        n = 0
        for t in tokens:
            if t is not None:
                if decided is not None:
                    decided(t)
                control.append((t, ACK))
                n += 1
        self.stats.acks += n
        if self._terminate:
            self._to_term()

    def terminate(self, token: object) -> None:
        """Settle ``token`` with a terminate (``+TERM``) rather than an ack, whenever it is settled:
        a poison message past ``max_deliver`` ends in its request's error result and is never
        redelivered (an ack would do the same on a work queue, but the server's advisory and the
        consumer's counters then say what happened)."""
        self._terminate[id(token)] = token

    def term(self, tokens: Iterable[object]) -> None:
        """Terminate ``tokens`` now (``+TERM``): their request ended and can store nothing more, so a
        redelivery could only be refused again (:attr:`GiveUp.ends`)."""
        self.stats.terminated += self._settle_now(tokens, TERM)

    def nak(self, tokens: Iterable[object], delay: float = 0.0) -> None:
        self.stats.naks += self._settle_now(tokens, NAK if delay <= 0 else Nak(delay))

    def _settle_now(self, tokens: Iterable[object], action: Action) -> int:
        """Settle each token (None skipped) with ``action`` now, whatever :meth:`terminate` marked it
        for; returns how many."""
        terminate = self._terminate
        decided = self._decided
        control = self._control
        n = 0
        for t in tokens:
            if t is not None:
                if decided is not None:
                    decided(t)
                control.append((t, action))
                n += 1
                if terminate:
                    terminate.pop(id(t), None)
        return n

    def on_puback(self, ticket: str, data: bytes, now: float) -> str:
        """A reply to the result published alone under ``ticket``; returns what it meant."""
        o = self._inflight.pop(ticket, None)
        if o is None:
            return UNMATCHED
        if not data or b'"error":' in data:  # see classify(); inlined on the hot path
            return self._refuse(o, now, data)
        outcome = STORED
        if b'"duplicate"' in data:  # see classify()
            self.stats.duplicate_results += 1
            outcome = DUPLICATE
        queue = self._stored(o, now)
        if queue:
            self.ready.append(queue[0])
        return outcome

    def on_batch_reply(self, ticket: str, commit: bool, data: bytes, now: float) -> str:
        """A reply to a message of the fast batch ``ticket`` (``commit``: to its last message).

        The batch's PubAck (``"count"``) ends it: in gap-fail mode what the server stored of a batch
        is a prefix of what was sent (``tests/test_fast_batch_server.py``), so its first ``count``
        results are stored and the first one after them was not. Flow acks, a refusal inside the
        batch (``"type":"err"``) and a gap (``"type":"gap"``) come before that PubAck and change
        nothing, but a refusal's reason is kept when it is a full subject (it ends the request). A plain error (the message was refused before the batch saw it, or there is no
        stream) on the commit means no PubAck will come: the batch ends with nothing known stored
        (``BATCH_REFUSED``, :meth:`_refused_whole`). Whatever was not stored is sent again, its first
        result alone.
        """
        head = self._inflight.get(ticket)
        if head is None or head.flight != ticket:
            return UNMATCHED
        if b'"count":' in data and b'"batch":' in data:
            count = _count(data)
        elif b'"type":' in data or not commit and data:
            # A refusal inside the batch (``"type":"err"``, or a plain error for its first message)
            # because the request's subject is full: every later result of the request is refused
            # too, so where the batch stopped is refused for that reason (GiveUp.ends), not retried.
            if _SUBJECT_FULL in data:
                head.full = data
            return PENDING
        else:  # the commit refused before the batch saw it, or a no-responders status (empty body)
            del self._inflight[ticket]
            full = head.full
            self._land(head)
            if full is not None:  # its start was refused for the subject: not the batch's doing
                return self._refuse(head, now, full)
            return self._refused_whole(head, now)
        del self._inflight[ticket]
        full = head.full
        members = self._land(head)
        queue = None
        for m in members[:count]:
            queue = self._stored(m, now)
        if count >= len(members):
            if queue:
                self.ready.append(queue[0])
            return STORED
        return self._refuse(members[count], now, full)

    def send_failed(self, o: Outgoing) -> None:
        """The publish of ``o`` did not leave (disconnected, closed): send it again at the next tick."""
        self.stats.publish_errors += 1
        o.handed -= 1
        head = self._inflight.get(o.flight) if o.flight is not None else o
        if head is not None:
            head.due = float("-inf")

    def unsendable(self, o: Outgoing, reason: str) -> list[GiveUp]:
        """The publish of ``o`` can never leave (its message is larger than the connection allows):
        give it up now, to be replaced by an error result at its seq (:attr:`GiveUp.replace`) when it
        is its request's first result not stored (every earlier one is, so the error leaves no gap)
        and no send of it ever left. A later member of a fast batch (the ones before it may not be
        stored) ends its batch there instead: the batch's head leaves again, and this one rides in no
        batch behind another (:attr:`Outgoing.solo`), so it is replaced in its turn. Otherwise it is
        NAKed, as :meth:`tick` gives up a refused result, and recovered when redelivered: an error
        result already (replaced in turn, a server whose
        ``max_payload`` is below an error result's size made a loop), or one sent before, to a
        server whose ``max_payload`` was higher (a reconnect): it may be stored, and the error
        result, under the same ``Nats-Msg-Id``, was deduplicated against it, its PubAck read as
        stored, ending the request behind a stored result that need not be final. Returns it."""
        self.stats.publish_errors += 1
        o.failures += 1
        o.handed -= 1
        queue = self._queues.get(o.result.request_id)
        head = self._inflight.get(o.flight) if o.flight is not None else None
        if head is not None and head is not o and o.result.error is None and not o.handed:
            # A later member of a fast batch: the ones before it may not be stored, so it cannot be
            # replaced yet, and given up its request's chunks came back only to make the same batch
            # (40 such requests, 80 redeliveries). The batch ends here (its rest is not sent), its head
            # leaves again at once (what left of it is deduplicated), and this one rides in no batch
            # behind another: sent as its request's first unstored result, it is replaced.
            del self._inflight[o.flight]  # type: ignore[arg-type]
            self._land(head)
            o.solo = True
            self.ready.append(head)
            return []
        self._inflight.pop(o.ticket, None)
        self._give_up(o, reason, replace=o.result.error is None and not o.handed and queue is not None
                      and queue[0] is o)
        return self.given_up()

    def tick(self, now: float, reconnected: bool = False,
             held: Callable[[], Iterable[object]] | None = None) -> list[GiveUp]:
        """Send overdue results again (every one in flight after a reconnect); run a progress round
        when one is due (``held`` yields the other tokens still held, the correlator's). Returns the
        results given up now (also in :meth:`given_up`)."""
        config = self.config
        inflight = self._inflight
        again = [(key, o) for key, o in inflight.items() if reconnected or now >= o.due]
        for key, o in again:
            del inflight[key]
            if o.members is not None:
                self._land(o)  # a batch sent again is a new batch: its first result leads it
            if o.refused:
                o.refused = False  # counted when it was refused
            elif now >= o.due:
                o.failures += 1
                self.stats.pubacks_overdue += 1
                self._overdue.append(o)
                if o.failures >= config.max_attempts:
                    self._give_up(o, "timeout")
                    continue
            o.wait = min(o.wait * 2, config.max_wait)
            self.stats.publish_retries += 1
            self.ready.append(o)
        if held is not None and now >= self._next_progress:
            self._next_progress = now + config.progress_every
            self._progress(held())
        return self.given_up()

    def abandon(self, belongs: Callable[[str], bool]) -> tuple[list[object], list[str]]:
        """Drop the queued results of the requests ``belongs`` selects (their partition moves).

        Returns every token they would have acked (the shell NAKs them, so the next owner gets them
        at once and recovers from what is stored) and those request ids: their results may not be
        stored, so the correlator must forget them even when it holds them as finished. A result
        already sent may still be stored; it acks nothing any more.
        """
        tokens: list[object] = []
        dropped = [rid for rid in self._queues if belongs(rid)]
        for rid in dropped:
            for o in self._queues.pop(rid):
                self.queued_bytes -= len(o.result.body)
                tokens.extend(o.settles)
                o.settles = []
                self._inflight.pop(o.ticket, None)
                if o.flight is not None:
                    self._inflight.pop(o.flight, None)
                    o.flight = o.members = None
        if dropped:
            keep = [o for o in self.ready if o.result.request_id in self._queues]
            self.ready.clear()  # in place: the shell may hold a reference
            self.ready.extend(keep)
        return tokens, dropped

    # ---------------------------------------------------------------------- out

    def sending(self, now: float, budget: int | None = None) -> list[Outgoing]:
        """Results to publish now, each waiting for its PubAck; the shell builds each reply subject
        from its ``ticket``, or from :attr:`Outgoing.batch` when it leaves in a fast batch.

        With ``batch_limit`` above 1, a request whose next result leaves with more queued behind it
        sends up to ``batch_limit`` of them as one fast batch (gap mode fail): pipelined, so they do
        not wait one PubAck each, yet stored as a prefix, in order. A batch starts only at a result
        whose predecessor is stored, because batches are not ordered against each other.

        ``budget``: bytes on the wire to send at most (:func:`wire_size`; the first send always
        leaves); the sends past it stay ready, in order, for the next call."""
        send = self.ready
        if not send:
            return []
        heads = list(send)
        send.clear()
        if budget is not None:
            heads = self._within(heads, budget, now)
        inflight = self._inflight
        limit = self._batch_limit(now)
        queues = self._queues
        out: list[Outgoing] = []
        observe = self.handed_latency.observe
        for o in heads:
            o.due = now + o.wait
            members: Any = None  # a batch's list, or (o,) alone
            if limit > 1 and not o.alone:
                queue = queues[o.result.request_id]
                if len(queue) > 1:
                    members = self._batch_of(queue, limit)
            if members is None:
                o.alone = False
                o.flight = None
                inflight[o.ticket] = o
                members = (o,)
            else:
                self._next += 1
                flight = self.batch_prefix + str(self._next)
                size = len(members)
                for i, m in enumerate(members, 1):
                    m.flight, m.batch_seq, m.size = flight, i, size
                o.members = members
                inflight[flight] = o
                self.stats.result_batches += 1
            for m in members:
                m.sent = now
                m.handed += 1
                if m.timed:
                    m.timed = False
                    observe(now - m.received)  # type: ignore[operator]  # timed only with a receipt time
                out.append(m)
        return out

    def control(self) -> list[tuple[object, Action]]:
        """Acks, NAKs and in-progress acks to send, as ``(token, action)``."""
        out = self._control
        if out:
            self._control = []
        return out

    def overdue(self) -> list[Outgoing]:
        """The results whose PubAck was overdue since the last call (sent again, or given up)."""
        out = self._overdue
        if out:
            self._overdue = []
        return out

    def given_up(self) -> list[GiveUp]:
        out = self._given_up
        if out:
            self._given_up = []
        return out

    # ---------------------------------------------------------------------- inside

    def _refuse(self, o: Outgoing, now: float, data: bytes | None = None) -> str:
        """``o``, its request's first result not stored, was refused (or its batch stopped at it):
        sent again alone after ``retry_after_refusal``, or given up after ``max_attempts`` refusals."""
        self.stats.publish_errors += 1
        self.last_refused = o.result
        o.failures += 1
        if data is not None and _HEADERS_TOO_LARGE in data:
            # Never storable, whatever the retries: given up now, as a result over max_payload is
            # (its chunk's worker chose the header, e.g. a 64 KB traceparent). Retried, it held its
            # chunk unacknowledged for 100 x 0.5 s per delivery, 20 deliveries, and max_ack_pending
            # such chunks stalled their partition (tests/test_durable_worker_attack.py).
            self._give_up(o, "its header block is larger than JetStream allows (64 KiB)")
            return GIVEN_UP
        if data is not None and _MESSAGE_TOO_LARGE in data:  # the same: retried, it held its chunk as long
            self._give_up(o, "it is larger than the results stream's max_msg_size")
            return GIVEN_UP
        if data is not None and _SUBJECT_FULL in data:  # the same: its request's later results are refused too
            self._give_up(o, "its request's results fill the results stream's max_msgs_per_subject (discard new)",
                          ends=True)
            return GIVEN_UP
        if o.failures >= self.config.max_attempts:
            self._give_up(o, "refused")
            return GIVEN_UP
        o.due = now + self.config.retry_after_refusal
        o.refused = True
        o.alone = True
        self._inflight[o.ticket] = o  # a late PubAck of an earlier copy still counts
        return REFUSED

    def _refused_whole(self, head: Outgoing, now: float) -> str:
        """``head``'s batch ended with nothing known stored, refused as a batch (batches turned off
        on the stream, all its open-batch slots taken, a batch id it no longer knows). That says
        nothing about the results: not charged, ``head`` is sent again alone at once, and results
        go one at a time for ``batch_pause`` (a refusal and a wait per result until a restart made
        a stream whose batches were turned off at runtime ~90x slower). Sent alone, ``head`` is
        stored or refused by itself, so each round stores one result or counts one failure."""
        self.stats.publish_errors += 1
        self.stats.batch_pauses += 1
        self.last_refused = head.result
        self._batches_from = now + self.config.batch_pause
        head.alone = True
        self.ready.append(head)
        return BATCH_REFUSED

    def _stored(self, o: Outgoing, now: float) -> list[Outgoing] | None:
        """``o``, its request's first result not stored, is stored: release its tokens and take it
        off the queue; returns what is left of the queue (None when nothing)."""
        if not o.refused:  # else a late PubAck of a copy sent before the refusal: no send time to match
            self.puback_latency.observe(now - o.sent)
        if o.received is not None:
            self.result_latency.observe(now - o.received)
        settles = o.settles  # None already filtered out
        if settles:
            control = self._control
            for t in settles:
                control.append((t, ACK))
            self.stats.acks += len(settles)
            if self._terminate:
                self._to_term()
        rid = o.result.request_id
        queue = self._queues[rid]  # a result in flight is always at its request's head
        del queue[0]
        self.queued_bytes -= len(o.result.body)
        if queue:
            return queue
        del self._queues[rid]
        return None

    def _within(self, heads: list[Outgoing], budget: int, now: float) -> list[Outgoing]:
        """The first ``heads`` whose sends fit ``budget`` bytes on the wire (at least one); the
        others go back to :attr:`ready`, in order. A batch's size is counted as :meth:`sending`
        will make it, each result as :func:`wire_size` estimates it."""
        limit = self._batch_limit(now)
        queues = self._queues
        for n, o in enumerate(heads):
            if budget <= 0 and n:
                self.ready.extend(heads[n:])
                return heads[:n]
            members = self._batch_of(queues[o.result.request_id], limit) if limit > 1 and not o.alone else None
            for m in members or (o,):
                # wire_size(m.result), inline: one Python call per result less (docs/benchmarks.md, "Durable
                # CPU, seventh pass"); the same sum, tests/test_outbox.py checks them against each other
                r = m.result
                budget -= len(r.body) + 2 * len(r.request_id) + RESULT_OVERHEAD
        return heads

    def _batch_limit(self, now: float) -> int:
        """``batch_limit``, or 1 while batches pause after one was refused whole (:meth:`_refused_whole`)."""
        return self.config.batch_limit if now >= self._batches_from else 1

    def _batch_of(self, queue: list[Outgoing], limit: int) -> list[Outgoing] | None:
        """The first results of ``queue`` that go in one batch (within ``batch_limit`` and
        ``batch_bytes``), or None when only the first fits."""
        room = self.config.batch_bytes
        n = 1
        for o in queue[1:limit]:
            room -= len(o.result.body)
            if room < 0 or o.solo:
                break
            n += 1
        return queue[:n] if n > 1 else None

    @staticmethod
    def _land(head: Outgoing) -> list[Outgoing]:
        """End ``head``'s batch (its results are single results again); returns its members."""
        members = head.members or [head]
        head.members = None
        head.full = None
        for m in members:
            m.flight = None
        return members

    def _to_term(self) -> None:
        """Turn the queued acks of tokens marked by :meth:`terminate` into terminates."""
        terminate = self._terminate
        control = self._control
        for i, (t, action) in enumerate(control):
            if action is ACK and id(t) in terminate:
                del terminate[id(t)]
                control[i] = (t, TERM)
                self.stats.acks -= 1
                self.stats.terminated += 1

    def _give_up(self, o: Outgoing, reason: str, ends: bool = False, replace: bool = False) -> None:
        rid = o.result.request_id
        tokens, _ = self.abandon(lambda r: r == rid)
        if replace:
            kept = tuple(tokens)
        else:
            kept = ()
            if ends:
                self.term(tokens)
            else:
                self.nak(tokens)
        self.stats.results_given_up += 1
        self._given_up.append(GiveUp(rid, o.result.seq, o.failures, reason, ends, replace, kept,
                                     o.result.format if replace else None))

    def _progress(self, held: Iterable[object]) -> None:
        """+WPI for every token that was already held at the previous round.

        The shell runs rounds every quarter of ``ack_wait``, so a token gets its first in-progress
        ack within two rounds (plus the tick interval) of being held: before it is redelivered.
        """
        current: dict[int, object] = {}
        for t in held:
            current[id(t)] = t
        for t in self.tokens():
            current[id(t)] = t
        seen = self._progress_seen
        control = self._control
        for key, t in current.items():
            if key in seen and t is not None:
                control.append((t, PROGRESS))
                self.stats.in_progress += 1
        self._progress_seen = set(current)


# A published result's bytes beyond its body and its request id's two copies (subject and
# Nats-Msg-Id): the HPUB line, the subject prefix, the reply subject (a batch's, ~75 bytes), the
# header block's names and values. 149 measured for a batch member with seq and id only; the rest
# is room for a final flag, a verdict, an error kind. An over-estimate only moves a send to the
# next write.
RESULT_OVERHEAD = 192


def wire_size(result: Result) -> int:
    """About what publishing ``result`` adds to the client's write buffer."""
    return len(result.body) + 2 * len(result.request_id) + RESULT_OVERHEAD


def in_turn(sends: list[Outgoing]) -> Iterator[tuple[Outgoing, tuple[str, int, int] | None]]:
    """Walk what :meth:`Outbox.sending` returned while publishing it, one by one: each result with
    its :attr:`~Outgoing.batch` as the outbox made it, skipping a batch member that is no longer in
    that batch when its turn comes. Earlier publishes can end a batch (a member that can never be
    sent gives its request up; an await lets a reconnect send the batch again as a new one), and
    its rest, published alone, would be stored at once, maybe after a gap. A member skipped never
    left, so its :attr:`~Outgoing.handed` count (which :meth:`Outbox.sending` raised) is taken back:
    counted, a member over ``max_payload`` in the batch sent again looked as if a copy might be
    stored, and was given up, its chunks NAKed, rather than replaced."""
    # o.batch, inline: a property call per result on the hot path (docs/benchmarks.md, "Calls per chunk")
    for o, batch in [(o, None if o.flight is None else (o.flight, o.size, o.batch_seq)) for o in sends]:
        if batch is None or o.flight == batch[0]:
            yield o, batch
        else:
            o.handed -= 1


def _count(data: bytes) -> int:
    """A fast batch PubAck's ``count`` (``{"stream":..,"seq":..,"batch":..,"count":N}``); 0 if unreadable."""
    i = data.find(b'"count":') + 8
    j = i
    while j < len(data) and data[j] in b" 0123456789":
        j += 1
    try:
        return int(data[i:j])
    except ValueError:
        return 0


_NO_NOTICES: list[Notice] = []  # returned by take() when there are none; never appended to


def _sole_request(decisions: list[Any]) -> str | None:  # Decisions; Settles skipped by class
    """The request every Result and Notice of ``decisions`` names, if there is exactly one."""
    named = {d.request_id for d in decisions if d.__class__ is not Settle}
    return named.pop() if len(named) == 1 else None
