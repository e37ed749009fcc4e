"""Format fidelity of the vLLM codec, bodies written by hand from upstream vLLM's source.

Nothing here uses the simulator (``worker.py``), ``streamproc_vllm.upstream`` or any other streamproc
builder: each body is spelled out from the upstream function named next to it, and each P/D result is
compared with what the aggregated engine returns for the same request (JSON equality and key order).

Upstream source read (vllm-project/vllm, the commit the index reported for the version read):

* ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` @ ``00a80787a504467c1bcd76d5405a50b2aaa00d5a``:
  ``ServingTokens.serve_tokens_full_generator``::

      usage = UsageInfo(prompt_tokens=..., completion_tokens=..., total_tokens=...)
      if self.enable_prompt_tokens_details and final_res.num_cached_tokens is not None:
          usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=final_res.num_cached_tokens)

  and ``serve_tokens_stream_generator`` (``num_cached_tokens = res.num_cached_tokens`` on the first
  output; the same ``prompt_tokens_details`` on the ``choices: []`` usage chunk, dumped with
  ``exclude_none=True``; continuous-usage chunks carry no details). The older
  ``vllm/entrypoints/serve/disagg/serving.py`` @ ``0001948bc76939369ca855c90b36d81256477e85`` sets it
  only ``if self.enable_prompt_tokens_details and final_res.num_cached_tokens`` (so ``null`` when no
  prompt token was cached).
* ``vllm/v1/core/sched/scheduler.py`` @ ``00024d314514900f361ad072af6931e403b7f589``
  ``Scheduler.schedule``: ``num_computed_tokens = num_new_local_computed_tokens +
  num_external_computed_tokens`` and then ``if request.num_cached_tokens < 0:
  request.num_cached_tokens = num_computed_tokens``: the KV a connector loaded counts as cached.
  After an async load the request comes back with ``request.num_computed_tokens`` set by
  ``_update_waiting_for_remote_kv`` (every loaded block, minus one token when the whole prompt was
  loaded, so that the last prompt token is recomputed to sample the first output token).
* ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` @
  ``002a1057e9ae674d7bdc9c4be95bc29d65d2e808`` ``NixlConnectorScheduler.get_num_new_matched_tokens``:
  a decode request with ``do_remote_prefill`` loads ``len(prompt_token_ids) - num_computed_tokens``
  tokens ("Remote prefill: get all prompt blocks from remote"); a prefill request
  (``do_remote_decode``) loads nothing, so its count is its own prefix-cache hit, exactly what an
  aggregated engine reports for the same prompt.

So a P/D decode leg reports ``cached_tokens`` = the whole prompt but one, which no aggregated engine
reports for a prompt it had not cached: the count that equals the aggregated one is prefill's.
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

RID = "generate-tokens-r7"
PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks and a partial one
OUT = [21, 22, 23]
LPS = [-0.5, -0.25, -1.0]
LAYERS, TOPK = 2, 2
# What the decode engine counts as cached: the loaded prompt minus the recomputed last token.
DECODE_CACHED = len(PROMPT) - 1


def npy_b64(arr: np.ndarray) -> str:
    """``serve_tokens_full_generator``: ``np.save(buf, output.routed_experts)`` then
    ``base64.b64encode(buf.getvalue()).decode("ascii")``."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def rows(start: int, end: int) -> np.ndarray:
    """Expert ids of positions [start, end), distinct within a (position, layer)."""
    ids = [[[(p * 5 + layer * 3 + k * 7 + 1) % 64 + k * 64 for k in range(TOPK)] for layer in range(LAYERS)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.uint8).reshape(-1, LAYERS, TOPK)


def logprobs(ids: list[int], lps: list[float]) -> dict:
    """``ServingTokens._create_tokens_logprobs`` (00a80787): ``ChatCompletionLogProbsContent(token=
    f"token_id:{id}", logprob=max(lp, -9999.0), bytes=None, top_logprobs=[...])``."""
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None}]}
                        for t, lp in zip(ids, lps)]}


