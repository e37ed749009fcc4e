"""ChunkPublisher's durable mode against a real JetStream: a refused chunk is an exception, never a loss."""

from __future__ import annotations

import re

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from streamproc.client.publisher import ChunkPublisher
from streamproc.core.errors import ChunkIdTaken, PublishRefused
from streamproc.core.wire import MAX_SEQ, Subjects, chunk_headers

from helpers import wait_until

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


async def test_a_chunk_whose_msg_id_another_publisher_stored_first_raises_instead_of_vanishing(client):
    """Any publisher with rights on P.chunks.> could store a chunk under a genuine worker's
    Nats-Msg-Id first: the worker's own chunk then came back as a PubAck ``duplicate`` and was
    dropped without a word. The stored copy is compared; another body raises ChunkIdTaken."""
    await small_chunk_stream(client, 1 << 20)
    js = client.jetstream()
    subjects = Subjects()
    publisher = ChunkPublisher(client, subjects, durable=True)
    forged = chunk_headers("victim", "agg", 0)
    await js.publish(subjects.chunk("victim", "agg"), b'{"text":"FORGED"}', headers=forged)
    with pytest.raises(ChunkIdTaken, match="already stored a different chunk under Nats-Msg-Id 'victim.agg.0.0'"):
        await publisher.publish("victim", "agg", 0, b'{"text":"genuine"}')
    # Consumed (deleted) before the genuine chunk came: it cannot be compared, and this publisher never sent it.
    await js.publish(subjects.chunk("victim2", "agg"), b'{"text":"FORGED"}', headers=chunk_headers("victim2", "agg", 0))
    await js.delete_msg("SMALL", (await js.stream_info("SMALL")).state.last_seq)
    with pytest.raises(ChunkIdTaken, match="no longer readable to compare"):
        await publisher.publish("victim2", "agg", 0, b'{"text":"genuine"}')
    # The worker's own retries stay quiet: the stored copy is its chunk, or one it sent before.
    await publisher.publish("own", "agg", 0, b"x")
    await publisher.publish("own", "agg", 0, b"x")
    await js.delete_msg("SMALL", (await js.stream_info("SMALL")).state.last_seq)
    await publisher.publish("own", "agg", 0, b"x")


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("seq", [MAX_SEQ + 1, 10**18, 1.5, True, False, -1, "3", None])
async def test_a_seq_the_processor_would_refuse_is_a_value_error_and_nothing_is_published(client, durable, seq):
    """seq 10**18, 1.5 and True were published (headers the processor reads as a contract error, or as seq 1)."""
    await small_chunk_stream(client, 1 << 20)
    publisher = ChunkPublisher(client, Subjects(), durable=durable)
    with pytest.raises(ValueError, match=r"seq must be an int from 0 to 999999999999999999, got"):
        await publisher.publish("r4", "agg", seq, b"x")
    with pytest.raises(ValueError, match="attempt must be an int"):
        await publisher.publish("r4", "agg", 0, b"x", attempt=seq)
    await publisher.publish("r4", "agg", MAX_SEQ, b"x", final=True)  # the largest seq the processor reads

    async def stored() -> int:
        return (await client.jetstream().stream_info("SMALL")).state.messages

    await wait_until(stored, 10, "the valid chunk stored")  # a core publish is stored after the PubAck-less send
    assert await stored() == 1  # and nothing before it (one connection keeps the order)
