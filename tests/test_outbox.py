"""The durable outbox (:mod:`streamproc.core.outbox`), pure: the guarantees of durable mode without a server.

The property drives one outbox (rebuilt after every crash) through random interleavings of
results of many requests, duplicate deliveries, publishes that are stored, refused, lost or fail
to leave, PubAcks that arrive, get lost or arrive after a crash, time, reconnects, abandons and
crashes, against a model of the results stream (a dict keyed by ``Nats-Msg-Id``; its duplicate
window is taken as longer than a run) and of JetStream redelivery. Checked at every step: a
request's results are stored in seq order with no gap, each msg-id once with its own body; no
token is acked before every result it waits for is stored, none is acked twice or acked and
NAKed. Checked after a fault-free tail: every request is stored completely, every input was
acknowledged, nothing of the live instance is left held, and it got there in bounded rounds.
"""

from __future__ import annotations

import pytest
from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.events import Notice, Result, Settle
from streamproc.core.latency import LatencyHistogram
from streamproc.core.outbox import (
    ACK,
    BATCH_REFUSED,
    DUPLICATE,
    GIVEN_UP,
    NAK,
    PROGRESS,
    REFUSED,
    STORED,
    TERM,
    UNMATCHED,
    GiveUp,
    Nak,
    Outbox,
    PENDING,
    OutboxConfig,
    classify,
    in_turn,
    wire_size,
)
from streamproc.core.recovery import resume_point
from streamproc.core.wire import FINAL, SEQ

STORED_ACK = b'{"stream":"R","seq":7}'
DUPLICATE_ACK = b'{"stream":"R","seq":7,"duplicate": true}'  # nats-server's wording, space included (live test below)
REFUSED_ACK = b'{"error":{"code":503,"description":"stream unavailable"}}'
NO_RESPONDERS = b""  # a 503 status reply has an empty body
# Plain errors to a fast batch's message, as nats-server words them (tests/test_fast_batch_server.py).
UNKNOWN_BATCH = b'{"error":{"code":400,"err_code":10208,"description":"batch publish ID unknown"},"stream":"R","seq":0}'
TOO_LARGE = (b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"},'
             b'"stream":"R","seq":0}')


class Token:
    """An ack handle: one delivery of one input (identity matters, as for nats-py's Msg)."""

    __slots__ = ("rid", "name", "copy")

    def __init__(self, rid: str, name: str, copy: int) -> None:
        self.rid, self.name, self.copy = rid, name, copy

    def __repr__(self) -> str:
        return f"Token({self.rid}/{self.name}#{self.copy})"


def result(rid: str, seq: int, final: bool = False, settles: tuple = ()) -> Result:
    return Result(rid, seq, f"{rid}:{seq}".encode(), final, settles=settles)


def acked(actions) -> list:
    return [t for t, a in actions if a == ACK]


# ------------------------------------------------------------------------------ the model

