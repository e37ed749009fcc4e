"""vLLM 0.34.0 P/D joins of finishes, parallel sampling and usage, against the aggregated engine, bodies by hand.

Nothing here uses the simulator, ``streamproc_vllm.upstream`` or any other streamproc builder: every body is
spelled out from the vLLM 0.34.0 wheel (``pip download --no-deps vllm==0.34.0``), the function named next to
it, and every P/D result is compared with what the aggregated engine returns for the same request.

Shapes (``vllm/entrypoints/scale_out/token_in_token_out/serving.py``, ``ServingTokens``):

* unary: ``serve_tokens_full_generator`` -> ``GenerateTokensResponse(choices=..., **_build_response_fields(...))``,
  ``JSONResponse(content=model_dump())``; a choice's ``finish_reason`` is ``output.finish_reason if
  output.finish_reason else "stop"``, its ``routed_experts`` ``numpy2base64(output.routed_experts)`` or ``None``;
* stream: ``serve_tokens_stream_generator``, one ``GenerateTokensStreamResponse`` per output with a token or a
  finish ("Terminal outputs are always emitted so the client sees the finish reason, e.g. an abort, which has
  no new tokens"), dumped with ``model_dump_json(exclude=...)`` (nulls kept); with ``include_usage`` a
  ``choices: []`` usage chunk (``exclude_none=True``); with ``continuous_usage_stats`` every token chunk has
  ``UsageInfo(prompt_tokens, completion_tokens=num_generated_tokens[i], total_tokens)``.
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
from streamproc_vllm import VLLMCodec
from vllm_034_bodies import npy_b64 as numpy2base64  # vllm/utils/serial_utils.py numpy2base64

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

RID = "generate-tokens-fin-3"
PROMPT = list(range(500, 512))  # 12 tokens
LAYERS, TOPK = 2, 2

# ``NixlConnectorScheduler.request_finished`` (``nixl/pull_scheduler.py``) for a length-capped prefill, plus
# ``remote_prefill_cached_tokens`` (``Scheduler.update_from_output``).
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[2, 3]],
              "remote_engine_id": "p0", "remote_request_id": RID, "remote_host": "10.0.0.3", "remote_port": 5600,
              "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(PROMPT),
              "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
              "remote_prefill_cached_tokens": 0}


def expert_rows(start: int, end: int) -> np.ndarray:
    """Expert ids of positions [start, end), distinct within a (position, layer)."""
    ids = [[[(p * 7 + layer * 3 + k * 13 + 1) % 64 + k * 64 for k in range(TOPK)] for layer in range(LAYERS)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8).reshape(-1, LAYERS, TOPK)


def choice(out: list[int] | None, finish: str | None, experts: str | None, *, index: int = 0,
           stop_reason: int | str | None = None) -> dict:
    """``GenerateTokensChoice`` / ``GenerateTokensStreamChoice`` (``GenerateChoiceBase`` fields, then
    ``logprobs``; ``None``: not requested)."""
    return {"index": index, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": out,
            "routed_experts": experts, "sampling_mask": None, "weight_versions": None, "logprobs": None}


def usage(completion: int, *, exclude_none: bool = False) -> dict:
    """``UsageInfo`` without ``--enable-prompt-tokens-details`` (``prompt_tokens_details`` is ``exclude_if``
    None); ``completion_tokens_details`` left out under ``exclude_none``."""
    u: dict = {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + completion,
               "completion_tokens": completion}
    if not exclude_none:
        u["completion_tokens_details"] = None
    return u


def unary(choices: list[dict], *, kv: dict | None = None) -> dict:
    """``_build_response_fields`` + ``GenerateTokensResponse.model_dump()``; ``completion_tokens`` sums every
    choice's ``token_ids`` (``num_generated_tokens += len(output.token_ids)``)."""
    done = sum(len(c["token_ids"]) for c in choices)
    return {"request_id": RID, "model": "m", "created": 1700000000, "usage": usage(done),
            "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": choices}


def token_chunk(ch: dict, continuous: int | None = None) -> dict:
    """A ``GenerateTokensStreamResponse`` token chunk; ``continuous``: that choice's count so far."""
    return {"request_id": RID, "usage": None if continuous is None else usage(continuous), "output_mode": "tokens",
            "choices": [ch]}


def usage_chunk(completion: int) -> dict:
    return {"request_id": RID, "usage": usage(completion, exclude_none=True), "output_mode": "tokens", "choices": []}


