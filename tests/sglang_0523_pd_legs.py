"""The P/D legs of ``test_sglang_0523_pd_legs_driven_apart`` (a router that asks only the decode leg for
logprobs), written by hand from SGLang 0.5.23's code (that module's docstring says which functions), shared
with ``test_sglang_0523_token_zero_hostile``, which mutates them."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from helpers import upstream_json as dumps
from sglang_0523_bodies import add_counts
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import SGLangZstdCodec

from streamproc.codec import CodecOptions

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
PROMPT = [11, 12, 13, 14]
OUT = [201, 202, 203]
TEXTS = ["H", "é", "!"]
FINISH = {"type": "length", "length": 3}
OUTPUT_LP = [[-0.125, 201, None], [-0.5, 202, None], [-0.75, 203, None]]
OUTPUT_TOP = [[[-0.125, 201, None], [-2.5, 7, None]], [[-0.5, 202, None], [-1.0, 9, None]],
              [[-0.75, 203, None], [-0.875, 5, None]]]
# What a metadata slot holds where prefill never wrote logprobs: zeros (a fresh slot), or the values of
# the last request with logprobs that used it.
STALE = {
    "zeros": ([0.0, 0, None], [[0.0, 0, None], [0.0, 0, None]]),
    "left_over": ([-3.25, 555, None], [[-3.25, 555, None], [-4.5, 556, None]]),
}


def _meta(*, rid: str, lo: int, n: int, finished: bool, logprobs: bool, first: tuple | None = None,
          finish: Any = FINISH) -> dict[str, Any]:
    """``_handle_batch_output``'s ``meta_info`` after ``n`` tokens, output lists sliced from ``lo``
    (``add_logprob_to_meta_info``; ``input_*`` is ``[]`` for a default request without ``token_ids_logprob``
    on every engine: ``handle_generate_request`` sets ``logprob_start_len = len(origin_input_ids)``)."""
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish if finished else None,
                            "prompt_tokens": len(PROMPT), "weight_version": "default", "num_retractions": 0}
    if logprobs:
        lp, top = list(OUTPUT_LP), list(OUTPUT_TOP)
        if first is not None:  # decode: token 0's entries from the metadata slot
            lp[0], top[0] = first
        meta.update({"input_token_logprobs": [], "output_token_logprobs": lp[lo:n],
                     "output_token_logprobs_length": n, "input_top_logprobs": [],
                     "output_top_logprobs": top[lo:n]})
    add_counts(meta, n, finished=finished)
    if finished:
        meta["e2e_latency"] = 0.5
    return meta


def _body(lo: int, n: int, **kw: Any) -> dict[str, Any]:
    return {"text": "".join(TEXTS[lo:n]), "output_ids": OUT[lo:n], "meta_info": _meta(lo=lo, n=n, **kw)}


# Chunk spans: unary; a stream with ``stream_interval`` 1; the same stream read by a client that fell
# behind (``TokenizerManager._coalesce_streaming_chunks``: tokens 0 and 1 in one body).
SPANS = {False: [(0, 3)], True: [(0, 1), (1, 2), (2, 3)], "coalesced": [(0, 2), (2, 3)]}


def legs(*, streamed: bool | str, prefill_logprobs: bool, stale: str) -> tuple[list[dict], list[bytes], list[bytes]]:
    """(aggregated bodies, prefill leg, decode leg). Prefill: ``process_batch_result_disagg_prefill``
    finishes token 0 with ``FINISH_LENGTH(0)``, one body."""
    spans = SPANS[streamed]
    last = len(spans) - 1
    agg = [_body(lo, n, rid="agg", finished=i == last, logprobs=True) for i, (lo, n) in enumerate(spans)]
    first = (OUTPUT_LP[0], OUTPUT_TOP[0]) if prefill_logprobs else STALE[stale]
    dec = [_body(lo, n, rid="agg", finished=i == last, logprobs=True, first=first) for i, (lo, n) in enumerate(spans)]
    pre = _body(0, 1, rid="prefill", finished=True, logprobs=prefill_logprobs,
                finish={"type": "length", "length": 0})
    if prefill_logprobs:  # a default request's prompt is not scored: ``[]`` on prefill too
        pre["meta_info"]["output_token_logprobs"] = [OUTPUT_LP[0]]
        pre["meta_info"]["output_top_logprobs"] = [OUTPUT_TOP[0]]
    return agg, [dumps(pre)], [dumps(b) for b in dec]


CODECS = [pytest.param(SGLangCodec, id="sglang"), pytest.param(SGLangZstdCodec, id="sglang-zstd")]

# ai-dynamo/dynamo prefill_handler.py ``PrefillWorkerHandler.generate``: the frame it yields to Dynamo's
# router before running the prefill (its SGLang results are consumed, never yielded).
DYNAMO_BOOTSTRAP_FRAME = {"token_ids": [], "text": None, "finish_reason": None,
                          "disaggregated_params": {"bootstrap_host": "10.0.0.7", "bootstrap_port": 8998,
                                                   "bootstrap_room": 7}}


RETRACT_ABORT = {"type": "abort", "message": "retract: out of memory", "status_code": 503, "err_type": None}


def _leg_that_says_nothing(kind: str, pre: list[bytes]) -> list[bytes] | None:
    """A prefill leg that does not tell whether prefill was asked for logprobs: none (timed out), Dynamo's
    in-process handler's frame alone (it consumes SGLang's results without yielding them), SGLang's body
    with an unreadable ``output_token_logprobs``, or one that failed (an abort finish); or one whose logprob
    lists name the slot's left-over token (it says prefill was asked, the slot says it was not written)."""
    if kind == "timeout":
        return None
    if kind == "frame":
        return [dumps(DYNAMO_BOOTSTRAP_FRAME)]
    leg = json.loads(pre[0])
    if kind == "failed":
        leg["meta_info"]["finish_reason"] = RETRACT_ABORT
    elif kind == "disagreeing":
        leg["meta_info"]["output_token_logprobs"] = [list(STALE["left_over"][0])]
        leg["meta_info"]["output_top_logprobs"] = [list(STALE["left_over"][1])]
    else:
        leg["meta_info"]["output_token_logprobs"] = "x"
    return [dumps(leg)]


