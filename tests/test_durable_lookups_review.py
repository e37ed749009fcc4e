"""Recovery lookups as tasks (core/lookups.py, DurableInput._handlers): the deliveries parked behind
a lookup, attacked with real nats-server deliveries (in-process processor, lookups slowed or failed)."""

from __future__ import annotations

import anyio
import pytest

from streamproc.client.publisher import ChunkPublisher
from streamproc.nats.durable_input import DurableInput
from streamproc.nats.processor import Processor
from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name

from durable_helpers import chunk_stream_messages, durable_settings, stored_results
from helpers import wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


async def dead_owner_takes(client, count: int) -> list:
    """A dead owner: takes ``count`` chunks from partition 0's consumer and acknowledges none."""
    sub = await client.jetstream().pull_subscribe_bind(partition_consumer_name(0), stream=CHUNKS_STREAM)
    try:
        return await sub.fetch(count, timeout=5)
    finally:
        await sub.unsubscribe()


async def test_a_chunk_parked_on_its_last_delivery_is_decided_when_the_lookup_before_it_fails(
        client, nats_url, monkeypatch):
    """A request's chunk that needs a lookup (seq 2, first delivery) and, parked behind it, another
    of its chunks on its ``max_deliver``-th delivery (seq 1, taken before by an owner that died). The
    lookup fails: the first is NAKed for a retry, but a NAK of the second is its end, as nats-server
    never delivers it again (it stays in the work-queue stream, unacknowledged, until chunks_max_age).
    Decided on its own, as before lookups ran as tasks, it is looked up once more without a retry
    and dropped as poison (its request ends with an error result), and the chunk stream empties."""
    settings = durable_settings(nats_url, partitions=1, ack_wait=1.5, max_deliver=2)
    js = client.jetstream()
    async with Processor(settings):  # the streams and the partition's consumer
        pass
    rid = "parked-on-its-last-delivery"
    publisher = ChunkPublisher(client, settings.subjects)
    await publisher.publish(rid, "agg", 1, b'{"text": "1"}')
    assert len(await dead_owner_takes(client, 1)) == 1  # delivery 1 of seq 1: back after ack_wait
    await publisher.publish(rid, "agg", 2, b'{"text": "2"}', final=True)

    adopt = DurableInput._adopt
    calls = 0

    async def failing_once(self, r, *args, **kwargs):  # the first lookup fails once seq 1 parked behind it
        nonlocal calls
        calls += 1
        if calls == 1:
            with anyio.fail_after(10):
                while self.stats.lookups_parked < 1:
                    await anyio.sleep(0.01)
            raise TimeoutError("results stream unreadable")
        return await adopt(self, r, *args, **kwargs)

    monkeypatch.setattr(DurableInput, "_adopt", failing_once)
    async with Processor(settings) as p:
        await wait_until(lambda: p.snapshot()["lookups_parked"] >= 1, 10, "seq 1 parked behind seq 2's lookup")
        try:
            await wait_until(_empty(js), 10, "every chunk acknowledged or terminated")
        finally:
            snap = p.snapshot()
    stored = await stored_results(js, settings.subjects)
    assert snap["poisoned"] >= 1, snap
    assert [(s.seq, s.final, s.error is not None) for s in stored[rid]][-1][1:] == (True, True), stored[rid]


def _empty(js):
    async def check() -> bool:
        return await chunk_stream_messages(js) == 0
    return check
