"""Hostile workers aiming at attempts, against a `streamproc run` subprocess and a real nats-server:
a lost worker flooding its sealed attempt, and one naming attempts never granted (huge, or one past
the current). Coverage of paths that held (2026-12-07 attack session): the core's rules are pinned
sans-I/O in test_migration_correlator.py; this pins them end to end with the process's memory."""

from __future__ import annotations

import anyio
import pytest

from streamproc.client.migration import Migrator
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.sim.migration import native_request
from streamproc.simulation import make_truth

from helpers import peak_rss
from migration_helpers import SimulatedPool, assert_uninterrupted

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

MiB = 1 << 20
FLOOD = 2000
LARGE = b'{"text":"' + b"z" * (16 * 1024 - 12) + b'"}'


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_a_sealed_attempts_flood_and_never_granted_attempts_end_only_their_own_requests(
        mode, client, start_processor):
    """Request ``moved`` is migrated after 3 tokens; its lost worker then publishes 2,000 more
    16 KiB chunks of sealed attempt 0 (31 MiB), each a new seq, while attempt 1 serves it to the end:
    its client sees one uninterrupted stream. Request ``victim``'s worker names attempt
    999999999999999999, and request ``ahead``'s attempt 1 with no migrate: each ends with an
    ``invalid_chunk`` error result saying the attempt was never granted. An honest request is
    answered in full, and the processor's peak RSS grows by less than the flood (dropped chunks
    are not kept)."""
    fmt = "sglang"
    async with start_processor("subprocess", format=fmt, mode=mode) as rp:
        assert rp.process is not None
        publisher = ChunkPublisher(client, rp.subjects)
        migrator = Migrator(client, rp.subjects, format=fmt)
        moved, honest = (make_truth(k, request_id=f"flood-{mode}-{name}", prompt_len=6, output_len=12,
                                    chunk_sizes=[1] * 12) for k, name in ((1, "moved"), (2, "honest")))
        old = SimulatedPool(publisher, fmt, moved, pd=False)
        new = SimulatedPool(publisher, fmt, moved, pd=False)
        baseline = peak_rss(rp.process.pid)
        async with follow(client, rp.subjects, moved.request_id, timeout=60) as moved_stream, \
                follow(client, rp.subjects, honest.request_id, timeout=60) as honest_stream, \
                follow(client, rp.subjects, f"flood-{mode}-victim", timeout=30) as victim_stream, \
                follow(client, rp.subjects, f"flood-{mode}-ahead", timeout=30) as ahead_stream:
            [(role, bodies)] = old.legs(0)
            await old.publish(role, bodies, 0, stop=3)
            await client.flush()

            async def lost_worker() -> None:
                for seq in range(3, 3 + FLOOD):
                    await publisher.publish(moved.request_id, "agg", seq, LARGE, attempt=0)
                    if seq % 64 == 0:
                        await client.flush()

            async with anyio.create_task_group() as tg:
                await migrator.migrate(moved.request_id, native_request(fmt, moved), send=new.serve,
                                       expected_attempt=0)
                tg.start_soon(lost_worker)
                for request_id, attempt in ((f"flood-{mode}-victim", 999_999_999_999_999_999),
                                            (f"flood-{mode}-ahead", 1)):
                    await publisher.publish(request_id, "agg", 0, b'{"text":"a","output_ids":[1],"meta_info":{}}')
                    await publisher.publish(request_id, "agg", 1, b'{"text":"b","output_ids":[2],"meta_info":{}}',
                                            attempt=attempt)
            # After the flood, on the same connection: the processor receives it in order, so the
            # honest request's answer comes after every flooded chunk reached the processor.
            honest_pool = SimulatedPool(publisher, fmt, honest, pd=False)
            [(role, bodies)] = honest_pool.legs(0)
            await honest_pool.publish(role, bodies, 0)
            await client.flush()
            moved_results = await moved_stream.collect()
            honest_results = await honest_stream.collect()
            victims = [await victim_stream.collect(), await ahead_stream.collect()]
        growth = peak_rss(rp.process.pid) - baseline
    assert_uninterrupted(fmt, moved, moved_results)
    assert_uninterrupted(fmt, honest, honest_results)
    for results, attempt in zip(victims, (999_999_999_999_999_999, 1)):
        assert [r.seq for r in results] == [0, 1], results
        error = results[-1]
        assert error.final and error.error == "invalid_chunk", error
        assert f"attempt {attempt} was never granted".encode() in error.body, error.body
    assert growth < 16 * MiB, f"peak RSS grew by {growth / MiB:.0f} MiB for a {FLOOD * len(LARGE) / MiB:.0f} MiB flood"
