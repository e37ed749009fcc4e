"""Format-fidelity review of the ``sglang`` codec against SGLang 0.5.23: abort bodies, migration, P/D experts.

Source: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (``pip download
sglang==0.5.23 --no-deps --only-binary :all:``; the wheel records no commit id). Paths are relative
to ``sglang/srt/``. Bodies are written by hand from the functions quoted here: nothing comes from
the simulator (``worker.py``) or ``upstream.py``.

``managers/tokenizer_manager.py`` ``TokenizerManager._handle_abort_req`` (0.5.23)::

    meta_info = {"id": recv_obj.rid, "finish_reason": finish_reason,
                 "weight_version": ..., "e2e_latency": state.time_stats.get_e2e_latency()}
    if recv_obj.weight_versions is not None: add_weight_versions_to_meta_info(...)
    if getattr(state.obj, "return_logprob", False):
        self.add_logprob_to_meta_info(meta_info, state, ..., finished=True)   # whole lists
    output_ids = state.output_ids
    meta_info["completion_tokens"] = len(output_ids)
    if is_stream and self.incremental_streaming_output:
        output_ids = [output_ids[-1]] if len(output_ids) > 0 else []
    out = {"text": state.get_text(), "output_ids": output_ids, "meta_info": meta_info}

Older trees (``if is_stream:``, e.g. sgl-project/sglang @ 001067ff, ``tests/test_upstream_abort_bodies.py``)
cut ``output_ids`` to the last id in both streaming modes; 0.5.23 does so only with
``--incremental-streaming-output``: a cumulative stream's abort body restates EVERY id, as it
restates the text and the output logprob lists.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import drive_stitch
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
RID = "req-1"
PROMPT_TOKENS = 4
OUT = [201, 202, 203, 204, 205]
TEXT = ["Hé", "llo", " w", "or", "ld"]
OUTPUT_LP = [[-0.125, t, None] for t in OUT]
# scheduler.py Scheduler.update_running_batch: _make_abort_req(req, finished_reason=abort_reason.to_json())
RETRACT_ABORT = {"type": "abort", "message": "retract: out of memory", "status_code": 503, "err_type": None}
# A unary request answers an abort body only for an abort without a status code in [400, 600)
# (``TokenizerManager._handle_abort_finish_reason`` raises for the others): ``_handle_abort_req``'s
# own reason for a queued or retracted request ``abort_request`` removed.
QUEUED_ABORT = {"type": "abort", "message": "Abort in waiting queue"}
K = 2  # tokens the first attempt published before its worker was lost


def chunk(lo: int, end: int, *, cumulative: bool, offset: int = 0, rid: str = RID,
          prompt: int = PROMPT_TOKENS) -> dict[str, Any]:
    """``_handle_batch_output`` (BatchStrOutput), an unfinished stream chunk over the engine's own output
    positions ``[lo, end)``; its tokens are the request's ``offset + lo`` ... (``offset`` = K for a
    resumed attempt, whose engine sees the emitted tokens as prompt)."""
    start = 0 if cumulative else lo
    meta = {"id": rid, "finish_reason": None, "prompt_tokens": prompt, "weight_version": "default",
            "num_retractions": 0, "input_token_logprobs": [],
            "output_token_logprobs": OUTPUT_LP[offset + start:offset + end],
            "output_token_logprobs_length": end, "reasoning_tokens": 0, "completion_tokens": end,
            "cached_tokens": 0, "cached_tokens_details": None}
    return {"text": "".join(TEXT[offset + start:offset + end]), "output_ids": OUT[offset + start:offset + end],
            "meta_info": meta}


def abort(seen: int, *, incremental: bool, offset: int = 0, rid: str = RID,
          finish: dict[str, Any] = RETRACT_ABORT) -> dict[str, Any]:
    """0.5.23 ``_handle_abort_req`` of a stream once the engine holds ``seen`` tokens of its own."""
    meta = {"id": rid, "finish_reason": finish, "weight_version": "default", "e2e_latency": 0.5,
            "input_token_logprobs": [], "output_token_logprobs": OUTPUT_LP[offset:offset + seen],
            "output_token_logprobs_length": seen, "completion_tokens": seen}
    ids = OUT[offset:offset + seen]
    if incremental:
        ids = ids[-1:]
    return {"text": "".join(TEXT[offset:offset + seen]), "output_ids": ids, "meta_info": meta}


def migrated(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[bytes]:
    """What the client is sent: the first attempt's bodies, then the resumed attempt's, stitched."""
    return drive_stitch(SGLangCodec(OPTIONS), first, second)


ABORT_FIELDS = ("text", "output_ids")
ABORT_META = ("output_token_logprobs", "output_token_logprobs_length", "completion_tokens", "finish_reason")


def assert_abort_body(got: bytes, want: dict[str, Any]) -> None:
    doc = json.loads(got)
    for key in ABORT_FIELDS:
        assert doc[key] == want[key], key
    for key in ABORT_META:
        assert doc["meta_info"][key] == want["meta_info"][key], key


@pytest.mark.parametrize("resumed", [0, 1, 2, 3])
def test_0523_cumulative_abort_body_after_a_migration_restates_every_id_as_the_engine_does(resumed):
    """A cumulative stream (SGLang's default) migrated after K tokens; the resumed attempt is aborted by
    its scheduler after ``resumed`` more. Uninterrupted, the engine's abort body restates all K +
    ``resumed`` ids (0.5.23, above); the stitched body must too, not the attempt's ids alone behind
    the client's text (the stitch used to restate text and lists but never an abort body's ids)."""
    first = [chunk(0, k + 1, cumulative=True) for k in range(K)]
    second = [chunk(0, k + 1, cumulative=True, offset=K, rid="req-2", prompt=PROMPT_TOKENS + K)
              for k in range(resumed)]
    published = migrated(first, [*second, abort(resumed, incremental=False, offset=K, rid="req-2",
                                                 finish=QUEUED_ABORT)])
    assert_abort_body(published[-1], abort(K + resumed, incremental=False, finish=QUEUED_ABORT))
    folded = json.loads(SGLangCodec(OPTIONS).fold(published))
    want = abort(K + resumed, incremental=False)  # the unary abort answer: ids, text, lists whole
    assert folded["output_ids"] == want["output_ids"] and folded["text"] == want["text"]
    assert folded["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("sent", [1, 2, 4])
def test_0523_cumulative_abort_body_folds_to_the_unary_abort(sent):
    """No migration: a cumulative abort that overtook ``5 - sent`` chunks restates every id in 0.5.23,
    so the fold has all of them (the older trees' known limit does not apply)."""
    chunks = [chunk(0, k + 1, cumulative=True) for k in range(sent)]
    folded = json.loads(SGLangCodec(OPTIONS).fold([dumps(c) for c in [*chunks, abort(5, incremental=False,
                                                                                      finish=QUEUED_ABORT)]]))
    assert folded["output_ids"] == OUT and folded["text"] == "".join(TEXT)


def test_0523_incremental_abort_body_after_a_migration_restates_the_whole_text():
    """Incremental mode: the engine's abort body restates the whole text and lists (``state.get_text()``,
    ``add_logprob_to_meta_info`` never sliced) with ``output_ids = [last]``. After a migration the
    resumed attempt's ``state`` holds its own tokens only; the stitch puts the text and lists the
    client was sent in front (the migration session keeps them: a function of the published bodies,
    law 7). Was a strict xfail."""
    first = [chunk(k, k + 1, cumulative=False) for k in range(K)]
    second = [chunk(0, 1, cumulative=False, offset=K, rid="req-2", prompt=PROMPT_TOKENS + K)]
    published = migrated(first, [*second, abort(1, incremental=True, offset=K, rid="req-2", finish=QUEUED_ABORT)])
    assert_abort_body(published[-1], abort(K + 1, incremental=True, finish=QUEUED_ABORT))
    folded = json.loads(SGLangCodec(OPTIONS).fold(published))
    want = abort(K + 1, incremental=False)  # the unary abort answer
    assert folded["output_ids"] == want["output_ids"] and folded["text"] == want["text"]
    assert folded["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]


def test_0523_incremental_abort_body_after_a_second_migration_restates_the_whole_text():
    """Two seals: the second attempt's stitched chunk is part of what the client was told."""
    first = [chunk(0, 1, cumulative=False)]
    session = SGLangCodec(OPTIONS).open_migration()
    session.absorb([dumps(c) for c in first])
    session.seal()
    stitched = session.stitch(dumps(chunk(0, 1, cumulative=False, offset=1, rid="req-2", prompt=PROMPT_TOKENS + 1)),
                              False)
    session.absorb([stitched[0]])
    session.seal()
    body, _ = session.stitch(dumps(abort(1, incremental=True, offset=2, rid="req-3")), True)
    assert_abort_body(body, abort(3, incremental=True))


def test_0523_incremental_abort_body_coalesced_after_a_migration_stays_the_attempts_known_limit():
    """Known limit: chunks coalesced in front of the resumed attempt's abort body (``_coalesce_streaming_chunks``:
    their ids, then the last again) put their text and lists before the attempt's whole ones, where
    the client's cannot be placed exactly; the body keeps the attempt's text and lists (the fold
    still gets the request's lists: tests/test_upstream_abort_bodies.py)."""
    first = [chunk(k, k + 1, cumulative=False) for k in range(K)]
    sent = chunk(0, 1, cumulative=False, offset=K, rid="req-2", prompt=PROMPT_TOKENS + K)
    queued, tail = chunk(1, 2, cumulative=False, offset=K, rid="req-2", prompt=PROMPT_TOKENS + K), abort(
        2, incremental=True, offset=K, rid="req-2")
    body = dict(tail, output_ids=queued["output_ids"] + tail["output_ids"], text=queued["text"] + tail["text"])
    body["meta_info"] = dict(tail["meta_info"], output_token_logprobs=queued["meta_info"]["output_token_logprobs"]
                             + tail["meta_info"]["output_token_logprobs"])
    published = migrated(first, [sent, body])
    got = json.loads(published[-1])
    assert got["text"] == body["text"]  # the attempt's, not the request's
    assert got["meta_info"]["output_token_logprobs"] == body["meta_info"]["output_token_logprobs"]


# ============================================================================ routed_experts after a retraction
#
# SGLang 0.5.23 (wheel above; the newest trees in the public index read the same):
#
# ``state_capturer/base.py`` (sgl-project/sglang @ 0564b521 too): each forward writes its rows at the
# KV slots it filled, ``TopkCaptureOutput.finalize``: ``host_cache.buffer[out_cache_loc] = topk``;
# at finish ``BaseTopkCapturer.get_topk`` reads them at the request's CURRENT slots,
# ``req_to_token[req_pool_idx][start_len : seqlen - 1]`` (called by
# ``managers/scheduler_components/batch_result_processor.py`` ``_maybe_collect_routed_experts``).
#
# Aggregated engine: ``ScheduleBatch.retract_decode`` -> ``release_req`` (``managers/schedule_batch.py``)
# backs up no KV outside ``disaggregation_mode == "decode"``, frees the row and calls
# ``Req.reset_for_retract`` (``retraction_count += 1``, ``routed_experts = None``);
# ``Scheduler._add_request_to_queue`` puts it back in ``waiting_queue`` and it is prefilled again
# over ``origin_input_ids + output_ids``: every row is written again by a forward (or read at radix
# slots a forward wrote). Its rows are right, and its body says ``num_retractions: 1``.
#
# P/D decode: ``release_req`` -> ``mem_cache/common.py`` ``backup_kv_cache`` copies the KV of
# ``[0, seqlen - 1)`` to host (``cpu_tensor``: ``Req.offload_kv_cache``; ``host_pool``:
# ``UnifiedRadixCache.backup_kv_cache``); ``disaggregation/decode.py``
# ``DecodePreallocQueue.resume_retracted_reqs`` gives it new slots (``_pre_alloc``) and
# ``restore_kv_cache`` copies the KV back into them (sgl-project/sglang @ 0035ca42:
# ``self._pre_alloc(req)`` then ``req.load_kv_cache(...)``). A DeepSeek-V4 pool
# (``dsv4_needs_rebootstrap``) re-bootstraps instead: ``DecodePreallocQueue.add`` pops the last id
# and the prefill recomputes ``[0, seqlen - 1)``, which the KV transfer writes into decode's new slots.
# Either way no forward of this request wrote the capture rows at those slots: decode's generated
# rows for the tokens before the retraction are whatever request last ran a forward there (or zeros).
# ``reset_for_retract`` counts it, and ``_handle_batch_output`` writes the count on every body
# (``"num_retractions": recv_obj.retraction_counts[i]``; ``total_retractions`` in older trees).

LAYERS, TOPK = 2, 2
ALL_OUT = 5  # the request's tokens; decode was retracted after ``k`` of them
STOP = {"type": "stop", "matched": OUT[-1]}


def expert_rows(start: int, end: int, seed: int = 0) -> bytes:
    """int32 ids of positions [start, end): distinct per layer, as a router picks them."""
    ids = [[(p * 7 + j * 3 + 1 + seed) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)]
           for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def experts_body(out: list[int], *, finish: Any, experts: bytes, retractions: int,
                 key: str = "num_retractions") -> dict[str, Any]:
    """``_handle_batch_output`` (0.5.23 key order) of a finished unary body with routed experts."""
    meta = {"id": RID, "finish_reason": finish, "prompt_tokens": PROMPT_TOKENS, "weight_version": "default",
            key: retractions, "reasoning_tokens": 0, "completion_tokens": len(out), "cached_tokens": 0,
            "weight_versions": [{"version": "default", "start": 0, "end": len(out)}],
            "cached_tokens_details": None, "routed_experts": base64.b64encode(experts).decode(),
            "e2e_latency": 0.5}
    return {"text": "".join(TEXT[:len(out)]), "output_ids": out, "meta_info": meta}


def retraction_case(k: int, key: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(aggregated, prefill, decode) bodies of a request retracted once after ``k`` tokens."""
    seqlen = PROMPT_TOKENS + ALL_OUT
    restored = PROMPT_TOKENS + k - 1  # the KV the backup (or the re-bootstrap) put back: [0, seqlen_k - 1)
    aggregated = experts_body(OUT, finish=STOP, experts=expert_rows(0, seqlen - 1), retractions=1, key=key)
    # disaggregation/prefill.py: FINISH_LENGTH(0), the first token, the prompt rows (0.5.23 collects them)
    prefill = experts_body(OUT[:1], finish={"type": "length", "length": 0},
                           experts=expert_rows(0, PROMPT_TOKENS), retractions=0, key=key)
    stale = expert_rows(0, restored, seed=17)  # another request's rows at the slots decode was given
    decode = experts_body(OUT, finish=STOP, retractions=1, key=key,
                          experts=stale + expert_rows(restored, seqlen - 1))
    return aggregated, prefill, decode


@pytest.mark.parametrize("key", ["num_retractions", "total_retractions"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_retracted_pd_decode_never_publishes_rows_its_restored_kv_slots_hold(k, key):
    """A P/D decode retracted after ``k`` tokens (KV copied back, or re-bootstrapped) reads the rows of
    its first ``k - 1`` generated tokens at slots no forward of it wrote (above); the aggregated
    engine recomputed them. Those rows look real (distinct ids), so only the body's retraction count
    tells: the joined answer must equal the aggregated rows or omit them with a reason."""
    aggregated, prefill, decode = retraction_case(k, key)
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    meta = json.loads(out)["meta_info"]
    want = aggregated["meta_info"]["routed_experts"]
    assert meta.get("routed_experts", want) == want, "decode's stale rows were published"
    assert meta["routed_experts_unavailable_reason"] == "decode_corrupt"
    assert verdict is Verdict.OMITTED
    rest = {key: v for key, v in meta.items() if key != "routed_experts_unavailable_reason"}
    assert rest == {key: v for key, v in aggregated["meta_info"].items() if key != "routed_experts"}


def test_unretracted_pd_decode_rows_are_joined_to_the_aggregated_rows():
    """The same request without a retraction: decode's generated rows are its own forwards', and the
    join (prefill's prompt rows, then decode's generated rows) equals the aggregated body."""
    seqlen = PROMPT_TOKENS + ALL_OUT
    aggregated = experts_body(OUT, finish=STOP, experts=expert_rows(0, seqlen - 1), retractions=0)
    prefill = experts_body(OUT[:1], finish={"type": "length", "length": 0},
                           experts=expert_rows(0, PROMPT_TOKENS), retractions=0)
    decode = experts_body(OUT, finish=STOP, retractions=0,
                          experts=expert_rows(0, PROMPT_TOKENS, seed=17) + expert_rows(PROMPT_TOKENS, seqlen - 1))
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert verdict is Verdict.JOINED
    assert_same_body(out, dumps(aggregated))


@pytest.mark.parametrize("cumulative", [True, False])
def test_retraction_between_stream_chunks_omits_the_final_rows(cumulative):
    """Streamed: the count rises on the first chunk after the retraction; the rows come with the final
    chunk (``_maybe_collect_routed_experts`` runs at finish), which alone is judged."""
    _, prefill, decode = retraction_case(3, "num_retractions")

    def unfinished(lo: int, end: int, retractions: int) -> dict[str, Any]:
        lo = 0 if cumulative else lo
        meta = {"id": RID, "finish_reason": None, "prompt_tokens": PROMPT_TOKENS, "weight_version": "default",
                "num_retractions": retractions, "reasoning_tokens": 0, "completion_tokens": end,
                "cached_tokens": 0, "cached_tokens_details": None}
        return {"text": "".join(TEXT[lo:end]), "output_ids": OUT[lo:end], "meta_info": meta}

    final = decode if cumulative else {**decode, "text": "".join(TEXT[3:]), "output_ids": OUT[3:]}
    chunks = [unfinished(0, 1, 0), unfinished(1, 3, 1), final]
    got = join(SGLangCodec(OPTIONS), [dumps(c) for c in chunks], [dumps(prefill)])
    assert [verdict for _, verdict in got[:-1]] == [Verdict.PASSTHROUGH, Verdict.PASSTHROUGH]
    meta = json.loads(got[-1][0])["meta_info"]
    assert "routed_experts" not in meta and meta["routed_experts_unavailable_reason"] == "decode_corrupt"
    assert got[-1][1] is Verdict.OMITTED


# ============================================================================ the P/D prefill's routed_experts
#
# SGLang 0.5.23 (wheel above) COLLECTS on the prefill (sgl-project/sglang PR #22916, with the overlap
# fix #23885; the index's ``disaggregation/prefill.py`` @ 000c2b94 has the finalize but not the collect).
#
# ``disaggregation/prefill.py`` ``process_batch_result_disagg_prefill``: ``copy_done.synchronize()``,
# ``result.routed_experts_output.finalize()`` (the prompt forward's rows reach the host cache at its
# ``out_cache_loc``), then ``req.output_ids.append(next_token_id)`` and the request joins
# ``disagg_prefill_inflight_queue``. ``process_disagg_prefill_inflight_queue``, on ``KVPoll.Success``::
#
#     if req.return_routed_experts:
#         self.batch_result_processor._maybe_collect_routed_experts(req)
#     if not isinstance(req.finished_reason, FINISH_ABORT):
#         req.finished_reason = FINISH_LENGTH(length=0)
#     release_kv_cache(...)            # after the collect: the slots are still the request's
#     ... self.output_streamer.stream_output(done_reqs, ...)
#
# ``managers/scheduler_components/batch_result_processor.py`` ``_maybe_collect_routed_experts``:
# ``seqlen = len(origin_input_ids) + len(output_ids_through_stop)`` (prefill: prompt + 1) and
# ``get_topk(..., start_len=req.routed_experts_start_len)`` reads ``req_to_token[start_len : seqlen - 1]``
# (``state_capturer/base.py``; ``start_len = min(start_len, seqlen - 1)``): rows ``[start, prompt)``,
# ``prompt - start`` of them, the last prompt position included. ``detokenizer_manager.py``
# ``_b64_encode_per_request``: ``b64encode(tensor.numpy().tobytes())`` of the int32 host cache; the
# tokenizer writes it as ``meta_info["routed_experts"]`` and echoes neither the start nor a dtype.
# The prefill body: ``finish_reason`` ``{"type": "length", "length": 0}``, ``output_ids`` [first token],
# ``completion_tokens`` 1 (``_GenerationStreamAccumulator.accept``). It is sent once, at Success.
#
# Aggregated (``process_batch_result_prefill`` / ``_handle_finish_state_updated_req``): the same collect
# at finish, ``seqlen = prompt + n``: rows ``[start, prompt + n - 1)``, prompt rows from the prompt
# forward, generated rows from decode forwards. P/D decode: the same collect, its prompt rows read at
# slots the KV transfer filled (stale); a one-token decode finishes in ``process_batch_result_prebuilt``,
# which does not collect (no key).

WIDE_LAYERS, WIDE_TOPK = 48, 8  # a real row width (384 ids), so the stale-row check sees whole rows


def wide_rows(start: int, end: int, seed: int = 0) -> bytes:
    """int32 ids of positions [start, end): each layer's top-k distinct, as a router picks them."""
    ids = [[(p * 31 + layer * 7 + seed + j * 5) % 64 for layer in range(WIDE_LAYERS) for j in range(WIDE_TOPK)]
           for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def pd_body(prompt: int, out: list[int], finish: Any, experts: bytes | None) -> dict[str, Any]:
    """``_handle_batch_output`` (0.5.23 key order) of a finished unary body; ``experts`` None: no key."""
    meta: dict[str, Any] = {
        "id": RID, "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
        "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": len(out), "cached_tokens": 0,
        "weight_versions": [{"version": "default", "start": 0, "end": len(out)}], "cached_tokens_details": None}
    if experts is not None:
        meta["routed_experts"] = base64.b64encode(experts).decode()
    meta["e2e_latency"] = 0.5
    return {"text": "".join(TEXT[:len(out)]), "output_ids": out, "meta_info": meta}


def pd_case(prompt: int, start: int, n: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(aggregated, prefill, decode) bodies of an ``n``-token answer with ``routed_experts_start_len``
    ``start`` (a request field the bodies do not echo)."""
    out = OUT[:n]
    finish = {"type": "length", "length": n}
    aggregated = pd_body(prompt, out, finish, wide_rows(start, prompt + n - 1))
    prefill = pd_body(prompt, out[:1], {"type": "length", "length": 0}, wide_rows(start, prompt))
    decode = pd_body(prompt, out, finish, None if n == 1 else
                     wide_rows(start, prompt, seed=17) + wide_rows(prompt, prompt + n - 1))
    return aggregated, prefill, decode


@pytest.mark.parametrize(("prompt", "start", "n"), [
    (4, 0, 1), (4, 0, 2), (4, 0, 5), (1, 0, 3),  # SGLang's default start
    (4, 1, 5), (4, 3, 2), (7, 2, 4), (4, 2, 1),  # a start the bodies do not state: read from byte counts
])
def test_0523_pd_answer_with_the_prefill_s_own_rows_equals_the_aggregated_body(prompt, start, n):
    """0.5.23's prefill sends rows ``[start, prompt)``; the join (prefill's rows, then decode's rows past
    its stale prompt copy; prefill's alone for a one-token decode, which sends none) is the aggregated
    body, key order included."""
    aggregated, prefill, decode = pd_case(prompt, start, n)
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert verdict is Verdict.JOINED
    assert_same_body(out, dumps(aggregated))


@pytest.mark.parametrize(("prompt", "start", "n", "reason"), [
    (4, 4, 3, "prefill_corrupt"),  # start = prompt: prefill's rows are "" (get_topk reads [P:P])
    (4, 4, 1, "prefill_corrupt"),
    (4, 2, 3, "length_mismatch"),  # unstated start 2 also reads as suffix coverage: two answers fit
])
def test_0523_pd_rows_the_bodies_cannot_place_are_omitted_never_decode_s(prompt, start, n, reason):
    """Where the bodies do not tell the layout (0.5.23 echoes no start), the field is omitted with a
    reason: never decode's stale prompt rows, never a guess."""
    aggregated, prefill, decode = pd_case(prompt, start, n)
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    meta = json.loads(out)["meta_info"]
    assert "routed_experts" not in meta and meta["routed_experts_unavailable_reason"] == reason
    assert verdict is Verdict.OMITTED
    rest = {k: v for k, v in meta.items() if k != "routed_experts_unavailable_reason"}
    assert rest == {k: v for k, v in aggregated["meta_info"].items() if k != "routed_experts"}
