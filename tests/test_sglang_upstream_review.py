"""Independent review of the ``sglang`` codecs against the LATEST RELEASED SGLang: 0.5.23.

Source: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (``pip download
sglang --no-deps --only-binary :all:``; ``sglang/_version.py``: ``__version__ = '0.5.23'``,
``__commit_id__ = None``: the wheel records no commit). Paths below are relative to
``sglang/srt/`` in that wheel.

Every body here is written by hand from the upstream function quoted above it: nothing comes from
``streamproc.simulation``, the simulated workers (``worker.py``) or ``upstream.py``. Each P/D case
is compared with the body the aggregated engine returns for the same request.

What 0.5.23's ``TokenizerManager._handle_batch_output`` (managers/tokenizer_manager.py) writes,
in this order::

    meta_info = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"}
    convert_logprob_style -> add_logprob_to_meta_info     # input/output token logprobs, length,
                                                           # top logprobs (nested or flat), ids logprobs
    meta_info.update({"reasoning_tokens", "completion_tokens", "cached_tokens"})
    add_weight_versions_to_meta_info                       # finished bodies: weight_versions
    meta_info["cached_tokens_details"]                     # always (None without a cache hit)
    image_tokens / audio_tokens / video_tokens             # only for a request that has them
    meta_info["hidden_states"]; meta_info["routed_experts"]; ...; meta_info["e2e_latency"]
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body as assert_same
from helpers import drive_join as join
from helpers import upstream_json as dumps

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)

RID = "req-0523"
PROMPT = [101, 102, 103, 104]
OUT = [201, 202, 203]
LAYERS, TOPK = 2, 2




def rows(start: int, end: int) -> bytes:
    """int32 expert ids of positions [start, end) (BaseHostCache: torch.int32), distinct per layer."""
    ids = [[(p * 7 + j * 3 + 1) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)] for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def b64(raw: bytes) -> str:
    # detokenizer_manager._b64_encode_per_request: pybase64.b64encode(tensor.numpy().tobytes())
    return base64.b64encode(raw).decode()


def stale_prompt_rows() -> bytes:
    """Decode's rows for the prompt positions: its host cache at KV slots the KV transfer filled, which
    no forward of this request wrote (state_capturer/base.py BaseTopkCapturer.get_topk)."""
    stale = np.full(len(PROMPT) * LAYERS * TOPK, 0x5A5A, dtype="<i4")
    stale[1::2] += 1
    return stale.tobytes()


# detokenize_logprob_tokens(decode_to_text=False): (logprob, token_id, None)
INPUT_LP = [[None, 101, None], [-1.5, 102, None], [-0.25, 103, None], [-2.0, 104, None]]
OUTPUT_LP = [[-0.125, 201, None], [-0.5, 202, None], [-0.75, 203, None]]
# top_logprobs_num=2, detokenize_top_logprobs_tokens: None for a position without values.
INPUT_TOP_VAL = [None, [-1.5, -1.75], [-0.25, -3.0], [-2.0, -2.5]]
INPUT_TOP_IDX = [None, [102, 9], [103, 7], [104, 5]]
OUTPUT_TOP = [[[-0.125, 201, None], [-4.0, 8, None]], [[-0.5, 202, None], [-1.0, 9, None]],
              [[-0.75, 203, None], [-0.875, 5, None]]]
# token_ids_logprob=[9, 42]
INPUT_IDS_LP = [None, [[-1.75, 9, None], [-6.0, 42, None]], [[-5.0, 9, None], [-6.5, 42, None]],
                [[-4.0, 9, None], [-7.0, 42, None]]]
OUTPUT_IDS_LP = [[[-3.0, 9, None], [-8.0, 42, None]], [[-1.0, 9, None], [-9.0, 42, None]],
                 [[-2.0, 9, None], [-9.5, 42, None]]]

STOP = {"type": "stop", "matched": 203}
# disaggregation/prefill.py process_disagg_prefill_inflight_queue, on KVPoll.Success:
#     req.finished_reason = FINISH_LENGTH(length=0)
PREFILL_FINISH = {"type": "length", "length": 0}


def body(*, out: list[int], finish: Any, completion: int, logprobs: dict[str, Any] | None = None,
         experts: str | None = None, hidden: Any = None, mm: dict[str, int] | None = None,
         finished: bool = True) -> dict:
    """0.5.23 ``TokenizerManager._handle_batch_output``, BatchStrOutput branch, one request."""
    meta: dict[str, Any] = {
        "id": RID,
        "finish_reason": finish,
        "prompt_tokens": len(PROMPT),
        "weight_version": "default",
        "num_retractions": 0,  # recv_obj.retraction_counts[i] (0.5.23 renamed total_retractions)
    }
    if logprobs is not None:
        meta.update(logprobs)
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = completion
    meta["cached_tokens"] = 0
    if finished:  # OutputStreamer.accept appends weight-version spans for a finished request only
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": completion}]
    meta["cached_tokens_details"] = None  # OutputStreamer.get_cached_tokens_details: no cache hit
    for key, value in (mm or {}).items():
        meta[key] = value
    if hidden is not None:
        meta["hidden_states"] = hidden
    if experts is not None:
        meta["routed_experts"] = experts
    if finished:
        meta["e2e_latency"] = 0.25
    return {"text": "x" * len(out), "output_ids": out, "meta_info": meta}


# ============================================================================ output_token_ids_logprobs

def ids_logprobs(output_lp: list, output_ids_lp: list, *, input_side: bool, length: int) -> dict[str, Any]:
    """``add_logprob_to_meta_info`` with top_logprobs_num=0 and token_ids_logprob=[9, 42]."""
    return {
        "input_token_logprobs": INPUT_LP if input_side else [],
        "output_token_logprobs": output_lp,
        "output_token_logprobs_length": length,
        "input_token_ids_logprobs": INPUT_IDS_LP if input_side else [],
        "output_token_ids_logprobs": output_ids_lp,
    }


# 0.5.23 disaggregation/decode.py DecodeTransferQueue._commit_transfer_to_req:
#
#     if decode_req.req.return_logprob and not replayed_boundary:
#         decode_req.req.logprob.output_token_logprobs_val.append(output_token_logprobs_val[0].item())
#         ...
#         if decode_req.req.logprob.token_ids_logprob is not None:
#             # Prefill omits these scores; reserve a row for the streaming offset.
#             decode_req.req.logprob.output_token_ids_logprobs_val.append([])
#             decode_req.req.logprob.output_token_ids_logprobs_idx.append([])
#
# and managers/tokenizer_manager.py TokenizerManager.detokenize_top_logprobs_tokens:
#
#     for i in range(len(token_logprobs_val)):
#         if token_logprobs_val[i]: ret.append(self.detokenize_logprob_tokens(...))
#         else: ret.append(None)
#
# So 0.5.23's P/D decode body has a FULL-LENGTH output_token_ids_logprobs whose position 0 is null
# (no longer one entry short), and a real first-token logprob. The prefill leg computed position 0
# (scheduler_components/logprob_result_processor.py add_logprob_return_values appends
# next_token_token_ids_logprobs_val for the sampled token); the aggregated body has it.

def ids_case() -> tuple[dict, dict, dict]:
    agg = body(out=OUT, finish=STOP, completion=3,
               logprobs=ids_logprobs(OUTPUT_LP, OUTPUT_IDS_LP, input_side=True, length=3),
               experts=b64(rows(0, 6)))
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1,
                   logprobs=ids_logprobs(OUTPUT_LP[:1], OUTPUT_IDS_LP[:1], input_side=True, length=1),
                   experts=b64(rows(0, 4)))
    decode = body(out=OUT, finish=STOP, completion=3,
                  logprobs=ids_logprobs(OUTPUT_LP, [None, *OUTPUT_IDS_LP[1:]], input_side=False, length=3),
                  experts=b64(stale_prompt_rows() + rows(4, 6)))
    return agg, prefill, decode


def test_0523_decode_reserved_null_token_ids_logprob_row_is_filled_from_prefill():
    agg, prefill, decode = ids_case()
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert verdict is Verdict.JOINED
    assert_same(out, dumps(agg))


@pytest.mark.parametrize("cumulative", [True, False])
def test_0523_decode_reserved_null_token_ids_logprob_row_in_a_stream(cumulative):
    """Streaming (``_handle_batch_output``): cumulative mode restates the lists from position 0 on
    every chunk; incremental mode slices them at ``state.last_output_offset``
    (``_slice_streaming_output_meta_info``), so only the first chunk holds position 0."""
    spans = [(0, 1), (1, 3)]
    decode_ids = [None, *OUTPUT_IDS_LP[1:]]

    def leg(ids_lp: list, input_side: bool, experts: str) -> list[bytes]:
        out = []
        for lo, end in spans:
            last = end == 3
            lo_ = 0 if cumulative else lo
            lp = ids_logprobs(OUTPUT_LP[lo_:end], ids_lp[lo_:end], input_side=input_side, length=end)
            out.append(dumps(body(out=OUT[lo_:end], finish=STOP if last else None, completion=end,
                                  logprobs=lp, experts=experts if last else None, finished=last)))
        return out

    agg = leg(OUTPUT_IDS_LP, True, b64(rows(0, 6)))
    decode = leg(decode_ids, False, b64(stale_prompt_rows() + rows(4, 6)))
    _, prefill, _ = ids_case()
    got = join(SGLangCodec(OPTIONS), decode, [dumps(prefill)])
    for (out, _), want in zip(got, agg):
        assert_same(out, want)


def test_0523_decode_reserved_null_row_without_prefills_entry_stays_null_with_its_reason():
    """No prefill value for position 0: that row stays decode's reserved ``null`` with the field's
    reason; the other rows are decode's own steps' and are kept."""
    _, prefill, decode = ids_case()
    del prefill["meta_info"]["output_token_ids_logprobs"]
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    meta = json.loads(out)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert meta["output_token_ids_logprobs"] == decode["meta_info"]["output_token_ids_logprobs"]
    assert meta["output_token_ids_logprobs"][0] is None
    assert meta["output_token_ids_logprobs_unavailable_reason"] == "prefill_missing"


# ============================================================================ flat raw input top logprobs

# 0.5.23 io_struct.GenerateReqInput.return_flat_raw_top_logprobs: "Return prompt top logprobs as flat
# arrays plus shape metadata instead of the nested per-position [logprob, token_id, text] lists."
# tokenizer_manager.TokenizerManager.add_logprob_to_meta_info (top_logprobs_num > 0, use_flat):
#
#     if use_flat and state.input_top_logprobs_scheduler_flat is not None: ...   # prefill / agg
#     elif use_flat:
#         if state.input_top_logprobs_flat_num_rows != len(state.input_top_logprobs_val):   # -1 != 0
#             state.input_top_logprobs_flat_fields = _build_flat_top_logprobs_fields(
#                 "input", state.input_top_logprobs_val, state.input_top_logprobs_idx, top_logprobs_num, ...)
#         ...
#         meta_info.update(state.input_top_logprobs_flat_fields)
#
# _build_flat_top_logprobs_fields -> {input_top_logprobs_val_flat, input_top_logprobs_idx_flat,
# input_top_logprobs_shape: [rows - null_prefix, k], input_top_logprobs_null_prefix}
# (io_struct.flat_top_logprobs_layout: null_prefix = leading None rows; k = top_logprobs_num for none).
# The P/D decode worker never receives input logprobs (scheduler_components/output_streamer.py
# accept: "Decode server does not send input logprobs" -> input_top_logprobs_val_flat None, [] rows),
# so its body carries the flat fields of ZERO prompt rows: [], [], [0, 2], 0.

def flat_logprobs(*, input_side: bool, output_slice: slice, length: int) -> dict[str, Any]:
    if input_side:
        flat = {
            "input_top_logprobs_val_flat": [v for row in INPUT_TOP_VAL[1:] for v in row],
            "input_top_logprobs_idx_flat": [i for row in INPUT_TOP_IDX[1:] for i in row],
            "input_top_logprobs_shape": [3, 2],
            "input_top_logprobs_null_prefix": 1,
        }
    else:
        flat = {"input_top_logprobs_val_flat": [], "input_top_logprobs_idx_flat": [],
                "input_top_logprobs_shape": [0, 2], "input_top_logprobs_null_prefix": 0}
    return {
        "input_token_logprobs": INPUT_LP if input_side else [],
        "output_token_logprobs": OUTPUT_LP[output_slice],
        "output_token_logprobs_length": length,
        **flat,
        "output_top_logprobs": OUTPUT_TOP[output_slice],
    }


def test_0523_flat_raw_input_top_logprobs_are_taken_from_prefill_not_decodes_empty_ones():
    agg = body(out=OUT, finish=STOP, completion=3,
               logprobs=flat_logprobs(input_side=True, output_slice=slice(0, 3), length=3))
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1,
                   logprobs=flat_logprobs(input_side=True, output_slice=slice(0, 1), length=1))
    decode = body(out=OUT, finish=STOP, completion=3,
                  logprobs=flat_logprobs(input_side=False, output_slice=slice(0, 3), length=3))
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert verdict is Verdict.JOINED
    assert_same(out, dumps(agg))


def test_0523_flat_raw_input_top_logprobs_base64_variant():
    """``return_flat_raw_top_logprobs_b64``: ``_build_flat_top_logprobs_fields_from_arrays`` writes
    ``input_top_logprobs_{val,idx}_flat_b64`` (float32 / int32 bytes), their ``_dtype`` markers, then
    shape and null_prefix. Decode's arrays have zero rows: empty Base64."""
    val = np.asarray([v for row in INPUT_TOP_VAL[1:] for v in row], dtype="<f4").tobytes()
    idx = np.asarray([i for row in INPUT_TOP_IDX[1:] for i in row], dtype="<i4").tobytes()

    def lp(input_side: bool, sl: slice, length: int) -> dict[str, Any]:
        return {
            "input_token_logprobs": INPUT_LP if input_side else [],
            "output_token_logprobs": OUTPUT_LP[sl],
            "output_token_logprobs_length": length,
            "input_top_logprobs_val_flat_b64": b64(val) if input_side else "",
            "input_top_logprobs_idx_flat_b64": b64(idx) if input_side else "",
            "input_top_logprobs_val_flat_b64_dtype": "float32",
            "input_top_logprobs_idx_flat_b64_dtype": "int32",
            "input_top_logprobs_shape": [3, 2] if input_side else [0, 2],
            "input_top_logprobs_null_prefix": 1 if input_side else 0,
            "output_top_logprobs": OUTPUT_TOP[sl],
        }

    agg = body(out=OUT, finish=STOP, completion=3, logprobs=lp(True, slice(0, 3), 3))
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1, logprobs=lp(True, slice(0, 1), 1))
    decode = body(out=OUT, finish=STOP, completion=3, logprobs=lp(False, slice(0, 3), 3))
    [(out, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(out, dumps(agg))


def test_0523_flat_raw_input_top_logprobs_without_prefills_are_omitted():
    """A prefill leg without the flat fields: decode's zero-row fields would claim the prompt had no
    top logprobs; they are removed and ``input_top_logprobs_unavailable_reason`` says why."""
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1,
                   logprobs=flat_logprobs(input_side=True, output_slice=slice(0, 1), length=1))
    decode = body(out=OUT, finish=STOP, completion=3,
                  logprobs=flat_logprobs(input_side=False, output_slice=slice(0, 3), length=3))
    for key in [k for k in prefill["meta_info"] if k.startswith("input_top_logprobs_")]:
        del prefill["meta_info"][key]
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    meta = json.loads(out)["meta_info"]
    assert verdict is Verdict.OMITTED
    assert [k for k in meta if k.startswith("input_top_logprobs_")] == ["input_top_logprobs_unavailable_reason"]
    assert meta["input_top_logprobs_unavailable_reason"] == "prefill_missing"
    assert meta["input_token_logprobs"] == INPUT_LP  # the nested token logprobs are still prefill's


# Rows the flat format cannot represent (io_struct.flat_top_logprobs_layout: "Raises ValueError when the
# rows are not representable by (shape, null_prefix): interior nulls or ragged k, e.g. multi-item
# scoring"). The aggregated engine and the P/D prefill keep the nested rows:
#
#     scheduler_components/logprob_result_processor.py _flatten_input_top_logprobs:
#         except ValueError as e:
#             # Unrepresentable rows (e.g. multi-item scoring): keep the nested
#             # format, mirroring the tokenizer manager fallback.
#     tokenizer_manager.py add_logprob_to_meta_info:
#         except ValueError as e:
#             # A raise here would disrupt unrelated requests ...; degrade to nested instead.
#             state.input_top_logprobs_flat_fields = None
#         ...
#         if state.input_top_logprobs_flat_fields is not None: meta_info.update(...)
#         else: use_flat = False
#         if not use_flat: ... meta_info["input_top_logprobs"] = state.input_top_logprobs
#
# P/D decode has zero prompt rows, which flat_top_logprobs_layout accepts (k = top_logprobs_num): its
# body carries the zero-row flat fields where the aggregated one has the nested list.
RAGGED_TOP = [None, [[-1.5, 102, None], [-1.75, 9, None]], [[-0.25, 103, None]],
              [[-2.0, 104, None], [-2.5, 5, None]]]


def test_0523_nested_fallback_of_unrepresentable_prompt_top_logprobs_is_taken_from_prefill():
    def nested(sl: slice, length: int) -> dict[str, Any]:
        return {"input_token_logprobs": INPUT_LP, "output_token_logprobs": OUTPUT_LP[sl],
                "output_token_logprobs_length": length, "input_top_logprobs": RAGGED_TOP,
                "output_top_logprobs": OUTPUT_TOP[sl]}

    agg = body(out=OUT, finish=STOP, completion=3, logprobs=nested(slice(0, 3), 3))
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1, logprobs=nested(slice(0, 1), 1))
    decode = body(out=OUT, finish=STOP, completion=3,
                  logprobs=flat_logprobs(input_side=False, output_slice=slice(0, 3), length=3))
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(out, dumps(agg))  # prefill's nested rows, no flat fields, no omission reason
    assert verdict is Verdict.JOINED


