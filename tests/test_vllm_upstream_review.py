"""Independent review of the vLLM codec against upstream vLLM, bodies written by hand.

Nothing here uses the simulator, ``streamproc_vllm.upstream`` or any other streamproc builder: every
body below is spelled out from the upstream function named above it. Each P/D case is compared with
what the aggregated engine returns for the same request (parsed JSON equality plus key order).

Upstream source read: vLLM 0.34.0 as published on PyPI (wheel ``vllm-0.34.0-cp38-abi3-manylinux_2_28``,
``vllm/_version.py``: ``__commit_id__ = 'g62d4bc3c7'``), paths relative to the package root:

* ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` (the ``/inference/v1/generate``
  models): ``GenerateLogProb`` (token_id, logprob, rank), ``GenerateLogProbsContent`` (+ top_logprobs),
  ``GenerateLogProbs`` (content), ``GenerateChoiceBase`` (index, finish_reason, stop_reason, token_ids,
  routed_experts, sampling_mask, weight_versions), ``GenerateTokensChoice`` (+ logprobs),
  ``GenerateStreamChoiceBase`` / ``GenerateTokensStreamChoice``, ``GenerateResponseBase`` (request_id,
  model, created, usage, prompt_logprobs, prompt_token_id_logprobs, prompt_token_ids, mm_placeholders,
  metrics, kv_transfer_params, ec_transfer_params), ``GenerateTokensResponse`` (+ output_mode, choices),
  ``GenerateStreamResponseBase`` / ``GenerateTokensStreamResponse``.
* ``vllm/entrypoints/scale_out/token_in_token_out/serving.py``: ``ServingTokens.serve_tokens_full_generator``,
  ``_build_response_fields``, ``serve_tokens_stream_generator`` and ``_create_tokens_logprobs``
  (``output_mode="tokens"``, the default: "integer token ids, no tokenizer").
* ``vllm/entrypoints/scale_out/token_in_token_out/api_router.py`` ``generate``: unary bodies are
  ``JSONResponse(content=generator.model_dump())``; stream chunks ``model_dump_json(exclude=...)``.
* ``vllm/distributed/aux_output_connector/connector.py`` ``AuxOutputSchedulerConnector.build_connector_meta``
  and ``worker.py`` (``_WorkerRequestState(emit_cursor=emit_start)``): the routed-experts rows start at
  ``min(SamplingParams.routed_experts_prompt_start, num_prompt_tokens)``;
  ``vllm/sampling_params.py`` ``SamplingParams.routed_experts_prompt_start``;
  ``connector.py`` ``cap_external_hit`` / ``max_cache_hit`` and ``take_output`` (rows up to
  ``num_tokens - 1``); ``vllm/v1/engine/input_processor.py`` (``0 <= S <= prompt_len`` or
  ``VLLMValidationError``); ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``
  ``_truncate_request_for_prefill`` / ``_prefill_backoff`` (a prefiller's shortened prompt).
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

RID = "generate-tokens-r1"
PROMPT = [11, 12, 13, 14, 15]
OUT = [21, 22, 23]
LPS = [-0.5, -0.25, -1.0]
LAYERS, TOPK = 3, 2




def npy_b64(arr: np.ndarray) -> str:
    """``vllm/utils/serial_utils.py`` ``numpy2base64``: ``np.save(buffer, array, allow_pickle=False)``,
    then ``pybase64.b64encode(...).decode("ascii")``."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def rows(start: int, end: int) -> np.ndarray:
    """Expert ids of positions [start, end), distinct within a (position, layer); uint8 because the
    model has <= 256 experts (``RoutedExpertsCapturer.output_dtype_name``)."""
    ids = [[[(p * 5 + layer * 3 + k * 7 + 1) % 64 + k * 64 for k in range(TOPK)] for layer in range(LAYERS)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8).reshape(-1, LAYERS, TOPK)  # (0, L, K) when empty


def tokens_logprobs(ids: list[int], lps: list[float]) -> dict:
    """``ServingTokens._create_tokens_logprobs`` (0.34.0): ``GenerateLogProbs(content=[
    GenerateLogProbsContent(token_id, logprob, rank, top_logprobs=[GenerateLogProb(token_id, logprob,
    rank) for every candidate, the sampled one first])])``. There is no ``token`` and no ``bytes`` key:
    the generate server has no tokenizer in tokens mode."""
    return {"content": [{"token_id": t, "logprob": lp, "rank": 1,
                         "top_logprobs": [{"token_id": t, "logprob": lp, "rank": 1},
                                          {"token_id": 7, "logprob": lp - 1.0, "rank": 2}]}
                        for t, lp in zip(ids, lps)]}


def usage(prompt: int, completion: int) -> dict:
    # UsageInfo: prompt_tokens, total_tokens, completion_tokens, (prompt_tokens_details excluded when
    # None: exclude_if), completion_tokens_details.
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "completion_tokens_details": None}


