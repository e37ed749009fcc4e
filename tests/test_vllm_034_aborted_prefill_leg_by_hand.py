"""vLLM 0.34.0 P/D: a prefill leg aborted before its first token, bodies written by hand from upstream.

Nothing here uses the simulator, ``streamproc_vllm.upstream`` or ``VLLMWorker``: the bodies are spelled out
from ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` (``ServingTokens._build_full_response``:
``finish_reason=output.finish_reason if output.finish_reason else "stop"``, ``routed_experts`` ``None`` when
the output has none, ``prompt_logprobs=clamp_prompt_logprobs(final_res.prompt_logprobs)``,
``usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=final_res.num_cached_tokens)``,
``kv_transfer_params=final_res.kv_transfer_params``) and ``tests/vllm_034_bodies.py``'s builders.

A prefill leg (the client's request, ``max_tokens=1``, ``kv_transfer_params.do_remote_decode``) that a
``pause(mode="abort")`` or the server's ``/inference/v1/abort_requests`` ended before its first token answers
``OutputProcessor.abort_requests``' output: ``finish_reason: "abort"``, no token, no rows (``Scheduler.
update_from_output`` hands rows over only with an output), the unscored ``prompt_logprobs`` list
``LogprobsProcessor`` started with (``[null]`` plus a ``null`` per position before ``prompt_logprob_start``)
and ``num_cached_tokens`` 0 (prefill stats come only with the first output). No connector hands KV over for
it: ``request_finished`` returns ``(False, None)`` unless ``request.status ==
RequestStatus.FINISHED_LENGTH_CAPPED`` (vLLM ``MooncakeConnectorScheduler.request_finished``: ``if params is
None or not params.get("do_remote_decode") or request.status != RequestStatus.FINISHED_LENGTH_CAPPED: return
False, None``), so its ``kv_transfer_params`` are ``null`` and a decode leg that still answered scored the
prompt itself. Nothing the prefill leg says about the prompt is the aggregated answer: its count 0 and its
all-``null`` list were published as the answer's until 2026-12-07 (decode's 16 cached tokens and scored list
replaced, no marker).
"""

from __future__ import annotations

import json

import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from vllm_034_bodies import OPTIONS, OUT, PROMPT, RID, choice, npy_b64, rows, usage

from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

P = len(PROMPT)


def body(out: list[int], cached: int, experts: str | None, finish: str, prompt_logprobs: list | None) -> dict:
    """``GenerateTokensResponse.model_dump()`` (``_build_response_fields``), one choice."""
    return {"request_id": RID, "model": "m", "created": 1700000000, "usage": usage(len(out), cached),
            "prompt_logprobs": prompt_logprobs, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice(out, finish, experts)]}


def scored(start: int) -> list:
    """``prompt_logprobs`` of a leg that scored the prompt from ``prompt_logprob_start = start``: ``null``
    at 0 and before ``start``, a ``{id: Logprob}`` row after (``clamp_prompt_logprobs`` keeps finite
    values)."""
    def row(t: int) -> dict:
        return {str(t): {"logprob": -1.25, "rank": 2, "decoded_token": f"token_id:{t}"}}
    return [None] + [None if p < start else row(t) for p, t in enumerate(PROMPT[1:], start=1)]


def aborted_prefill(start: int) -> dict:
    """``OutputProcessor.abort_requests``' output of the prefill leg: ``new_token_ids=[]``,
    ``FinishReason.ABORT``, ``kv_transfer_params=None``; ``num_cached_tokens`` 0, the unscored list."""
    return body([], 0, None, "abort", [None] * (1 + start))


def decode_that_scored_the_prompt(start: int) -> dict:
    """The decode leg, sent the prefill's ``kv_transfer_params`` (``null``): it ran the whole request, 16
    prompt tokens from its own prefix cache, rows ``[0, P + O - 1)``."""
    return body(OUT, 16, npy_b64(rows(0, P + len(OUT) - 1)), "stop", scored(start))


@pytest.mark.parametrize("start", [0, P - 1], ids=["start0", "start_last"])
def test_an_aborted_prefill_legs_count_and_unscored_list_are_not_published_as_the_answers(start):
    decode = decode_that_scored_the_prompt(start)
    [(out, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(aborted_prefill(start))])
    doc = json.loads(out)
    assert verdict is Verdict.OMITTED
    # Neither prefill's uncounted 0 nor its unscored list stands for the answer's.
    assert doc["usage"]["prompt_tokens_details"] is None
    assert doc["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_error"
    assert doc["prompt_logprobs"] is None
    assert doc["prompt_logprobs_unavailable_reason"] == "prefill_error"
    [ch] = doc["choices"]
    assert ch["routed_experts"] is None and ch["routed_experts_unavailable_reason"] == "prefill_error"
    # Everything else is decode's own, as sent.
    assert ch["token_ids"] == OUT and ch["finish_reason"] == "stop"
    assert doc["usage"]["completion_tokens"] == len(OUT) and doc["kv_transfer_params"] is None


def test_a_decode_aborted_before_its_first_token_keeps_its_own_values_beside_an_aborted_prefill():
    """Both legs aborted before token 0: decode's unscored list and 0 are the aggregated abort body's
    (rule 5), whatever the prefill leg became; nothing is omitted."""
    decode = body([], 0, None, "abort", [None])
    [(out, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(aborted_prefill(0))])
    assert json.loads(out) == decode
    assert verdict is Verdict.PASSTHROUGH


def test_a_length_capped_prefill_is_still_joined():
    """The control: the prefill leg that finished ``length`` (its KV handed over) gives its count, list
    and rows."""
    prefill = body(OUT[:1], 4, npy_b64(rows(0, P)), "length", scored(0))
    decode = body(OUT, P - 1, npy_b64(rows(0, P + len(OUT) - 1)), "stop", [None] * P)
    [(out, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    doc = json.loads(out)
    assert verdict is Verdict.JOINED
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert doc["prompt_logprobs"] == scored(0)
    assert "routed_experts_unavailable_reason" not in doc["choices"][0]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["subprocess"])
async def test_an_aborted_prefill_leg_over_the_wire_omits_what_it_cannot_give(kind, client, start_processor):
    """The same pair through a real nats-server and the ``streamproc run`` subprocess, decode published first
    (it waits for the prefill leg), as a router's two workers would."""
    from streamproc.client.publisher import ChunkPublisher
    from streamproc.client.results import ResultCollector

    rid = "vllm-aborted-prefill"
    async with start_processor(kind, format="vllm") as rp:
        publisher = ChunkPublisher(client, rp.subjects)
        async with ResultCollector(client, rp.subjects) as collector:
            await publisher.publish_leg(rid, "decode", [dumps(decode_that_scored_the_prompt(0))])
            await publisher.publish_leg(rid, "prefill", [dumps(aborted_prefill(0))])
            results = await collector.wait_for([rid], timeout=30)
    [result] = results[rid]
    assert result.error is None and result.final and result.verdict is Verdict.OMITTED
    doc = json.loads(result.body)
    assert doc["usage"]["prompt_tokens_details"] is None
    assert doc["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_error"
    assert (doc["prompt_logprobs"], doc["prompt_logprobs_unavailable_reason"]) == (None, "prefill_error")
    assert doc["choices"][0]["routed_experts_unavailable_reason"] == "prefill_error"