def usage(completion: int, cached: int | None, *, details: bool = True) -> dict:
    """``UsageInfo`` field order (prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details);
    ``details=False``: a server without ``--enable-prompt-tokens-details`` whose dump leaves it out."""
    u: dict = {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + completion,
               "completion_tokens": completion}
    if details:
        u["prompt_tokens_details"] = None if cached is None else {"cached_tokens": cached}
    return u


def unary(*, out: list[int], cached: int | None, experts: str | None, finish: str = "stop",
          kv: dict | None = None, details: bool = True) -> dict:
    """``serve_tokens_full_generator`` -> ``GenerateResponse`` (``JSONResponse(model_dump())``)."""
    choice = {"index": 0, "logprobs": logprobs(out, LPS[:len(out)]), "finish_reason": finish,
              "stop_reason": None, "token_ids": out, "routed_experts": experts}
    return {"request_id": RID, "model": "m", "created": 1700000000, "choices": [choice],
            "usage": usage(len(out), cached, details=details), "prompt_logprobs": None,
            "kv_transfer_params": kv}


# NixlConnectorScheduler.request_finished (002a1057) for a length-capped prefill request.
PREFILL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5, 6],
              "remote_engine_id": "p0", "remote_request_id": RID, "remote_host": "10.0.0.1",
              "remote_port": 5600, "tp_size": 1}


def stream(out_chunks: list[list[int]], experts_last: str | None, cached: int) -> list[dict]:
    """``serve_tokens_stream_generator`` (00a80787): a ``GenerateStreamResponse`` per delta
    (``model_dump_json()``, nulls kept; ``routed_experts`` only on the finished output), then with
    include_usage the ``choices: []`` chunk with ``prompt_tokens_details`` (``exclude_none=True``)."""
    bodies = []
    pos = 0
    for k, ids in enumerate(out_chunks):
        last = k == len(out_chunks) - 1
        choice = {"index": 0, "logprobs": logprobs(ids, LPS[pos:pos + len(ids)]),
                  "finish_reason": "stop" if last else None, "stop_reason": None, "token_ids": ids,
                  "routed_experts": experts_last if last else None}
        bodies.append({"request_id": RID, "choices": [choice], "usage": None})
        pos += len(ids)
    bodies.append({"request_id": RID, "choices": [], "usage": usage(pos, cached)})
    return bodies


def details_of(body: bytes) -> tuple[object, object]:
    u = json.loads(body)["usage"]
    return u.get("prompt_tokens_details", "absent"), u.get("prompt_tokens_details_unavailable_reason")