def unary(*, out: list[int], lps: list[float], experts: str | None, finish: str = "stop",
          kv: dict | None = None) -> dict:
    """``serve_tokens_full_generator`` + ``_build_response_fields`` -> ``GenerateTokensResponse``
    (``output_mode="tokens"``), dumped with ``model_dump()``: base fields first, then the subclass's
    ``output_mode`` and ``choices``."""
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out,
              "routed_experts": experts, "sampling_mask": None, "weight_versions": None,
              "logprobs": tokens_logprobs(out, lps)}
    return {"request_id": RID, "model": "m", "created": 1700000000, "usage": usage(len(PROMPT), len(out)),
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice]}


PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
              "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 1}


# ------------------------------------------------------------------ finding 1: tokens-mode logprobs


def test_tokens_mode_unary_logprobs_are_not_given_a_token_key_the_aggregated_body_lacks():
    """vLLM 0.34.0 ``_create_tokens_logprobs`` entries carry ``token_id`` and no ``token``; the P/D
    result must equal the aggregated body (the join must not invent ``"token": "token_id:N"``)."""
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, lps=LPS, experts=npy_b64(rows(0, total)))
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    # 0.34.0's decode capture covers [0, P + O - 1) (prompt rows materialised from the aux-output
    # store for KV it loaded, AuxOutputWorkerConnector._commit_output), so full coverage.
    decode = unary(out=OUT, lps=LPS, experts=npy_b64(rows(0, total)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is not Verdict.OMITTED


def test_tokens_mode_logprobs_without_experts_pass_through_untouched():
    """Expert capture off (``routed_experts`` None on every leg) and nothing from prefill to add: the
    decode body already equals the aggregated one, so it must pass through as its original bytes."""
    agg = unary(out=OUT, lps=LPS, experts=None)
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, lps=LPS, experts=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH
    assert body == dumps(decode)


def stream_chunks(out_chunks: list[list[int]], experts_last: str | None, *, include_usage: bool) -> list[dict]:
    """``serve_tokens_stream_generator`` (0.34.0), tokens mode: ``GenerateTokensStreamResponse`` per
    delta, dumped with ``exclude={prompt_token_ids, mm_placeholders, metrics}`` when they are None
    (so ``request_id, usage, output_mode, choices``); ``routed_experts`` is only set on the finishing
    output (``RequestState.make_request_output``: concatenated ``if finished``); then with
    include_usage a ``choices: []`` chunk dumped with ``exclude_none=True``."""
    bodies = []
    pos = 0
    for k, ids in enumerate(out_chunks):
        last = k == len(out_chunks) - 1
        choice = {"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None, "token_ids": ids,
                  "routed_experts": experts_last if last else None, "sampling_mask": None,
                  "weight_versions": None, "logprobs": tokens_logprobs(ids, LPS[pos:pos + len(ids)])}
        bodies.append({"request_id": RID, "usage": None, "output_mode": "tokens", "choices": [choice]})
        pos += len(ids)
    if include_usage:
        u = usage(len(PROMPT), pos)
        del u["completion_tokens_details"]  # exclude_none
        bodies.append({"request_id": RID, "usage": u, "output_mode": "tokens", "choices": []})
    return bodies


@pytest.mark.parametrize("include_usage", [True, False])
def test_tokens_mode_stream_logprobs_join_to_the_aggregated_stream(include_usage):
    total = len(PROMPT) + len(OUT) - 1
    agg = stream_chunks([[21], [22, 23]], npy_b64(rows(0, total)), include_usage=include_usage)
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = stream_chunks([[21], [22, 23]], npy_b64(rows(0, total)), include_usage=include_usage)
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
    # The first (middle) chunk has nothing to join: it must be published as it came.
    assert results[0][1] is Verdict.PASSTHROUGH


# ----------------------------------------------- finding 2: routed_experts_prompt_start (rows start at S)


def test_routed_experts_prompt_start_rows_are_joined_like_the_aggregated_body():
    """``SamplingParams.routed_experts_prompt_start`` (0.34.0): "skip the first
    routed_experts_prompt_start prompt tokens from the returned routing data".
    ``AuxOutputSchedulerConnector.build_connector_meta`` sets the request's emit start to
    ``max(min(S, num_prompt_tokens), 0 if num_output_tokens == 0 else num_tokens - 1)`` and the worker
    creates ``_WorkerRequestState(emit_cursor=emit_start)``, so the aggregated rows are
    ``[S, P + O - 1)`` and the prefill leg's (same sampling params, max_tokens=1) ``[S, P)``. Both
    legs imply the same ``S`` (prefill ``P - rows``, decode ``P + O - 1 - rows``), so the join keeps
    prefill's ``[S, P)`` and decode's generated rows (a strict xfail until 2026-12-04: the join read
    prefill's ``P - S`` rows as a prefill that lost rows and omitted the field)."""
    start = 2
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, lps=LPS, experts=npy_b64(rows(start, total)))
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=npy_b64(rows(start, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = unary(out=OUT, lps=LPS, experts=npy_b64(rows(start, total)))  # emit_cursor = S on decode too
    [(body, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def prompt_start_legs(start: int, out: list[int], *, prefill_end: int | None = None,
                      decode_start: int | None = None) -> tuple[dict, dict]:
    """The prefill leg (``max_tokens=1``: rows ``[S, P)``, or ``[S, prefill_end)``) and the unary
    decode leg (rows ``[S, P + O - 1)``, or from ``decode_start``) of one request."""
    total = len(PROMPT) + len(out) - 1
    prefill_end = len(PROMPT) if prefill_end is None else prefill_end
    decode_start = start if decode_start is None else decode_start
    prefill = unary(out=out[:1], lps=LPS[:1], experts=npy_b64(rows(min(start, prefill_end), prefill_end)),
                    finish="length", kv=PREFILL_KV)
    decode = unary(out=out, lps=LPS[:len(out)], experts=npy_b64(rows(decode_start, total)))
    return prefill, decode


def omitted_experts(body: bytes) -> str | None:
    """The join's omission reason for the first choice's rows (None: the rows are there)."""
    [choice] = json.loads(body)["choices"]
    if choice["routed_experts"] is not None:
        return None
    return choice.get("routed_experts_unavailable_reason")


@pytest.mark.parametrize("start", [1, 3, 4])
@pytest.mark.parametrize("include_usage", [True, False])
def test_routed_experts_prompt_start_stream_joins_to_the_aggregated_stream(start, include_usage):
    """The stream carries the rows on the finishing chunk (``RequestState.make_request_output``
    concatenates ``routed_experts_chunks`` ``if finished``); without ``include_usage`` the finishing
    chunk has no usage, so ``P`` is prefill's and ``O`` the token ids the session saw."""
    total = len(PROMPT) + len(OUT) - 1
    agg = stream_chunks([[21], [22, 23]], npy_b64(rows(start, total)), include_usage=include_usage)
    prefill, _ = prompt_start_legs(start, OUT)
    decode = stream_chunks([[21], [22, 23]], npy_b64(rows(start, total)), include_usage=include_usage)
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
    assert all(verdict is not Verdict.OMITTED for _, verdict in results)


@pytest.mark.parametrize("start", [0, 2, len(PROMPT)])
def test_routed_experts_prompt_start_with_a_one_token_completion_is_the_prefill_rows(start):
    """``O == 1``: no generated row is forwarded, so the aggregated rows are ``[S, P)`` and decode's
    ``P - S`` rows imply the same ``S`` as prefill's."""
    out = OUT[:1]
    agg = unary(out=out, lps=LPS[:1], experts=npy_b64(rows(start, len(PROMPT))))
    prefill, decode = prompt_start_legs(start, out)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is not Verdict.OMITTED


def test_routed_experts_prompt_start_at_the_prompt_length_keeps_only_the_generated_rows():
    """``S = P`` is the largest start upstream accepts (``InputProcessor`` raises
    ``VLLMValidationError`` unless ``0 <= routed_experts_prompt_start <= prompt_len``): prefill sends
    ``(0, L, K)`` (``take_output``: ``rows[:local_end]`` with ``local_end = 0``) and the aggregated
    body the generated rows ``[P, P + O - 1)`` only."""
    start = len(PROMPT)
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, lps=LPS, experts=npy_b64(rows(start, total)))
    prefill, decode = prompt_start_legs(start, OUT)
    assert np.load(io.BytesIO(base64.b64decode(prefill["choices"][0]["routed_experts"]))).shape == (0, LAYERS, TOPK)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is not Verdict.OMITTED


@pytest.mark.parametrize("start, joined", [(len(PROMPT), True), (len(PROMPT) - 1, False), (2, False)])
def test_routed_experts_prompt_start_clamped_by_a_prefiller_that_cut_the_prompt_short(start, joined):
    """``build_connector_meta`` clamps ``S`` to ``request.num_prompt_tokens``, which a NIXL prefiller
    cuts short by ``_prefill_backoff()`` tokens (``_truncate_request_for_prefill``: Mamba, bounded
    replay, MTP lookahead; ``usage.prompt_tokens`` stays ``P``, it counts the frontend's
    ``prompt_token_ids``). With one token backed off, prefill's rows are ``[min(S, P - 1), P - 1)``:
    only ``S = P`` (both legs clamped to ``P``) still names the aggregated rows; otherwise prefill
    implies a larger ``S`` than decode and the rows it never computed must not be invented."""
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, lps=LPS, experts=npy_b64(rows(start, total)))
    prefill, decode = prompt_start_legs(start, OUT, prefill_end=len(PROMPT) - 1)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    if joined:
        assert_same(body, dumps(agg))
        assert verdict is not Verdict.OMITTED
    else:
        assert omitted_experts(body) == "length_mismatch"
        assert verdict is Verdict.OMITTED


@pytest.mark.parametrize("prefill_start, decode_start", [(3, 2), (2, 3), (0, 2), (2, 0)])
def test_legs_whose_prompt_starts_disagree_omit_the_rows_as_length_mismatch(prefill_start, decode_start):
    """A leg that lost (or gained) rows implies another ``S`` than the other leg: which one is right
    is unknown, so the rows are omitted with the reason the join always gave, ``length_mismatch``."""
    total = len(PROMPT) + len(OUT) - 1
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=npy_b64(rows(prefill_start, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = unary(out=OUT, lps=LPS, experts=npy_b64(rows(decode_start, total)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert omitted_experts(body) == "length_mismatch"
    assert verdict is Verdict.OMITTED


def test_a_decode_leg_without_rows_does_not_confirm_a_prefill_start():
    """Decode's ``null`` (capture lost on that leg) behind a prefill implying ``S > 0``: nothing
    confirms the start, so the rows are omitted, as before, as ``length_mismatch``."""
    prefill, decode = prompt_start_legs(2, OUT[:1])
    decode["choices"][0]["routed_experts"] = None
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert omitted_experts(body) == "length_mismatch"
    assert verdict is Verdict.OMITTED


@pytest.mark.parametrize("leg, first, end", [
    ("prefill", 0, len(PROMPT) + 1),  # P + 1 rows: S = -1
    ("prefill", 0, len(PROMPT) + 40),
    ("decode", 0, len(PROMPT) + len(OUT)),  # P + O rows: S = -1
    ("decode", 5, len(PROMPT) + 1),  # fewer rows than it generated: S = P + 1
    ("decode", 0, 0),  # (0, L, K): S = P + O - 1
])
def test_a_leg_whose_rows_imply_a_start_outside_the_prompt_is_omitted(leg, first, end):
    """Hostile row counts: ``S < 0`` (more rows than positions) or ``S > P`` (decode short of its own
    generated rows) is no capture upstream makes; the join omits, never crashes."""
    prefill, decode = prompt_start_legs(0, OUT)
    target = prefill if leg == "prefill" else decode
    target["choices"][0]["routed_experts"] = npy_b64(rows(first, end))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert omitted_experts(body) == "length_mismatch"
    assert verdict is Verdict.OMITTED


@pytest.mark.parametrize("prompt_tokens, completion_tokens", [(-3, 3), (2, 3), (5, 0), (5, -4), (-10**30, 3)])
def test_usage_counts_that_put_the_start_outside_the_prompt_are_omitted(prompt_tokens, completion_tokens):
    """Hostile usage on both legs (a negative or short prompt, no completion): the implied ``S`` is
    below 0 or the positions do not cover the rows, so the rows are omitted, never mis-sliced."""
    prefill, decode = prompt_start_legs(2, OUT)
    for body in (prefill, decode):
        body["usage"] = {**body["usage"], "prompt_tokens": prompt_tokens}
    decode["usage"]["completion_tokens"] = completion_tokens
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert omitted_experts(body) == "length_mismatch"
    assert verdict is Verdict.OMITTED


# ---------------------------------------- claim checked: a 0.34.0 decode leg scores the prompt itself


def test_decode_leg_that_scores_the_prompt_itself_joins_to_the_aggregated_body():
    """docs/formats-vllm.md says the decode leg's ``prompt_logprobs`` is null because it "only receives
    KV". In 0.34.0 a request with ``prompt_logprobs`` has ``skip_reading_prefix_cache`` set
    (``SamplingParams.__post_init__``), so ``Request.get_prefix_cache_hit_limit`` is
    ``prompt_logprob_start or 0`` and ``Request.skip_reading_external_kv`` is true: the decode leg
    recomputes the prompt and returns the same list (``clamp_prompt_logprobs(final_res.prompt_logprobs)``).
    With routed-experts capture on, ``Scheduler`` also caps an external KV hit to rows its aux-output
    store holds (``AuxOutputSchedulerConnector.cap_external_hit``), so decode's prompt rows are real.
    The join must keep that body as it is (it equals the aggregated one)."""
    plp = [None] + [{str(t): {"logprob": -1.0 - i, "rank": 1, "decoded_token": None}}
                    for i, t in enumerate(PROMPT[1:])]
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, lps=LPS, experts=npy_b64(rows(0, total)))
    agg["prompt_logprobs"] = plp
    prefill = unary(out=OUT[:1], lps=LPS[:1], experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    prefill["prompt_logprobs"] = plp
    decode = json.loads(dumps(agg))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


# ------------------------------------------ the live page's view of rows that start at S


@pytest.mark.parametrize("start", [0, 2, len(PROMPT)])
def test_the_experts_view_lays_joined_rows_out_from_the_prompt_start(start):
    """``Codec.routed_experts`` (the edge's heat map) of a joined body whose rows are ``[S, P + O - 1)``:
    row 0 is position ``S``, prefill's ``P - S`` rows come first, then decode's."""
    total = len(PROMPT) + len(OUT) - 1
    prefill, decode = prompt_start_legs(start, OUT)
    codec = VLLMCodec(OPTIONS)
    [(body, _)] = join(codec, [dumps(decode)], [dumps(prefill)])
    # The join may pass decode's bytes through (0.34.0's decode rows equal the joined ones); the page
    # shows a P/D request by its strongest verdict, here that of a request with a joined chunk.
    view = codec.routed_experts(body, verdict=Verdict.JOINED, limit=1 << 20)
    assert (view.present, view.problem, view.omitted) == (True, None, {})
    assert view.start == start
    assert view.matrix.tolist() == rows(start, total).reshape(total - start, -1).tolist()
    prompt_rows = len(PROMPT) - start
    assert view.splice == (prompt_rows if prompt_rows else None)
    assert [(s.source, s.start, s.stop) for s in view.spans] == (
        [("prefill", 0, prompt_rows)] if prompt_rows else []) + [("decode", prompt_rows, total - start)]


def test_the_experts_view_of_several_choices_keeps_row_zero_at_position_zero():
    """With ``n = 2`` ``usage.completion_tokens`` counts both choices' tokens
    (``serve_tokens_full_generator``: ``num_generated_tokens`` summed over ``final_res.outputs``), so
    it says nothing about one choice's rows: the view does not read a start from it."""
    total = len(PROMPT) + len(OUT) - 1
    body = unary(out=OUT, lps=LPS, experts=npy_b64(rows(0, total)))
    second = json.loads(json.dumps(body["choices"][0]))
    second["index"] = 1
    body["choices"].append(second)
    body["usage"] = usage(len(PROMPT), 2 * len(OUT))
    view = VLLMCodec(OPTIONS).routed_experts(dumps(body), verdict=Verdict.JOINED, limit=1 << 20)
    assert (view.start, view.splice) == (0, len(PROMPT))
