"""Upstream-drift audit: bodies written by hand from the NEWEST upstream sources in the public index.

Nothing here uses the simulator, ``upstream.py`` or any other streamproc builder: each body is spelled
out from the upstream function named above it. Sources (the index stores many versions of a file;
the commit is the one the index reported for the version read, "index id" where it reported none):

* SGLang ``python/sglang/srt/managers/tokenizer_manager.py`` at commit
  ``001067fffe33427bee0ed2f007fb7551a1d76b44``: ``TokenizerManager._handle_batch_output``,
  ``_INCREMENTAL_STREAMING_META_INFO_KEYS``, ``_slice_streaming_output_meta_info``.
* SGLang ``python/sglang/srt/disaggregation/utils.py`` ``MetadataBuffers.set_buf`` (index id
  54506714605) and ``disaggregation/decode.py`` ``DecodeTransferQueue._commit_transfer_to_req`` (index
  id 54491847455): the first token's sampling mask travels to decode, so decode's list is complete.
* vLLM ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` (index id 70125355188):
  ``ServingTokens.serve_tokens`` (``prompt_logprob_token_ids`` refused for streams) and
  ``_build_full_response`` (``prompt_token_id_logprobs=numpy2base64(...)``); ``protocol.py`` at
  commit ``006ebac240f34ddcd36383832b28c25840d2ea80``: ``GenerateResponseBase`` field order.
* SGLang ``return_indexer_topk``: ``state_capturer/base.py`` ``BaseTopkCapturer.get_topk`` /
  ``on_forward_end`` (commit ``0564b5215b333749d722348c3b3d9b92c3de8c44``),
  ``state_capturer/indexer_topk.py`` (commit ``02d3f4b2df5480f1a9767c88d76c8112d7b008d4``),
  ``managers/scheduler_components/batch_result_processor.py``
  ``SchedulerBatchResultProcessor._maybe_collect_indexer_topk`` / ``process_batch_result_prebuilt`` /
  ``_handle_finish_state_updated_req`` (index id 54487866788), ``disaggregation/prefill.py``
  ``process_batch_result_disagg_prefill`` / ``process_disagg_prefill_inflight_queue`` (commit
  ``000c2b942308ea5502978be73542016c230dba02``; index id 58615488336 for a newer version) and
  ``tokenizer_manager.py`` ``_handle_batch_output`` (index id 55043436083).
* vLLM ``sampling_mask``: ``vllm/v1/engine/output_processor.py`` ``RequestState._new_completion_output``
  (vLLM 0.34.0 wheel) and ``ServingTokens.serve_tokens_stream_generator`` / ``_build_full_response``
  (0.34.0 and index id 70125355188): a stream chunk's masks are its delta's.
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
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

# ------------------------------------------------------------------ SGLang: return_sampling_mask

SG_RID = "req-mask"
SG_PROMPT = 4
SG_OUT = [201, 202, 203]
SG_TEXT = ["a", "b", "c"]
# The sampling support of each output token (token ids the constrained sampler could pick) and the
# sampled token's log-probability renormalised over that support.
SG_MASKS = [[201, 7], [202], [203, 9, 11]]
SG_MASK_LPS = [-0.69, 0.0, -1.1]


def sglang_meta(start: int, end: int, *, finished: bool) -> dict:
    """``TokenizerManager._handle_batch_output`` (001067ff), ``return_sampling_mask=True``, no logprobs,
    metrics off::

        meta_info = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"}
        if state.obj.return_sampling_mask:                      # after convert_logprob_style
            meta_info["output_token_sampling_mask"] = state.output_token_sampling_mask
            meta_info["output_token_sampling_logprobs"] = state.output_token_sampling_logprobs
            meta_info["output_token_sampling_mask_length"] = len(state.output_token_sampling_mask)
        meta_info.update({"reasoning_tokens", "completion_tokens", "cached_tokens"})
        ...
        if state.finished: meta_info["e2e_latency"] = ...

    The state lists accumulate from output position 0; incremental streaming then slices the two
    ``_INCREMENTAL_STREAMING_META_INFO_KEYS`` (``_slice_streaming_output_meta_info``) to the chunk,
    while ``output_token_sampling_mask_length`` stays the running total."""
    meta = {"id": SG_RID, "finish_reason": {"type": "length", "length": 3} if finished else None,
            "prompt_tokens": SG_PROMPT, "weight_version": "default", "num_retractions": 0,
            "output_token_sampling_mask": SG_MASKS[start:end],
            "output_token_sampling_logprobs": SG_MASK_LPS[start:end],
            "output_token_sampling_mask_length": end,
            "reasoning_tokens": 0, "completion_tokens": end, "cached_tokens": 0}
    if finished:
        meta["e2e_latency"] = 0.25
    return meta


def sglang_unary() -> dict:
    """``stream=False``: one body once finished, ``{"text", "output_ids", "meta_info"}``, whole lists."""
    return {"text": "".join(SG_TEXT), "output_ids": SG_OUT, "meta_info": sglang_meta(0, 3, finished=True)}


def sglang_incremental() -> list[dict]:
    """``--incremental-streaming-output``, ``stream_interval=1``: ``{"text": delta_text, "output_ids":
    delta_output_ids, "meta_info": meta_info}`` per token, the sampling lists sliced from
    ``state.last_output_offset``."""
    return [{"text": SG_TEXT[k], "output_ids": [SG_OUT[k]],
             "meta_info": {**sglang_meta(0, k + 1, finished=k == 2),
                           "output_token_sampling_mask": SG_MASKS[k:k + 1],
                           "output_token_sampling_logprobs": SG_MASK_LPS[k:k + 1]}}
            for k in range(3)]


def sglang_cumulative() -> list[dict]:
    """The default (cumulative) stream: every chunk restates the lists from position 0 (the
    intermediate ``text`` is filled in by ``_wait_one_response``; here it is the running text)."""
    return [{"text": "".join(SG_TEXT[:k + 1]), "output_ids": SG_OUT[:k + 1],
             "meta_info": sglang_meta(0, k + 1, finished=k == 2)} for k in range(3)]


@pytest.mark.parametrize("stream", [sglang_incremental, sglang_cumulative])
def test_sglang_folded_stream_keeps_the_whole_sampling_mask(stream):
    """An incremental stream's ``output_token_sampling_mask`` / ``_logprobs`` are per-chunk slices like
    ``output_token_logprobs``: folded (``Codec.fold``, the edge's unary answer of a stream) they must
    concatenate to the unary body's lists, not keep the last chunk's slice."""
    folded = SGLangCodec(OPTIONS).fold([dumps(chunk) for chunk in stream()])
    assert_same(folded, dumps(sglang_unary()))


def test_sglang_pd_incremental_stream_with_sampling_mask_joins_to_the_aggregated_stream():
    """``set_buf`` sends the handoff token's mask and ``_commit_transfer_to_req`` appends it, so decode's
    chunks already equal the aggregated ones: the join must leave them as they are."""
    chunks = sglang_incremental()
    prefill = {"text": "a", "output_ids": [201],
               "meta_info": {**sglang_meta(0, 1, finished=False),
                             "finish_reason": {"type": "length", "length": 0}}}
    out = join(SGLangCodec(OPTIONS), [dumps(c) for c in chunks], [dumps(prefill)])
    for (body, verdict), want in zip(out, chunks):
        assert_same(body, dumps(want))
        assert verdict is Verdict.PASSTHROUGH


# ------------------------------------------------------------------ vLLM: prompt_logprob_token_ids

V_RID = "generate-tokens-r1"
V_PROMPT = [11, 12, 13, 14, 15]
V_OUT = [21, 22, 23]
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
              "remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 1}


def numpy2base64(arr: np.ndarray) -> str:
    """``vllm/utils/serial_utils.py`` ``numpy2base64``: ``np.save(..., allow_pickle=False)`` then Base64."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# The prompt's scores for two fixed candidate ids per position (``SamplingParams.prompt_logprob_token_ids``).
SCORES = numpy2base64(np.asarray([[-0.5, -1.5], [-2.5, -3.5], [-0.25, -4.0], [-1.0, -2.0]], dtype=np.float32))


def vllm_unary(*, out: list[int], scores: str | None, finish: str = "stop", kv: dict | None = None) -> dict:
    """``_build_full_response`` -> ``GenerateTokensResponse.model_dump()``: ``GenerateResponseBase``'s fields
    in declaration order (request_id, model, created, usage, prompt_logprobs, prompt_token_id_logprobs,
    prompt_token_ids, mm_placeholders, metrics, kv_transfer_params, ec_transfer_params), then
    ``output_mode`` and ``choices``; a choice is ``GenerateChoiceBase`` (index, finish_reason, token_ids,
    routed_experts, sampling_mask, weight_versions) plus ``logprobs``. No logprobs, no expert capture."""
    choice = {"index": 0, "finish_reason": finish, "token_ids": out, "routed_experts": None,
              "sampling_mask": None, "weight_versions": None, "logprobs": None}
    return {"request_id": V_RID, "model": "m", "created": 1700000000,
            "usage": {"prompt_tokens": len(V_PROMPT), "total_tokens": len(V_PROMPT) + len(out),
                      "completion_tokens": len(out), "completion_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_id_logprobs": scores, "prompt_token_ids": None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv, "ec_transfer_params": None,
            "output_mode": "tokens", "choices": [choice]}


def test_vllm_prompt_token_id_logprobs_are_taken_from_prefill():
    """Only the leg that runs the prompt scores it: prefill (the client's sampling parameters,
    ``max_tokens=1``) sends the scores, a decode that loaded the prompt's KV has none. The aggregated
    body has prefill's scores, so the P/D answer must too."""
    agg = vllm_unary(out=V_OUT, scores=SCORES)
    prefill = vllm_unary(out=V_OUT[:1], scores=SCORES, finish="length", kv=PREFILL_KV)
    decode = vllm_unary(out=V_OUT, scores=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_vllm_prompt_token_id_logprobs_a_decode_computed_itself_are_kept():
    """A decode that recomputed the prompt sends the same scores: nothing to change."""
    decode = vllm_unary(out=V_OUT, scores=SCORES)
    prefill = vllm_unary(out=V_OUT[:1], scores=SCORES, finish="length", kv=PREFILL_KV)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert body == dumps(decode)
    assert verdict is Verdict.PASSTHROUGH


def test_vllm_prompt_token_id_logprobs_without_a_prefill_leg_are_omitted_with_the_reason():
    """Prefill timed out: nothing tells whether the prompt was to be scored, so the field is ``null``
    with ``prompt_token_id_logprobs_unavailable_reason`` (as ``prompt_logprobs`` is)."""
    decode = vllm_unary(out=V_OUT, scores=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], None)
    assert b'"prompt_token_id_logprobs":null' in body
    assert b'"prompt_token_id_logprobs_unavailable_reason":"prefill_timeout"' in body
    assert verdict is Verdict.OMITTED


def test_vllm_prompt_token_id_logprobs_that_differ_between_the_legs_are_prefills():
    """Until 2026-12-05 omitted as ``inconsistent_legs``. vLLM 0.34.0's decode recomputes the prompt for
    ``prompt_logprob_token_ids`` (``Request.get_prefix_cache_hit_limit`` bounds the request, so
    ``skip_reading_external_kv``): another engine's floats. Prefill scored the prompt as the aggregated
    engine does, so its scores are published."""
    other = numpy2base64(np.zeros((4, 2), dtype=np.float32))
    decode = vllm_unary(out=V_OUT, scores=other)
    prefill = vllm_unary(out=V_OUT[:1], scores=SCORES, finish="length", kv=PREFILL_KV)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert json.loads(body)["prompt_token_id_logprobs"] == SCORES
    assert b"prompt_token_id_logprobs_unavailable_reason" not in body
    assert verdict is Verdict.JOINED


# ------------------------------------------------------------------ SGLang: return_indexer_topk

IX_PROMPT = 4
IX_OUT = [201, 202, 203]
IX_LAYERS, IX_TOPK = 2, 4


def indexer_rows(start: int, end: int) -> np.ndarray:
    """What the indexer of position ``p`` selects in each layer: earlier KV positions, ``-1`` padded."""
    rows = np.full((end - start, IX_LAYERS, IX_TOPK), -1, dtype="<i4")
    for r, p in enumerate(range(start, end)):
        for layer in range(IX_LAYERS):
            picks = [q for q in range(p, -1, -1) if (q + layer) % 2 == 0 or q == p][:IX_TOPK]
            rows[r, layer, :len(picks)] = picks
    return rows


def indexer_body(*, out: list[int], finish: dict, rows: np.ndarray | None) -> dict:
    """``TokenizerManager._handle_batch_output`` (index id 55043436083), one finished request::

        if getattr(recv_obj, "indexer_topk", None):
            val = recv_obj.indexer_topk[i]
            if val is not None:                   # a request that collected nothing has no key
                val = pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")
                meta_info["indexer_topk"] = val   # after routed_experts, before customized info

    ``IndexerTopkCapturer`` keeps ``int32`` rows of ``(num_indexer_layers, index_topk)``."""
    meta: dict = {"id": "req-ix", "finish_reason": finish, "prompt_tokens": IX_PROMPT,
                  "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
                  "completion_tokens": len(out), "cached_tokens": 0}
    if rows is not None:
        meta["indexer_topk"] = base64.b64encode(rows.tobytes()).decode()
    meta["e2e_latency"] = 0.25
    return {"text": "x" * len(out), "output_ids": out, "meta_info": meta}


@pytest.mark.parametrize("codec", [SGLangCodec, SGLangZstdCodec])  # sglang-zstd changes routed_experts only
def test_sglang_pd_indexer_topk_is_omitted_not_published_with_stale_prompt_rows(codec):
    """Aggregated: ``_maybe_collect_indexer_topk`` reads ``get_topk(req_pool_idx, seqlen,
    req_to_token_pool)`` (start 0, no start-len field): the host cache at the request's KV slots for
    positions ``[0, seqlen - 1)``, which ``on_forward_end`` filled from each forward's
    ``out_cache_loc``. P/D decode runs the same collection, but no forward of this request wrote its
    prompt slots there: they were filled by the KV transfer (``_commit_transfer_to_req`` carries no
    capture rows), so rows ``[0, prompt)`` are the zeroed host cache or an earlier request's. The
    prefill leg never collects: ``process_batch_result_disagg_prefill`` only finalizes the capture
    and neither it nor ``process_disagg_prefill_inflight_queue`` calls ``_maybe_collect_indexer_topk``,
    so prefill's body has no ``indexer_topk``. No leg has the prompt rows: the field is removed."""
    seqlen = IX_PROMPT + len(IX_OUT)
    length = {"type": "length", "length": len(IX_OUT)}
    agg = indexer_body(out=IX_OUT, finish=length, rows=indexer_rows(0, seqlen - 1))
    stale = np.zeros((IX_PROMPT, IX_LAYERS, IX_TOPK), dtype="<i4")  # BaseHostCache.buffer.zero_()
    decode = indexer_body(out=IX_OUT, finish=length,
                          rows=np.concatenate([stale, indexer_rows(IX_PROMPT, seqlen - 1)]))
    prefill = indexer_body(out=IX_OUT[:1], finish={"type": "length", "length": 0}, rows=None)
    assert decode["meta_info"]["indexer_topk"] != agg["meta_info"]["indexer_topk"]  # what would be published
    [(body, verdict)] = join(codec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    want = indexer_body(out=IX_OUT, finish=length, rows=None)
    want["meta_info"]["indexer_topk_unavailable_reason"] = "prefill_missing"
    assert_same(body, dumps(want))
    assert verdict is Verdict.OMITTED


def test_sglang_pd_one_token_decode_has_no_indexer_topk_and_nothing_is_invented():
    """A one-token P/D decode finishes in ``process_batch_result_prebuilt``, which never collects:
    neither leg has the key, as for a request that did not ask for it, so the body passes."""
    finish = {"type": "length", "length": 1}
    decode = indexer_body(out=IX_OUT[:1], finish=finish, rows=None)
    prefill = indexer_body(out=IX_OUT[:1], finish={"type": "length", "length": 0}, rows=None)
    [(body, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(decode))
    assert verdict is Verdict.PASSTHROUGH


# ------------------------------------------------------------------ vLLM: sampling_mask in a folded stream
#
# vLLM 0.34.0 wheel (``__commit_id__ = 'g62d4bc3c7'``) and the newest indexed ``token_in_token_out/serving.py``
# (index id 70125355188) build ``sampling_mask`` the same way:
#
# * ``vllm/v1/engine/output_processor.py`` ``RequestState._new_completion_output``::
#
#       if (delta or finished) and self.sampling_mask_chunks:
#           sampling_mask = SamplingMask([position for chunk in self.sampling_mask_chunks
#                                         for position in chunk.to_nested_list()])
#           if delta:
#               self.sampling_mask_chunks.clear()
#
#   so a ``RequestOutputKind.DELTA`` (stream) output carries the masks of its own new tokens only, and a
#   ``FINAL_ONLY`` (unary) output the masks of every token.
# * ``ServingTokens.serve_tokens_stream_generator`` / ``_build_full_response``: ``sampling_mask =
#   output.sampling_mask.token_ids`` on the choice (``GenerateStreamChoiceBase`` / ``GenerateChoiceBase``).

V_MASKS = [[21, 5], [22], [23, 8, 9]]  # the token ids the sampler could pick at each output position


def vllm_mask_choice(out: list[int], masks: list[list[int]], finish: str | None) -> dict:
    """``GenerateTokensChoice`` / ``GenerateTokensStreamChoice`` of 0.34.0 (``index, finish_reason,
    stop_reason, token_ids, routed_experts, sampling_mask, weight_versions``, then ``logprobs``)."""
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out, "routed_experts": None,
            "sampling_mask": masks, "weight_versions": None, "logprobs": None}


def test_vllm_folded_stream_keeps_the_whole_sampling_mask():
    """Each stream chunk's ``sampling_mask`` covers its own delta: folded (``Codec.fold``, the edge's
    unary answer of a stream) the lists must concatenate to the unary choice's, not keep the last
    chunk's."""
    chunks = [{"request_id": V_RID, "usage": None, "output_mode": "tokens",
               "choices": [vllm_mask_choice([V_OUT[k]], V_MASKS[k:k + 1], "stop" if k == 2 else None)]}
              for k in range(3)]
    unary_choice = vllm_mask_choice(V_OUT, V_MASKS, "stop")
    folded = json.loads(VLLMCodec(OPTIONS).fold([dumps(c) for c in chunks]))
    assert folded["choices"][0]["sampling_mask"] == unary_choice["sampling_mask"]
    assert folded["choices"][0]["token_ids"] == unary_choice["token_ids"]


# ------------------------------------------------------------------ vLLM: text in a folded output_mode="text" stream
#
# vLLM 0.34.0 wheel: ``RequestState._new_completion_output`` takes ``text =
# self.detokenizer.get_next_output_text(finished, delta)``, and ``BaseIncrementalDetokenizer.get_next_output_text``
# returns ``self.output_text[last_offset:length]`` (the text since the previous call) when ``delta``, the
# whole ``output_text`` otherwise. ``serve_tokens_stream_generator`` puts it on
# ``GenerateTextStreamChoice(text=output.text, ...)``; ``serve_tokens_full_generator`` on
# ``GenerateTextChoice(text=output.text, ...)``. Both are ``GenerateChoiceBase`` /
# ``GenerateStreamChoiceBase`` fields, then ``text``, then ``logprobs``.

V_TEXT = ["Hel", "lo", "!"]  # the detokenizer's delta per output token


def vllm_text_choice(out: list[int], text: str, finish: str | None) -> dict:
    """``GenerateTextChoice`` / ``GenerateTextStreamChoice`` of 0.34.0, no logprobs or mask."""
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out, "routed_experts": None,
            "sampling_mask": None, "weight_versions": None, "text": text, "logprobs": None}


def test_vllm_folded_text_stream_keeps_the_whole_text():
    """Each ``output_mode="text"`` stream chunk's ``text`` is its delta's: folded (``Codec.fold``, the edge's
    unary answer of a stream) the pieces must concatenate to the unary choice's text, not keep the last
    chunk's."""
    chunks = [{"request_id": V_RID, "usage": None, "output_mode": "text",
               "choices": [vllm_text_choice([V_OUT[k]], V_TEXT[k], "stop" if k == 2 else None)]}
              for k in range(3)]
    unary_choice = vllm_text_choice(V_OUT, "".join(V_TEXT), "stop")
    folded = json.loads(VLLMCodec(OPTIONS).fold([dumps(c) for c in chunks]))
    assert folded["choices"][0] == unary_choice  # every value; the fold's key order is its own (docs, "Fold")


def test_vllm_fold_of_a_unary_text_body_keeps_its_text():
    """A unary body folds to itself: its whole text stays as it is."""
    body = {"request_id": V_RID, "usage": None, "output_mode": "text",
            "choices": [vllm_text_choice(V_OUT, "".join(V_TEXT), "stop")]}
    folded = json.loads(VLLMCodec(OPTIONS).fold([dumps(body)]))
    assert folded["choices"][0]["text"] == "Hello!"


def test_vllm_folded_stream_choice_has_the_unary_choices_key_order():
    """``GenerateTokensStreamChoice`` and ``GenerateTokensChoice`` declare the same fields in the same
    order (``GenerateStreamChoiceBase`` / ``GenerateChoiceBase``: index, finish_reason, stop_reason,
    token_ids, routed_experts, sampling_mask, weight_versions; then ``logprobs``), and pydantic dumps
    them in that order. The folded choice (the edge's unary answer of a stream) must keep it, as a client
    comparing bodies sees it: the fold wrote ``logprobs`` second and ``stop_reason`` after the mask."""
    chunks = [{"request_id": V_RID, "usage": None, "output_mode": "tokens",
               "choices": [vllm_mask_choice([V_OUT[k]], V_MASKS[k:k + 1], "stop" if k == 2 else None)]}
              for k in range(3)]
    folded = json.loads(VLLMCodec(OPTIONS).fold([dumps(c) for c in chunks]))
    assert list(folded["choices"][0]) == list(vllm_mask_choice(V_OUT, V_MASKS, "stop"))


# ------------------------------------------------------------------ vLLM: message in a folded output_mode="derender" stream
#
# vLLM 0.34.0 wheel, ``token_in_token_out/serving.py``: ``serve_tokens_stream_generator`` puts
# ``ChatStreamProcessor.step``'s delta on ``GenerateDerenderStreamChoice(delta=..., **choice_fields)``
# (``delta.role = "assistant"`` on a choice's first chunk; ``_serialize_delta``: ``model_dump(exclude_none=True)``);
# without a parser ``step`` returns ``DeltaMessage(content=delta_text)``. ``serve_tokens_full_generator`` puts
# ``OnlineDerenderer.derender_text_choices``'s ``ChatMessage(role="assistant", content=output.text)`` (no parser)
# on ``GenerateDerenderChoice(message=..., **fields)``, dumped by ``JSONResponse(content=model_dump())``:
# ``ChatMessage`` is role, content, refusal, audio, function_call, tool_calls (popped when empty), reasoning
# (``annotations`` has ``exclude_if=None``). ``GenerateDerenderStreamChoice`` / ``GenerateDerenderChoice``
# are the ``GenerateStreamChoiceBase`` / ``GenerateChoiceBase`` fields, then ``delta`` / ``message``, then
# ``logprobs``. With ``include_reasoning=false`` (``hide_metadata``) both set ``token_ids``, ``logprobs`` and
# ``sampling_mask`` to None.


def vllm_derender_choice(out: list[int] | None, finish: str | None, place: str, value: dict) -> dict:
    """``GenerateDerenderChoice`` / ``GenerateDerenderStreamChoice`` of 0.34.0, no logprobs or mask."""
    return {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": out, "routed_experts": None,
            "sampling_mask": None, "weight_versions": None, place: value, "logprobs": None}


def chat_message(content: str | None, reasoning: str | None = None, tool_calls: list | None = None) -> dict:
    """``ChatMessage.model_dump()`` of an assistant message ``derender_text_choices`` builds."""
    return {"role": "assistant", "content": content, "refusal": None, "audio": None, "function_call": None,
            **({"tool_calls": tool_calls} if tool_calls else {}), "reasoning": reasoning}


def derender_stream(deltas: list[dict], out: list[int] | None, finish: str) -> list[bytes]:
    return [dumps({"request_id": V_RID, "usage": None, "output_mode": "derender", "choices": [vllm_derender_choice(
        None if out is None else [out[k]], finish if k == len(deltas) - 1 else None, "delta", delta)]})
            for k, delta in enumerate(deltas)]


def test_vllm_folded_derender_stream_has_the_unary_message():
    """No parser: the deltas' content concatenates into the unary ``message`` (``ChatMessage(role="assistant",
    content=output.text)``), byte for byte and where the unary choice has it; the fold kept the last
    chunk's ``delta`` and built no ``message``."""
    deltas = [{"role": "assistant", "content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    folded = json.loads(VLLMCodec(OPTIONS).fold(derender_stream(deltas, V_OUT, "stop")))
    unary = vllm_derender_choice(V_OUT, "stop", "message", chat_message("Hello!"))
    assert dumps(folded["choices"][0]) == dumps(unary)


def test_vllm_folded_derender_stream_with_hidden_reasoning_has_no_token_ids():
    """``include_reasoning=false`` with a reasoning parser: every chunk's ``token_ids`` is None
    (``hide_metadata``), as is the unary choice's; the fold made it ``[]``."""
    deltas = [{"role": "assistant", "content": "Hi"}, {"content": "!"}]
    folded = json.loads(VLLMCodec(OPTIONS).fold(derender_stream(deltas, None, "stop")))
    unary = vllm_derender_choice(None, "stop", "message", chat_message("Hi!"))
    assert dumps(folded["choices"][0]) == dumps(unary)


def test_vllm_folded_derender_tool_call_stream_merges_its_calls_and_omits_the_unknown_content():
    """A tool parser's ``DeltaToolCall`` pieces (dumped without nulls: id, type, index, function) merge by
    ``index`` into ``ToolCall`` dumps (id, type, function{name, arguments}; ``FunctionCall.id`` is
    excluded). No content piece was streamed: the unary content is None under ``tool_choice="auto"`` and
    ``""`` under a forced one (``assemble_chat_message_fields``: ``content = content or ""`` when
    ``_forces_tool_calls``), and the stream does not say which, so it is omitted with a reason."""
    deltas = [{"role": "assistant", "reasoning": "need "}, {"reasoning": "weather"},
              {"tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "index": 0,
                               "function": {"name": "get_weather", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}]
    out = [31, 32, 33, 34, 35]
    folded = json.loads(VLLMCodec(OPTIONS).fold(derender_stream(deltas, out, "tool_calls")))
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    message = {**chat_message(None, "need weather", [call]), "content_unavailable_reason": "fold_ambiguous"}
    assert dumps(folded["choices"][0]) == dumps(vllm_derender_choice(out, "tool_calls", "message", message))


def test_vllm_fold_of_a_unary_derender_body_keeps_its_message():
    """A unary body folds to itself: its message stays as it is."""
    choice = vllm_derender_choice(V_OUT, "stop", "message", chat_message("Hello!"))
    body = {"request_id": V_RID, "usage": None, "output_mode": "derender", "choices": [choice]}
    assert dumps(json.loads(VLLMCodec(OPTIONS).fold([dumps(body)]))["choices"][0]) == dumps(choice)