# ------------------------------------------------- usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("prefill_cached", [0, 32])
def test_decode_cached_tokens_counting_the_transferred_prompt_are_replaced_by_prefills_count(prefill_cached):
    """The aggregated engine reports its own prefix-cache hit (0 cold, 32 with two cached blocks); the
    prefill leg, which ran the prompt, reports the same; the decode leg reports the KV NIXL loaded
    (``DECODE_CACHED``). The joined body must carry the aggregated count, not decode's."""
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, cached=prefill_cached, experts=npy_b64(rows(0, total)))
    prefill = unary(out=OUT[:1], cached=prefill_cached, experts=npy_b64(rows(0, len(PROMPT))),
                    finish="length", kv=PREFILL_KV)
    stale = np.zeros_like(rows(0, len(PROMPT) - 1))  # slots NIXL wrote: no capture ran for them
    decode = unary(out=OUT, cached=DECODE_CACHED,
                   experts=npy_b64(np.concatenate([stale, rows(len(PROMPT) - 1, total)])))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_decode_cached_tokens_are_replaced_even_when_nothing_else_needs_joining():
    """Expert capture off: the only difference from the aggregated body is decode's cached count, so
    passing decode's bytes through is wrong."""
    agg = unary(out=OUT, cached=0, experts=None)
    prefill = unary(out=OUT[:1], cached=0, experts=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, cached=DECODE_CACHED, experts=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_stream_usage_chunk_carries_prefills_cached_tokens():
    """The stream's usage-only chunk (``exclude_none``) carries decode's count; the joined stream must
    equal the aggregated stream chunk for chunk, and the middle chunk still passes through."""
    total = len(PROMPT) + len(OUT) - 1
    agg = stream([[21], [22, 23]], npy_b64(rows(0, total)), cached=0)
    prefill = unary(out=OUT[:1], cached=0, experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = stream([[21], [22, 23]], npy_b64(rows(0, total)), cached=DECODE_CACHED)
    results = join(VLLMCodec(OPTIONS), [dumps(d) for d in decode], [dumps(prefill)])
    assert len(results) == len(agg)
    for (body, _), want in zip(results, agg):
        assert_same(body, dumps(want))
    assert results[0][1] is Verdict.PASSTHROUGH


def test_older_serving_null_details_on_a_cold_prefill_give_the_aggregated_null():
    """``serve/disagg/serving.py`` (0001948b) sets the details only when ``num_cached_tokens`` is
    truthy: a cold aggregated engine and a cold prefill both dump ``"prompt_tokens_details": null``
    while decode has ``{"cached_tokens": P - 1}``."""
    agg = unary(out=OUT, cached=None, experts=None)
    prefill = unary(out=OUT[:1], cached=None, experts=None, finish="length", kv=PREFILL_KV)
    decode = unary(out=OUT, cached=DECODE_CACHED, experts=None)
    [(body, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def test_cached_tokens_without_a_prefill_leg_are_omitted_with_the_reason():
    """Prefill timed out: nothing says what the aggregated engine would have counted."""
    decode = unary(out=OUT, cached=DECODE_CACHED, experts=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], None)
    assert details_of(body) == (None, "prefill_timeout")
    assert verdict is Verdict.OMITTED


def test_cached_tokens_of_a_prefill_without_the_field_are_omitted_as_prefill_missing():
    """A prefill server without ``--enable-prompt-tokens-details`` (no key in its usage) behind a decode
    server with it: decode's count is not the aggregated one, and prefill's is unknown."""
    prefill = unary(out=OUT[:1], cached=0, experts=None, finish="length", kv=PREFILL_KV, details=False)
    decode = unary(out=OUT, cached=DECODE_CACHED, experts=None)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert details_of(body) == (None, "prefill_missing")
    assert verdict is Verdict.OMITTED


def test_a_body_without_prompt_tokens_details_is_left_without_them():
    """Neither server reports details: the aggregated body has none, so none is added."""
    agg = unary(out=OUT, cached=None, experts=None, details=False)
    prefill = unary(out=OUT[:1], cached=None, experts=None, finish="length", kv=PREFILL_KV, details=False)
    decode = unary(out=OUT, cached=None, experts=None, details=False)
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.PASSTHROUGH
    assert body == dumps(decode)


# ------------------------------------- a resumed attempt's cached_tokens (migration stitch)


def test_resumed_attempt_cached_tokens_never_exceed_the_original_prompt():
    """A resumed attempt's prompt is the original prompt plus the k emitted tokens
    (``resume_request``), and the engine counts cached tokens over that whole prompt
    (``Scheduler.schedule`` / ``serve_tokens_full_generator``, as above): blocks holding emitted tokens
    (the earlier attempt's, left in the prefix cache) count too. The stitch restates ``prompt_tokens``
    as the original prompt's, so a cached count above it describes no prompt the client sent."""
    codec = VLLMCodec(OPTIONS)
    session = codec.open_migration()
    first = {"request_id": RID, "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                             "stop_reason": None, "token_ids": OUT[:2],
                                             "routed_experts": None}], "usage": None}
    session.absorb([dumps(first)])
    session.seal()
    k = 2
    resumed_prompt = len(PROMPT) + k
    retry = unary(out=OUT[2:], cached=None, experts=None)
    retry["usage"] = {"prompt_tokens": resumed_prompt, "total_tokens": resumed_prompt + 1, "completion_tokens": 1,
                      "prompt_tokens_details": {"cached_tokens": resumed_prompt - 1}}
    stitched = session.stitch(dumps(retry), True)
    assert stitched is not None
    u = json.loads(stitched[0])["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (len(PROMPT), 3, len(PROMPT) + 3)
    assert u["prompt_tokens_details"] == {"cached_tokens": len(PROMPT)}


def test_resumed_attempt_cached_tokens_within_the_original_prompt_stay():
    codec = VLLMCodec(OPTIONS)
    session = codec.open_migration()
    first = {"request_id": RID, "choices": [{"index": 0, "token_ids": OUT[:2]}], "usage": None}
    session.absorb([dumps(first)])
    session.seal()
    retry = unary(out=OUT[2:], cached=16, experts=None)
    retry["usage"]["prompt_tokens"] = len(PROMPT) + 2
    stitched = session.stitch(dumps(retry), True)
    assert stitched is not None
    assert json.loads(stitched[0])["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


# ------------------------------------------------------------------------ prompt_logprobs in P/D
#
# Upstream source read for this section (vllm-project/vllm, commit the index reported):
#
# * ``vllm/sampling_params.py`` (``SamplingParams.__post_init__``, the version quoted by every stored
#   copy): ``if self.skip_reading_prefix_cache is None: self.skip_reading_prefix_cache =
#   self.prompt_logprobs is not None``; ``vllm/v1/request.py`` @ ``dba83d52c06471eabafba4310718ac7a100cbfa4``
#   ``Request.get_skip_reading_prefix_cache`` copies it; ``KVCacheManager.get_computed_blocks`` returns no
#   local hit for it. That bounds the *local* prefix cache only.
# * ``vllm/v1/core/sched/scheduler.py`` @ ``b4622cf924bc72504aed99e486062d6633fde39e``
#   ``Scheduler.schedule`` still calls ``self.connector.get_num_new_matched_tokens(request,
#   num_new_local_computed_tokens)`` for that request, and NIXL
#   (``nixl_connector.py`` @ ``002a1057e9ae674d7bdc9c4be95bc29d65d2e808``,
#   ``NixlConnectorScheduler.get_num_new_matched_tokens``) returns ``len(prompt_token_ids) -
#   num_computed_tokens`` for ``do_remote_prefill``: the decode leg loads the whole prompt's KV.
#   ``Scheduler._update_waiting_for_remote_kv`` then sets ``num_computed_tokens`` to the loaded
#   tokens minus one (``if num_computed_tokens == request.num_tokens: num_computed_tokens -= 1``).
# * ``vllm/v1/worker/gpu_model_runner.py`` @ ``4e1790651fc758c06c7a903dd4cd82364ac91b27``
#   ``GPUModelRunner._get_prompt_logprobs_dict``: ``logprobs_tensors = LogprobsTensors.empty_cpu(
#   num_prompt_tokens - 1, num_prompt_logprobs + 1)``; ``start_idx = request.num_computed_tokens``
#   (``P - 1``), ``num_remaining_tokens = num_prompt_tokens - start_tok`` (0), so the request is
#   "the last chunk": ``prompt_logprobs_dict[req_id] = logprobs_tensors`` and then ``if num_logits <=
#   0: continue``: nothing is ever copied into the ``P - 1`` rows. ``LogprobsTensors.empty_cpu``
#   (``vllm/v1/outputs.py`` @ ``1b55f1e9b664c3844552b42749193e7ab3df352c``) is ``torch.empty``:
#   uninitialised memory. ``LogprobsProcessor._update_prompt_logprobs`` (``vllm/v1/engine/logprobs.py``
#   @ ``dfafe710448e80b695513dfbee690b8e0334f230``) appends one entry per row after the leading
#   ``None``. So the decode leg sends a list of the right length whose entries are garbage.
# * vLLM 0.34.0 (PyPI wheel, ``vllm/_version.py`` ``__commit_id__ = 'g62d4bc3c7'``):
#   ``Request.skip_reading_external_kv`` is true for a request with ``prompt_logprobs`` (its
#   ``get_prefix_cache_hit_limit`` is ``prompt_logprob_start or 0``) and ``Scheduler.schedule`` sets
#   ``ext_tokens, load_kv_async = 0, False`` for it: the decode leg recomputes the prompt and sends
#   a real list, from another engine and another batch, so its floats need not equal prefill's bit
#   for bit.
#
# Either way the prefill leg (``do_remote_decode``: NIXL loads nothing; no local hit) scored the whole
# prompt exactly as the aggregated engine does, so its list is the one to publish, whatever decode sent.

PL_PROMPT = PROMPT[:6]
PL_SCORES = [-2.5, -0.75, -1.125, -3.0, -0.5]  # prompt positions 1.. (position 0 is never scored)


def prompt_logprobs_list(scores: list[float], ids: list[int] = PL_PROMPT) -> list:
    """``LogprobsProcessor`` with ``prompt_logprobs=0`` in tokens mode (no tokenizer): ``[None]`` then,
    per position, ``{target_id: Logprob(logprob, rank, decoded_token=None)}``
    (``append_logprobs_for_next_position``), rendered as JSON by ``serve_tokens_full_generator``."""
    return [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": None}}
                     for t, lp in zip(ids[1:], scores)]


def pl_unary(*, out: list[int], plp: list | None, finish: str = "stop", kv: dict | None = None,
             prompt_tokens: int = len(PL_PROMPT)) -> dict:
    body = unary(out=out, cached=None, experts=None, finish=finish, kv=kv, details=False)
    body["usage"] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(out),
                     "completion_tokens": len(out)}
    body["prompt_logprobs"] = plp
    return body


# What ``torch.empty`` may hold: fresh zeroed pages, or leftovers of an earlier tensor.
UNINITIALISED = {
    "zeroed": [None] + [{"0": {"logprob": 0.0, "rank": 0, "decoded_token": None}}] * (len(PL_PROMPT) - 1),
    "leftovers": [None] + [{str(1953066613 + i): {"logprob": 4.1e-31 * (i + 1), "rank": -7,
                                                  "decoded_token": None}} for i in range(len(PL_PROMPT) - 1)],
}


@pytest.mark.parametrize("garbage", sorted(UNINITIALISED))
def test_decode_prompt_logprobs_from_uninitialised_rows_are_replaced_by_prefills(garbage):
    """A decode leg that loaded the prompt's KV (NIXL) sends ``P - 1`` never-written rows; the joined
    body must carry prefill's list, which is the aggregated engine's, not omit the field."""
    agg = pl_unary(out=OUT, plp=prompt_logprobs_list(PL_SCORES))
    prefill = pl_unary(out=OUT[:1], plp=prompt_logprobs_list(PL_SCORES), finish="length", kv=PREFILL_KV)
    decode = pl_unary(out=OUT, plp=UNINITIALISED[garbage])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_decode_prompt_logprobs_recomputed_by_another_engine_are_replaced_by_prefills():
    """vLLM 0.34.0: decode recomputes the prompt (``skip_reading_external_kv``); its floats differ from
    prefill's in the last bits (another engine, another batch). That is no inconsistency: the field
    must be published (prefill's list, as prefill ran the prompt as the aggregated engine does)."""
    agg = pl_unary(out=OUT, plp=prompt_logprobs_list(PL_SCORES))
    prefill = pl_unary(out=OUT[:1], plp=prompt_logprobs_list(PL_SCORES), finish="length", kv=PREFILL_KV)
    noisy = [lp + 2.0 ** -20 for lp in PL_SCORES]
    decode = pl_unary(out=OUT, plp=prompt_logprobs_list(noisy))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_a_prefill_list_that_does_not_cover_the_prompt_is_omitted_as_length_mismatch():
    """Prefill's list is trusted over decode's, so it must have one entry per prompt token
    (``usage.prompt_tokens``): a shorter one (a prefiller that scored a shortened prompt) is no
    aggregated answer and is omitted, never published or patched from decode."""
    prefill = pl_unary(out=OUT[:1], plp=prompt_logprobs_list(PL_SCORES[:-1]), finish="length", kv=PREFILL_KV)
    decode = pl_unary(out=OUT, plp=prompt_logprobs_list(PL_SCORES))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)
    assert (got["prompt_logprobs"], got["prompt_logprobs_unavailable_reason"]) == (None, "length_mismatch")
    assert verdict is Verdict.OMITTED


def test_a_one_token_prompt_keeps_prefills_single_null():
    """``P = 1``: nothing is scored on either leg (``empty_cpu(0, ...)``), both send ``[None]``."""
    agg = pl_unary(out=OUT, plp=[None], prompt_tokens=1)
    prefill = pl_unary(out=OUT[:1], plp=[None], finish="length", kv=PREFILL_KV, prompt_tokens=1)
    decode = pl_unary(out=OUT, plp=[None], prompt_tokens=1)
    [(body, _)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))


