"""Upstream-shaped worker traffic through a real nats-server and processor (in-process and CLI).

The simulated workers render what upstream SGLang and vLLM emit (``shape=``): SGLang's default
cumulative streaming with uint16 rows and empty logprob windows, which needs the processor's
``--format-option streaming=cumulative``; vLLM streams without ``model``/``prompt_logprobs`` and
prompt logprobs requested independently of sampled ones.
"""

from __future__ import annotations

import pytest

from streamproc.sim import traffic
from streamproc.client.results import ResultCollector
from streamproc_sglang import SGLangWorker
from streamproc_sglang import upstream as sgl
from streamproc_vllm import VLLMWorker
from streamproc_vllm import upstream as vll

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

CASES = {
    "sglang": (SGLangWorker(shape=sgl.Shape(streaming="cumulative", dtype="uint16", advertise_dtype=True)),
               {"format_option": "streaming=cumulative"}),
    "vllm": (VLLMWorker(shape=vll.Shape(prompt_logprobs=False, include_usage=False)), {}),
}


@pytest.mark.parametrize("kind", ["in-process", "subprocess"])
@pytest.mark.parametrize("fmt", sorted(CASES))
async def test_upstream_shaped_traffic_is_joined_exactly_over_the_wire(fmt, kind, client, start_processor):
    worker, overrides = CASES[fmt]
    plans = traffic.plan(fmt, requests=40, mode="mixed", seed=11, id_prefix=f"up-{fmt}", worker=worker)
    messages = traffic.schedule(plans, seed=11, shuffle=True, duplicates=0.1)
    async with start_processor(kind, format=fmt, **overrides) as rp:
        async with ResultCollector(client, rp.subjects) as collector:
            await traffic.publish(client, rp.subjects, messages, format=fmt)
            results = await collector.wait_for([p.request_id for p in plans], timeout=30)
    problems = {p.request_id: traffic.verify(p, results[p.request_id], worker) for p in plans}
    assert {rid: found for rid, found in problems.items() if found} == {}
    assert any(r.verdict.value == "joined" for rs in results.values() for r in rs)