def test_0523_nested_prompt_top_logprobs_fallback_takes_the_flat_fields_place_when_output_is_flat_too():
    """``return_flat_raw_output_top_logprobs`` (finished bodies): ``add_logprob_to_meta_info`` writes
    the output rows flat (``meta_info.update(_build_flat_top_logprobs_fields("output", ...))``), so no
    nested ``output_top_logprobs`` follows the prompt's nested fallback. The aggregated body has
    ``input_top_logprobs`` where decode has its zero-row flat fields; the join put it last."""
    def output_flat(sl: slice) -> dict[str, Any]:
        rows = OUTPUT_TOP[sl]
        return {"output_top_logprobs_val_flat": [e[0] for row in rows for e in row],
                "output_top_logprobs_idx_flat": [e[1] for row in rows for e in row],
                "output_top_logprobs_shape": [len(rows), 2], "output_top_logprobs_null_prefix": 0}

    def logprobs(sl: slice, length: int, nested: bool) -> dict[str, Any]:
        fields = flat_logprobs(input_side=False, output_slice=sl, length=length)
        del fields["output_top_logprobs"]
        if nested:
            for key in ("input_top_logprobs_val_flat", "input_top_logprobs_idx_flat", "input_top_logprobs_shape",
                        "input_top_logprobs_null_prefix"):
                del fields[key]
            fields["input_token_logprobs"] = INPUT_LP
            fields["input_top_logprobs"] = RAGGED_TOP
        return {**fields, **output_flat(sl)}

    agg = body(out=OUT, finish=STOP, completion=3, logprobs=logprobs(slice(0, 3), 3, nested=True))
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1, logprobs=logprobs(slice(0, 1), 1, nested=True))
    decode = body(out=OUT, finish=STOP, completion=3, logprobs=logprobs(slice(0, 3), 3, nested=False))
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(out, dumps(agg))
    assert verdict is Verdict.JOINED