def test_a_decode_leg_that_scored_only_the_recomputed_token_gets_prefills_list():
    """vLLM 0.33.0's V2 model runner (``vllm/v1/worker/gpu/sample/prompt_logprob.py``
    ``compute_prompt_logprobs``): a decode leg scheduled only the last prompt token (the rest loaded;
    0.33.0 has no ``skip_reading_external_kv``) drops its one row (``end_idx -= 1``, then ``logprobs =
    None if start_idx >= end_idx``), so ``LogprobsProcessor`` keeps ``create_prompt_logprobs``'s
    ``[None]``: a one-entry list for a six-token prompt. Prefill's list is the aggregated one."""
    agg = pl_unary(out=OUT, plp=prompt_logprobs_list(PL_SCORES))
    prefill = pl_unary(out=OUT[:1], plp=prompt_logprobs_list(PL_SCORES), finish="length", kv=PREFILL_KV)
    decode = pl_unary(out=OUT, plp=[None])
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


# ------------------------------------------------- routed_experts rows with cached prompt tokens
#
# vLLM 0.34.0 and 0.33.0 (PyPI wheels; ``distributed/aux_output_connector`` is the same in both)
# collect the rows per engine step (``Scheduler.update_from_output``: ``take_output`` per output;
# ``RequestState.routed_experts_chunks`` concatenated ``if finished``), but do not leave cached prompt
# positions out: ``AuxOutputSchedulerConnector.build_connector_meta`` sets the emit start to
# ``min(routed_experts_prompt_start, num_prompt_tokens)`` on the first schedule, and
# ``AuxOutputWorkerConnector._commit_output``, when that start lies before the step's first computed
# token (a prefix-cache or connector hit), materialises the rows from its block store
# (``materialize_routed_experts``). ``Scheduler.schedule`` bounds the local hit by
# ``max_cache_hit`` (blocks whose rows the store holds) and keeps an external hit only if
# ``cap_external_hit`` (block-aligned, within ``max_cache_hit``), else 0: a P/D decode recomputes the
# prompt. The older capture (``Scheduler._get_routed_experts`` @ ``b4622cf9``) reads every row of
# ``[0, num_tokens - 1)`` by KV slot: a connector-loaded prompt's slots hold stale rows. Neither
# shortens a leg by its cache hit.