def prefill(n: int = 1) -> dict:
    """The NIXL prefill leg: the client's request with ``max_tokens=1``, unary; rows ``[0, P)`` per choice."""
    return unary([choice([41 + i], "length", numpy2base64(expert_rows(0, len(PROMPT))), index=i)
                  for i in range(n)], kv=PREFILL_KV)


# ---------------------------------------------------------------- a decode aborted before its first token
#
# ``OutputProcessor.abort_requests`` ("Produce final abort output") calls ``make_request_output(new_token_ids=[],
# finish_reason=FinishReason.ABORT, stop_reason=None, kv_transfer_params=None)``; ``_new_completion_output``
# attaches rows only ``if finished and self.routed_experts_chunks``, and ``Scheduler.update_from_output`` hands
# rows over only with an output (``should_emit_output = bool(new_token_ids or pooler_output is not None or
# stopped)``). A request aborted before its first token (a P/D decode waiting for its KV:
# ``WAITING_FOR_REMOTE_KVS``) has no rows on any engine: the aggregated answer is ``"routed_experts": null``
# with ``finish_reason: "abort"`` and ``completion_tokens`` 0. Prefill's prompt rows are not that answer.


def abort_stream(include_usage: bool) -> list[dict]:
    chunks = [token_chunk(choice([], "abort", None))]
    return chunks + ([usage_chunk(0)] if include_usage else [])


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("prefill_leg", ["rows", "timed_out"])
def test_a_stream_aborted_before_its_first_token_keeps_the_aggregated_null_rows_without_a_reason(
        include_usage, prefill_leg):
    agg = abort_stream(include_usage)
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in agg],
                   [dumps(prefill())] if prefill_leg == "rows" else None)
    assert len(results) == len(agg)
    for (body, verdict), want in zip(results, agg):
        assert_same(body, dumps(want))
        assert verdict is Verdict.PASSTHROUGH


def test_a_unary_decode_aborted_before_its_first_token_is_the_aggregated_body():
    """``AsyncLLM.generate`` yields the abort output (finished) to ``serve_tokens_full_generator``, which keeps
    ``finish_reason="abort"`` and ``routed_experts=None``."""
    agg = unary([choice([], "abort", None)])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(agg)], [dumps(prefill())])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_an_aborted_decode_that_emitted_tokens_but_lost_its_rows_is_still_decode_missing():
    """After ``k`` tokens the abort output carries rows ``[0, P + k - 1)`` (the chunks received); a decode
    leg without them lost them, which the aggregated stream would carry."""
    chunks = [token_chunk(choice([7], None, None)), token_chunk(choice([8], None, None)),
              token_chunk(choice([], "abort", None)), usage_chunk(2)]
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in chunks], [dumps(prefill())])
    finishing = json.loads(results[2][0])["choices"][0]
    assert (finishing["routed_experts"], finishing["routed_experts_unavailable_reason"]) == (None, "decode_missing")
    assert results[2][1] is Verdict.OMITTED


def test_an_aborted_decode_with_rows_after_two_tokens_joins_to_the_aggregated_stream():
    whole = expert_rows(0, len(PROMPT) + 1)
    stale = whole.copy()
    stale[:len(PROMPT)] = expert_rows(30, 30 + len(PROMPT))  # decode's prompt rows: another request's
    def stream(rows: np.ndarray) -> list[dict]:
        return [token_chunk(choice([7], None, None)), token_chunk(choice([8], None, None)),
                token_chunk(choice([], "abort", numpy2base64(rows))), usage_chunk(2)]
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in stream(stale)], [dumps(prefill())])
    for (body, _), want in zip(results, stream(whole)):
        assert_same(body, dumps(want))
    assert results[2][1] is Verdict.JOINED


# ------------------------------------------------------------- n > 1: a choice aborted before its token
#
# ``AsyncLLM.add_request`` fans ``n`` out into child requests (``ParentRequest.get_child_info``:
# ``f"{index}_{request_id}"``, ``n = 1`` each), scheduled on their own; an abort of the parent aborts every
# child (``OutputProcessor.abort_requests``: "Abort children prior to removing the parent"), each with its
# own abort output. A child that had not produced a token yet has no rows; its sibling has ``[0, P + k - 1)``.
# Unary (``FINAL_ONLY``), ``ParentRequest.get_outputs`` aggregates the ``n`` final outputs by index and
# ``usage.completion_tokens`` sums them.


