"""Durable mode against streams edited under the running processor (real nats-server, real
`streamproc run`): start-up checks the streams and buckets, nothing checks them afterwards, so a
co-tenant's or an operator's edit must cost a clear error, never a stalled partition."""

from __future__ import annotations

import time

import anyio
import nats
import pytest

from durable_helpers import FORMAT, connect, durable_flags, durable_settings
from helpers import free_port, scrape, wait_until
from streamproc.catalog import worker_for
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import follow
from streamproc.core.partitions import partition_of
from streamproc.core.wire import chunk_headers
from streamproc.nats.processor import Processor
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from streamproc.nats.streams import CHUNKS_STREAM, RESULTS_STREAM, partition_consumer_name
from streamproc.sim import traffic
from streamproc.wire import Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

MAX_MSG_SIZE = 2048


def _body(text: str) -> bytes:
    return b'{"text":"%s","output_ids":[1,2,3],"meta_info":{"id":"x"}}' % text.encode()


async def _publish_final(nc: nats.aio.client.Client, rid: str, text: str) -> None:
    """An aggregated request's one (final) chunk, acknowledged by the chunk stream."""
    ack = await nc.request(f"streamproc.chunks.{rid}.agg", _body(text),
                           headers=chunk_headers(rid, "agg", 0, final=True), timeout=5)
    assert b'"error"' not in ack.data, ack.data


async def _stored(js: JetStreamContext, rid: str) -> bool:
    """Whether the results stream holds a result of ``rid``."""
    try:
        await js.get_last_msg(RESULTS_STREAM, f"streamproc.results.{rid}")
        return True
    except Exception:  # noqa: BLE001  (not found)
        return False