class ResultsStream:
    """The results stream: a msg-id is stored once; PubAcks as the server words them."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.last: dict[str, Result] = {}
        self.batches: dict[str, dict] = {}

    def store(self, r: Result) -> bytes:
        mid = r.msg_id
        if mid in self.stored:
            assert self.stored[mid] == r.body, f"{mid} stored with another body"
            return DUPLICATE_ACK
        assert r.seq == 0 or f"{r.request_id}.{r.seq - 1}" in self.stored, f"{mid} stored after a gap"
        self.stored[mid] = r.body
        self.last[r.request_id] = r
        return STORED_ACK

    def store_in_batch(self, batch: str, size: int, index: int, r: Result, fate: str) -> list[bytes]:
        """A message of fast batch ``batch`` (gap mode fail) arrives; returns the replies to it.

        nats-server's behaviour as ``tests/test_fast_batch_server.py`` pins it against the wheel's
        server: a batch starts at seq 1 (an ended id at seq 1 starts a new one); each message is
        stored at once, a duplicate ``Nats-Msg-Id`` skipped but counted; a message out of sequence
        (lost, or arriving late) is a gap that ends the batch; a refusal inside the batch (``refused``:
        a discard-new limit) ends it (as its first message: a plain error and no PubAck,
        ``processJetStreamFastBatchMsg``); a refusal before the batch sees it (``before``: max_msg_size)
        is a plain error the batch does not count; the end of a batch answers with its PubAck and
        ``count``; messages of an ended or unknown batch get 10208. Arrival order here is arbitrary,
        which is more than one connection does."""
        b = self.batches.get(batch)
        if index == 1 and fate != "before" and (b is None or not b["open"]):
            b = self.batches[batch] = {"next": 1, "count": 0, "open": True}
            if fate == "refused":  # refused as the batch's first message: its flow ack, a plain error, gone
                b["open"] = False
                return [b'{"type":"ack","seq":0,"msgs":%d}' % size, REFUSED_ACK]
        if b is None or not b["open"]:
            return [UNKNOWN_BATCH]
        if fate == "before":
            return [TOO_LARGE]
        if index != b["next"]:
            b["open"] = False
            return [b'{"type":"gap","last_seq":%d,"seq":%d}' % (b["next"] - 1, index), self.batch_ack(batch)]
        if fate == "refused":
            b["open"] = False
            return [b'{"type":"err","seq":%d,"error":{"code":503,"err_code":10077}}' % index, self.batch_ack(batch)]
        self.store(r)
        b["count"] += 1
        b["next"] += 1
        replies = [b'{"type":"ack","seq":%d,"msgs":%d}' % (index - 1, size)]
        if index == size:
            b["open"] = False
            replies.append(self.batch_ack(batch))
        return replies

    def batch_ack(self, batch: str) -> bytes:
        return b'{"stream":"R","seq":9,"batch":"%s","count":%d}' % (batch.encode(), self.batches[batch]["count"])

    def expire_batches(self) -> None:
        """Open batches idle for 10 s are cleaned up without a reply (``max_batch_timeout``)."""
        for b in self.batches.values():
            b["open"] = False

    def last_headers(self, rid: str) -> dict[str, str] | None:
        r = self.last.get(rid)
        if r is None:
            return None
        return {SEQ: str(r.seq), **({FINAL: "true"} if r.final else {})}


class World:
    """One processor instance at a time over a shared stream; the correlator reduced to its contract."""

    def __init__(self, sizes: list[int], pd: list[bool], config: OutboxConfig) -> None:
        self.config = config
        self.sizes = {f"r{i}": n for i, n in enumerate(sizes)}
        self.pd = {f"r{i}": p for i, p in enumerate(pd)}
        self.stream = ResultsStream()
        self.now = 0.0
        self.instance = 0
        self.outbox = self.new_outbox()
        # Publishes on their way to the stream and replies on their way back, each with its reply
        # subject: a ticket, or (batch ticket, size, batch seq) for a fast batch's message.
        self.wire: list[tuple[int, object, Result]] = []
        self.replies: list[tuple[int, object, bytes]] = []
        self.next_seq: dict[str, int] = {}
        self.emitted: dict[str, list[str]] = {}  # msg-ids queued by this instance since the request was (re)started
        self.held: dict[str, Token] = {}  # prefill tokens the correlator holds
        self.replaced: set[str] = set()  # requests ended by an error result in place of an unsendable one
        self.issued: set[Token] = set()  # tokens of the live instance
        self.required: dict[Token, set[str]] = {}
        self.acked: set[Token] = set()
        self.naked: set[Token] = set()
        self.inputs_acked: set[tuple[str, str]] = set()
        self.copies = 0
        self.given_up = 0
        self.on_wire: set[str] = set()  # msg-ids handed to NATS at least once
        self.left: set[object] = set()  # the queued results (Outgoing) handed to NATS at least once
        self.oversized: set[str] = set()  # msg-ids whose result can never be sent (the same every time)
        # msg-ids of results refused by the client before any copy left: refused again at every send
        self.too_large: set[str] = set()
        for rid in self.sizes:
            self.restart(rid)

    # ------------------------------------------------------------------ helpers

    def new_outbox(self) -> Outbox:
        box = Outbox(self.config)
        box.batch_prefix = f"i{self.instance}-"  # batch ids unique on the stream, as the shell makes them
        return box

    def token(self, rid: str, name: str, required: set[str]) -> Token:
        self.copies += 1
        t = Token(rid, name, self.copies)
        self.issued.add(t)
        self.required[t] = required
        return t

    def mid(self, rid: str, seq: int) -> str:
        return f"{rid}.{seq}"

    def restart(self, rid: str) -> None:
        """The request is (re)delivered to this instance: recover from the last stored result."""
        point = resume_point(self.stream.last_headers(rid))
        nxt, final = point if point is not None else (0, False)
        n = self.sizes[rid]
        self.next_seq[rid] = n if final else nxt  # an error in place of an unsendable result is final early
        self.emitted[rid] = []
        self.held.pop(rid, None)
        self.replaced.discard(rid)  # its error result not stored yet: made again, as the redelivery would
        # a final result stored (an error in place of an unsendable one ends the request early): every chunk is late
        late = [str(s) for s in range(n if final else nxt) if (rid, str(s)) not in self.inputs_acked]
        if self.pd[rid]:
            if final:
                if (rid, "prefill") not in self.inputs_acked:
                    late.append("prefill")
            else:
                self.held[rid] = self.token(rid, "prefill", {self.mid(rid, s) for s in range(n)})
        for name in late:  # chunks whose results are stored: late now, settled at once
            required = ({self.mid(rid, s) for s in range(n)} if name == "prefill" else {self.mid(rid, int(name))})
            if final and nxt < n:  # ended early by an error result: what is stored is all there is
                required = {self.mid(rid, s) for s in range(nxt)}
            self.take([Settle((self.token(rid, name, required),))], rid)

    def take(self, decisions: list, rid: str | None) -> None:
        notices = self.outbox.take(decisions, rid)
        assert notices == [d for d in decisions if isinstance(d, Notice)]

    def drain(self) -> None:
        for t, action in self.outbox.control():
            assert t in self.issued, f"{t} belongs to no live delivery"
            assert t not in self.acked and t not in self.naked, f"{t} answered twice ({action})"
            if action == ACK:
                missing = self.required[t] - self.stream.stored.keys()
                assert not missing, f"{t} acked before {sorted(missing)} stored"
                self.acked.add(t)
                self.inputs_acked.add((t.rid, t.name))
            elif action == PROGRESS:
                pass  # still held (checked above): extends its ack deadline
            else:
                assert isinstance(action, Nak)
                self.naked.add(t)

    def forget(self, rid: str) -> None:
        """The correlator forgets a request (abandon, give-up): its held tokens are NAKed, and the
        NAKed inputs come back, to this instance in the model."""
        held = self.held.pop(rid, None)
        self.outbox.nak([held] if held is not None else [])
        self.restart(rid)

    def gave_up(self, records: list[GiveUp], counted: bool = True) -> None:
        """``counted``: given up after ``max_attempts`` (not at once, as an unsendable result is).
        One to ``replace`` is, as the durable shell does: an error result at its seq ends the request
        and settles the given-up tokens and what the correlator held once stored."""
        for g in records:
            self.given_up += counted
            assert not counted or g.attempts >= self.config.max_attempts
            if not g.replace:
                assert not g.tokens
                self.forget(g.request_id)
                continue
            self.oversized.add(self.mid(g.request_id, g.seq))
            self.replace(g.request_id, g.seq, g.tokens)

    def done(self, rid: str) -> bool:
        return self.next_seq[rid] >= self.sizes[rid] or rid in self.replaced

    # ------------------------------------------------------------------ steps

    def emit(self, rid: str) -> None:
        if self.done(rid):
            return
        s = self.next_seq[rid]
        final = s == self.sizes[rid] - 1
        settles = (self.token(rid, str(s), {self.mid(rid, s)}),)
        if final and rid in self.held:
            settles += (self.held.pop(rid),)
        self.next_seq[rid] = s + 1
        if self.mid(rid, s) in self.oversized:  # made again from its redelivered chunk: replaced again
            self.replace(rid, s, settles)
            return
        self.emitted[rid].append(self.mid(rid, s))
        self.take([result(rid, s, final, settles), Notice(rid, "emitted")], rid)

    def replace(self, rid: str, seq: int, tokens: tuple) -> None:
        """The durable shell's answer to an unsendable result (``GiveUp.replace``): an error result at
        its seq ends the request and settles ``tokens`` and what the correlator held once stored."""
        held = self.held.pop(rid, None)
        settles = (*tokens, *((held,) if held is not None else ()))
        for t in settles:
            self.required[t] = {self.mid(rid, s) for s in range(seq + 1)}
        self.replaced.add(rid)
        # the results queued after it are dropped: a repeat now waits for the error alone
        self.emitted[rid] = [m for m in self.emitted[rid] if int(m.rsplit(".", 1)[1]) < seq] + [self.mid(rid, seq)]
        self.take([Result(rid, seq, f"{rid}:error".encode(), True, error="internal", settles=settles)], rid)

    def duplicate(self, rid: str, off_path: bool = False) -> None:
        """A repeat of a chunk already turned into a result: settled, but behind what is queued.
        ``off_path``: released by a decision off the message path (a seal), which names the request
        only in its Notice."""
        if not self.emitted[rid]:
            return
        mid = self.emitted[rid][-1]
        t = self.token(rid, mid.rsplit(".", 1)[1], set(self.emitted[rid]))
        if off_path:
            self.take([Settle((t,)), Notice(rid, "migrated")], None)
        else:
            self.take([Settle((t,))], rid)

    def send(self, fail: list[bool], budget: int | None = None, interrupt: tuple[str, int] | None = None) -> None:
        """Publish what the outbox sends now, as the pump does (:func:`in_turn`): ``fail[i]``, the
        i-th publish did not leave; ``interrupt``, before the k-th publish either it can never be
        sent (``unsendable``: its request is given up) or, during an await, a reconnect is seen."""
        for i, (o, batch) in enumerate(in_turn(self.outbox.sending(self.now, budget))):
            if o.result.msg_id in self.too_large and o.result.error is None:  # the same bytes: refused again
                self.gave_up(self.outbox.unsendable(o, "larger than the server's max_payload"), counted=False)
                continue
            if interrupt is not None and interrupt[1] == i:
                if interrupt[0] == "unsendable":
                    # The same bytes: a result that left once always can, unless the server's max_payload
                    # was lowered (a reconnect) since this very send left: it may be stored, so it must
                    # not be replaced (the error result has its Nats-Msg-Id).
                    if o.result.msg_id not in self.on_wire or o in self.left:
                        if o.result.msg_id not in self.on_wire and o.result.error is None:
                            self.too_large.add(o.result.msg_id)
                        self.gave_up(self.outbox.unsendable(o, "larger than the server's max_payload"),
                                     counted=False)
                        continue
                else:
                    self.tick(0.0, reconnected=True)
            if i < len(fail) and fail[i]:
                self.outbox.send_failed(o)
            else:
                self.on_wire.add(o.result.msg_id)
                self.left.add(o)
                self.wire.append((self.instance, batch or o.ticket, o.result))

    def arrive(self, i: int, fate: str) -> None:
        instance, ticket, r = self.wire.pop(i)
        if isinstance(ticket, tuple):
            if fate != "lost":
                replies = self.stream.store_in_batch(*ticket, r, BATCH_FATES.get(fate, "stored"))
                if fate != "stored_ack_lost":
                    self.replies.extend((instance, ticket, data) for data in replies)
            return
        if fate == "stored":
            self.replies.append((instance, ticket, self.stream.store(r)))
        elif fate == "refused":
            self.replies.append((instance, ticket, REFUSED_ACK))
        elif fate == "no_responders":
            self.replies.append((instance, ticket, NO_RESPONDERS))
        elif fate == "stored_ack_lost":
            self.stream.store(r)
        # "lost": neither stored nor answered

    def reply(self, j: int, lost: bool) -> None:
        instance, ticket, data = self.replies.pop(j)
        if lost or instance != self.instance:
            return  # a crashed instance's inbox is gone
        if isinstance(ticket, tuple):
            batch, size, index = ticket
            outcome = self.outbox.on_batch_reply(batch, index == size, data, self.now)
            assert outcome in (STORED, REFUSED, BATCH_REFUSED, GIVEN_UP, UNMATCHED, PENDING)
        else:
            outcome = self.outbox.on_puback(ticket, data, self.now)
            assert outcome == GIVEN_UP or outcome == UNMATCHED or outcome == classify(data)
        if outcome == GIVEN_UP:
            self.gave_up(self.outbox.given_up())

    def tick(self, dt: float, reconnected: bool = False) -> None:
        self.now += dt
        self.gave_up(self.outbox.tick(self.now, reconnected, held=lambda: list(self.held.values())))

    def abandon(self, rid: str) -> None:
        tokens, dropped = self.outbox.abandon(lambda r: r == rid)
        assert set(dropped) <= {rid}
        self.outbox.nak(tokens)
        self.forget(rid)

    def crash(self) -> None:
        """Drop the instance; JetStream redelivers every unacknowledged input to the next one."""
        self.instance += 1
        self.outbox = self.new_outbox()
        self.issued = set()
        self.acked, self.naked = set(), set()
        for rid in self.sizes:
            self.restart(rid)

    # ------------------------------------------------------------------ end

    def settle_everything(self) -> int:
        """No more faults: run until every request is stored and nothing is held; return the rounds."""
        for rounds in range(1, 200):
            for rid in self.sizes:
                while not self.done(rid):
                    self.emit(rid)
            self.drain()
            self.send([])
            while self.wire:
                self.arrive(0, "stored")
            while self.replies:
                self.reply(0, lost=False)
                self.drain()
            if self.outbox.idle and not self.wire and all(self.done(r) for r in self.sizes):
                return rounds
            self.tick(self.config.max_wait + 1.0)
            self.drain()
        raise AssertionError("the outbox did not settle in 200 fault-free rounds")


STEPS = ("emit", "emit", "emit", "duplicate", "send", "send", "arrive", "arrive", "arrive", "reply", "reply",
         "reply", "time", "reconnect", "abandon", "crash")
FATES = ("stored", "stored", "stored", "refused", "no_responders", "lost", "stored_ack_lost")
# A fast batch's message: "refused" inside the batch, "no_responders" stands for a plain refusal
# before the batch sees it; "lost" and "stored_ack_lost" as for a single result.
BATCH_FATES = {"refused": "refused", "no_responders": "before"}


@outbox_settings
@given(data=st.data(), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       max_attempts=st.sampled_from([1, 2, 3, 100]))
def test_random_faults_never_lose_reorder_or_duplicate_a_result_nor_ack_before_storage(data, sizes, max_attempts):
    random_faults(data, sizes, max_attempts, batch_limit=1, fates=FATES, interrupts=(None,))


@outbox_settings
@given(data=st.data(), sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       max_attempts=st.sampled_from([1, 2, 3, 100]), batch_limit=st.sampled_from([2, 3, 8]))
def test_random_faults_with_fast_batches_never_lose_reorder_or_duplicate_a_result_nor_ack_before_storage(
        data, sizes, max_attempts, batch_limit):
    """The same law with a request's queued results leaving as fast batches, against the server's
    batch semantics (:meth:`ResultsStream.store_in_batch`): messages of a batch arriving in any
    order or not at all, refused inside or before the batch, batches expiring, replies lost."""
    random_faults(data, sizes, max_attempts, batch_limit, fates=FATES[2:],  # more faults: short batches
                  interrupts=(None, None, None, ("unsendable", 0), ("unsendable", 1), ("reconnect", 1)))


def random_faults(data, sizes: list[int], max_attempts: int, batch_limit: int, fates: tuple[str, ...],
                  interrupts: tuple) -> None:
    pd = data.draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    config = OutboxConfig(first_wait=2.0, max_wait=10.0, retry_after_refusal=0.5, max_attempts=max_attempts,
                          progress_every=2.5, batch_limit=batch_limit)
    w = World(sizes, pd, config)
    rids = sorted(w.sizes)
    for _ in range(data.draw(st.integers(0, 80))):
        step = data.draw(st.sampled_from(STEPS))
        if step == "emit":
            w.emit(data.draw(st.sampled_from(rids)))
        elif step == "duplicate":
            w.duplicate(data.draw(st.sampled_from(rids)), off_path=data.draw(st.booleans()))
        elif step == "send":
            w.send(data.draw(st.lists(st.booleans(), max_size=3)), data.draw(st.sampled_from([None, None, 0, 10])),
                   data.draw(st.sampled_from(interrupts)))
        elif step == "arrive" and w.wire:
            w.arrive(data.draw(st.integers(0, len(w.wire) - 1)), data.draw(st.sampled_from(fates)))
        elif step == "reply" and w.replies:
            w.reply(data.draw(st.integers(0, len(w.replies) - 1)), lost=data.draw(st.integers(0, 5)) == 0)
        elif step == "time":
            dt = data.draw(st.sampled_from([0.1, 0.5, 1.0, 2.5, 11.0]))
            if dt > 10:
                w.stream.expire_batches()
            w.tick(dt)
        elif step == "reconnect":
            w.tick(0.0, reconnected=True)
        elif step == "abandon":
            w.abandon(data.draw(st.sampled_from(rids)))
        elif step == "crash" and data.draw(st.integers(0, 3)) == 0:
            w.crash()
        w.drain()

    w.settle_everything()
    for rid, n in w.sizes.items():
        last = w.stream.last[rid]
        if last.error is not None:  # ended in place of an unsendable result: a prefix, then the error
            assert last.final and last.body == f"{rid}:error".encode()
            n = last.seq
        else:
            assert last.seq == n - 1
        assert {m for m in w.stream.stored if m.startswith(rid + ".")} == {f"{rid}.{s}" for s in range(n + (last.error is not None))}
        for s in range(n):
            assert w.stream.stored[f"{rid}.{s}"] == f"{rid}:{s}".encode()
        inputs = {str(s) for s in range(n)} | ({"prefill"} if w.pd[rid] else set())
        assert {(rid, name) for name in inputs} <= w.inputs_acked, f"an input of {rid} was never acknowledged"
    assert w.outbox.pending == 0 and not w.held
    assert w.issued == w.acked | w.naked, "a token of the live instance was left unanswered"
    if max_attempts >= 100:
        assert w.given_up == 0


@outbox_settings
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5), max_attempts=st.integers(1, 6),
       refusal=st.sampled_from(["refused", "no_responders", "lost"]))
def test_a_stream_that_never_stores_ends_every_request_in_bounded_rounds_with_every_token_nakd(
        sizes, max_attempts, refusal):
    config = OutboxConfig(max_attempts=max_attempts)
    w = World(sizes, [False] * len(sizes), config)
    for rid in w.sizes:
        w.emit(rid)
    w.drain()
    first_tokens = set(w.issued)
    for _ in range(max_attempts * 2 + 2):
        w.send([])
        while w.wire:
            w.arrive(0, refusal)
        while w.replies:
            w.reply(0, lost=False)
        w.tick(config.max_wait + 1.0)
        w.drain()
        if first_tokens <= w.naked:
            break
    assert first_tokens <= w.naked and not first_tokens & w.acked
    assert w.given_up >= len(sizes) and not w.stream.stored
    assert w.outbox.stats.results_given_up == w.given_up


# ---------------------------------------------------------------------------- behaviour

def test_the_next_result_of_a_request_leaves_only_after_the_previous_ones_puback():
    box = Outbox()
    box.take([result("a", 0), result("a", 1), result("a", 2, final=True)], "a")
    first = box.sending(0.0)
    assert [o.result.seq for o in first] == [0] and box.sending(0.0) == []
    assert box.on_puback(first[0].ticket, STORED_ACK, 0.1) == STORED
    assert [o.result.seq for o in box.sending(0.1)] == [1]


def test_a_chunks_results_are_timed_once_when_the_last_is_first_handed_to_nats():
    """``handed_latency`` is core mode's result latency: chunk received -> the results it made ready
    handed to NATS, one observation per chunk; a resend and results with no chunk are not counted."""
    handed = LatencyHistogram()
    box = Outbox(OutboxConfig(first_wait=1.0), handed_latency=handed)
    assert box.handed_latency is handed
    box.take([result("a", 0), result("a", 1)], "a", received=10.0)  # one chunk released two results
    box.take([result("t", 0, final=True)], None)  # the timer's: no chunk arrived for it
    first = box.sending(10.5)
    assert sorted((o.result.request_id, o.result.seq) for o in first) == [("a", 0), ("t", 0)]
    assert handed.count == 0  # a-1 waits behind a-0's PubAck
    box.tick(12.0)  # a-0's PubAck is overdue: sent again, not timed again
    again = box.sending(12.0)
    assert handed.count == 0 and {o.result.request_id for o in again} == {"a", "t"}
    (a0,) = [o for o in again if o.result.request_id == "a"]
    box.on_puback(a0.ticket, STORED_ACK, 12.25)
    box.sending(12.5)  # a-1: every result of the chunk is handed to NATS now
    assert (handed.count, handed.total) == (1, 2.5)
    box.tick(20.0)
    box.sending(20.0)  # a-1 sent again
    assert handed.count == 1


def test_results_of_different_requests_are_in_flight_together():
    box = Outbox()
    box.take([result("a", 0)], "a")
    box.take([result("b", 0)], "b")
    assert sorted(o.result.request_id for o in box.sending(0.0)) == ["a", "b"]


def test_a_results_tokens_are_acked_when_its_puback_is_in_not_before():
    box = Outbox()
    t = Token("a", "0", 1)
    box.take([result("a", 0, settles=(t, None))], "a")
    (o,) = box.sending(0.0)
    assert box.control() == []
    box.on_puback(o.ticket, STORED_ACK, 0.1)
    assert box.control() == [(t, ACK)] and box.stats.acks == 1


def test_a_token_marked_for_termination_is_terminated_when_its_result_is_stored_and_others_acked():
    box = Outbox()
    poison, other = Token("a", "0", 3), Token("a", "p", 1)
    box.terminate(poison)
    box.take([result("a", 0, final=True, settles=(other, poison))], "a")
    (o,) = box.sending(0.0)
    assert box.control() == []  # not before the error result is stored
    box.on_puback(o.ticket, STORED_ACK, 0.1)
    assert box.control() == [(other, ACK), (poison, TERM)]
    assert box.stats.acks == 1 and box.stats.terminated == 1


def test_a_token_marked_for_termination_but_nakd_is_not_terminated_later():
    box = Outbox()
    poison = Token("a", "0", 3)
    box.terminate(poison)
    box.nak([poison])
    box.take([Settle((poison,))], None)  # the same handle settled again later: an ack, the mark is gone
    assert box.control() == [(poison, NAK), (poison, ACK)] and box.stats.terminated == 0


def test_a_settle_waits_behind_the_last_queued_result_of_its_request():
    box = Outbox()
    dup = Token("a", "0", 2)
    box.take([result("a", 0), result("a", 1)], "a")
    box.take([Settle((dup,))], "a")
    (o0,) = box.sending(0.0)
    box.on_puback(o0.ticket, STORED_ACK, 0.1)
    assert box.control() == []  # seq 1 is not stored yet
    (o1,) = box.sending(0.1)
    box.on_puback(o1.ticket, STORED_ACK, 0.2)
    assert acked(box.control()) == [dup]


def test_a_settle_with_nothing_queued_for_its_request_is_acked_at_once():
    box = Outbox()
    box.take([result("other", 0)], "other")
    a, b = Token("a", "0", 1), Token("x", "?", 1)
    box.take([Settle((a,))], "a")
    box.take([Settle((b,))], None)  # the processor's unreadable messages name no request
    assert acked(box.control()) == [a, b]


def test_a_settle_dispatched_off_the_message_path_waits_behind_the_one_request_its_batch_names():
    """A seal (control request) releases held tokens with a Notice naming its request and no
    request id from a message: they still must not overtake that request's queued result."""
    box = Outbox()
    held, other = Token("a", "prefill", 1), Token("b", "0", 1)
    box.take([result("a", 0)], "a")
    box.take([result("b", 0)], "b")
    box.take([Settle((held,)), Notice("a", "migrated")], None)
    box.take([Settle((other,)), Notice("a", "x"), Notice("b", "y")], None)  # two requests: no owner
    assert acked(box.control()) == [other]
    sent = {o.result.request_id: o for o in box.sending(0.0)}
    box.on_puback(sent["a"].ticket, STORED_ACK, 0.1)
    assert acked(box.control()) == [held]


