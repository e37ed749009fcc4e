"""Durable mode against a results stream edited under the running processor to refuse results when
full (discard ``new`` with ``max_msgs_per_subject`` / ``max_msgs``; real nats-server, real
`streamproc run`). Start-up refuses such a stream and the config watch reports the edit
(``event=stream_config_changed``); these pin what becomes of the results it then refuses."""

from __future__ import annotations

import time

import anyio
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from durable_helpers import FORMAT, chunk_stream_messages, connect, durable_flags
from helpers import free_port, scrape, wait_until
from streamproc.catalog import worker_for
from streamproc.client.publisher import ChunkPublisher
from streamproc.nats.streams import CHUNKS_STREAM, RESULTS_STREAM, partition_consumer_name
from streamproc.sim import traffic
from streamproc.wire import Subjects, chunk_headers

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]


async def _results_of(js: JetStreamContext, rid: str) -> int:
    """How many results of ``rid`` the results stream holds."""
    info = await js.stream_info(RESULTS_STREAM, subjects_filter=f"streamproc.results.{rid}")
    return sum((info.state.subjects or {}).values())


async def _answered(js: JetStreamContext, rid: str) -> bool:
    return await _results_of(js, rid) > 0


async def _refuse_when_full(js: JetStreamContext, **limits: object) -> None:
    """Edit the results stream to discard ``new`` with ``limits``, as a co-tenant or an operator would."""
    info = await js.stream_info(RESULTS_STREAM)
    info.config.discard = DiscardPolicy.NEW
    for name, value in limits.items():
        setattr(info.config, name, value)
    await js.update_stream(info.config)


def _streamed(rid: str, chunks: int) -> list[bytes]:
    """An aggregated streamed answer of ``chunks`` chunks, one token each (one result each)."""
    truth = traffic.make_truth(1, request_id=rid, prompt_len=4, output_len=chunks, chunk_sizes=[1] * chunks)
    return worker_for(FORMAT).agg(truth, stream=True)


def _answer(rid: str) -> list[bytes]:
    return worker_for(FORMAT).agg(traffic.make_truth(2, request_id=rid, prompt_len=4, output_len=1), stream=False)