def n_abort_unary(rows0: np.ndarray) -> dict:
    return unary([choice([7, 8], "abort", numpy2base64(rows0), index=0), choice([], "abort", None, index=1)])


def n_abort_stream(rows0: np.ndarray) -> list[dict]:
    return [token_chunk(choice([7], None, None, index=0)), token_chunk(choice([8], None, None, index=0)),
            token_chunk(choice([], "abort", numpy2base64(rows0), index=0)),
            token_chunk(choice([], "abort", None, index=1)), usage_chunk(2)]


def _rows_after_two_tokens() -> tuple[np.ndarray, np.ndarray]:
    whole = expert_rows(0, len(PROMPT) + 1)
    stale = whole.copy()
    stale[:len(PROMPT)] = expert_rows(30, 30 + len(PROMPT))
    return whole, stale


def test_n2_unary_with_a_choice_aborted_before_its_token_joins_to_the_aggregated_body():
    whole, stale = _rows_after_two_tokens()
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(n_abort_unary(stale))], [dumps(prefill(n=2))])
    assert_same(body, dumps(n_abort_unary(whole)))
    assert verdict is Verdict.JOINED


def test_n2_stream_with_a_choice_aborted_before_its_token_joins_to_the_aggregated_stream():
    whole, stale = _rows_after_two_tokens()
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in n_abort_stream(stale)], [dumps(prefill(n=2))])
    agg = n_abort_stream(whole)
    assert len(results) == len(agg)
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
    assert [v for _, v in results][2:4] == [Verdict.JOINED, Verdict.PASSTHROUGH]


# ------------------------------------- prompt-side fields of a request that ended before its first token
#
# ``Scheduler.update_from_output`` sends a request's prompt logprobs and its prefill stats only with its
# first output ("Invariant: EngineCore returns no partial prefill outputs": ``assert not
# prompt_logprobs_tensors``; ``prefill_stats = request.take_prefill_stats()`` under ``should_emit_output``).
# Aborted before token 0, the aggregated engine's ``RequestOutput`` has what ``LogprobsProcessor.from_new_request``
# started with, ``create_prompt_logprobs``'s ``[None]`` plus one ``None`` per position before
# ``prompt_logprob_start``, and ``RequestState.num_cached_tokens`` is still its initial 0 (decode's
# ``remote_prefill_cached_tokens`` is applied in the same ``is_prefilling`` branch, on an output). The decode
# leg aborted before token 0 sends exactly that; prefill's scores and count are not the aggregated answer.


def pl_entry(token: int, logprob: float) -> dict:
    """``append_logprobs_for_next_position`` with ``prompt_logprobs=0``, tokens mode: ``{id: Logprob}``."""
    return {str(token): {"logprob": logprob, "rank": 1, "decoded_token": None}}


def scored(start: int) -> list:
    """Prefill's list: ``[None]``, ``start`` unscored positions, then one entry per scored prompt token."""
    return [None] * (1 + start) + [pl_entry(t, -0.5 - i / 8) for i, t in enumerate(PROMPT[1 + start:])]


def with_details(body: dict, cached: int, *, exclude_none: bool = False) -> dict:
    """``--enable-prompt-tokens-details``: ``PromptTokenUsageInfo(cached_tokens=num_cached_tokens)``, placed
    before ``completion_tokens_details`` (``UsageInfo`` field order); a stream's usage chunk dumps it
    ``exclude_none``."""
    u = body["usage"]
    details = {"cached_tokens": cached} if exclude_none else \
        {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
    rest = {k: v for k, v in u.items() if k != "completion_tokens_details"}
    tail = {} if exclude_none else {"completion_tokens_details": None}
    return {**body, "usage": {**rest, "prompt_tokens_details": details, **tail}}


@pytest.mark.parametrize("start", [0, 3])
def test_a_unary_decode_aborted_before_its_first_token_keeps_its_own_unscored_prompt_logprobs(start):
    pre = {**prefill(), "prompt_logprobs": scored(start)}
    agg = {**unary([choice([], "abort", None)]), "prompt_logprobs": [None] * (1 + start)}
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(agg)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_a_unary_decode_aborted_before_its_first_token_keeps_its_unscored_list_when_prefill_timed_out():
    agg = {**unary([choice([], "abort", None)]), "prompt_logprobs": [None]}
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(agg)], None)
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_a_unary_decode_aborted_before_its_first_token_keeps_its_zero_cached_tokens():
    pre = with_details(prefill(), 8)
    agg = with_details(unary([choice([], "abort", None)]), 0)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(agg)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH


def test_a_stream_aborted_before_its_first_token_keeps_the_zero_cached_tokens_of_its_usage_chunk():
    """``serve_tokens_stream_generator`` reads ``num_cached_tokens`` from its first ``RequestOutput``, here the
    abort output."""
    pre = with_details(prefill(), 8)
    agg = [token_chunk(choice([], "abort", None)), with_details(usage_chunk(0), 0, exclude_none=True)]
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in agg], [dumps(pre)])
    for (body, verdict), want in zip(results, agg):
        assert_same(body, dumps(want))
        assert verdict is Verdict.PASSTHROUGH


# ------------------------------------------------- n > 1 and continuous usage: choices paired by index
#
# With ``stream_options = {include_usage, continuous_usage_stats}`` (``should_include_usage``) every token chunk
# carries ``UsageInfo(prompt_tokens, completion_tokens=num_generated_tokens[i], total_tokens)`` of its own
# choice ``i`` (``prompt_tokens_details`` left out, ``exclude_if``); the ``choices: []`` chunk sums them and
# carries the details. The prefill leg (``max_tokens=1``, ``n=2``) has one choice per child, each with the
# prompt's rows ``[0, P)``; a P/D decode's prompt rows may be another request's. A decode that loaded the
# prompt's KV without a forwarded count reports ``P - 1`` cached tokens; prefill's count is the aggregated one.

N_OUTS = [[7, 8, 9], [4, 5]]


def n_rows(i: int, out: list[int], *, stale: bool) -> np.ndarray:
    r = expert_rows(0, len(PROMPT) + len(out) - 1)
    r[len(PROMPT):] = expert_rows(40 + 9 * i, 40 + 9 * i + len(out) - 1)
    if stale:
        r[:len(PROMPT)] = expert_rows(30, 30 + len(PROMPT))
    return r


def n_continuous_stream(*, stale: bool, cached: int) -> list[dict]:
    chunks = []
    for step in range(max(map(len, N_OUTS))):
        for i, out in enumerate(N_OUTS):
            if step < len(out):
                last = step == len(out) - 1
                rows = numpy2base64(n_rows(i, out, stale=stale)) if last else None
                chunks.append(token_chunk(choice([out[step]], "stop" if last else None, rows, index=i),
                                          continuous=step + 1))
    return chunks + [with_details(usage_chunk(sum(map(len, N_OUTS))), cached, exclude_none=True)]


def test_an_n2_stream_with_continuous_usage_joins_each_choice_to_the_aggregated_stream():
    """A 12-token prompt fills no 16-token block (vLLM's default ``block_size``): no child of either engine
    hits the prefix cache, so prefill's 0 is every child's count (a count other than 0 is one child's: below)."""
    agg = n_continuous_stream(stale=False, cached=0)
    decode = n_continuous_stream(stale=True, cached=len(PROMPT) - 1)
    pre = with_details(prefill(n=2), 0)
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in decode], [dumps(pre)])
    assert len(results) == len(agg)
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))


def test_an_n2_decode_behind_a_prefill_that_ran_one_choice_omits_the_other_choices_rows():
    """A router that sent the prefill ``n=1``: its one choice's rows are child ``0_<id>``'s prompt pass. The
    aggregated engine's choice 1 is child ``1_<id>``, its own request (``ParentRequest.get_child_info``) with
    its own prompt pass or prefix-cache hit; no leg sent its rows, so they are omitted, never copied from
    choice 0."""
    decode = unary([choice(out, "stop", numpy2base64(n_rows(i, out, stale=True)), index=i)
                    for i, out in enumerate(N_OUTS)])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill(n=1))])
    got = json.loads(body)["choices"]
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(got[0]["routed_experts"]))),
                          n_rows(0, N_OUTS[0], stale=False))
    assert (got[1]["routed_experts"], got[1]["routed_experts_unavailable_reason"]) == (None, "prefill_missing")
    assert verdict is Verdict.OMITTED


