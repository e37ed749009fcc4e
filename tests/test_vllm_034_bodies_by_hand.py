"""vLLM 0.34.0 ``/inference/v1/generate`` P/D joins against the aggregated engine, bodies written by hand.

Nothing here uses the simulator, ``streamproc_vllm.upstream`` or any other streamproc builder: every body
is spelled out from the vLLM 0.34.0 wheel (``pip download --no-deps vllm==0.34.0``), the function named
next to it, and every P/D result is compared with what the aggregated engine returns for the same
request (JSON equality and key order, ``assert_same_body``).

Serialisation, checked with pydantic 2.14 on the classes copied from the wheel:

* unary: ``api_router.generate`` -> ``JSONResponse(content=generator.model_dump())``: every field, nulls
  kept, except ``UsageInfo.prompt_tokens_details`` (``Field(exclude_if=lambda value: value is None)``).
  ``PromptTokenUsageInfo(cached_tokens=n)`` (``serve/engine/protocol.py``: ``cached_tokens``,
  ``created_cache_tokens``, ``multimodal_tokens``) dumps as
  ``{"cached_tokens": n, "created_cache_tokens": null, "multimodal_tokens": null}``;
* stream: ``serve_tokens_stream_generator`` dumps each token chunk with ``model_dump_json(exclude=...)``
  (nulls kept) and the ``choices: []`` usage chunk with ``model_dump_json(exclude_none=True)``, so the
  same details dump there as ``{"cached_tokens": n}``.
"""

from __future__ import annotations

import json

import pytest
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps
from streamproc_vllm import VLLMCodec
from vllm_034_bodies import (
    OPTIONS,
    OUT,
    PROMPT,
    TOTAL,
    npy_b64,
    prefill,
    prefill_kv,
    rows,
    stream,
    unary,
    usage,
)

from streamproc.wire import Verdict

# ------------------------------------------------- usage.prompt_tokens_details of a 0.34.0 stream


@pytest.mark.parametrize("decode_cached", [16, len(PROMPT) - 1])
def test_stream_usage_chunk_keeps_the_exclude_none_shape_of_the_aggregated_stream(decode_cached):
    """The aggregated stream's usage chunk (``exclude_none``) has ``{"cached_tokens": n}``; the prefill leg is
    unary, whose details also carry ``created_cache_tokens`` and ``multimodal_tokens`` as nulls. The join
    takes prefill's count, not prefill's unary object: a decode that reported prefill's count
    (``RequestState.remote_prefill_cached_tokens``, vLLM 0.34.0) is already the aggregated chunk, and one
    that counted the KV it loaded (``P - 1``, older decode engines) gets the count in its own shape."""
    agg = stream([[51], [52, 53]], npy_b64(rows(0, TOTAL)), cached=16)
    decode = stream([[51], [52, 53]], npy_b64(rows(0, TOTAL)), cached=decode_cached)
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill(16, 16))])
    assert len(results) == len(agg)
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
    body, verdict = results[-1]
    if decode_cached == 16:
        assert verdict is Verdict.PASSTHROUGH and body == dumps(decode[-1])  # nothing to change: its bytes
    else:
        assert verdict is Verdict.JOINED


def test_unary_decode_details_keep_every_key_of_the_aggregated_body():
    """Unary legs dump the same three keys; the count is prefill's."""
    agg = unary(out=OUT, cached=16, experts=npy_b64(rows(0, TOTAL)))
    decode = unary(out=OUT, cached=len(PROMPT) - 1, experts=npy_b64(rows(0, TOTAL)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill(16, 16))])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


@pytest.mark.parametrize("stream_request", [False, True])
def test_a_prefill_without_details_still_gives_its_count_through_its_kv_transfer_params(stream_request):
    """A prefill server without ``--enable-prompt-tokens-details`` leaves the details out of its usage, but
    its engine still hands the count to decode: ``Scheduler.update_from_output`` puts
    ``remote_prefill_cached_tokens = prefill_stats.num_cached_tokens`` into the ``kv_transfer_params`` the
    prefill body carries (an engine fact, not the serving flag), and the decode engine reports it as its
    own ``num_cached_tokens`` (``RequestState``: ``if kv_transfer_params.get("do_remote_prefill"): ...
    remote_prefill_cached_tokens``). That is prefill's prefix-cache hit, the aggregated engine's count:
    nothing is missing."""
    pre = prefill(None, 16)
    if stream_request:
        agg = stream([[51], [52, 53]], npy_b64(rows(0, TOTAL)), cached=16)
        decode = stream([[51], [52, 53]], npy_b64(rows(0, TOTAL)), cached=16)
    else:
        agg = [unary(out=OUT, cached=16, experts=npy_b64(rows(0, TOTAL)))]
        decode = [unary(out=OUT, cached=16, experts=npy_b64(rows(0, TOTAL)))]
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(pre)])
    for (body, _), want in zip(results, agg, strict=True):
        assert_same(body, dumps(want))
    assert results[-1][1] is Verdict.PASSTHROUGH