async def test_a_result_over_a_max_msg_size_shrunk_under_the_processor_ends_its_request_soon_and_stalls_nothing(
        nats_url, streamproc_run):
    """The results stream's ``max_msg_size`` was lowered after start-up (where a value below
    ``max_payload`` stops it): nats-server refuses every larger result ("message size exceeds maximum
    allowed", err_code 10054), the same refusal every time. The outbox re-sent it every 0.5 s up to
    ``--max-result-attempts`` (100) per delivery, its chunk held unacknowledged meanwhile, for
    ``--max-deliver`` deliveries: 50 s per delivery before the request got its error result, and
    ``--max-ack-pending`` such chunks stalled their partition. Now given up at once, as a header
    block over 64 KiB is: the request ends with a stored error result after ``--max-deliver`` quick
    deliveries, and a request behind it in the same partition is answered."""
    flags = durable_flags(partitions=1, max_deliver=3, max_ack_pending=4)
    with streamproc_run(*flags) as (_, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(RESULTS_STREAM)
            info.config.max_msg_size = MAX_MSG_SIZE
            await js.update_stream(info.config)
            big = [f"big{k}" for k in range(4)]  # max_ack_pending of them: the partition's every slot
            for rid in big:
                await _publish_final(nc, rid, "y" * 3 * MAX_MSG_SIZE)
            await anyio.sleep(0.5)
            await _publish_final(nc, "bystander", "small")
            t0 = time.monotonic()
            await wait_until(lambda: _stored(js, "bystander"), 20,
                             "the bystander's result stored, behind chunks whose results the stream refuses")
            for rid in big:
                await wait_until(lambda: _stored(js, rid), 20, f"{rid}'s error result stored")
                msg = await js.get_last_msg(RESULTS_STREAM, f"streamproc.results.{rid}")
                assert msg.headers and "Streamproc-Error" in msg.headers, msg.headers
            assert time.monotonic() - t0 < 20
            assert "max_msg_size" in log_path.read_text()  # result_given_up says why
        finally:
            await nc.close()


async def test_a_held_prefill_leg_survives_its_consumers_ack_wait_shortened_under_the_processor(client, nats_url):
    """A co-tenant (or an operator) shortened a partition consumer's ``ack_wait`` after the processor
    opened it (it sets its own at open, and again only when it repairs a lost consumer): the held
    prefill leg, kept alive by an in-progress ack every ``--ack-wait / 4``, was redelivered between
    them, and at ``--max-deliver`` deliveries ended its healthy request as poison."""
    settings = durable_settings(nats_url, ack_wait=2.0, max_deliver=6)
    js = client.jetstream()
    worker = worker_for(FORMAT)
    truth = traffic.make_truth(5, request_id="pd-held", prompt_len=9, output_len=4)
    consumer = partition_consumer_name(partition_of("pd-held", settings.partitions))
    async with Processor(settings):
        publisher = ChunkPublisher(client, settings.subjects)
        await publisher.publish_leg("pd-held", "prefill", worker.prefill(truth, stream=False))
        await wait_until(lambda: _pending(js, consumer), 5, "the prefill leg delivered")
        info = await js.consumer_info(CHUNKS_STREAM, consumer)
        info.config.ack_wait = 0.3
        await js.add_consumer(CHUNKS_STREAM, info.config)  # an update: same durable name
        await anyio.sleep(4)  # 13 of its ack waits, two of the processor's
        async with follow(client, settings.subjects, "pd-held", timeout=10) as results:
            await publisher.publish_leg("pd-held", "decode", worker.decode(truth, stream=False))
            (final,) = await results.collect()
        assert final.verdict is Verdict.JOINED, final
        info = await js.consumer_info(CHUNKS_STREAM, consumer)
        assert abs(info.config.ack_wait - settings.ack_wait) < 0.01, "the consumer's ack_wait never restored"


async def _pending(js, consumer: str) -> bool:
    return (await js.consumer_info(CHUNKS_STREAM, consumer)).num_ack_pending == 1


async def test_a_chunk_stream_edited_to_drop_unprocessed_chunks_under_the_processor_is_reported_at_once(
        nats_url, streamproc_run):
    """Start-up refuses a chunk stream with discard ``old`` (at a limit it drops unprocessed chunks,
    the workers' PubAcks notwithstanding); edited so under the running processor it went unseen:
    chunks lost without a word in the log or a metric. Now the streams and the migrations bucket
    are checked again every ``--lease-ttl``: an error naming what changed, and a counter."""
    port = free_port()
    with streamproc_run(*durable_flags(partitions=1), "--http-port", str(port), "--http-host", "127.0.0.1") as (
            _, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            info = await js.stream_info(CHUNKS_STREAM)
            info.config.discard = DiscardPolicy.OLD
            info.config.max_msgs = 1000
            await js.update_stream(info.config)
            await wait_until(lambda: "event=stream_config_changed" in log_path.read_text(), 10,
                             "the edited chunk stream reported")
            line = next(x for x in log_path.read_text().splitlines() if "event=stream_config_changed" in x)
            assert CHUNKS_STREAM in line and "discard is 'old'" in line, line
            assert scrape(port)["streamproc_durable_stream_config_changes_total"] == 1
            await _publish_final(nc, "after", "after")
            await wait_until(lambda: _stored(js, "after"), 10, "a request answered after the edit")  # the processor serves on
            await anyio.sleep(3)  # two more checks: reported once, not at every check
            assert log_path.read_text().count("event=stream_config_changed") == 1
        finally:
            await nc.close()


async def test_a_processor_serves_on_after_its_lease_bucket_is_deleted_under_it(nats_url, streamproc_run):
    """The lease bucket deleted while a processor runs: its lease lapsed and it could never take the
    partition again (every KV write failed as unreachable), so nothing more was answered."""
    with streamproc_run(*durable_flags(partitions=1)) as (_, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            await js.delete_key_value(f"{CHUNKS_STREAM}_LEASES")
            await anyio.sleep(2)  # past the lease's validity (lease_ttl 1.5 s)
            await _publish_final(nc, "later", "later")
            await wait_until(lambda: _stored(js, "later"), 15, "a request answered after the lease bucket's deletion")
            assert "event=lease_bucket_gone" in log_path.read_text()
        finally:
            await nc.close()
