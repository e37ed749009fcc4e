"""Aborted P/D requests of vLLM 0.34.0, unary and ``n = 2``, join to what the aggregated engine answers.

Independent differential check written by hand from ``vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl`` (paths
relative to ``vllm/``), not from the simulator, ``streamproc_vllm.upstream`` or another test's fixtures. The
server runs ``--enable-prompt-tokens-details``, routed-expert capture and speculative decoding; the NIXL
connector hands decode its ``kv_transfer_params``.

**An abort** (``v1/engine/output_processor.py`` ``OutputProcessor.abort_requests``)::

    request_output := req_state.make_request_output(new_token_ids=[], ..., finish_reason=FinishReason.ABORT,
                                                    stop_reason=None, kv_transfer_params=None, ...)

For a unary request (``RequestOutputKind.FINAL_ONLY``) ``_new_completion_output`` takes the whole
``detokenizer.output_token_ids`` and logprobs, and on a finish ``routed_experts = np.concatenate(
self.routed_experts_chunks, axis=0)`` (``None`` without chunks: a child aborted before its first output);
``_new_request_output`` sets ``num_cached_tokens=self.num_cached_tokens`` and ``kv_transfer_params`` (``None``).
``entrypoints/scale_out/token_in_token_out/serving.py`` ``serve_tokens_full_generator`` raises only on
``"error"`` (``_raise_if_error``) and builds ``GenerateTextChoice(finish_reason=output.finish_reason or "stop",
...)`` per output, ``_build_response_fields`` the rest::

    usage = UsageInfo(prompt_tokens=..., completion_tokens=num_generated_tokens, total_tokens=...)
    if self.enable_prompt_tokens_details and final_res.num_cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=final_res.num_cached_tokens)
    per_request_metrics = None
    if request.sampling_params.n == 1:
        spec_stats = build_spec_decoding_metrics(final_res)
        if spec_stats is not None:
            per_request_metrics = PerRequestMetrics(speculative_decoding=spec_stats)

**Cached tokens in P/D.** ``v1/core/sched/scheduler.py`` (prefill engine, on finish)::

    # P-side cache hits, so D can report them in prompt_tokens_details instead of its own (~100%)
    # hit rate from the KV transfer.
    kv_transfer_params["remote_prefill_cached_tokens"] = (prefill_stats.num_cached_tokens)

and the decode engine's ``RequestState.from_new_request`` reads it from its request's
``kv_transfer_params`` (``do_remote_prefill``); ``OutputProcessor.process_outputs`` on the first output::

    if req_state.is_prefilling:
        if engine_core_output.prefill_stats is not None:
            req_state.num_cached_tokens = (engine_core_output.prefill_stats.num_cached_tokens)
        ...
        if req_state.remote_prefill_cached_tokens is not None:
            req_state.num_cached_tokens = req_state.remote_prefill_cached_tokens

So a decode with tokens reports prefill's own prefix hits, as the aggregated engine reports its own; a
decode aborted before its first output never leaves ``is_prefilling``: 0, as the aggregated engine's.

**Streamed ``n = 2``** (``serve_tokens_stream_generator``): one chunk per child output (``index`` the
child's), "Terminal outputs are always emitted so the client sees the finish reason, e.g. an abort, which
has no new tokens"; ``abort_requests`` on the parent aborts the children in the order they were added
(child 0, then child 1); the usage chunk (``model_dump_json(exclude_none=True)``) sums the children's tokens
and has no ``metrics`` (``n > 1``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps
from vllm_034_bodies import npy_b64, pd_rows

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_vllm import VLLMCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "cmpl-7c3e91d2-0"
PROMPT = [101, 102, 103, 104, 105]
OUT = {0: [72, 101, 108, 108], 1: [87, 111, 114]}
TEXT = {0: ["H", "e", "l", "l"], 1: ["W", "o", "r"]}
CREATED = 1764979260
CACHED = 2  # prefill's own prefix-cache hits (prefill_stats.num_cached_tokens)


def rows(child: int, stale: bool) -> np.ndarray:
    return pd_rows(len(PROMPT), len(OUT[child]), child=child, stale=stale)


def content(child: int, pos: int) -> dict:
    """``_create_text_logprobs``: ``ChatCompletionLogProbsContent`` (``token, logprob, bytes, top_logprobs``)."""
    tok = TEXT[child][pos]
    entry = {"token": tok, "logprob": -0.25 * (pos + 1) - child,
             "bytes": list(tok.encode("utf-8", errors="replace"))}
    return {**entry, "top_logprobs": [dict(entry)]}


def spec_metrics() -> dict:
    """``PerRequestMetrics(speculative_decoding=SpeculativeDecodingMetrics(**metrics.to_dict()))``,
    ``model_dump()``: every field, ``None`` included. Decode ran every verify step of the request."""
    return {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": None,
            "mean_itl_ms": None, "tokens_per_second": None,
            "speculative_decoding": {"mean_acceptance_length": 1.5, "draft_acceptance_rate": 0.25,
                                     "acceptance_histogram": [1, 1, 0], "num_spec_steps": 2,
                                     "num_accepted_draft_tokens": 1, "num_draft_tokens": 4, "num_spec_tokens": 2,
                                     "per_step_accepted": None, "per_step_drafted": None}}


def unary_choice(child: int, k: int, finish: str, experts: str | None) -> dict:
    """``GenerateTextChoice`` (``index, finish_reason, stop_reason, token_ids, routed_experts, sampling_mask,
    weight_versions, text, logprobs``) of a child with ``k`` tokens."""
    return {"index": child, "finish_reason": finish, "stop_reason": None, "token_ids": OUT[child][:k],
            "routed_experts": experts, "sampling_mask": None, "weight_versions": None,
            "text": "".join(TEXT[child][:k]),
            "logprobs": {"content": [content(child, p) for p in range(k)]}}


def usage(prompt: int, completion: int, cached: int | None, *, unary: bool) -> dict:
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                         "completion_tokens": completion}
    if cached is not None:
        u["prompt_tokens_details"] = ({"cached_tokens": cached, "created_cache_tokens": None,
                                       "multimodal_tokens": None} if unary else {"cached_tokens": cached})
    if unary:
        u["completion_tokens_details"] = None
    return u


def unary(choices: list[dict], cached: int | None, metrics: dict | None, kv: dict | None) -> bytes:
    """``GenerateTextResponse.model_dump()`` via ``JSONResponse``."""
    completion = sum(len(c["token_ids"]) for c in choices)
    return dumps({"request_id": RID, "model": "m", "created": CREATED,
                  "usage": usage(len(PROMPT), completion, cached, unary=True),
                  "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
                  "mm_placeholders": None, "metrics": metrics, "kv_transfer_params": kv,
                  "ec_transfer_params": None, "output_mode": "text", "choices": choices})


def nixl_params() -> dict:
    """The prefill engine's ``kv_transfer_params`` for decode, with ``remote_prefill_cached_tokens``."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3]],
            "remote_engine_id": "e0", "remote_request_id": RID, "remote_host": "10.0.0.2", "remote_port": 5600,
            "tp_size": 1, "remote_prefill_cached_tokens": CACHED}


