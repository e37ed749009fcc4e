"""The edge behind a real processor: simulated workers -> processor -> results stream -> edge -> HTTP.

Results are checked against the simulation's ground truth with the same verifier the demo uses
(:func:`streamproc.traffic.verify`), after travelling through the edge: aggregated bodies must
arrive byte for byte, P/D results must carry the truth's expert rows and never stale ones.
"""

from __future__ import annotations

import json

import anyio
import httpx
import nats
import pytest
from edge_harness import expected_sse, running_edge
from httpx_sse import aconnect_sse

from streamproc.sim import traffic
from streamproc.catalog import Catalog, worker_for
from streamproc.wire import ResultInfo, Subjects, Verdict

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def read_results(client: httpx.AsyncClient, request_id: str) -> list[ResultInfo]:
    """One request's results as an SSE client reconstructs them (verdicts from the meta events)."""
    async with aconnect_sse(client, "GET", f"/v1/results/{request_id}?verdicts=1") as source:
        events = [event async for event in source.aiter_sse()]
    assert events[-1].data == "[DONE]"
    metas = [json.loads(e.data) for e in events if e.event == "meta"]
    data = [e for e in events if e.event == "message"][:-1]
    assert [m["seq"] for m in metas] == [int(e.id) for e in data]
    return [
        ResultInfo(
            request_id,
            int(e.id),
            i == len(data) - 1,
            Verdict(m["verdict"]) if m["verdict"] else None,
            m["error"],
            e.data.encode(),
        )
        for i, (e, m) in enumerate(zip(data, metas))
    ]


@pytest.mark.parametrize("format", ["sglang", "sglang-zstd"])
async def test_processor_results_reach_sse_clients_joined_and_byte_for_byte(
    nats_server, start_processor, format
):
    worker = worker_for(format)
    plans = traffic.plan(format, requests=16, mode="mixed", seed=5, id_prefix=f"edge-{format}")
    assert plans[0].kind == "agg" and plans[0].stream
    with running_edge(nats_server.url, "--format", format, "--ensure-results-stream") as edge:
        async with start_processor("in-process", format=format):
            async with await nats.connect(nats_server.url) as nc:
                async with httpx.AsyncClient(base_url=edge.url, timeout=20) as client:
                    live_id = plans[0].request_id
                    async with client.stream("GET", f"/v1/results/{live_id}") as live:  # attached before
                        await traffic.publish(nc, Subjects(), traffic.schedule(plans, seed=5))
                        live_raw = await live.aread()
                    with anyio.fail_after(20):
                        for plan in plans:  # attached after: replayed from the results stream
                            results = await read_results(client, plan.request_id)
                            assert traffic.verify(plan, results, worker) == [], plan.request_id
                            if plan.kind == "pd":
                                assert results[-1].verdict is Verdict.JOINED
                                assert Verdict.OMITTED not in {r.verdict for r in results}
                    streamed = next(p for p in plans if p.kind == "agg" and p.stream and len(p.agg) > 1)
                    unary = await client.get(
                        f"/v1/results/{streamed.request_id}", headers={"Accept": "application/json"}
                    )

    assert live_raw == expected_sse(plans[0].agg)
    assert unary.status_code == 200
    assert unary.content == Catalog()(format).fold(streamed.agg)