def flat_top(meta: dict[str, Any], side: str, *, b64: bool, k: int | None = None) -> dict[str, Any]:
    """``meta`` with its nested ``<side>_top_logprobs`` replaced, where it stood, by SGLang 0.5.23's
    ``_build_flat_top_logprobs_fields(side, ...)`` (``return_flat_raw_<side>_top_logprobs``): ``[rows, k]``
    arrays after the leading null rows (``<side>_top_logprobs_null_prefix``), float32/int32 with ``b64``;
    ``k`` the row width (default: the last row's; all rows null: ``[0, k]``)."""
    key = f"{side}_top_logprobs"
    rows = meta[key]
    prefix = 0
    while prefix < len(rows) and not rows[prefix]:
        prefix += 1
    vals = [entry[0] for row in rows[prefix:] for entry in row]
    idxs = [entry[1] for row in rows[prefix:] for entry in row]
    if b64:
        flat: dict[str, Any] = {
            f"{key}_val_flat_b64": base64.b64encode(struct.pack(f"<{len(vals)}f", *vals)).decode(),
            f"{key}_idx_flat_b64": base64.b64encode(struct.pack(f"<{len(idxs)}i", *idxs)).decode(),
            f"{key}_val_flat_b64_dtype": "float32",
            f"{key}_idx_flat_b64_dtype": "int32"}
    else:
        flat = {f"{key}_val_flat": vals, f"{key}_idx_flat": idxs}
    flat[f"{key}_shape"] = [len(rows) - prefix, k if k is not None else len(rows[-1])]
    flat[f"{key}_null_prefix"] = prefix
    out: dict[str, Any] = {}
    for name, value in meta.items():
        if name == key:
            out.update(flat)
        else:
            out[name] = value
    return out


def _flat_output_top(meta: dict[str, Any], *, b64: bool) -> dict[str, Any]:
    """``meta`` as ``return_flat_raw_output_top_logprobs`` (unary only) answers it (:func:`flat_top`)."""
    return flat_top(meta, "output", b64=b64)
