"""A hand-over's redeliveries come back in stream order, and a request with large chunks survives them.

Against a real nats-server and `streamproc run --mode durable`. When a partition is handed over
(here: the processor stopped with SIGSTOP past its lease, so on SIGCONT it finds the lease lapsed),
its unacknowledged chunks are NAKed and redelivered. nats-server puts a redelivered message that
does not fit a pull's remaining ``max_bytes`` at the *back* of the consumer's redelivery queue when
no other waiting pull takes it (server/consumer.go ``loopAndGatherMsgs``:
``o.decDeliveryCount(pmsg.seq); o.addToRedeliverQueue(pmsg.seq)``, and ``addToRedeliverQueue``
appends; docs/operations.md, "Redelivery order"), so with ~1 MB chunks nearly every pull left a gap
and the chunks behind it piled up in the request's reorder buffer: past ``--max-buffered-bytes``
the request ended with ``invalid_chunk`` ("more than N bytes of buffered chunks"). Here the budget
is 6 MiB; before the fix the request ended at seq ~36 in every run (8 of 8). Now, while
redeliveries are expected, pulls ask for no more messages than their ``max_bytes`` always holds
(core/credit.py ``uncut_batch``), end on their count and are never cut. That left 2 of 6 runs
failing on main: the hand-over's own NAKs reordered the chunks (core/handback.py): sent while the
closing subscription's pulls still waited on the server, the first redeliveries went to those pulls
and, NAKed again as they arrived, to the back of the queue; sent after its UNSUB, the first one met
only dead pulls and went to the back. Now a hand-over's NAKs wait until the subscription is drained
and the server has dropped its pulls, and go out in stream order. The second test makes the first
case certain: every chunk delivered (the pulls wait with credit left) when the processor stops.

``STREAMPROC_SOAK=1`` also runs the soak: ``STREAMPROC_SOAK_CHUNKS`` (320) chunks of ~1 MB with the
default ``--max-buffered-bytes`` (32 MiB), printing the processor's redelivery counters.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio
import pytest
from conftest import processor_subprocess
from durable_helpers import connect, durable_flags, publish_paced, stored_results
from helpers import free_port, rid, scrape, wait_until
from nats.js.errors import NotFoundError

from streamproc.core.wire import Subjects, chunk_headers
from streamproc.nats.streams import CHUNKS_STREAM, partition_consumer_name
from streamproc.wire import result_from_message

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(240)]

SUBJECTS = Subjects()
MiB = 1 << 20


SOAK = os.environ.get("STREAMPROC_SOAK") == "1"


async def hand_over_mid_request(nats_url: str, chunks: int, *flags: str, drained: bool = False) -> dict[str, float]:
    """Publish one request of ``chunks`` ~1 MB chunks (paced), stop the processor past its lease once
    15 results are stored (``drained``: once every chunk was delivered to it, while it still holds
    many, so its pulls wait on the server with credit left), let it go on; assert the request
    completes with every chunk in order and that the hand-over's path ran. Returns the processor's
    metrics."""
    port = free_port()
    # ack_wait well above the stop: the chunks come back by the hand-over's NAKs, not by expiry.
    flags = tuple(durable_flags(partitions=1, ack_wait=15.0, lease_ttl=1.5, max_deliver=20)) + flags + (
        "--http-port", str(port))
    with processor_subprocess(nats_url, *flags) as (proc, log_path):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            request = rid("handover")
            body = b"x" * (MiB - 4096)
            subject = SUBJECTS.result(request)

            async def stored() -> int:
                info = await js.stream_info("STREAMPROC_RESULTS", subjects_filter=subject)
                return (info.state.subjects or {}).get(subject, 0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish_paced, nc, [(SUBJECTS.chunk(request, "agg"), body,
                                                   chunk_headers(request, "agg", seq, final=seq == chunks - 1))
                                                  for seq in range(chunks)], 32, 60.0 + chunks / 2)
                # Stop the processor while chunks stream in: the pulls it has out are delivered meanwhile.
                async def some_stored() -> bool:
                    return await stored() >= 15

                async def all_delivered() -> bool:
                    info = await js.consumer_info(CHUNKS_STREAM, partition_consumer_name(0))
                    return info.delivered.stream_seq >= chunks and info.num_pending == 0

                if drained:
                    await wait_until(all_delivered, 60, "every chunk delivered", every=0.01)
                else:
                    await wait_until(some_stored, 60, "15 results stored", every=0.02)
                os.kill(proc.pid, signal.SIGSTOP)
                try:
                    await anyio.sleep(4.0)  # > lease_ttl (1.5 s) with a margin: the lease lapses
                finally:
                    os.kill(proc.pid, signal.SIGCONT)

            async def ended() -> bool:  # its last stored result is final: all of them, or an error
                try:
                    last = await js.get_last_msg("STREAMPROC_RESULTS", subject)
                except NotFoundError:
                    return False
                return result_from_message(SUBJECTS, last.subject, last.headers, last.data).final

            await wait_until(ended, 90 + chunks / 2, "the request's final result stored", every=0.25)
            metrics = scrape(port)
            results = (await stored_results(js, SUBJECTS, timeout=60.0)).get(request, [])
            errors = [r for r in results if r.error]
            assert not errors, (f"the request ended after a hand-over: {errors[0].body[:200]!r} "
                                f"(metrics: redelivered {metrics.get('streamproc_durable_redelivered_total')}, "
                                f"naks {metrics.get('streamproc_durable_naks_total')})")
            assert [r.seq for r in results] == list(range(chunks))
            assert results[-1].final and all(r.body == body for r in results)
            # The path under test ran: the lease lapsed, chunks were NAKed and redelivered.
            assert metrics["streamproc_durable_leases_lost_total"] >= 1
            assert metrics["streamproc_durable_redelivered_total"] > 0
            assert proc.poll() is None
            return metrics
        finally:
            await nc.close()


async def test_a_request_survives_the_out_of_order_redelivery_of_a_hand_over(nats_url):
    await hand_over_mid_request(nats_url, 120, "--max-buffered-bytes", str(6 * MiB))


async def test_the_hand_over_naks_of_a_partition_whose_pulls_still_wait_come_back_in_order(nats_url):
    """Every chunk delivered before the stop, so the processor's pulls wait on the server with credit
    left. Before the fix the fence NAKed at once, those pulls took the first redeliveries, the closing
    partition NAKed each again as it arrived, and they came back behind all the others: 4 of 4 runs
    ended ``invalid_chunk`` at the first NAKed seq (``naks`` 68 > ``redelivered`` 56)."""
    await hand_over_mid_request(nats_url, 60, "--max-buffered-bytes", str(6 * MiB), drained=True)


async def test_a_stopping_processor_naks_what_it_holds_in_stream_order_for_the_next_owner(nats_url):
    """A graceful stop hands its held chunks over; the next owner (here the test, pulling from the
    partition's consumer) gets them in stream order. Chunks 1..10 of a request whose seq 0 never
    came are held (unacknowledged) while the processor's pulls wait with credit left. Before the
    fix the stop drained the subscription (UNSUB) and then NAKed: the first redelivery met only the
    stopped subscription's pulls, which ``nextWaiting`` dropped, and went to the back of the
    redelivery queue (stream seqs 3..11, 2)."""
    with processor_subprocess(nats_url, *durable_flags(partitions=1, ack_wait=30.0, max_deliver=20)) as (proc, _):
        nc = await connect(nats_url)
        try:
            js = nc.jetstream()
            request = rid("held")
            for seq in range(1, 11):
                await js.publish(SUBJECTS.chunk(request, "agg"), b'{"text": "x"}',
                                 headers=chunk_headers(request, "agg", seq))
            consumer = partition_consumer_name(0)

            async def all_held() -> bool:
                info = await js.consumer_info(CHUNKS_STREAM, consumer)
                return info.num_pending == 0 and info.num_ack_pending == 10

            await wait_until(all_held, 20, "the 10 chunks delivered and held")
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(proc.wait, 20) == 0
            psub = await js.pull_subscribe_bind(consumer, CHUNKS_STREAM)
            got: list[tuple[int, int, str]] = []
            with anyio.fail_after(20):
                while len(got) < 10:
                    for m in await psub.fetch(10 - len(got), timeout=5):
                        got.append((m.metadata.num_delivered, m.metadata.sequence.stream,
                                    (m.headers or {}).get("Streamproc-Seq", "")))
            assert [seq for _, _, seq in got] == [str(s) for s in range(1, 11)], got
            assert all(delivered == 2 for delivered, _, _ in got), got  # redelivered by the stop's NAKs
        finally:
            await nc.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not SOAK, reason="a soak: STREAMPROC_SOAK=1")
async def test_a_long_request_of_large_chunks_survives_a_hand_over_with_the_default_buffer(nats_url):
    chunks = int(os.environ.get("STREAMPROC_SOAK_CHUNKS", "320"))
    metrics = await hand_over_mid_request(nats_url, chunks)
    shown = {name.removeprefix("streamproc_"): value for name, value in sorted(metrics.items())
             if any(k in name for k in ("redelivered", "naks", "poisoned", "terminated", "leases_lost", "pulls",
                                        "over_budget"))}
    print(f"soak chunks={chunks} {shown}", file=sys.stderr)
    assert metrics["streamproc_durable_poisoned_total"] == 0