def test_the_decided_hook_sees_every_token_once_as_it_enters_the_outbox_and_it_is_still_settled_after():
    """``decided`` sees each input token once, when its chunk is decided (a result's settles, a Settle
    queued behind a result or acked at once, a NAK): the shell drops the chunk's body there, since
    settling a token needs only the token. The tokens are still acked after their result is stored."""
    decided: list = []
    box = Outbox(decided=decided.append)
    t0, dup, late, other, gone = (Token("a", "0", 1), Token("a", "0", 2), Token("a", "1", 1),
                                  Token("b", "0", 1), Token("c", "0", 1))
    box.take([result("a", 0, final=True, settles=(t0, None))], "a")
    box.take([Settle((dup, late))], "a")  # queued behind a's result
    box.take([Settle((other,))], "b")  # nothing queued for b: acked at once
    box.nak([gone])
    assert decided == [t0, dup, late, other, gone]
    assert box.control() == [(other, ACK), (gone, NAK)]
    (o,) = box.sending(0.0)
    box.on_puback(o.ticket, STORED_ACK, 0.1)
    assert acked(box.control()) == [t0, dup, late]
    assert decided == [t0, dup, late, other, gone]  # once each


def test_take_returns_the_notices_for_the_log():
    box = Outbox()
    n = Notice("a", "late_chunk", "seq 3")
    assert box.take([Settle(()), n], "a") == [n]