def test_a_decode_that_counted_the_loaded_kv_gets_the_count_prefills_kv_transfer_params_carry():
    """The same prefill in front of a decode engine that counts the KV it loaded (one before
    ``remote_prefill_cached_tokens``, or behind a router that rebuilt ``kv_transfer_params``): prefill's
    count replaces decode's."""
    agg = unary(out=OUT, cached=16, experts=npy_b64(rows(0, TOTAL)))
    decode = unary(out=OUT, cached=len(PROMPT) - 1, experts=npy_b64(rows(0, TOTAL)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill(None, 16))])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_a_prefill_without_details_or_a_count_in_its_kv_transfer_params_is_still_prefill_missing():
    """No count anywhere in the prefill leg (an engine before ``remote_prefill_cached_tokens``): omitted."""
    pre = prefill(None, 16)
    del pre["kv_transfer_params"]["remote_prefill_cached_tokens"]
    decode = unary(out=OUT, cached=len(PROMPT) - 1, experts=npy_b64(rows(0, TOTAL)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    usage_out = json.loads(body)["usage"]
    assert usage_out["prompt_tokens_details"] is None
    assert usage_out["prompt_tokens_details_unavailable_reason"] == "prefill_missing"
    assert verdict is Verdict.OMITTED


# ------------------------------------------- a known limit: OpenAI /v1/completions bodies are not the format


def completion(*, out: list[int], prompt_logprobs: list, experts: str | None, finish: str = "stop",
               kv: dict | None = None) -> dict:
    """``OpenAIServingCompletion.request_output_to_completion_response`` (``openai/completion/serving.py``)
    -> ``CompletionResponse``, ``JSONResponse(content=model_dump())``, with ``return_token_ids``: each
    ``CompletionResponseChoice`` carries ``prompt_logprobs=final_res.prompt_logprobs`` itself (there is no
    top-level one), ``Logprob(logprob, rank, decoded_token)`` per position."""
    c = {"index": 0, "text": "abc", "logprobs": None, "finish_reason": finish, "stop_reason": None,
         "token_ids": out, "prompt_logprobs": prompt_logprobs, "prompt_token_ids": PROMPT,
         "routed_experts": experts, "weight_versions": None}
    return {"id": "cmpl-r9", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [c],
            "service_tier": None, "system_fingerprint": None, "usage": usage(len(out), None),
            "kv_transfer_params": kv, "ec_transfer_params": None, "metrics": None}


def scored(lp: float) -> list:
    return [None, *({str(t): {"logprob": lp, "rank": 1, "decoded_token": "x"}} for t in PROMPT[1:])]


@pytest.mark.xfail(strict=True, reason="known limit: the vllm format is /inference/v1/generate; an OpenAI "
                   "/v1/completions choice's own prompt_logprobs are not joined (docs/formats-vllm.md)")
def test_openai_completions_choice_prompt_logprobs_are_not_taken_from_decode():
    """A P/D decode leg that loaded the prompt's KV returns ``prompt_logprobs`` rows it never wrote
    (``GPUModelRunner._get_prompt_logprobs_dict``: ``LogprobsTensors.empty_cpu``), and /v1/completions puts
    them on every choice (``CompletionResponseChoice.prompt_logprobs``), also into an ``echo`` answer's
    ``logprobs`` (``out_logprobs = [*prompt_logprobs, *output.logprobs]``). The join knows only the
    top-level field of the generate endpoint, so decode's rows pass: this must not stand as joined."""
    agg = completion(out=OUT, prompt_logprobs=scored(-1.5), experts=npy_b64(rows(0, TOTAL)))
    pre = completion(out=OUT[:1], prompt_logprobs=scored(-1.5), experts=npy_b64(rows(0, len(PROMPT))),
                     finish="length", kv=prefill_kv(0))
    decode = completion(out=OUT, prompt_logprobs=scored(0.0), experts=npy_b64(rows(0, TOTAL)))
    [(body, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    got = json.loads(body)["choices"][0]
    assert got["prompt_logprobs"] == agg["choices"][0]["prompt_logprobs"] or (
        got["prompt_logprobs"] is None and got.get("prompt_logprobs_unavailable_reason"))
