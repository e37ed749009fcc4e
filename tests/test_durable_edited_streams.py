"""Durable mode against streams edited under the running processor (real nats-server, real
`streamproc run`): start-up checks the streams and buckets, nothing checks them afterwards, so a
co-tenant's or an operator's edit must cost a clear error, never a stalled partition."""

from __future__ import annotations

import time

import anyio
import pytest

from durable_helpers import connect, durable_flags
from helpers import wait_until
from streamproc.core.wire import chunk_headers
from streamproc.nats.streams import RESULTS_STREAM

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

MAX_MSG_SIZE = 2048


def _body(text: str) -> bytes:
    return b'{"text":"%s","output_ids":[1,2,3],"meta_info":{"id":"x"}}' % text.encode()


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
                ack = await nc.request(f"streamproc.chunks.{rid}.agg", _body("y" * 3 * MAX_MSG_SIZE),
                                       headers=chunk_headers(rid, "agg", 0, final=True), timeout=5)
                assert b'"error"' not in ack.data, ack.data
            await anyio.sleep(0.5)
            ack = await nc.request("streamproc.chunks.bystander.agg", _body("small"),
                                   headers=chunk_headers("bystander", "agg", 0, final=True), timeout=5)
            assert b'"error"' not in ack.data, ack.data

            async def stored(rid: str) -> bool:
                try:
                    await js.get_last_msg(RESULTS_STREAM, f"streamproc.results.{rid}")
                    return True
                except Exception:  # noqa: BLE001  (not found)
                    return False

            t0 = time.monotonic()
            await wait_until(lambda: stored("bystander"), 20,
                             "the bystander's result stored, behind chunks whose results the stream refuses")
            for rid in big:
                await wait_until(lambda: stored(rid), 20, f"{rid}'s error result stored")
                msg = await js.get_last_msg(RESULTS_STREAM, f"streamproc.results.{rid}")
                assert msg.headers and "Streamproc-Error" in msg.headers, msg.headers
            assert time.monotonic() - t0 < 20
            assert "max_msg_size" in log_path.read_text()  # result_given_up says why
        finally:
            await nc.close()