# ============================================================================ routed_experts key order

# A one-token P/D decode finishes in SchedulerBatchResultProcessor.process_batch_result_prebuilt,
# which never calls _maybe_collect_routed_experts: decode's body has no routed_experts, and the join
# inserts prefill's. In 0.5.23 _handle_batch_output writes image/audio/video_tokens (for a request
# that has them) AFTER cached_tokens_details and BEFORE hidden_states / routed_experts; decode has
# them too (OutputStreamer.accept: "In disagg decode mode the prefill node already computed these
# and transferred them via the metadata buffer").

def test_0523_one_token_multimodal_decode_gets_routed_experts_after_image_tokens():
    fin = {"type": "length", "length": 1}
    lp = ids_logprobs(OUTPUT_LP[:1], OUTPUT_IDS_LP[:1], input_side=True, length=1)
    mm = {"image_tokens": 3}
    agg = body(out=OUT[:1], finish=fin, completion=1, logprobs=lp, experts=b64(rows(0, 4)), mm=mm)
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1, logprobs=lp, experts=b64(rows(0, 4)),
                   mm=mm)
    decode = body(out=OUT[:1], finish=fin, completion=1, mm=mm,
                  logprobs=ids_logprobs(OUTPUT_LP[:1], OUTPUT_IDS_LP[:1], input_side=False, length=1))
    [(out, _)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    assert_same(out, dumps(agg))


# ============================================================================ hidden states

# return_hidden_states=True (server --enable-return-hidden-states). Aggregated:
# SchedulerBatchResultProcessor.process_batch_result_prefill -> _append_prefill_hidden_states
# appends the prompt's block (req.hidden_states.append(req_hidden_states.cpu().clone().tolist()), a
# [prompt_len][hidden] list), then _append_decode_hidden_states extends one [hidden] vector per step;
# OutputStreamer.accept sends req.hidden_states[:finished_len].
# P/D: disaggregation/prefill.py process_batch_result_disagg_prefill never calls
# _append_prefill_hidden_states (prefill's body: hidden_states = []), and decode's
# _commit_transfer_to_req does not touch req.hidden_states: decode's list is its steps only. The
# prompt block exists on no leg, so the join cannot equal the aggregated value: omit it.

def test_0523_pd_hidden_states_lacking_the_prompt_block_are_omitted_not_published():
    h = lambda p: [p + 0.5, -p - 0.25]  # noqa: E731  a 2-wide hidden vector of position p
    agg_hidden = [[h(p) for p in range(4)], h(4), h(5)]  # prompt block, then steps feeding tokens 1, 2
    decode_hidden = [h(4), h(5)]
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1, hidden=[])
    decode = body(out=OUT, finish=STOP, completion=3, hidden=decode_hidden)
    agg = body(out=OUT, finish=STOP, completion=3, hidden=agg_hidden)
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
    meta = json.loads(out)["meta_info"]
    assert agg["meta_info"]["hidden_states"] != decode_hidden  # what the join would publish otherwise
    assert "hidden_states" not in meta
    assert meta["hidden_states_unavailable_reason"] == "prefill_missing"
    assert verdict is Verdict.OMITTED


