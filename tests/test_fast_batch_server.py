"""What nats-server's fast batch publish does when a batch goes wrong: the facts a durable outbox
pipelining a request's results inside one fast batch would rest on (docs/benchmarks.md, "Fast
batches"). Each test drives the installed nats-server (the wheel's) through the wire protocol, so a
server upgrade that changes any of them fails here.

The protocol rides in the reply subject: ``<inbox>.<batch id>.<flow>.<gap mode>.<batch seq>.<op>.$FI``
(op 0 start, 1 append, 2 commit, 3 commit at end of batch without a message, 4 ping;
``server/stream.go`` ``getFastBatch``). The stream needs ``allow_batched``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.js.api import DiscardPolicy, StreamConfig

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

START, APPEND, COMMIT = 0, 1, 2


class Batcher:
    """Publishes fast-batch messages and collects every reply (flow acks, errors, gaps, PubAcks)."""

    def __init__(self, nc, inbox: str) -> None:
        self.nc, self.inbox, self.replies = nc, inbox, []

    @classmethod
    async def open(cls, nc, **stream: object) -> Batcher:
        await nc.jetstream().add_stream(StreamConfig(**{"name": "R", "subjects": ["r.>"], "allow_batched": True,
                                                        "duplicate_window": 60, **stream}))
        self = cls(nc, nc.new_inbox())

        async def on_reply(msg) -> None:
            self.replies.append(json.loads(msg.data))

        await nc.subscribe(self.inbox + ".>", cb=on_reply)
        return self

    async def send(self, batch: str, seq: int, op: int, msg_id: str, body: bytes = b"x" * 10,
                   subject: str = "r.a", flow: int = 1) -> None:
        await self.nc.publish(subject, body, reply=f"{self.inbox}.{batch}.{flow}.fail.{seq}.{op}.$FI",
                              headers={"Nats-Msg-Id": msg_id})
        await self.nc.flush()

    async def settle(self) -> list[dict]:
        """Every reply so far, once a round trip has passed since the last publish."""
        await self.nc.flush()
        await asyncio.sleep(0.2)
        replies, self.replies = self.replies, []
        return replies

    async def stored_ids(self) -> list[str]:
        js = self.nc.jetstream()
        info = await js.stream_info("R")
        return [(await js.get_msg("R", seq)).headers["Nats-Msg-Id"]
                for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages]


def pubacks(replies: list[dict]) -> list[dict]:
    return [r for r in replies if "type" not in r and "error" not in r]


async def test_flow_one_acks_every_stored_message_and_the_commit_answers_with_the_count(client):
    b = await Batcher.open(client)
    for seq, op in ((1, START), (2, APPEND), (3, COMMIT)):
        await b.send("b1", seq, op, f"a.{seq - 1}")
    replies = await b.settle()
    assert replies == [{"type": "ack", "seq": 0, "msgs": 1}, {"type": "ack", "seq": 1, "msgs": 1},
                       {"type": "ack", "seq": 2, "msgs": 1}, {"stream": "R", "seq": 3, "batch": "b1", "count": 3}]
    assert await b.stored_ids() == ["a.0", "a.1", "a.2"]


async def test_a_message_refused_mid_batch_ends_the_batch_and_nothing_after_it_is_stored(client):
    """Discard new with max_bytes refuses the large second message; the small third would fit but is
    refused with the batch: what is stored is the prefix before the refusal, and the PubAck says so."""
    b = await Batcher.open(client, max_bytes=1000, discard=DiscardPolicy.NEW)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, APPEND, "a.1", body=b"x" * 900)
    await b.send("b1", 3, APPEND, "a.2")
    await b.send("b1", 4, COMMIT, "a.3")
    replies = await b.settle()
    assert {"type": "err", "seq": 2, "error": {"code": 503, "err_code": 10077,
                                                "description": "maximum bytes exceeded"}} in replies
    assert pubacks(replies) == [{"stream": "R", "seq": 1, "batch": "b1", "count": 1}]
    assert [r["error"]["err_code"] for r in replies if "error" in r and "type" not in r] == [10208, 10208]
    assert await b.stored_ids() == ["a.0"]


async def test_a_batch_whose_first_message_is_refused_inside_it_answers_a_plain_error_and_is_gone(client):
    """Refused as the batch's first message (``processJetStreamFastBatchMsg``: the batch "immediately
    errors"), the reply is a plain error, not ``type: err`` with a PubAck: the batch is cleaned up,
    its later messages get 10208 and nothing is stored. So no ``count`` ever comes, and the outbox
    ends such a batch at its commit's plain error."""
    b = await Batcher.open(client, max_bytes=100, discard=DiscardPolicy.NEW)
    await b.send("b1", 1, START, "a.0", body=b"x" * 200)
    await b.send("b1", 2, APPEND, "a.1")
    await b.send("b1", 3, COMMIT, "a.2")
    replies = await b.settle()
    assert replies[0] == {"type": "ack", "seq": 0, "msgs": 1}  # the start's flow ack comes first
    assert "type" not in replies[1] and replies[1]["error"]["err_code"] == 10077, replies
    assert pubacks(replies) == []
    assert [r["error"]["err_code"] for r in replies[2:]] == [10208, 10208]
    assert await b.stored_ids() == []