def prefill_leg(children: int) -> list[bytes]:
    """``max_tokens=1``: each child's token 0 and its prompt rows ``[0, prompt)``; unary, ``metrics`` only
    for ``n == 1`` (one verify-free step: ``build_spec_decoding_metrics`` has no metrics then)."""
    choices = [unary_choice(c, 1, "length", npy_b64(rows(c, False)[:len(PROMPT)])) for c in range(children)]
    return [unary(choices, CACHED, None, nixl_params())]


@pytest.mark.parametrize("k", [1, 3])
def test_a_unary_decode_aborted_after_tokens_joins_to_the_aggregated_abort_body(k):
    """The abort body's rows cover the whole request, the prompt's stale on decode: prefill's replace them;
    ``prompt_tokens_details`` is prefill's hits (what decode reported too, from ``remote_prefill_cached_tokens``,
    and what the aggregated engine counts); the spec metrics and the null ``kv_transfer_params`` pass."""
    def body(stale: bool) -> bytes:
        experts = npy_b64(rows(0, stale)[:len(PROMPT) + k - 1])
        return unary([unary_choice(0, k, "abort", experts)], CACHED, spec_metrics(), None)

    agg, dec = body(False), body(True)
    assert agg != dec
    codec = VLLMCodec(OPTIONS)
    [(got, verdict)] = join(codec, [dec], prefill_leg(1))
    assert verdict is Verdict.JOINED
    assert_same_body(got, agg)
    assert got == agg
    assert not codec.folds_alone(got)  # answered verbatim: an abort is a 200 body in vLLM
    assert codec.answer_status(got) == 200