def test_0523_hidden_states_last_mode_and_aggregated_shape_are_kept():
    """``return_hidden_states="last"``: OutputStreamer.accept sends ``req.hidden_states[-1]``, one
    vector, which decode's last step computes as the aggregated engine's does: passed through. A
    list that starts with a prompt block (a decode that computed the prompt itself) is kept too."""
    prefill = body(out=OUT[:1], finish=PREFILL_FINISH, completion=1)
    for hidden in ([5.5, -5.25], [[[0.5, -0.25]], [1.5, -1.25]]):
        decode = body(out=OUT, finish=STOP, completion=3, hidden=hidden, finished=False)
        [(out, verdict)] = join(SGLangCodec(OPTIONS), [dumps(decode)], [dumps(prefill)])
        assert verdict is Verdict.PASSTHROUGH or json.loads(out)["meta_info"]["hidden_states"] == hidden


def test_0523_hidden_states_on_a_chunk_that_does_not_wait_are_omitted_too():
    """A streamed chunk without logprobs or rows never waits for prefill; the rule reads the chunk only."""
    session = SGLangCodec(OPTIONS).open_session()
    chunk = dumps(body(out=OUT[:2], finish=None, completion=2, hidden=[[4.5, -4.25]], finished=False))
    assert not session.needs_prefill(chunk, False)
    out, verdict = session.join(chunk, False)
    assert verdict is Verdict.OMITTED
    assert json.loads(out)["meta_info"]["hidden_states_unavailable_reason"] == "prefill_missing"


# ============================================================================ folding a 0.5.23 stream

# Found by the upstream property laws (tests/test_upstream_shapes.py, ``Shape(version="0.5.23")``):
# ``OutputStreamer.accept`` computes weight-version spans for a finished request only, so
# ``_handle_batch_output`` (add_weight_versions_to_meta_info) writes ``weight_versions`` on the last
# chunk alone, between ``cached_tokens`` and ``cached_tokens_details``. Folding the stream must put it
# there, as the unary body has it, not after the keys every chunk carries.

@pytest.mark.parametrize("cumulative", [True, False])
def test_0523_folded_stream_keeps_weight_versions_where_the_unary_body_has_it(cumulative):
    spans = [(0, 1), (1, 3)]
    chunks = []
    for lo, end in spans:
        last = end == 3
        lo_ = 0 if cumulative else lo
        chunks.append(dumps(body(out=OUT[lo_:end], finish=STOP if last else None, completion=end,
                                 finished=last)))
    unary = body(out=OUT, finish=STOP, completion=3)
    assert_same(SGLangCodec(OPTIONS).fold(chunks), dumps(unary))
