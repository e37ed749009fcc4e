"""A request whose results the results stream refuses for good (its subject is full: ``max_msgs_per_subject``
with discard new per subject, err_code 10077) ends at its first refusal, pure: the outbox and the
correlator driven together as the durable shell drives them (``DurableInput._given_up``).

Before, the give-up NAKed the request's chunks and forgot it: each came back up to ``max_deliver``
times, was recovered, refused again and poisoned, and its later chunks were held behind the gap
until ``request_timeout`` or the partition's shedding (against nats-server: 64 redeliveries, 96 NAKs
and 6 chunks left unacknowledged for a minute for one request of 40 chunks). Now its chunks are
terminated, later ones acknowledged and dropped on arrival as ``unstorable``, nothing is held."""

from __future__ import annotations

import random

import msgspec
from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.correlator import UNSTORABLE_CHUNK, Correlator, CorrelatorConfig
from streamproc.core.events import Chunk, Notice, Result, Role, Settle
from streamproc.core.outbox import ACK, GIVEN_UP, NAK, PENDING, STORED, TERM, Outbox, OutboxConfig, in_turn
from streamproc.testing.harness import leg, shuffle_with_duplicates
from toy_codec import resolve

STORED_ACK = b'{"stream":"R","seq":7}'
DUPLICATE_ACK = b'{"stream":"R","seq":7,"duplicate": true}'
SUBJECT_FULL = (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages per subject exceeded"},'
                b'"stream":"R","seq":0}')
UNKNOWN_BATCH = b'{"error":{"code":400,"err_code":10208,"description":"batch publish ID unknown"},"stream":"R","seq":0}'
BATCH_ACK = b'{"stream":"R","seq":9,"batch":"%s","count":%d}'
STREAM_FULL = b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},"stream":"R","seq":0}'


