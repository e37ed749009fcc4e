"""``benchmarks/durable_floor.py`` does the durable processor's wire work, or its figure means nothing.

The floor is the least CPU per chunk a Python durable relay can spend (docs/benchmarks.md, "The
floor under target 4's CPU figure"). A floor that skipped part of the work (results out of order,
chunks never acknowledged, results not stored) would measure less than the processor's job; these
pin that it stores every request's results in seq order, one at a time (or, with ``--fast-batch``,
one batch at a time), and acknowledges each chunk.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import connection, wait_until

from streamproc import config
from streamproc.nats.streams import CHUNKS_STREAM, RESULTS_STREAM

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCHMARKS))  # durable.py imports passthrough.py as a sibling
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("fast_batch", [False, True], ids=["one_by_one", "fast_batches"])
async def test_the_durable_floor_stores_each_requests_results_in_order_and_acks_every_chunk(nats_url, fast_batch):
    durable, floor = load("durable"), load("durable_floor")
    settings = config.load({}, {"nats_url": nats_url, "mode": "durable"})
    chunks = durable.build_load(60, True, settings.prefix)  # requests of 1-8 chunks, published back to back
    async with connection(nats_url) as nc:
        await durable.prepare(nc, settings, durable.FLOOR_FB if fast_batch else durable.FLOOR)
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        host, port = nats_url.rsplit("//", 1)[1].rsplit(":", 1)
        transport, relay = await loop.create_connection(
            lambda: floor.DurableFloor(CHUNKS_STREAM, "jsrelay", settings.prefix, 16, 0.002, ready, fast_batch),
            host, int(port))
        # a request's result (or batch) published while its previous one awaited its PubAck
        overlapping: list[bytes] = []
        batched: list[int] = []
        publish, publish_batch = relay.publish, relay.publish_batch

        def busy(rid: bytes) -> bool:
            return any(r == rid for r, _ in (*relay.in_flight.values(), *relay.batches.values()))

        def one_in_flight(rid: bytes, *rest) -> None:
            overlapping.extend([rid] * busy(rid))
            publish(rid, *rest)

        def one_batch_in_flight(rid: bytes, items) -> None:
            overlapping.extend([rid] * busy(rid))
            batched.append(len(items))
            publish_batch(rid, items)

        relay.publish, relay.publish_batch = one_in_flight, one_batch_in_flight
        try:
            await asyncio.wait_for(ready, 10)
            for subject, body, headers in chunks:
                await nc.publish(subject, body, headers=headers)
            await nc.flush()
            js = nc.jetstream()

            async def settled() -> bool:
                info = await js.consumer_info(CHUNKS_STREAM, "jsrelay")
                return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq == len(chunks)

            await wait_until(settled, 10, "every chunk acknowledged")
            stored = await js.stream_info(RESULTS_STREAM)
            assert stored.state.messages == len(chunks)
            seqs: dict[str, list[int]] = collections.defaultdict(list)
            for n in range(stored.state.first_seq, stored.state.last_seq + 1):
                msg = await js.get_msg(RESULTS_STREAM, n)
                seqs[msg.subject.rsplit(".", 1)[1]].append(int(msg.headers["Streamproc-Seq"]))
            expected = collections.Counter(s.rsplit(".", 2)[-2] for s, _, _ in chunks)
            assert {rid: list(range(n)) for rid, n in expected.items()} == dict(seqs)
            assert relay.errors == 0
            assert overlapping == []
            assert bool(batched) == fast_batch  # the load's requests have up to 8 chunks published back to back
        finally:
            transport.close()