# ---------------------------------------------- n > 1 without an abort: whose cached count is the answer
#
# The children of one parent hit each other's prompt blocks. ``AsyncLLM.add_request`` adds child ``0_<id>``
# first; ``KVCacheManager.allocate_slots`` caches a request's full blocks as they are allocated
# (``self.coordinator.cache_blocks(request, num_tokens_to_cache)``, ``BlockPool.cache_full_blocks`` ->
# ``cached_block_hash_to_block.insert``), so a sibling scheduled after it, in the same step or a later one,
# finds them in ``get_computed_blocks``: ``PrefillStats`` (``num_local_cached_tokens``) and hence
# ``RequestState.num_cached_tokens`` are per child, child 0's the hits from before the request, every later
# child's the prompt's full blocks. Which child's count a body reports:
#
# * unary: the child whose output completes the parent (``ParentRequest.get_outputs`` returns the aggregator
#   once ``child_requests`` is empty; ``RequestState._new_request_output`` reads ``self.num_cached_tokens``):
#   the prefill leg's ``max_tokens=1`` children finish together, the last scheduled last; the aggregated
#   engine's last child is whichever generates longest, child 0 included;
# * stream: ``serve_tokens_stream_generator`` reads ``num_cached_tokens`` from its first ``RequestOutput``
#   (``if first_iteration``), the first child to output, child 0 when they start together.
#
# With a 4-token block (``--block-size 4``) and a 12-token prompt seen before in its first 4 tokens: child 0
# counts 4, child 1 counts 8 (two full blocks; the last prompt token is always recomputed). Prefill's body
# says 8, the aggregated unary body 4 or 8 as the children's lengths fall, the aggregated stream 4; no body
# says which child a count is. Only 0 is every child's (a prompt whose blocks no child could hit).

PD_N_DECODE_CACHED = len(PROMPT) - 1  # a NIXL decode counts the prompt KV it loaded


def n_stop_unary(outs: list[list[int]], *, stale: bool) -> dict:
    return unary([choice(out, "stop", numpy2base64(n_rows(i, out, stale=stale)), index=i)
                  for i, out in enumerate(outs)])


@pytest.mark.parametrize("outs", [N_OUTS, N_OUTS[::-1]], ids=["child0_last", "child1_last"])
def test_n2_unary_omits_a_cached_count_that_is_only_the_prefill_legs_last_child(outs):
    """Prefill's count is its last child's (8); the aggregated body's is that of the child that finished
    last there: 4 when child 0 generated longest, 8 otherwise. The join published 8 for both."""
    pre = with_details(prefill(n=2), 8)
    decode = with_details(n_stop_unary(outs, stale=True), PD_N_DECODE_CACHED)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    got = json.loads(body)
    assert (got["usage"]["prompt_tokens_details"], got["usage"]["prompt_tokens_details_unavailable_reason"]) == \
        (None, "prefill_missing")
    for i, out in enumerate(outs):  # the rows are still joined per child
        assert np.array_equal(np.load(io.BytesIO(base64.b64decode(got["choices"][i]["routed_experts"]))),
                              n_rows(i, out, stale=False))
    assert verdict is Verdict.OMITTED


def test_n2_unary_omits_a_count_prefill_handed_to_decode_for_its_last_child():
    """A prefill server without ``--enable-prompt-tokens-details``: ``kv_transfer_params`` is also the last
    child's (``_new_request_output(..., kv_transfer_params)`` of the output that completes the parent), so
    ``remote_prefill_cached_tokens`` is that child's count."""
    pre = {**prefill(n=2), "kv_transfer_params": {**PREFILL_KV, "remote_prefill_cached_tokens": 8}}
    decode = with_details(n_stop_unary(N_OUTS, stale=True), PD_N_DECODE_CACHED)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    usage_out = json.loads(body)["usage"]
    assert (usage_out["prompt_tokens_details"], usage_out["prompt_tokens_details_unavailable_reason"]) == \
        (None, "prefill_missing")
    assert verdict is Verdict.OMITTED


def test_n2_stream_omits_a_cached_count_the_aggregated_stream_takes_from_its_first_child():
    """The aggregated stream's usage chunk says child 0's 4, prefill's unary body its last child's 8."""
    decode = n_continuous_stream(stale=True, cached=PD_N_DECODE_CACHED)
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in decode], [dumps(with_details(prefill(n=2), 8))])
    usage_out = json.loads(results[-1][0])["usage"]
    assert (usage_out["prompt_tokens_details"], usage_out["prompt_tokens_details_unavailable_reason"]) == \
        (None, "prefill_missing")
    assert results[-1][1] is Verdict.OMITTED