def test_an_overdue_puback_sends_the_result_again_with_a_doubling_wait_up_to_the_max():
    box = Outbox(OutboxConfig(first_wait=2.0, max_wait=10.0))
    box.take([result("a", 0)], "a")
    now, waits = 0.0, []
    for _ in range(5):
        (o,) = box.sending(now)
        waits.append(o.due - now)
        assert box.tick(now + o.wait - 0.01) == [] and box.sending(now) == []  # not overdue yet
        now += o.wait
        box.tick(now)
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert box.stats.publish_retries == 5


def test_each_overdue_puback_is_reported_once_for_the_log_and_counted():
    """A stream that never answers (no_ack) re-sent result 0 for hours with nothing logged: every
    overdue PubAck is now handed to the shell (which logs it, rate-limited) and counted."""
    box = Outbox(OutboxConfig(first_wait=1.0, max_wait=1.0, max_attempts=3))
    box.take([result("a", 0)], "a")
    reported = []
    for now in (0.0, 1.0, 2.0):
        box.sending(now)
        box.tick(now + 1.0)
        reported += [(o.result.request_id, o.result.seq, o.failures) for o in box.overdue()]
        assert box.overdue() == []  # drained
    assert reported == [("a", 0, 1), ("a", 0, 2), ("a", 0, 3)]
    assert box.stats.pubacks_overdue == 3 and box.stats.results_given_up == 1


def test_a_refused_result_is_sent_again_half_a_second_later():
    box = Outbox()
    box.take([result("a", 0)], "a")
    (o,) = box.sending(0.0)
    assert box.on_puback(o.ticket, REFUSED_ACK, 1.0) == REFUSED
    box.tick(1.4)
    assert box.sending(1.4) == []
    box.tick(1.5)
    assert [x.result.seq for x in box.sending(1.5)] == [0]
    assert box.stats.publish_errors == 1 and box.stats.publish_retries == 1