HIT = 16  # one cached 16-token block of the 40-token prompt


def test_rows_of_a_prefill_with_a_prefix_cache_hit_cover_the_whole_prompt_and_join():
    """Prefill (and the aggregated engine) hit ``HIT`` cached prompt tokens: their rows are still
    ``[0, P)`` / ``[0, P + O - 1)``, the cached ones materialised; decode recomputed the prompt."""
    total = len(PROMPT) + len(OUT) - 1
    agg = unary(out=OUT, cached=HIT, experts=npy_b64(rows(0, total)))
    prefill = unary(out=OUT[:1], cached=HIT, experts=npy_b64(rows(0, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = unary(out=OUT, cached=0, experts=npy_b64(rows(0, total)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(body, dumps(agg))
    assert verdict is Verdict.JOINED


def test_legs_that_left_their_cached_prompt_rows_out_are_omitted_not_spliced():
    """The shape an outside note describes (rows only for tokens computed in a step, cached ones left
    out), which no vLLM read here sends: prefill ``[HIT, P)``, decode ``[P - 1, P + O - 1)`` (only
    the last prompt token recomputed). The legs imply different starts, so the rows are omitted as
    ``length_mismatch``: no partial array is published."""
    total = len(PROMPT) + len(OUT) - 1
    prefill = unary(out=OUT[:1], cached=HIT, experts=npy_b64(rows(HIT, len(PROMPT))), finish="length",
                    kv=PREFILL_KV)
    decode = unary(out=OUT, cached=DECODE_CACHED, experts=npy_b64(rows(len(PROMPT) - 1, total)))
    [(body, verdict)] = join(VLLMCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    [choice] = json.loads(body)["choices"]
    assert (choice["routed_experts"], choice["routed_experts_unavailable_reason"]) == (None, "length_mismatch")
    assert verdict is Verdict.OMITTED