def test_n2_unary_keeps_a_zero_count_every_child_has():
    agg = with_details(n_stop_unary(N_OUTS, stale=False), 0)
    decode = with_details(n_stop_unary(N_OUTS, stale=True), PD_N_DECODE_CACHED)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(with_details(prefill(n=2), 0))])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


# ------------------------------------------------------------- kv_transfer_params of other connectors
#
# ``Scheduler.update_from_output`` adds ``remote_prefill_cached_tokens`` only to parameters with
# ``do_remote_prefill`` (NIXL's prefill-side ``request_finished``). ``MooncakeConnectorScheduler.request_finished``
# returns ``(delay_free_blocks, None)`` on the prefiller (its body: ``"kv_transfer_params": null``);
# ``LMCacheMPConnector.request_finished`` returns ``{}``, or ``{"num_lmcache_extra_cached_tokens": n}`` when
# asked. None of them tells prefill's cache hits, so a prefill server without ``--enable-prompt-tokens-details``
# leaves the decode's count (the KV it loaded) unconfirmed: omitted, never passed on.

KV_WITHOUT_A_COUNT = {
    "mooncake_null": None,
    "lmcache_mp_empty": {},
    "lmcache_mp_extra": {"num_lmcache_extra_cached_tokens": 32},
    "nixl_without_count": {k: v for k, v in PREFILL_KV.items() if k != "remote_prefill_cached_tokens"},
    "nixl_count_not_an_int": {**PREFILL_KV, "remote_prefill_cached_tokens": True},
}


@pytest.mark.parametrize("kv", sorted(KV_WITHOUT_A_COUNT))
def test_a_decode_cached_count_no_prefill_field_confirms_is_omitted(kv):
    pre = {**prefill(), "kv_transfer_params": KV_WITHOUT_A_COUNT[kv]}
    decode = with_details(unary([choice([7, 8], "stop", numpy2base64(expert_rows(0, len(PROMPT) + 1)))]),
                          len(PROMPT) - 1)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    usage_out = json.loads(body)["usage"]
    assert (usage_out["prompt_tokens_details"], usage_out["prompt_tokens_details_unavailable_reason"]) == \
        (None, "prefill_missing")
    assert verdict is Verdict.OMITTED


# ------------------------------------------- prompt_logprobs=k asked of the prefill leg only
#
# vLLM 0.34.0's decode with ``prompt_logprobs`` set never loads the prompt's KV (``Request.get_prefix_cache_hit_limit``
# returns ``prompt_logprob_start or 0``, so ``skip_reading_external_kv``) and recomputes the whole prompt; a
# router that wants the transfer sends the parameter to the prefill leg only. Decode then answers
# ``"prompt_logprobs": null`` (``LogprobsProcessor.from_new_request``: ``None`` unless asked) and prefill has
# the list the aggregated engine returns: per position the prompt token plus the top ``k``
# (``append_logprobs_for_next_position``: ``k + 1`` entries when the token is not among them), detokenised
# (``decoded_token``) by a server with a tokenizer.


def top_k_list(k: int) -> list:
    out: list = [None]
    for i, t in enumerate(PROMPT[1:]):
        entry = {str(t): {"logprob": -4.25 - i / 4, "rank": k + 3, "decoded_token": f"t{t}"}}
        entry.update({str(900 + j): {"logprob": -0.5 - j / 2, "rank": j + 1, "decoded_token": f"c{j}"}
                      for j in range(k)})
        out.append(entry)
    return out


def test_prompt_logprobs_k_asked_of_the_prefill_only_give_the_aggregated_list():
    rows = numpy2base64(expert_rows(0, len(PROMPT) + 1))
    agg = {**unary([choice([7, 8], "stop", rows)]), "prompt_logprobs": top_k_list(2)}
    decode = unary([choice([7, 8], "stop", rows)])
    pre = {**prefill(), "prompt_logprobs": top_k_list(2)}
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


