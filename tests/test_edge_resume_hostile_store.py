"""A hostile writer with publish rights on a request's results subject stores its results out of seq
order (seq 5 ahead of 1-4, as no processor does): a client resuming with ``Last-Event-ID`` (replay.py,
``Replay._seek``, which relies on a request's results being stored in seq order) against a real
`streamproc edge` subprocess and nats-server. What a read from the start gets is the reference."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from edge_harness import expected_sse, publish_results, running_edge
from helpers import connection, rid, wait_until

from streamproc.wire import FINAL, JOIN, SEQ, Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]

STORED = [0, 5, 1, 2, 3, 4, 6, 7]  # stream order; 7 is final


def body(seq: int) -> bytes:
    return b'{"text":"%d"}' % seq


async def test_a_resume_over_results_stored_out_of_seq_order_gets_the_rest_or_a_gap_error(nats_server):
    """Result 5 stored before 1-4. The search finds the Last-Event-ID's result by halving and reads on
    from there, so for a Last-Event-ID of 1 to 4 it can land past the early 5 and never read it: the
    stream must then end with the gap error naming seq 5 (``--gap-timeout``), never ``[DONE]`` with 5
    missing, nor a body stored for another seq. Every other Last-Event-ID gets exactly the rest, an open
    (which reads from the start, reordering) gets all 8, and another request's client opened meanwhile
    gets all of its own. Coverage of a path that held; it documents what the search costs a hostile
    store (docs/edge.md): a gap error for the resumes that request's writer broke, nothing served wrong."""
    subjects = Subjects("resumeorder")
    request_id, other_id = rid("victim"), rid("other")
    gap = f"result seq 5 of request {request_id} never arrived".encode()
    with running_edge(nats_server.url, "--prefix", subjects.prefix, "--ensure-results-stream",
                      "--gap-timeout", "1") as edge:
        async with connection(nats_server.url) as nc:
            js = nc.jetstream()
            for seq in STORED:
                headers = {SEQ: str(seq), JOIN: "passthrough"}
                if seq == 7:
                    headers[FINAL] = "true"
                await js.publish(subjects.result(request_id), body(seq), headers=headers)
            await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= len(STORED), 15,
                             "stored")
            others = [b'{"other":%d}' % k for k in range(4)]
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client, \
                    client.stream("GET", f"/v1/results/{other_id}") as other:
                assert other.status_code == 200
                assert (await client.get(f"/v1/results/{request_id}")).content == expected_sse(
                    [body(k) for k in range(8)])

                async def resume(after: int) -> bytes:
                    response = await client.get(f"/v1/results/{request_id}",
                                                headers={"Last-Event-ID": str(after)})
                    assert response.status_code == 200, response.text
                    return response.content

                got = await asyncio.gather(*(resume(after) for after in range(9)))
                await publish_results(nc, subjects, other_id, others)
                assert await other.aread() == expected_sse(others)
    gaps = []
    for after, content in enumerate(got):
        rest = expected_sse([body(k) for k in range(after + 1, 8)], start=after + 1)
        if content == rest:
            continue
        # The rest up to the gap, then the gap error: no [DONE] with 5 missing, no other seq's body.
        assert after < 5, (after, content)
        served = expected_sse([body(k) for k in range(after + 1, 5)], start=after + 1)
        served = served.removesuffix(b"data: [DONE]\n\n")
        assert content.startswith(served) and gap in content[len(served):], (after, content)
        assert content.endswith(b"data: [DONE]\n\n"), (after, content)
        assert content.count(b"data: ") == 5 - after + 1, (after, content)  # the rest to 4, the error, [DONE]
        gaps.append(after)
    print(f"Last-Event-IDs that met the gap error: {gaps}")