async def test_a_request_past_the_results_streams_per_subject_limit_is_given_up_at_once_and_its_partition_serves_on(
        nats_url, streamproc_run):
    """The results stream edited to ``max_msgs_per_subject`` 2 with discard new per subject: a
    request's third result is refused ("maximum messages per subject exceeded", err_code 10077), and
    so is every later one of that request (they share its subject). The outbox re-sent it every
    0.5 s for ``--max-result-attempts`` (100) per delivery, the request's later chunks held
    unacknowledged behind it: at ``--max-ack-pending`` 4 the partition stalled, a bystander
    unanswered after 60 s. Now given up at its first refusal, as a result over ``max_msg_size`` is,
    and the request ended (its chunks terminated: the next test); the bystander is answered within
    seconds, and so is a request after; the refusal is logged with its reason and counted, and
    nothing is re-sent after."""
    port = free_port()
    flags = durable_flags(partitions=1, max_deliver=3, max_ack_pending=4)
    with streamproc_run(*flags, "--http-port", str(port), "--http-host", "127.0.0.1") as (_, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            await _refuse_when_full(js, max_msgs_per_subject=2, discard_new_per_subject=True)
            publisher = ChunkPublisher(nc, durable=True)
            await publisher.publish_leg("long", "agg", _streamed("long", 12))  # 10 chunks past the limit
            await anyio.sleep(0.5)
            await publisher.publish_leg("bystander", "agg", _answer("bystander"))
            t0 = time.monotonic()
            await wait_until(lambda: _answered(js, "bystander"), 15,
                             "the bystander answered, behind a request whose results the stream refuses")
            assert time.monotonic() - t0 < 15
            await anyio.sleep(3)  # the refused request's chunks through their --max-deliver deliveries
            await publisher.publish_leg("after", "agg", _answer("after"))
            await wait_until(lambda: _answered(js, "after"), 5, "a request answered after the refused one's deliveries")
            assert await _results_of(js, "long") == 2  # what the limit let in; nothing more can be
            text = log_path.read_text()
            assert "event=result_given_up" in text and "max_msgs_per_subject" in text, text[-3000:]
            metrics = scrape(port)
            assert metrics["streamproc_durable_results_given_up_total"] >= 1
            sent = metrics["streamproc_durable_publish_errors_total"]
            await anyio.sleep(2)  # settled: nothing is re-sent any more
            assert scrape(port)["streamproc_durable_publish_errors_total"] == sent
        finally:
            await nc.close()


@pytest.mark.parametrize("limit", [2, 1], ids=["refused-inside-a-batch", "refused-as-a-batchs-start"])
async def test_a_request_past_its_subjects_limit_ends_at_once_not_redelivered_held_retried_or_pausing_batches(
        nats_url, streamproc_run, limit):
    """One request floods 40 chunks (one result each) past ``max_msgs_per_subject`` ``limit`` (discard new
    per subject), four bystanders of ``limit`` results each follow in the same partition. Its give-up used
    to NAK
    its chunks and forget it: each came back up to ``--max-deliver``, was recovered, refused again and
    poisoned (its error result refused too), and its later chunks were held behind the gap (measured:
    64 redeliveries, 96 NAKs, 6 shed requests, the bystanders answered after ~3 s, and 6 of its chunks
    unacknowledged and 38 left in the chunk stream a minute later). Now the request ends at the
    refusal: its chunks are terminated or, arriving later, acknowledged and dropped as ``unstorable``;
    nothing is redelivered or held, the bystanders are answered within 3 s.

    The flood's results leave as fast batches (the results stream streamproc creates allows them;
    ``result_batches`` > 0): its first result goes alone, the ones queued behind it in a batch, and
    the subject fills inside that batch. nats-server names why only in the refused
    message's own reply (``"type":"err"``, or a plain error when it is the batch's first message and
    the commit is then answered 10208), not in the batch's PubAck. Read as a plain refusal, the result
    was sent again alone after 0.5 s with its chunks held (``publish_retries``, ``result_not_stored``);
    refused as the batch's start (``limit`` 1) it read as a batch refused whole and paused batches for
    every request (``batch_pauses``). Now the batch's reply ends the request: nothing retried or
    paused, the bystanders answered within 3 s, no chunk redelivered or held."""
    port = free_port()
    flags = durable_flags(partitions=1, max_deliver=3, max_ack_pending=8)
    with streamproc_run(*flags, "--http-port", str(port), "--http-host", "127.0.0.1") as (_, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            assert (await js.stream_info(RESULTS_STREAM)).config.allow_batched is True
            await _refuse_when_full(js, max_msgs_per_subject=limit, discard_new_per_subject=True)
            publisher = ChunkPublisher(nc, durable=True)
            # The flood as a burst (core publishes, in order, one flush): its chunks wait for the partition
            # together, so its results queue behind the first one's PubAck and leave in a batch. Published
            # one PubAck at a time, under load each result could go out alone before the next chunk came:
            # no batch, the case not exercised (result_batches 0 in 2 of 3 runs beside two CPU burners).
            subjects = Subjects()
            flood = _streamed("flood", 40)
            for seq, body in enumerate(flood):
                await nc.publish(subjects.chunk("flood", "agg"), body,
                                 headers=chunk_headers("flood", "agg", seq, final=seq == len(flood) - 1))
            await nc.flush()
            bystanders = [f"bystander{n}" for n in range(4)]
            for rid in bystanders:  # at most two results each: never a batch
                await publisher.publish_leg(rid, "agg", _streamed(rid, limit))
            t0 = time.monotonic()

            async def all_answered() -> bool:
                return all([await _results_of(js, rid) == limit for rid in bystanders])

            await wait_until(all_answered, 3, "the bystanders answered, behind a request whose subject filled in a batch")
            assert time.monotonic() - t0 < 3

            async def settled() -> bool:
                info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
                return info.num_ack_pending == 0 and await chunk_stream_messages(js) == 0

            await wait_until(settled, 5, "every chunk acknowledged or terminated, none held")
            await anyio.sleep(2 * 2.0)  # two ack waits: anything NAKed or left unacknowledged would be redelivered
            info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
            assert (info.num_redelivered, info.num_ack_pending, info.delivered.consumer_seq) == (
                0, 0, 40 + 4 * limit), info
            assert await _results_of(js, "flood") == limit
            metrics = scrape(port)
            assert metrics["streamproc_durable_result_batches_total"] > 0  # the flood's results left in batches
            assert metrics["streamproc_durable_batch_pauses_total"] == 0  # not read as batches refused whole
            assert metrics["streamproc_durable_publish_retries_total"] == 0  # the refused result not sent again
            assert metrics["streamproc_durable_results_given_up_total"] == 1
            assert metrics["streamproc_durable_redelivered_total"] == 0
            assert metrics["streamproc_durable_naks_total"] == 0
            assert metrics["streamproc_durable_poisoned_total"] == 0
            assert metrics["streamproc_shed_total"] == 0
            dropped = metrics["streamproc_unstorable_total"]
            assert dropped > 0 and dropped + metrics["streamproc_durable_terminated_total"] == 40 - limit
            text = log_path.read_text()
            assert "event=unstorable_chunk request_id=flood" in text, text[-3000:]
            assert "event=result_batch_refused" not in text and "event=result_not_stored" not in text, text[-3000:]
            assert "event=chunk_poisoned" not in text
            sent = metrics["streamproc_durable_publish_errors_total"]
            await anyio.sleep(2)  # settled: nothing is re-sent any more
            after = scrape(port)
            assert (after["streamproc_durable_publish_errors_total"], after["streamproc_durable_result_batches_total"],
                    after["streamproc_durable_publish_retries_total"]) == (
                sent, metrics["streamproc_durable_result_batches_total"], 0)
        finally:
            await nc.close()


async def test_results_refused_by_a_full_results_stream_are_retried_at_a_bounded_rate_and_stored_once_it_has_room(
        nats_url, streamproc_run):
    """The results stream edited to discard new with ``max_msgs`` reached: every request's results are
    refused alike ("maximum messages exceeded", err_code 10077, the code of the per-subject limit
    above), and room comes back as results age out (``--results-max-age``) or the limit is raised, so
    a refused result is kept and sent again every 0.5 s (its chunk held, with in-progress acks) for
    ``--max-result-attempts`` per delivery: logged with the server's words, not given up, not spinning,
    and stored as soon as the stream has room."""
    port = free_port()
    with streamproc_run(*durable_flags(partitions=1), "--http-port", str(port), "--http-host", "127.0.0.1") as (
            _, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            publisher = ChunkPublisher(nc, durable=True)
            await publisher.publish_leg("first", "agg", _answer("first"))
            await wait_until(lambda: _answered(js, "first"), 10, "a request answered before the edit")
            await _refuse_when_full(js, max_msgs=1)
            await publisher.publish_leg("waiting", "agg", _answer("waiting"))
            await anyio.sleep(3)
            metrics = scrape(port)
            assert not await _answered(js, "waiting")
            assert metrics["streamproc_durable_results_given_up_total"] == 0
            assert 2 <= metrics["streamproc_durable_publish_errors_total"] <= 9  # one send per 0.5 s, not a spin
            assert "maximum messages exceeded" in log_path.read_text()  # result_not_stored quotes the server
            await _refuse_when_full(js, max_msgs=-1)  # room again
            await wait_until(lambda: _answered(js, "waiting"), 5, "the held result stored once the stream has room")
        finally:
            await nc.close()