def test_a_reconnect_sends_everything_in_flight_again_at_once():
    box = Outbox()
    box.take([result("a", 0)], "a")
    box.take([result("b", 0)], "b")
    box.sending(0.0)
    box.tick(0.1, reconnected=True)
    assert sorted(o.result.request_id for o in box.sending(0.1)) == ["a", "b"]
    assert all(o.failures == 0 for o in box._inflight.values())  # a reconnect is not the result's failure


def test_a_late_puback_of_an_earlier_copy_counts_as_stored():
    box = Outbox()
    t = Token("a", "0", 1)
    box.take([result("a", 0, settles=(t,))], "a")
    (o,) = box.sending(0.0)
    box.tick(2.0)
    (again,) = box.sending(2.0)
    assert again.ticket == o.ticket  # same reply subject for every copy
    assert box.on_puback(o.ticket, STORED_ACK, 2.1) == STORED
    assert acked(box.control()) == [t]
    assert box.on_puback(o.ticket, DUPLICATE_ACK, 2.2) == UNMATCHED  # the second copy's PubAck


def test_a_duplicate_puback_counts_as_stored():
    box = Outbox()
    box.take([result("a", 0, settles=(Token("a", "0", 1),))], "a")
    (o,) = box.sending(0.0)
    assert box.on_puback(o.ticket, DUPLICATE_ACK, 0.1) == DUPLICATE
    assert box.stats.duplicate_results == 1 and box.idle


@pytest.mark.nats
@pytest.mark.anyio
async def test_nats_servers_own_duplicate_puback_is_read_as_a_duplicate(client):
    """The PubAck bodies come from a real nats-server, not from this file: it writes
    ``"duplicate": true`` with a space, which a match on ``"duplicate":true`` read as a plain store
    (``duplicate_results`` stayed 0 in live runs)."""
    await client.jetstream().add_stream(name="DUPS", subjects=["dups.>"])
    acks = [(await client.request("dups.r", b"x", headers={"Nats-Msg-Id": "r:0"}, timeout=5)).data
            for _ in range(2)]
    assert [classify(ack) for ack in acks] == [STORED, DUPLICATE], acks
    box = Outbox()
    box.take([result("a", 0, settles=(Token("a", "0", 1),))], "a")
    (o,) = box.sending(0.0)
    assert box.on_puback(o.ticket, acks[1], 0.1) == DUPLICATE
    assert box.stats.duplicate_results == 1 and box.idle


def test_a_publish_that_did_not_leave_is_sent_again_at_the_next_tick():
    box = Outbox()
    box.take([result("a", 0)], "a")
    (o,) = box.sending(0.0)
    box.send_failed(o)
    box.tick(0.01)
    assert box.sending(0.01) == [o] and box.stats.publish_errors == 1


def test_a_result_that_can_never_be_sent_is_given_up_at_once_its_tokens_kept_for_the_error_in_its_place():
    """Its request's first result not stored: the shell puts an error result at its seq, which
    settles the tokens once stored (Correlator.unpublishable); nothing is NAKed, since a
    redelivered chunk only makes the same result again (tests/test_durable_worker_attack.py)."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0, t1 = Token("a", "0", 1), Token("a", "1", 1)
    box.take([result("a", 0, settles=(t0,)), result("a", 1, settles=(t1,))], "a")
    box.take([result("b", 0)], "b")
    (o, other) = box.sending(0.0)
    assert box.unsendable(o, "too large") == [GiveUp("a", 0, 1, "too large", replace=True, tokens=(t0, t1))]
    assert box.control() == []
    assert box.stats.results_given_up == 1 and box.stats.publish_errors == 1
    assert box.tick(100.0) == []  # nothing of "a" is sent again, however late; b is only overdue
    assert [x.result.request_id for x in box.sending(100.0)] == ["b"]  # b's overdue copy only
    box.take([Result("a", 0, b"error", True, error="internal", settles=(t0, t1))], "a")
    (e,) = [x for x in box.sending(100.0) if x.result.request_id == "a"]
    assert box.on_puback(o.ticket, b'{"stream":"R","seq":1}', 100.1) == UNMATCHED  # it never left
    assert box.on_puback(e.ticket, b'{"stream":"R","seq":1}', 100.1) == STORED
    assert box.control() == [(t0, ACK), (t1, ACK)]


def test_an_unsendable_result_s_give_up_names_its_format_for_the_error_in_its_place():
    """A finished request keeps no codec and its chunks' headers are gone: the error result's shape
    comes from the given-up result (Result.format), as core mode takes the chunk's."""
    box = Outbox(OutboxConfig(max_attempts=100))
    box.take([Result("a", 0, b"x", True, settles=(Token("a", "0", 1),), format="vllm")], "a")
    (o,) = box.sending(0.0)
    [g] = box.unsendable(o, "too large")
    assert g.replace and g.format == "vllm"


def test_a_result_that_may_have_left_before_is_nakd_when_it_becomes_unsendable_not_replaced():
    """Sent once (its PubAck lost), then refused by the client after a reconnect to a server whose
    ``max_payload`` is lower: it may be stored, so an error result at its seq (the same
    ``Nats-Msg-Id``) could be deduplicated against it, its PubAck read as stored, and the request
    ended here behind a stored result that is not final. NAKed, its chunks are recovered from what
    is stored."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0 = Token("a", "0", 1)
    box.take([result("a", 0, settles=(t0,))], "a")
    (o,) = box.sending(0.0)  # handed to NATS: it left
    assert box.tick(0.0, reconnected=True) == []
    assert box.sending(0.0) == [o]  # sent again after the reconnect: the client refuses it now
    assert box.unsendable(o, "too large") == [GiveUp("a", 0, 1, "too large")]
    assert box.control() == [(t0, NAK)]
    # one that never left, however often it was handed over, is replaced as before
    box.take([result("b", 0, settles=(t0,))], "b")
    (b,) = box.sending(1.0)
    box.send_failed(b)  # disconnected: it did not leave
    assert box.tick(1.0) == [] and box.sending(1.0) == [b]
    assert box.unsendable(b, "too large") == [GiveUp("b", 0, 2, "too large", replace=True, tokens=(t0,))]


def test_an_unsendable_later_batch_member_ends_its_batch_and_is_replaced_as_its_request_s_first_unstored():
    """A later member of a fast batch may follow a result that is not stored, so no error may take
    its place yet; given up, its request's chunks were NAKed, came back, made the same batch and
    were NAKed again (tests/test_durable_worker_attack.py). Its batch ends at it, the batch's head
    leaves again at once, the member rides in no batch behind another, and as its request's first
    unstored result it is replaced, its tokens and those queued behind it kept for the error."""
    box = Outbox(OutboxConfig(max_attempts=100, batch_limit=8))
    t0, t1, t2, t3 = (Token("a", str(i), 1) for i in range(4))
    box.take([result("a", 0, settles=(t0,))], "a")
    (first,) = box.sending(0.0)
    box.take([result("a", 1, settles=(t1,)), result("a", 2, settles=(t2,)), result("a", 3, settles=(t3,))], "a")
    assert box.on_puback(first.ticket, b'{"stream":"R","seq":1}', 0.1) == STORED
    assert box.control() == [(t0, ACK)]
    members = box.sending(0.2)
    assert [m.result.seq for m in members] == [1, 2, 3]
    sent = []
    for o, _ in in_turn(members):  # as the pump publishes them: seq 1 leaves, seq 2 cannot
        if o.result.seq == 2:
            assert box.unsendable(o, "too large") == []
        else:
            sent.append(o.result.seq)
    assert sent == [1]  # the batch ended at seq 2: seq 3 is not sent after the gap
    assert box.control() == [] and box.stats.results_given_up == 0
    (again,) = box.sending(0.3)  # seq 1 again, alone: seq 2 rides behind nothing
    assert again is members[0] and again.batch is None
    assert box.on_puback(again.ticket, b'{"stream":"R","seq":2,"duplicate": true}', 0.4) == DUPLICATE
    assert box.control() == [(t1, ACK)]
    heads = box.sending(0.5)
    assert [m.result.seq for m in heads] == [2, 3]  # now the first unstored: it leads
    assert box.unsendable(heads[0], "too large") == [GiveUp("a", 2, 2, "too large", replace=True, tokens=(t2, t3))]
    assert box.control() == []


def test_an_unsendable_error_result_is_given_up_its_tokens_nakd():
    """Replaced in turn, an error result too large for the server made a loop."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0 = Token("a", "0", 1)
    box.take([Result("a", 0, b"error", True, error="internal", settles=(t0,))], "a")
    (o,) = box.sending(0.0)
    assert box.unsendable(o, "too large") == [GiveUp("a", o.result.seq, 1, "too large")]
    assert box.control() == [(t0, NAK)]
    assert box.stats.results_given_up == 1 and box.stats.publish_errors == 1
    assert box.tick(100.0) == [] and box.sending(100.0) == []  # nothing of "a" is sent again
    assert box.on_puback(o.ticket, b'{"stream":"R","seq":1}', 100.1) == UNMATCHED