def test_a_unary_decode_aborted_before_its_first_output_is_published_as_the_aggregated_abort():
    """Aborted while it waited for its KV: no token, ``routed_experts`` null (no chunk received), and
    ``num_cached_tokens`` 0 (``is_prefilling`` never cleared), as the aggregated engine's abort before its
    first output; nothing of the prefill leg is spliced in."""
    dec = unary([unary_choice(0, 0, "abort", None)], 0, None, None)
    [(got, _)] = join(VLLMCodec(OPTIONS), [dec], prefill_leg(1))
    assert got == dec


def test_a_decode_with_tokens_reports_prefills_cached_tokens_and_the_join_keeps_that_count():
    """A finished unary decode: ``prompt_tokens_details.cached_tokens`` is the count the prefill engine put
    in ``remote_prefill_cached_tokens``; the aggregated engine's own hit count is that same prefix hit, so
    the joined body equals the aggregated one (rows aside, joined too)."""
    fin = unary([unary_choice(0, 4, "length", npy_b64(rows(0, True)))], CACHED, spec_metrics(), None)
    agg = unary([unary_choice(0, 4, "length", npy_b64(rows(0, False)))], CACHED, spec_metrics(), None)
    [(got, _)] = join(VLLMCodec(OPTIONS), [fin], prefill_leg(1))
    assert got == agg
    assert json.loads(got)["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED


def stream_choice(child: int, pos: int | None, finish: str | None, experts: str | None) -> dict:
    """``GenerateTextStreamChoice``; ``pos`` None: the abort output, no token."""
    return {"index": child, "finish_reason": finish, "stop_reason": None,
            "token_ids": [] if pos is None else [OUT[child][pos]], "routed_experts": experts,
            "sampling_mask": None, "weight_versions": None, "text": "" if pos is None else TEXT[child][pos],
            "logprobs": {"content": [] if pos is None else [content(child, pos)]}}


def chunk(choice: dict) -> bytes:
    """``GenerateTextStreamResponse`` (``request_id, usage, prompt_token_ids, mm_placeholders, metrics``, then
    ``output_mode, choices``) dumped with ``exclude={"prompt_token_ids", "mm_placeholders", "metrics"}`` (each
    ``None``): ``usage`` stays, null (no continuous usage)."""
    return dumps({"request_id": RID, "usage": None, "output_mode": "text", "choices": [choice]})


def n2_stream(stale: bool, child0_tokens: int) -> list[bytes]:
    """Child 0 streams ``child0_tokens`` tokens; child 1 waits (P/D: for its KV; aggregated: in the queue).
    The abort: child 0's terminal output with its rows, then child 1's with none; the usage chunk."""
    out = [chunk(stream_choice(0, p, None, None)) for p in range(child0_tokens)]
    experts = npy_b64(rows(0, stale)[:len(PROMPT) + child0_tokens - 1])
    out.append(chunk(stream_choice(0, None, "abort", experts)))
    out.append(chunk(stream_choice(1, None, "abort", None)))
    out.append(dumps({"request_id": RID, "usage": {"prompt_tokens": len(PROMPT),
                                                   "total_tokens": len(PROMPT) + child0_tokens,
                                                   "completion_tokens": child0_tokens},
                      "output_mode": "text", "choices": []}))
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_a_streamed_n2_abort_with_one_child_started_joins_to_the_aggregated_stream(k):
    """Child 0's abort chunk carries its rows (prompt rows stale on decode): prefill's child 0 rows replace
    them, never child 1's; child 1's abort chunk keeps its null rows; every chunk equals the aggregated one."""
    agg, dec = n2_stream(False, k), n2_stream(True, k)
    codec = VLLMCodec(OPTIONS)
    out = join(codec, dec, prefill_leg(2))
    assert len(out) == len(agg)
    for (got, _), want in zip(out, agg):
        assert_same_body(got, want)
        assert got == want
    assert codec.fold([b for b, _ in out]) == codec.fold(agg)


def n2_unary(stale: bool, child0_finish: str, cached: int) -> bytes:
    """Unary ``n = 2``: ``ParentRequest.get_outputs`` holds the children's outputs until every child finished
    and the parent's ``RequestOutput`` is built by the last one (its ``num_cached_tokens``). Child 0 ran 3
    tokens and ended ``child0_finish``; child 1 was aborted before its first output (no rows, count 0), and
    ``abort_requests`` walked it last (children in the order they were added)."""
    experts = npy_b64(rows(0, stale)[:len(PROMPT) + 3 - 1])
    return unary([unary_choice(0, 3, child0_finish, experts), unary_choice(1, 0, "abort", None)],
                 cached, None, None)


@pytest.mark.parametrize("child0_finish", ["length", "abort"])
def test_a_unary_n2_abort_with_an_unstarted_child_joins_child_0s_rows_and_keeps_the_count_of_0(child0_finish):
    """The unstarted child built the body, on both engines: its count 0 is the aggregated one and stays;
    child 0's stale prompt rows are replaced with prefill's child 0 rows; ``metrics`` is null (``n > 1``)."""
    agg, dec = n2_unary(False, child0_finish, 0), n2_unary(True, child0_finish, 0)
    [(got, _)] = join(VLLMCodec(OPTIONS), [dec], prefill_leg(2))
    doc = json.loads(got)
    assert doc["choices"][0]["routed_experts"] == json.loads(agg)["choices"][0]["routed_experts"]
    assert doc["choices"][1]["routed_experts"] is None
    if child0_finish == "length":
        assert_same_body(got, agg)
        assert got == agg
    else:
        # Which child built the body depends on how the abort was made, which no body shows
        # (docs/formats-vllm.md, rule 6): the count is the aggregated one (0) or omitted, never prefill's.
        details = doc["usage"]["prompt_tokens_details"]
        assert details is None or details["cached_tokens"] == 0
        if details is None:
            assert doc["usage"]["prompt_tokens_details_unavailable_reason"] == "decode_error"


def test_a_unary_n2_abort_of_two_started_children_omits_a_count_no_leg_has():
    """Both children ran (3 and 2 tokens) when the abort came: the body's count is the last child's, which on
    the aggregated engine may include its sibling's freshly cached prompt blocks (``KVCacheManager.allocate_slots``
    caches a child's full blocks as they are allocated). No leg has that count: omitted with its reason, never
    prefill's last child's; both children's rows are joined from prefill's children of the same index."""
    def body(stale: bool) -> bytes:
        return unary([unary_choice(0, 3, "abort", npy_b64(rows(0, stale)[:len(PROMPT) + 2])),
                      unary_choice(1, 2, "abort", npy_b64(rows(1, stale)[:len(PROMPT) + 1]))], CACHED, None, None)

    [(got, verdict)] = join(VLLMCodec(OPTIONS), [body(True)], prefill_leg(2))
    doc, agg = json.loads(got), json.loads(body(False))
    assert verdict is Verdict.OMITTED
    assert doc["usage"]["prompt_tokens_details"] is None
    assert doc["usage"]["prompt_tokens_details_unavailable_reason"] == "prefill_missing"
    assert [c["routed_experts"] for c in doc["choices"]] == [c["routed_experts"] for c in agg["choices"]]
    del doc["usage"]["prompt_tokens_details_unavailable_reason"]
    doc["usage"]["prompt_tokens_details"] = agg["usage"]["prompt_tokens_details"]
    assert doc == agg