async def test_a_full_subject_refuses_inside_the_batch_with_its_reason_before_the_pubAck(client):
    """``max_msgs_per_subject`` with discard new per subject: the message past the limit gets
    ``type: err`` naming the full subject, then the PubAck's ``count`` (which does not say why); a batch
    whose first message is refused so gets that reason as a plain error. The outbox reads the reason
    from those replies to end the request (``GiveUp.ends``) where the batch stopped."""
    b = await Batcher.open(client, max_msgs_per_subject=2, discard=DiscardPolicy.NEW, discard_new_per_subject=True)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, APPEND, "a.1")
    await b.send("b1", 3, APPEND, "a.2")
    await b.send("b1", 4, COMMIT, "a.3")
    replies = await b.settle()
    assert {"type": "err", "seq": 3, "error": {"code": 503, "err_code": 10077,
                                                "description": "maximum messages per subject exceeded"}} in replies
    assert pubacks(replies) == [{"stream": "R", "seq": 2, "batch": "b1", "count": 2}]
    await b.send("b2", 1, START, "a.4")
    await b.send("b2", 2, COMMIT, "a.5")
    replies = await b.settle()
    assert "type" not in replies[1] and replies[1]["error"]["description"] == "maximum messages per subject exceeded"
    assert pubacks(replies) == []
    assert await b.stored_ids() == ["a.0", "a.1"]


async def test_a_message_refused_before_the_batch_sees_it_shows_up_as_a_gap_at_the_next_one(client):
    """``max_msg_size`` is checked before the batch: the refusal is a plain error and the batch
    does not count the message, so the next one is a gap and ends the batch."""
    b = await Batcher.open(client, max_msg_size=500)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, APPEND, "a.1", body=b"x" * 600)
    await b.send("b1", 3, COMMIT, "a.2")
    replies = await b.settle()
    assert replies[2:] == [
        {"error": {"code": 400, "err_code": 10054, "description": "message size exceeds maximum allowed"},
         "stream": "R", "seq": 0},
        {"type": "gap", "last_seq": 2, "seq": 3},
        {"stream": "R", "seq": 1, "batch": "b1", "count": 1}]
    assert await b.stored_ids() == ["a.0"]


async def test_a_lost_message_ends_the_batch_at_the_gap(client):
    b = await Batcher.open(client)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 3, APPEND, "a.2")  # seq 2 never arrives (lost with a connection)
    await b.send("b1", 4, COMMIT, "a.3")
    replies = await b.settle()
    assert {"type": "gap", "last_seq": 2, "seq": 3} in replies
    assert pubacks(replies) == [{"stream": "R", "seq": 1, "batch": "b1", "count": 1}]
    assert await b.stored_ids() == ["a.0"]


async def test_a_retried_batch_skips_what_is_stored_by_msg_id_and_continues(client):
    """Unlike an atomic batch (one stored Nats-Msg-Id refuses it whole), a fast batch skips a
    duplicate and goes on; a batch of duplicates only commits with stream seq 0 and its count."""
    b = await Batcher.open(client)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, COMMIT, "a.1")
    await b.send("b2", 1, START, "a.0")
    await b.send("b2", 2, APPEND, "a.1")
    await b.send("b2", 3, COMMIT, "a.2")
    await b.send("b3", 1, START, "a.1")
    await b.send("b3", 2, COMMIT, "a.2")
    replies = await b.settle()
    assert pubacks(replies) == [{"stream": "R", "seq": 2, "batch": "b1", "count": 2},
                                {"stream": "R", "seq": 3, "batch": "b2", "count": 3},
                                {"stream": "R", "seq": 0, "batch": "b3", "count": 2}]
    assert await b.stored_ids() == ["a.0", "a.1", "a.2"]


async def test_an_ended_batch_refuses_appends_but_its_id_reused_at_seq_one_starts_a_new_batch(client):
    """So a retry must use a new batch id: the old id's first message, sent again, is stored."""
    b = await Batcher.open(client)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, COMMIT, "a.1")
    await b.send("b1", 3, APPEND, "a.2")
    await b.send("b1", 1, START, "a.9")
    replies = await b.settle()
    assert [r["error"]["err_code"] for r in replies if "error" in r] == [10208]
    assert await b.stored_ids() == ["a.0", "a.1", "a.9"]


async def test_batches_are_not_ordered_against_each_other(client):
    """The gap check is per batch: a second batch of the same subject stores whatever became of the
    first, so a request's results may be pipelined inside one batch only, not across two."""
    b = await Batcher.open(client, max_bytes=1000, discard=DiscardPolicy.NEW)
    await b.send("b1", 1, START, "a.0")
    await b.send("b1", 2, APPEND, "a.1", body=b"x" * 900)  # refused: the first batch ends at a.0
    await b.send("b2", 1, START, "a.2")
    await b.send("b2", 2, COMMIT, "a.3")
    await b.settle()
    assert await b.stored_ids() == ["a.0", "a.2", "a.3"]


async def test_a_stream_without_allow_batched_refuses_the_batch(client):
    await client.jetstream().add_stream(StreamConfig(name="N", subjects=["n.>"]))
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox + ".>")
    await client.publish("n.a", b"x", reply=f"{inbox}.b1.1.fail.1.0.$FI")
    msg = await sub.next_msg(timeout=5)
    assert json.loads(msg.data)["error"]["err_code"] == 10205