def test_a_result_refused_max_attempts_times_is_given_up_its_tokens_nakd_and_its_request_dropped():
    box = Outbox(OutboxConfig(max_attempts=2))
    t0, t1, dup = Token("a", "0", 1), Token("a", "1", 1), Token("a", "1", 2)
    box.take([result("a", 0, settles=(t0,)), result("a", 1, settles=(t1,))], "a")
    box.take([Settle((dup,))], "a")
    (o,) = box.sending(0.0)
    assert box.on_puback(o.ticket, REFUSED_ACK, 0.1) == REFUSED
    box.tick(0.6)
    (o,) = box.sending(0.6)
    assert box.on_puback(o.ticket, NO_RESPONDERS, 0.7) == GIVEN_UP
    assert box.given_up() == [GiveUp("a", 0, 2, "refused")]
    assert box.control() == [(t0, NAK), (t1, NAK), (dup, NAK)]
    assert box.idle and box.stats.results_given_up == 1 and box.sending(1.0) == []


def test_a_result_whose_header_block_jetstream_never_stores_is_given_up_at_its_first_refusal():
    """nats-server refuses a header block over 64 KiB (err_code 10097) every time: retried, the
    result held its chunk for 100 x 0.5 s per delivery (tests/test_durable_worker_attack.py)."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0 = Token("a", "0", 1)
    box.take([result("a", 0, settles=(t0,))], "a")
    (o,) = box.sending(0.0)
    refusal = (b'{"error":{"code":400,"err_code":10097,"description":"header size exceeds maximum allowed '
               b'of 64k"},"stream":"R","seq":0}')
    assert box.on_puback(o.ticket, refusal, 0.1) == GIVEN_UP
    (g,) = box.given_up()
    assert (g.request_id, g.seq, g.attempts) == ("a", 0, 1) and "64 KiB" in g.reason
    assert box.control() == [(t0, NAK)]
    assert box.idle and box.sending(1.0) == []


def test_a_result_past_its_subjects_limit_is_given_up_at_its_first_refusal_and_a_full_stream_is_retried():
    """A discard-new-per-subject ``max_msgs_per_subject`` refuses every later result of the request
    (they share its subject): retried, the result held its chunks for 100 x 0.5 s per delivery and
    stalled its partition (tests/test_durable_full_results_stream.py). A stream-wide ``max_msgs`` /
    ``max_bytes`` (the same err_code 10077) refuses every request alike until results age out: retried."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0, t1 = Token("a", "0", 1), Token("b", "0", 1)
    box.take([result("a", 0, settles=(t0,))], "a")
    box.take([result("b", 0, settles=(t1,))], "b")
    a, b = box.sending(0.0)
    per_subject = (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages per subject exceeded"},'
                   b'"stream":"R","seq":0}')
    stream_full = b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},"stream":"R","seq":0}'
    assert box.on_puback(a.ticket, per_subject, 0.1) == GIVEN_UP
    (g,) = box.given_up()
    assert (g.request_id, g.attempts, g.ends) == ("a", 1, True) and "max_msgs_per_subject" in g.reason
    assert box.control() == [(t0, TERM)]  # never storable: terminated, not redelivered (test_unstorable_request.py)
    assert box.on_puback(b.ticket, stream_full, 0.1) == REFUSED
    assert box.given_up() == [] and box.control() == []
    assert box.tick(1.0) == [] and [o.result.request_id for o in box.sending(1.0)] == ["b"]  # after 0.5 s


def test_a_result_whose_puback_never_comes_is_given_up_after_max_attempts_timeouts():
    box = Outbox(OutboxConfig(first_wait=1.0, max_wait=1.0, max_attempts=3))
    box.take([result("a", 0, settles=(Token("a", "0", 1),))], "a")
    gave_up = []
    for step in range(10):
        box.sending(float(step))
        gave_up += box.tick(step + 1.0)
    assert gave_up == [GiveUp("a", 0, 3, "timeout")] and box.idle


# ---------------------------------------------------------------------------- fast batches

def batch_ack(batch: str, count: int) -> bytes:
    return b'{"stream":"R","seq":9,"batch":"%s","count":%d}' % (batch.encode(), count)


def batched_box(limit: int = 8, **config) -> Outbox:
    box = Outbox(OutboxConfig(batch_limit=limit, **config))
    box.batch_prefix = "me-"
    return box


def queued(box: Outbox, rid: str, n: int) -> list[Token]:
    """``rid``'s first result sent alone and stored, with ``n - 1`` more queued behind it meanwhile
    (as chunks arriving during its PubAck's round trip queue theirs); each settles a token."""
    tokens = [Token(rid, str(s), 1) for s in range(n)]
    box.take([result(rid, 0, n == 1, (tokens[0],))], rid)
    (first,) = box.sending(0.0)
    assert first.batch is None  # nothing queued behind it when it left
    box.take([result(rid, s, s == n - 1, (tokens[s],)) for s in range(1, n)], rid)
    assert box.sending(0.0) == []  # nothing more of the request leaves before that PubAck
    assert box.on_puback(first.ticket, STORED_ACK, 0.0) == STORED
    assert acked(box.control()) == [tokens[0]]
    return tokens


def test_results_queued_behind_a_stored_one_leave_together_in_one_fast_batch():
    box = batched_box()
    queued(box, "a", 4)
    batch = box.sending(0.1)
    assert [o.result.seq for o in batch] == [1, 2, 3]
    ids = {o.batch[0] for o in batch}
    assert len(ids) == 1 and ids.pop().startswith("me-")
    assert [o.batch[1:] for o in batch] == [(3, 1), (3, 2), (3, 3)]  # size, batch seq (the last commits)
    assert box.sending(0.1) == []  # nothing more of "a" leaves before the batch's PubAck


def test_a_requests_first_results_queued_together_leave_as_one_batch():
    """Its first result has no predecessor, so a batch may start there."""
    box = batched_box()
    box.take([result("a", 0), result("a", 1, final=True)], "a")
    assert [(o.result.seq, o.batch[2]) for o in box.sending(0.0)] == [(0, 1), (1, 2)]


def test_without_a_batch_limit_results_leave_one_at_a_time():
    box = Outbox()
    box.take([result("a", 0), result("a", 1, final=True)], "a")
    assert [(o.result.seq, o.batch) for o in box.sending(0.0)] == [(0, None)]


def test_a_batch_never_holds_more_than_the_batch_limit():
    box = batched_box(limit=2)
    queued(box, "a", 5)
    assert [o.result.seq for o in box.sending(0.0)] == [1, 2]


def test_a_batch_carries_at_most_batch_bytes_beyond_its_first_result():
    """A PubAck releases a bounded amount into the client's write buffer; a large first result
    still leaves (it would have alone), a result too large to join leads the next batch."""
    box = batched_box(batch_bytes=100)
    box.take([Result("a", 0, b"x" * 500, False)], "a")
    box.on_puback(box.sending(0.0)[0].ticket, STORED_ACK, 0.0)
    box.take([Result("a", s, b"y" * size, False) for s, size in ((1, 500), (2, 60), (3, 40), (4, 1))], "a")
    assert [o.result.seq for o in box.sending(0.0)] == [1, 2, 3]  # 60 + 40 fit after the first
    assert acked(box.control()) == []