# ------------------------------------- n > 1 unary: prompt-side fields when some children had no token
#
# A unary body's prompt-side fields are those of the child whose output completed the parent's:
# ``ParentRequest.get_outputs`` returns ``self.output_aggregator`` only once ``child_requests`` is empty, and
# ``RequestState._new_request_output`` fills ``prompt_logprobs``, ``prompt_token_id_logprobs`` and
# ``num_cached_tokens`` from that child's own state. A child that ended before its first token has
# ``create_prompt_logprobs``'s unscored list and ``num_cached_tokens`` 0 (both set only with an output).
#
# * Choices with tokens finished normally, the others were aborted before their token: ``abort_requests``
#   builds the aborted children's outputs after every normal finish (it pops their ``request_states``; a later
#   engine output of theirs is dropped), so an unstarted child completes the parent, on every engine.
# * An abort that also ended a child with tokens: the order depends on the abort's path, which no body shows.
#   ``/inference/v1/abort_requests`` aborts by external id, and ``abort_requests`` walks ``external_req_ids`` (the
#   children in index order: the highest-index aborted child comes last); a ``pause(mode="abort")`` sends the abort
#   outputs from ``EngineCore._send_abort_outputs`` as ``list(req_ids)`` of a set of ``f"{index}_{request_id}"``
#   strings, in the process's string-hash order. The aggregated body has one of two values: omitted, ``decode_error``.


def n_unary(finishes: list[str], outs: list[list[int]], rows: list[np.ndarray | None]) -> dict:
    return unary([choice(out, fin, None if r is None else numpy2base64(r), index=i)
                  for i, (fin, out, r) in enumerate(zip(finishes, outs, rows))])


def test_n2_unary_whose_unstarted_child_was_aborted_after_its_sibling_finished_keeps_the_unscored_fields():
    whole, stale = _rows_after_two_tokens()
    pre = with_details({**prefill(n=2), "prompt_logprobs": scored(0)}, 8)
    agg = with_details({**n_unary(["stop", "abort"], [[7, 8], []], [whole, None]), "prompt_logprobs": [None]}, 0)
    decode = with_details({**n_unary(["stop", "abort"], [[7, 8], []], [stale, None]), "prompt_logprobs": [None]}, 0)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


@pytest.mark.parametrize("decode_last", ["started", "unstarted"])
def test_n2_unary_abort_of_a_started_and_an_unstarted_child_omits_the_order_dependent_prompt_fields(decode_last):
    """Whichever child the decode engine's set order built last, the aggregated engine's order is its own."""
    _, stale = _rows_after_two_tokens()
    pre = with_details({**prefill(n=2), "prompt_logprobs": scored(0)}, 8)
    own = ([None] + [pl_entry(t, 0.0) for t in PROMPT[1:]], len(PROMPT) - 1) if decode_last == "started" \
        else ([None], 0)
    decode = with_details({**n_abort_unary(stale), "prompt_logprobs": own[0]}, own[1])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    got = json.loads(body)
    assert (got["prompt_logprobs"], got["prompt_logprobs_unavailable_reason"]) == (None, "decode_error")
    assert (got["usage"]["prompt_tokens_details"], got["usage"]["prompt_tokens_details_unavailable_reason"]) == \
        (None, "decode_error")
    assert verdict is Verdict.OMITTED


def test_n2_unary_abort_of_a_started_and_an_unstarted_child_keeps_values_both_orders_give():
    """No prompt logprobs asked for and a prefill without cache hits: either child built last gives
    ``"prompt_logprobs": null`` and ``cached_tokens`` 0, so nothing is omitted."""
    whole, stale = _rows_after_two_tokens()
    pre = with_details(prefill(n=2), 0)
    agg = with_details(n_abort_unary(whole), 0)
    decode = with_details(n_abort_unary(stale), len(PROMPT) - 1)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


# ------------------------------------------------ output logprobs: the decode samples token 0 itself
#
# A NIXL decode loads the prompt's KV and recomputes its last token "so the next one can be sampled"
# (``Scheduler._update_waiting_for_remote_kv``: ``request.num_computed_tokens = request.num_tokens - 1`` on a full
# prompt hit), so token 0, its logprob and its top-k candidates are the decode's own; the prefill's ``max_tokens=1``
# token is never published. ``ServingTokens._create_tokens_logprobs``: ``GenerateLogProbsContent(token_id, logprob,
# rank, top_logprobs)`` with the sampled token first, ``rank or None``, and ``logprob=-9999.0`` alone for a sampled
# token missing from the engine's map.


def tokens_logprobs(ids: list[int], shift: float) -> dict:
    content = []
    for i, t in enumerate(ids):
        if t == 8:
            content.append({"token_id": t, "logprob": -9999.0, "rank": None, "top_logprobs": []})
            continue
        top = [{"token_id": t, "logprob": -0.25 - i - shift, "rank": 2}]
        top += [{"token_id": 900 + j, "logprob": -0.125 - j - shift, "rank": 1 + j * 2} for j in range(2)]
        content.append({"token_id": t, "logprob": -0.25 - i - shift, "rank": 2, "top_logprobs": top})
    return {"content": content}


