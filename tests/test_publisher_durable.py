"""ChunkPublisher's durable mode against a real JetStream: a refused chunk is an exception, never a loss."""

from __future__ import annotations

import re

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from streamproc.client.publisher import ChunkPublisher
from streamproc.core.errors import PublishRefused
from streamproc.core.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


async def small_chunk_stream(nc, max_bytes: int) -> None:
    await nc.jetstream().add_stream(StreamConfig(name="SMALL", subjects=["streamproc.chunks.>"],
                                                 max_bytes=max_bytes, discard=DiscardPolicy.NEW))


async def test_a_full_chunk_stream_raises_publish_refused_in_the_worker_and_stored_chunks_are_all_there(client):
    await small_chunk_stream(client, 20_000)
    publisher = ChunkPublisher(client, Subjects(), durable=True)
    stored = 0
    with pytest.raises(PublishRefused) as info:
        for seq in range(100):
            await publisher.publish("r1", "agg", seq, bytes(1000))
            stored += 1
    assert not info.value.retryable
    assert "maximum bytes" in info.value.reason
    state = (await client.jetstream().stream_info("SMALL")).state
    assert 0 < stored < 100 and state.messages == stored  # every chunk reported stored is stored


async def test_a_retried_chunk_is_stored_once(client):
    await small_chunk_stream(client, 1 << 20)
    publisher = ChunkPublisher(client, Subjects(), durable=True)
    for _ in range(3):  # what a retry after a lost PubAck looks like: the same Nats-Msg-Id
        await publisher.publish("r2", "decode", 0, b"x", final=True)
    assert (await client.jetstream().stream_info("SMALL")).state.messages == 1


async def test_without_a_stream_a_durable_publish_fails_after_bounded_retries(client):
    publisher = ChunkPublisher(client, Subjects(), durable=True, timeout=0.5, retries=2, backoff=0.05)
    with pytest.raises(PublishRefused) as info:
        await publisher.publish("r3", "agg", 0, b"x", final=True)
    assert info.value.retryable and "after 3 attempts" in info.value.reason


async def test_simulate_against_a_full_chunk_stream_exits_with_the_refusal_not_silently(nats_url, run_cli):
    nc = await nats.connect(nats_url)
    try:
        await small_chunk_stream(nc, 4_000)
    finally:
        await nc.close()
    done = run_cli("simulate", "--nats-url", nats_url, "--requests", "50", "--mode", "agg")
    # A StreamprocError at the CLI: exit code 1 (EXIT_FAILURE) and one line naming the refusal, no traceback.
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert re.fullmatch(r"streamproc simulate: error: chunk on 'streamproc\.chunks\.sim-[0-9a-f]+-\d+\.agg' not stored: "
                        r"maximum bytes exceeded \(code 10077\)\n", done.stderr), done.stderr