def test_sending_within_a_budget_keeps_the_rest_ready_in_order():
    """The pump hands the client at most what fits before its write buffer is backlogged; the
    first send always leaves, whole (a batch is counted as it will be sent)."""
    box = batched_box()
    for rid in "abc":
        box.take([Result(rid, s, b"z" * 100, False) for s in range(3)], rid)
    assert [(o.result.request_id, o.result.seq) for o in box.sending(0.0, budget=50)] == [("a", s) for s in range(3)]
    assert [o.result.request_id for o in box.ready] == ["b", "c"]
    size = wire_size(Result("b", 0, b"z" * 100, False))  # bytes on the wire, about: body, id, HPUB line, headers
    assert [(o.result.request_id, o.result.seq) for o in box.sending(0.0, budget=3 * size + 1)] == [
        (rid, s) for rid in "bc" for s in range(3)]
    assert not box.ready


def test_replies_before_a_batchs_puback_change_nothing_and_its_puback_settles_the_batch():
    box = batched_box()
    tokens = queued(box, "a", 3)
    batch = box.sending(0.0)
    bid = batch[0].batch[0]
    assert box.on_batch_reply(bid, False, b'{"type":"ack","seq":0,"msgs":2}', 0.1) == PENDING
    assert box.on_batch_reply(bid, True, b'{"type":"ack","seq":1,"msgs":2}', 0.1) == PENDING
    assert box.control() == [] and box.pending == 2
    assert box.on_batch_reply(bid, True, batch_ack(bid, 2), 0.2) == STORED
    assert acked(box.control()) == tokens[1:] and box.idle
    assert box.on_batch_reply(bid, True, batch_ack(bid, 2), 0.3) == UNMATCHED  # a copy: already ended


def test_a_batch_stored_short_settles_its_stored_prefix_and_sends_the_first_missing_result_alone():
    """In gap-fail mode what is stored is a prefix of the batch: ``count`` says where it stopped."""
    box = batched_box(retry_after_refusal=0.5)
    tokens = queued(box, "a", 5)
    batch = box.sending(0.0)
    bid = batch[0].batch[0]
    err = b'{"type":"err","seq":3,"error":{"code":503,"err_code":10077,"description":"maximum bytes exceeded"}}'
    assert box.on_batch_reply(bid, False, err, 0.1) == PENDING
    assert box.on_batch_reply(bid, False, batch_ack(bid, 2), 0.1) == REFUSED  # seqs 1, 2 stored; 3 not
    assert acked(box.control()) == tokens[1:3]
    assert box.last_refused.seq == 3 and box.stats.publish_errors == 1
    assert box.sending(0.2) == []  # the refused one waits retry_after_refusal
    box.tick(0.7)
    (again,) = box.sending(0.7)
    assert (again.result.seq, again.batch) == (3, None)  # alone
    assert box.on_puback(again.ticket, STORED_ACK, 0.8) == STORED
    assert [o.result.seq for o in box.sending(0.8)] == [4]  # the rest goes on
    assert acked(box.control()) == [tokens[3]]


def test_a_plain_error_on_a_batchs_commit_ends_it_with_nothing_known_stored():
    """A commit refused before the batch sees it (too large; 10208 after a refused start) gets no
    PubAck: the batch's first result is sent again alone, not charged with a refusal (nothing says
    it failed; with max_attempts 1 it is not given up). A plain error on another message waits for
    the gap it makes at the next one."""
    box = batched_box(max_attempts=1)
    queued(box, "a", 4)
    batch = box.sending(0.0)
    bid = batch[0].batch[0]
    assert box.on_batch_reply(bid, False, TOO_LARGE, 0.1) == PENDING
    assert box.on_batch_reply(bid, True, UNKNOWN_BATCH, 0.1) == BATCH_REFUSED
    assert box.control() == [] and box.pending == 3
    box.tick(1.0)
    (again,) = box.sending(1.0)
    assert (again.result.seq, again.batch) == (1, None)


def test_a_batch_refused_whole_sends_its_first_result_alone_at_once_and_pauses_batches():
    """A commit refused as a batch (batches turned off on the stream, no free batch slot) says
    nothing about the results: the first one leaves again alone at the next send, without waiting
    ``retry_after_refusal``, and the request's results go one at a time until ``batch_pause`` has
    passed (each new batch would be refused too); then batches form again."""
    box = batched_box(batch_pause=5.0)
    queued(box, "a", 6)
    bid = box.sending(0.0)[0].batch[0]
    assert box.on_batch_reply(bid, True, UNKNOWN_BATCH, 0.1) == BATCH_REFUSED
    assert box.stats.batch_pauses == 1
    (again,) = box.sending(0.1)
    assert (again.result.seq, again.batch) == (1, None)
    assert box.on_puback(again.ticket, STORED_ACK, 0.2) == STORED
    (single,) = box.sending(0.2)
    assert (single.result.seq, single.batch) == (2, None)  # paused: one at a time
    assert box.on_puback(single.ticket, STORED_ACK, 5.2) == STORED
    assert [(o.result.seq, o.batch[1:]) for o in box.sending(5.2)] == [(3, (3, 1)), (4, (3, 2)), (5, (3, 3))]


def test_a_no_responders_reply_to_a_batch_ends_it():
    box = batched_box()
    queued(box, "a", 3)
    bid = box.sending(0.0)[0].batch[0]
    assert box.on_batch_reply(bid, False, NO_RESPONDERS, 0.1) == BATCH_REFUSED


def test_an_overdue_batch_is_sent_again_under_a_new_batch_id_and_the_old_ones_puback_is_ignored():
    """nats-server forgets an ended batch id and starts a new batch if it comes again at seq 1, and
    an open one would see the resent start as a gap: a retry needs a new id. Stored ones are skipped
    by their Nats-Msg-Id."""
    box = batched_box(first_wait=2.0)
    tokens = queued(box, "a", 3)
    old = box.sending(0.0)[0].batch[0]
    box.tick(2.5)
    assert box.stats.pubacks_overdue == 1
    again = box.sending(2.5)
    assert [o.result.seq for o in again] == [1, 2]
    new = again[0].batch[0]
    assert new != old
    assert box.on_batch_reply(old, True, batch_ack(old, 2), 2.6) == UNMATCHED
    assert box.control() == []
    assert box.on_batch_reply(new, True, batch_ack(new, 2), 2.7) == STORED
    assert acked(box.control()) == tokens[1:]


def test_a_batch_member_that_did_not_leave_sends_the_batch_again_at_the_next_tick():
    box = batched_box()
    queued(box, "a", 3)
    batch = box.sending(0.0)
    box.send_failed(batch[1])
    box.tick(0.1)
    assert [o.result.seq for o in box.sending(0.1)] == [1, 2]


def test_abandoning_a_request_with_a_batch_in_flight_drops_the_batch():
    box = batched_box()
    tokens = queued(box, "a", 3)
    bid = box.sending(0.0)[0].batch[0]
    dropped_tokens, dropped = box.abandon(lambda r: r == "a")
    assert dropped == ["a"] and dropped_tokens == tokens[1:]
    assert box.on_batch_reply(bid, True, batch_ack(bid, 2), 0.1) == UNMATCHED and box.idle


def test_abandon_returns_tokens_and_request_ids_and_a_late_puback_acks_nothing():
    box = Outbox()
    ta, tb = Token("a", "0", 1), Token("b", "0", 1)
    box.take([result("a", 0, settles=(ta,)), result("a", 1)], "a")
    box.take([result("b", 0, settles=(tb,))], "b")
    sent = {o.result.request_id: o for o in box.sending(0.0)}
    tokens, dropped = box.abandon(lambda rid: rid == "a")
    assert tokens == [ta] and dropped == ["a"]
    assert box.on_puback(sent["a"].ticket, STORED_ACK, 0.1) == UNMATCHED
    assert box.control() == [] and box.pending == 1