@pytest.mark.parametrize("stream", [False, True])
def test_every_top_k_logprob_row_is_the_decodes_own_token_0_included(stream):
    pre = prefill()
    pre["choices"][0]["logprobs"] = tokens_logprobs([41], 3.0)  # prefill's own token 0: never the answer

    def bodies(rows: np.ndarray) -> list[dict]:
        lp = tokens_logprobs([7, 8, 9], 0.0)
        if not stream:
            return [unary([{**choice([7, 8, 9], "stop", numpy2base64(rows)), "logprobs": lp}])]
        return [token_chunk({**choice([t], "stop" if t == 9 else None, numpy2base64(rows) if t == 9 else None),
                             "logprobs": {"content": [entry]}}) for t, entry in zip([7, 8, 9], lp["content"])]

    whole = expert_rows(0, len(PROMPT) + 2)
    stale = whole.copy()
    stale[:len(PROMPT)] = expert_rows(30, 30 + len(PROMPT))
    results = join(VLLMCodec(OPTIONS), [dumps(b) for b in bodies(stale)], [dumps(pre)])
    for (body, _), want in zip(results, bodies(whole), strict=True):
        assert_same(body, dumps(want))


# ------------------------------------------------------------------ ec_transfer_params: decode's own
#
# ``Scheduler._free_request`` asks the EC connector (``ec_connector.request_finished``) for the parameters of the
# request's encoder cache; only a producer (``ec_role`` ``ec_producer``/``ec_both``) returns any
# (``ECExampleConnector`` and the Mooncake and CPU connectors: ``return False, None`` otherwise), naming its own
# cache (``collect_ec_item_metadata``; the CPU connector adds ``peer_host``/``peer_port`` of its region). An E/P/D
# pipeline's P and D legs are consumers and answer ``null``, as an aggregated consumer; a decode that is a
# producer names its own cache, as an aggregated producer would. The join passes decode's value on.


@pytest.mark.parametrize("ec", [None, {"mm-0": {"modality": "image", "item_indices": [0],
                                                "metadata": {"image_grid_thw": [1, 4, 4]},
                                                "peer_host": "10.0.0.9", "peer_port": 7100}}])
def test_ec_transfer_params_are_the_decodes_own(ec):
    whole, stale = _rows_after_two_tokens()
    pre = {**prefill(), "ec_transfer_params": None if ec is None else {
        "mm-0": {**ec["mm-0"], "peer_host": "10.0.0.3"}}}
    agg = {**unary([choice([7, 8], "stop", numpy2base64(whole))]), "ec_transfer_params": ec}
    decode = {**unary([choice([7, 8], "stop", numpy2base64(stale))]), "ec_transfer_params": ec}
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(pre)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


# ---------------------------------------------------------------- sampling_mask of the first output token
#
# vLLM 0.34.0: a NIXL decode that loaded the whole prompt's KV recomputes its last token "so the next one can
# be sampled" (``Scheduler._update_waiting_for_remote_kv``: ``request.num_computed_tokens = request.num_tokens
# - 1``), so decode's sampler samples token 0 itself and builds its mask (``Sampler`` with
# ``return_sampling_mask``; ``Scheduler.update_from_output`` puts ``new_sampling_mask`` on that output;
# ``RequestState._new_completion_output`` on the chunk). Prefill's mask is that of its own ``out0``.


def test_a_decode_streams_first_token_sampling_mask_is_decodes_own_not_prefills():
    """The aggregated stream's first chunk has token 0's mask, and so does decode's (its own sample): the
    join passes decode's masks through, never prefill's mask of the unpublished ``out0``."""
    pre = prefill()
    pre["choices"][0]["sampling_mask"] = [[41, 7]]  # prefill sampled out0 = 41
    masks = [[[42, 9]], [[43]], [[44, 5, 6]]]  # decode sampled 42 (not 41) at position 0
    chunks = [token_chunk({**choice([42 + k], "length" if k == 2 else None, None), "sampling_mask": masks[k]})
              for k in range(3)]
    results = join(VLLMCodec(OPTIONS), [dumps(c) for c in chunks], [dumps(pre)])
    assert [json.loads(body)["choices"][0]["sampling_mask"] for body, _ in results] == masks
