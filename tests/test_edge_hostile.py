"""Attacks on a real `streamproc edge` subprocess and nats-server: what one client or one results
publisher can make the edge do per request must not flood its log, and the others are answered."""

from __future__ import annotations

import httpx
import pytest
from edge_harness import publish_results, running_edge
from helpers import connection, peak_rss, rid, wait_until
from nats.js.api import StreamConfig

from streamproc.core.defaults import DUPLICATE_WINDOW, RESULTS_MAX_AGE
from streamproc.nats.streams import RESULTS_STREAM
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

SUBJECTS = Subjects()
MiB = 1 << 20
FLOOD = 300
BURST = 20  # LogLimiter's default: lines per event name per 10 s interval


async def test_per_request_edge_warnings_are_rate_limited_and_other_streams_are_answered(server):
    """300 malformed results on one client's stream and 300 requests whose subscription NATS refuses
    (the results stream allows one consumer, which a legitimate stream holds) wrote 600 WARNING
    lines, one each. Now each event writes its burst and one count of the rest per interval; every
    refused client gets a clear error event and the legitimate stream gets its results in full."""
    async with connection(server.url) as nc:
        await nc.jetstream().add_stream(StreamConfig(
            name=RESULTS_STREAM, subjects=[SUBJECTS.all_results], max_age=RESULTS_MAX_AGE,
            duplicate_window=DUPLICATE_WINDOW, allow_direct=True, max_consumers=1))
        with running_edge(server.url, "--recent", "0") as edge:
            legit = rid("legit")
            bodies = [b'{"text":"%d"}' % k for k in range(3)]
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, \
                    client.stream("GET", f"/v1/results/{legit}") as response:
                assert response.status_code == 200
                await wait_until(lambda: edge.metrics()["streamproc_edge_jetstream_replays_total"] == 1, 10,
                                 "the legitimate stream attached")
                for k in range(FLOOD):  # no Streamproc-Seq: breaks the wire contract
                    await nc.publish(SUBJECTS.result(legit), b'{"junk":%d}' % k)
                await publish_results(nc, SUBJECTS, legit, bodies)

                refused = []
                for _ in range(FLOOD):
                    answer = await client.get(f"/v1/results/{rid('victim')}")
                    refused.append((answer.status_code, answer.text))
                body = b"".join([chunk async for chunk in response.aiter_bytes()])
            ids = [line for line in body.decode().splitlines() if line.startswith("id: ")]
            assert ids == ["id: 0", "id: 1", "id: 2"] and body.endswith(b"data: [DONE]\n\n"), body[-500:]
            # A JetStream stream answers before its consumer exists: the refusal is the stream's one
            # error event, naming the cause, then [DONE].
            assert {status for status, _ in refused} == {200}
            assert all(body.startswith('data: {"error":{"message":"the edge lost its subscription to request victim-')
                       and "cannot subscribe to results: " in body and "maximum consumers limit reached" in body
                       and body.endswith("data: [DONE]\n\n") for _, body in refused), refused[0]
            assert edge.metrics()["streamproc_edge_malformed_results_total"] == FLOOD

            def suppressed(event: str) -> bool:
                return f"event=log_suppressed suppressed_event={event} count={FLOOD - BURST}" in edge.log()

            # The rest is counted and reported when the interval is over, even though the flood stopped.
            await wait_until(lambda: suppressed("malformed_result") and suppressed("subscribe_failed"), 20,
                             "the suppressed counts reported")
            log = edge.log()
            assert log.count(" event=malformed_result") == BURST, log.count(" event=malformed_result")
            assert log.count(" event=subscribe_failed") == BURST, log.count(" event=subscribe_failed")
            assert edge.proc.poll() is None
            assert peak_rss(edge.proc.pid) < 150 * MiB