def test_abandon_keeps_other_requests_results_waiting_to_be_sent():
    box = Outbox()
    box.take([result("a", 0)], "a")
    box.take([result("b", 0)], "b")
    box.abandon(lambda rid: rid == "a")
    assert [o.result.request_id for o in box.sending(0.0)] == ["b"]


def test_a_token_held_at_two_consecutive_progress_rounds_gets_in_progress():
    box = Outbox(OutboxConfig(progress_every=2.5))
    prefill, queued = Token("a", "prefill", 1), Token("b", "0", 1)
    box.take([result("b", 0, settles=(queued,))], "b")
    box.tick(0.0, held=lambda: [prefill])
    assert box.control() == []  # first seen
    box.tick(1.0, held=lambda: [prefill])
    assert box.control() == []  # not a round yet
    box.tick(2.5, held=lambda: [prefill])
    assert sorted(box.control(), key=repr) == sorted([(prefill, PROGRESS), (queued, PROGRESS)], key=repr)
    assert box.stats.in_progress == 2
    box.tick(5.0, held=lambda: [])
    assert box.control() == [(queued, PROGRESS)]  # the prefill token was released in between


@pytest.mark.parametrize("data, meaning", [
    (STORED_ACK, STORED), (DUPLICATE_ACK, DUPLICATE), (REFUSED_ACK, REFUSED), (NO_RESPONDERS, REFUSED),
    (b'{"error":{"code":500,"err_code":10077,"description":"message size exceeds maximum allowed"}}', REFUSED),
])
def test_a_puback_body_is_classified_as_stored_duplicate_or_refused(data, meaning):
    assert classify(data) == meaning


def test_the_first_send_leaves_whatever_the_budget_and_a_budget_used_up_exactly_stops_the_next():
    box = Outbox()
    for rid in "abc":
        box.take([result(rid, 0)], rid)
    assert [o.result.request_id for o in box.sending(0.0, budget=0)] == ["a"]
    size = wire_size(result("b", 0))
    assert [o.result.request_id for o in box.sending(0.0, budget=size)] == ["b"]  # nothing left for c
    assert [o.result.request_id for o in box.ready] == ["c"]


@given(st.lists(st.tuples(st.sampled_from(["a", "bb", "c" * 40]), st.integers(0, 3000)), min_size=1, max_size=12),
       st.integers(-1, 20000), st.integers(1, 4))
def test_a_budget_is_spent_as_wire_size_counts_each_result_without_calling_it(sizes, budget, batch_limit):
    """``_within`` counts each result as :func:`wire_size` does, its sum written out (one Python call per
    result less; docs/benchmarks.md, "Durable CPU, seventh pass"): the sends that fit are those whose
    wire_size sum, a batch counted whole, fits the budget (the first always leaves), in order."""
    import streamproc.core.outbox as outbox_module

    box = batched_box(limit=batch_limit) if batch_limit > 1 else Outbox()
    seqs: dict[str, int] = {}
    for rid, n in sizes:
        seqs[rid] = seqs.get(rid, -1) + 1
        box.take([Result(rid, seqs[rid], b"x" * n, False)], rid)
    # what the budget should keep, from wire_size itself: the heads, each with its batch as sending() makes it
    heads = list(box.ready)
    limit = box._batch_limit(0.0)
    want, left = [], budget
    for n, o in enumerate(heads):
        if left <= 0 and n:
            break
        want.append(o.result.request_id)
        members = box._batch_of(box._queues[o.result.request_id], limit) if limit > 1 and not o.alone else None
        left -= sum(wire_size(m.result) for m in members or (o,))
    original = outbox_module.wire_size

    def not_called(result):
        raise AssertionError("wire_size called on the send path")

    outbox_module.wire_size = not_called
    try:
        sent = box.sending(0.0, budget=budget)
    finally:
        outbox_module.wire_size = original
    assert list(dict.fromkeys(o.result.request_id for o in sent)) == want
    assert [o.result.request_id for o in box.ready] == [o.result.request_id for o in heads[len(want):]]


def test_a_nak_with_a_delay_asks_for_the_redelivery_that_much_later():
    box = Outbox()
    late, now = Token("a", "0", 1), Token("a", "1", 1)
    box.nak([late], delay=2.5)
    box.nak([now])
    assert box.control() == [(late, Nak(2.5)), (now, NAK)] and box.stats.naks == 2


def test_walking_a_batch_skips_its_members_once_the_batch_was_sent_again_as_a_new_one():
    box = batched_box()
    box.take([result("a", s) for s in range(3)], "a")
    sends = box.sending(0.0)
    assert len({o.flight for o in sends}) == 1 and sends[0].flight is not None
    walk = in_turn(sends)
    first, batch = next(walk)
    assert first is sends[0] and batch == (sends[0].flight, 3, 1)
    box.tick(0.0, reconnected=True)  # an await let a reconnect end the batch: it leaves again as a new one
    assert list(walk) == []


def test_the_puback_latency_is_the_wait_from_the_last_send_to_the_puback_and_a_refused_copy_is_not_timed():
    box = Outbox(OutboxConfig(retry_after_refusal=0.5))
    box.take([result("a", 0), result("b", 0)], None)
    a, b = box.sending(1.0)
    assert box.on_puback(a.ticket, STORED_ACK, 1.25) == STORED
    assert (box.puback_latency.count, box.puback_latency.total) == (1, 0.25)
    assert box.on_puback(b.ticket, REFUSED_ACK, 1.5) == REFUSED
    assert box.on_puback(b.ticket, STORED_ACK, 1.75) == STORED  # a late PubAck of the copy sent before
    assert box.puback_latency.count == 1


def test_a_batch_reply_naming_a_single_sends_ticket_is_unmatched_and_changes_nothing():
    box = batched_box()
    box.take([result("a", 0)], "a")
    [o] = box.sending(0.0)
    assert o.flight is None
    assert box.on_batch_reply(o.ticket, True, b'{"stream":"R","seq":1,"batch":"x","count":1}', 0.1) == UNMATCHED
    assert box.control() == [] and box.pending == 1
    assert box.on_puback(o.ticket, STORED_ACK, 0.2) == STORED and box.pending == 0


def test_a_batch_member_skipped_after_a_reconnect_never_left_so_an_unsendable_copy_of_it_is_still_replaced():
    """A batch published with awaits (a tracing wrapper around publish) can be sent again as a new
    batch during one of them (a reconnect); the old walk then skips the members it had not reached
    (:func:`in_turn`). Those never left, yet were counted as handed to NATS, so in the new batch a
    member over ``max_payload`` looked as if an earlier copy might be stored: given up, its request's
    chunks NAKed (each came back only to make the same batch), where one that never left ends its
    batch and is replaced in its turn."""
    box = Outbox(OutboxConfig(max_attempts=100, batch_limit=8))
    t0, t1, t2, t3 = (Token("a", str(i), 1) for i in range(4))
    box.take([result("a", 0, settles=(t0,))], "a")
    (first,) = box.sending(0.0)
    assert box.on_puback(first.ticket, b'{"stream":"R","seq":1}', 0.1) == STORED
    box.take([result("a", 1, settles=(t1,)), result("a", 2, settles=(t2,)), result("a", 3, settles=(t3,))], "a")
    walk = in_turn(box.sending(0.2))
    o, batch = next(walk)  # seq 1 published; during its await a reconnect sends the batch again
    assert o.result.seq == 1 and batch is not None
    assert box.tick(0.3, reconnected=True) == []
    again = box.sending(0.3)
    assert [m.result.seq for m in again] == [1, 2, 3]
    assert list(walk) == []  # the old walk's rest is skipped: seq 2 and 3 never left from it
    published = []
    for o, _ in in_turn(again):
        if o.result.seq == 2:  # over max_payload: it never left, from either walk
            assert box.unsendable(o, "too large") == []
        else:
            published.append(o.result.seq)
    assert published == [1]
    assert (box.stats.results_given_up, box.stats.naks) == (0, 0)
    assert box.control() == [(t0, ACK)]