class Delivery:
    """One delivery of one chunk: an ack handle whose identity matters, as a nats-py Msg's does."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Delivery({self.name})"


class Shell:
    """The durable shell's glue around one correlator and one outbox, with a results stream whose
    ``max_msgs_per_subject`` is ``limit`` (discard new per subject)."""

    def __init__(self, limit: int, batch_limit: int = 1) -> None:
        self.correlator = Correlator(resolve, "toy", CorrelatorConfig(finished_grace=60.0))
        self.outbox = Outbox(OutboxConfig(max_attempts=100, batch_limit=batch_limit))
        self.outbox.batch_prefix = "me-"
        self.limit = limit
        self.stored: dict[str, list[int]] = {}
        self.settled: dict[Delivery, list[str]] = {}
        self.ended: set[str] = set()
        self.sent_after_end: list[Result] = []
        self.notices: list[Notice] = []

    def deliver(self, chunk: Chunk, now: float) -> None:
        decisions = self.correlator.receive(chunk, now)
        self.notices.extend(self.outbox.take(decisions, chunk.request_id))
        self.pump(now)

    def pump(self, now: float) -> None:
        outbox = self.outbox
        while True:
            for token, action in outbox.control():
                self.settled.setdefault(token, []).append("nak" if action == NAK else action)
            sends = outbox.sending(now)
            if not sends:
                return
            replies: list[tuple[str, bool, bytes]] = []  # (ticket, batched commit, reply), in wire order
            batches: dict[str, dict] = {}
            for o, batch in in_turn(sends):
                r = o.result
                if r.request_id in self.ended:
                    self.sent_after_end.append(r)
                stored = self.stored.setdefault(r.request_id, [])
                if batch is not None:  # nats-server's fast batch, gap mode fail (tests/test_fast_batch_server.py)
                    flight, size, index = batch
                    b = batches.setdefault(flight, {"open": True, "count": 0})
                    commit = index == size
                    if not b["open"]:
                        replies.append((flight, commit, UNKNOWN_BATCH))
                        continue
                    if r.seq >= len(stored) and len(stored) >= self.limit:
                        b["open"] = False
                        if index == 1:  # refused as its first message: a plain error, no PubAck
                            replies.append((flight, commit, SUBJECT_FULL))
                        else:
                            replies.append((flight, False, b'{"type":"err","seq":%d,"error":{"code":503,'
                                            b'"err_code":10077,"description":"maximum messages per subject '
                                            b'exceeded"}}' % index))
                            replies.append((flight, True, BATCH_ACK % (flight.encode(), b["count"])))
                        continue
                    if r.seq >= len(stored):
                        assert r.seq == len(stored), f"{r.msg_id} stored after a gap"
                        stored.append(r.seq)
                    b["count"] += 1
                    if commit:
                        b["open"] = False
                        replies.append((flight, True, BATCH_ACK % (flight.encode(), b["count"])))
                    continue
                if r.seq < len(stored):
                    reply = DUPLICATE_ACK
                elif len(stored) >= self.limit:
                    reply = SUBJECT_FULL
                else:
                    assert r.seq == len(stored), f"{r.msg_id} stored after a gap"
                    stored.append(r.seq)
                    reply = STORED_ACK
                replies.append((o.ticket, False, reply))
            for ticket, commit, reply in replies:
                if ticket in batches:
                    outcome = outbox.on_batch_reply(ticket, commit, reply, now)
                else:
                    outcome = outbox.on_puback(ticket, reply, now)
                if outcome == GIVEN_UP:
                    for g in outbox.given_up():
                        self.given_up(g, now)

    def given_up(self, g, now: float) -> None:
        """``DurableInput._given_up``."""
        rid = g.request_id
        if getattr(g, "ends", False):
            self.ended.add(rid)
            self.outbox.term(self.correlator.unstorable(rid, now))
        else:
            self.outbox.nak(self.correlator.abandon(lambda r: r == rid, (rid,)))


def deliveries(chunks: list[Chunk]) -> list[Chunk]:
    """Each chunk as a delivery of its own (a redelivered copy is another Msg of the same message)."""
    return [msgspec.structs.replace(c, token=Delivery(f"{c.request_id}/{c.seq}#{n}")) for n, c in enumerate(chunks)]


def test_a_refusal_because_the_subject_is_full_ends_the_request_and_terminates_its_queued_chunks():
    """The give-up of a subject-full refusal ``ends`` the request: every token queued behind its
    results (the refused one's, later results', a Settle waiting behind them) is terminated, none
    NAKed; a stream-wide refusal (the same err_code, every request alike) is still retried."""
    box = Outbox(OutboxConfig(max_attempts=100))
    t0, t1, dup, tb = Delivery("a0"), Delivery("a1"), Delivery("a0 again"), Delivery("b0")
    box.take([Result("a", 0, b"a0", False, settles=(t0,)), Result("a", 1, b"a1", False, settles=(t1,))], "a")
    box.take([Settle((dup,))], "a")
    box.take([Result("b", 0, b"b0", False, settles=(tb,))], "b")
    a, b = box.sending(0.0)
    assert box.on_puback(a.ticket, SUBJECT_FULL, 0.1) == GIVEN_UP
    (g,) = box.given_up()
    assert (g.request_id, g.seq, g.ends) == ("a", 0, True)
    assert box.control() == [(t0, TERM), (t1, TERM), (dup, TERM)]
    assert box.stats.terminated == 3 and box.stats.naks == 0 and box.stats.acks == 0
    assert box.on_puback(b.ticket, STREAM_FULL, 0.1) != GIVEN_UP and box.given_up() == []
    assert box.control() == []


def test_later_chunks_of_an_unstorable_request_are_acknowledged_and_dropped_on_arrival_and_counted():
    """``Correlator.unstorable``: the request's held chunks are handed back (to be terminated), its
    state is freed, and its chunks that still come are settled at once with an ``unstorable_chunk``
    notice and counted, as long as it is remembered as finished (then forgotten: bounded)."""
    c = Correlator(resolve, "toy", CorrelatorConfig(finished_grace=60.0))
    chunks = deliveries(leg("f", Role.AGG, [b"0", b"1", b"2", b"3", b"4", b"5"]))
    c.receive(chunks[0], 0.0)
    assert c.receive(chunks[3], 0.0) == []  # held behind seq 1..2
    assert c.unstorable("f", 1.0) == [chunks[3].token]
    assert c.inflight == 0 and list(c.unsettled()) == [] and c.charged_bytes == 0
    out = c.receive(chunks[4], 2.0)
    assert out[0] == Settle((chunks[4].token,))
    assert isinstance(out[1], Notice) and out[1].event == UNSTORABLE_CHUNK
    assert (c.stats.unstorable, c.stats.late) == (1, 0)
    c.tick(62.0)  # past finished_grace: forgotten like any finished request
    assert not c.knows("f")


@outbox_settings
@given(limit=st.integers(1, 3), extra=st.integers(1, 12), bystanders=st.integers(0, 3), seed=st.integers(0, 2**32),
       batch_limit=st.sampled_from([1, 4]))
def test_a_request_past_its_subjects_limit_ends_with_every_delivery_settled_once_and_nothing_held(
        limit, extra, bystanders, seed, batch_limit):
    """Any arrival order, with redelivered copies, of one request of ``limit + extra`` chunks and of
    bystanders within the limit, interleaved: the flooding request's stored results are ``0..limit-1``;
    every delivery of it is settled exactly once, acknowledged or terminated, never NAKed (no
    redelivery); nothing of it is sent after its give-up; nothing is held and no state is left; the
    bystanders are stored whole. With fast batches (``batch_limit`` 4, refusals answered as nats-server
    answers them inside a batch) too: ended at the first refusal, no batch pause."""
    rng = random.Random(seed)
    shell = Shell(limit, batch_limit)
    flood = leg("flood", Role.AGG, [b"f%d" % i for i in range(limit + extra)])
    others = [leg(f"by{n}", Role.AGG, [b"b%d" % i for i in range(limit)]) for n in range(bystanders)]
    arrivals = deliveries(shuffle_with_duplicates(flood + [c for o in others for c in o], rng))
    for now, chunk in enumerate(arrivals):
        shell.deliver(chunk, float(now))
    end = float(len(arrivals))
    shell.outbox.tick(end)
    shell.pump(end)
    for chunk in arrivals:
        actions = shell.settled.get(chunk.token, [])
        assert len(actions) == 1 and actions[0] in (ACK, TERM), (chunk, actions)
    assert shell.stored.get("flood") == list(range(limit))
    assert "flood" in shell.ended and shell.sent_after_end == []
    for o in others:
        assert shell.stored.get(o[0].request_id) == list(range(limit))
    c, box = shell.correlator, shell.outbox
    assert box.idle and list(box.tokens()) == [] and list(c.unsettled()) == []
    assert c.inflight == 0 and c.charged_bytes == 0 and c.is_finished("flood")
    assert box.stats.naks == 0 and box.stats.batch_pauses == 0
    # Ended at the refusal that first said the subject is full, fast batch or not: never sent again
    # alone to be refused a second time.
    assert box.stats.publish_errors == 1
    late_flood = [n for n in shell.notices if n.request_id == "flood" and n.event == UNSTORABLE_CHUNK]
    assert c.stats.unstorable == len(late_flood)


def batched_request(box: Outbox, n: int) -> tuple[list[Delivery], str]:
    """Request ``a``'s first result sent alone and stored, its next ``n`` queued meanwhile and then sent
    as one fast batch; returns every result's token and the batch's ticket."""
    tokens = [Delivery(f"a{s}") for s in range(n + 1)]
    box.take([Result("a", 0, b"a0", False, settles=(tokens[0],))], "a")
    (first,) = box.sending(0.0)
    box.take([Result("a", s, b"a%d" % s, False, settles=(tokens[s],)) for s in range(1, n + 1)], "a")
    assert box.on_puback(first.ticket, STORED_ACK, 0.0) == STORED
    batch = box.sending(0.0)
    assert len(batch) == n and batch[0].batch is not None
    return tokens, batch[0].batch[0]


def test_a_subject_full_refusal_inside_a_fast_batch_ends_the_request_at_the_batchs_pubAck():
    """nats-server answers a message refused inside a fast batch with ``"type":"err"`` (the reason)
    and then the batch's PubAck, whose ``count`` says only where it stopped
    (tests/test_fast_batch_server.py). A subject-full reason there ends the request at that PubAck, as
    it does for a result sent alone: not charged as a plain refusal and sent again alone after
    ``retry_after_refusal`` with its chunks held, to be refused again."""
    box = Outbox(OutboxConfig(batch_limit=8, max_attempts=100))
    box.batch_prefix = "me-"
    tokens, bid = batched_request(box, 4)
    box.control()
    assert box.on_batch_reply(bid, False, b'{"type":"ack","seq":0,"msgs":1}', 0.1) == PENDING
    err = (b'{"type":"err","seq":2,"error":{"code":503,"err_code":10077,'
           b'"description":"maximum messages per subject exceeded"}}')
    assert box.on_batch_reply(bid, False, err, 0.1) == PENDING
    assert box.on_batch_reply(bid, True, b'{"stream":"R","seq":9,"batch":"%s","count":1}' % bid.encode(),
                              0.1) == GIVEN_UP
    (g,) = box.given_up()
    assert (g.request_id, g.seq, g.ends) == ("a", 2, True)
    assert box.control() == [(tokens[1], ACK), (tokens[2], TERM), (tokens[3], TERM), (tokens[4], TERM)]
    assert box.idle and box.stats.naks == 0


def test_a_fast_batch_whose_start_is_refused_for_a_full_subject_ends_the_request_without_pausing_batches():
    """Refused as a batch's first message, the refusal is a plain error and the commit gets 10208
    (no PubAck): a subject-full reason there ends the request, rather than reading as a batch refused
    whole (which turns batches off for every request for ``batch_pause`` and sends the result again
    alone, to be refused again)."""
    box = Outbox(OutboxConfig(batch_limit=8, max_attempts=100))
    box.batch_prefix = "me-"
    tokens, bid = batched_request(box, 3)
    box.control()
    assert box.on_batch_reply(bid, False, SUBJECT_FULL, 0.1) == PENDING
    unknown = b'{"error":{"code":400,"err_code":10208,"description":"batch publish ID unknown"},"stream":"R","seq":0}'
    assert box.on_batch_reply(bid, False, unknown, 0.1) == PENDING
    assert box.on_batch_reply(bid, True, unknown, 0.1) == GIVEN_UP
    (g,) = box.given_up()
    assert (g.request_id, g.seq, g.ends) == ("a", 1, True)
    assert box.control() == [(tokens[1], TERM), (tokens[2], TERM), (tokens[3], TERM)]
    assert box.idle and box.stats.batch_pauses == 0 and box.stats.naks == 0
