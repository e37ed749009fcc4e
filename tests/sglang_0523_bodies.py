"""SGLang native ``/generate`` bodies written by hand from upstream code (``TokenizerManager._handle_batch_output``
and the functions named beside each builder), shared by ``test_upstream_bodies_by_hand.py``, the codec
mutation tests and the 0.5.23 join tests. Nothing here uses the simulator or the codecs' ``upstream.py`` builders."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from streamproc.codec import CodecOptions

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)




# =========================================================================================== SGLang

RID = "req-1"
PROMPT = [101, 102, 103, 104]
OUT = [201, 202, 203]
OUT_TEXT = ["Hé", "llo", " 世"]
LAYERS, TOPK = 2, 2


def rows(start: int, end: int, dtype: str = "<i4") -> bytes:
    """Expert ids of positions [start, end): distinct within a (position, layer)."""
    ids = [[(p * 7 + j * 3 + 1) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)] for p in range(start, end)]
    return np.asarray(ids, dtype=dtype).tobytes()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def pd_rows(prompt: int, completion: int, *, stale: bool = False) -> np.ndarray:
    """Routed experts over positions ``[0, prompt + completion - 1)`` (2 layers x top-2, int32); decode's
    prompt rows are whatever its KV slots held (``stale``)."""
    r = np.array([[3 + p, 17 + p, 40 + p, 5 + p] for p in range(prompt + completion - 1)], dtype="<i4")
    if stale:
        r[:prompt] = [[60 + p, 61 + p, 62 + p, 63 + p] for p in range(prompt)]
    return r


def rows_b64(r: np.ndarray) -> str:
    """``routed_experts`` as SGLang sends it: the int32 rows' bytes, Base64."""
    return b64(np.ascontiguousarray(r, dtype="<i4").tobytes())


def add_counts(meta: dict[str, Any], n: int, *, finished: bool, cached: int = 0,
               cached_details: dict[str, int] | None = None) -> None:
    """``_handle_batch_output`` (0.5.23) after ``convert_logprob_style``: the token counts, on a finish
    ``add_weight_versions_to_meta_info`` (``weight_versions``, then ``weight_version``, already a key,
    updated), then ``cached_tokens_details``."""
    meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": cached})
    if finished:
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": n}]
        meta["weight_version"] = "default"
    meta["cached_tokens_details"] = cached_details


def coalesced(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """``TokenizerManager._coalesce_streaming_chunks`` (0.5.23, ``--incremental-streaming-output``): the
    chunks queued behind the reader merged, ``output_ids``/``text`` and the incremental meta lists
    concatenated, every other key the last chunk's."""
    merged = dict(bodies[-1])
    merged["output_ids"] = [i for b in bodies for i in b["output_ids"]]
    merged["text"] = "".join(b["text"] for b in bodies)
    metas = [b["meta_info"] for b in bodies]
    meta = dict(metas[-1])
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
                "output_token_sampling_mask", "output_token_sampling_logprobs"):
        if any(key in m for m in metas):
            meta[key] = [item for m in metas for item in m.get(key, [])]
    merged["meta_info"] = meta
    return merged


# tokenizer_manager.detokenize_logprob_tokens(decode_to_text=True): (logprob, id, text) triples; the
# scheduler pads the first scored prompt position with a None logprob.
INPUT_LP = [[None, 101, "<s>"], [-1.5, 102, "é"], [-0.25, 103, ""], [-2.0, 104, "😀"]]
OUTPUT_LP = [[-0.125, 201, "Hé"], [-0.5, 202, "llo"], [-0.75, 203, " 世"]]
# detokenize_top_logprobs_tokens: None where the position has no values (the padded first one).
INPUT_TOP = [None, [[-1.5, 102, "é"], [-1.75, 9, "x"]], [[-0.25, 103, ""], [-3.0, 7, None]],
             [[-2.0, 104, "😀"], [-2.5, 5, "y"]]]
OUTPUT_TOP = [[[-0.125, 201, "Hé"], [-4.0, 8, "z"]], [[-0.5, 202, "llo"], [-1.0, 9, "x"]],
              [[-0.75, 203, " 世"], [-0.875, 5, "y"]]]
# token_ids_logprob=[9, 42]: one [[lp, 9, t], [lp, 42, t]] per position.
INPUT_IDS_LP = [None, [[-1.75, 9, "x"], [-6.0, 42, "q"]], [[-5.0, 9, "x"], [-6.5, 42, "q"]],
                [[-4.0, 9, "x"], [-7.0, 42, "q"]]]
OUTPUT_IDS_LP = [[[-3.0, 9, "x"], [-8.0, 42, "q"]], [[-1.0, 9, "x"], [-9.0, 42, "q"]],
                 [[-2.0, 9, "x"], [-9.5, 42, "q"]]]


def sgl_body(*, out: list[int], text: str, finish: Any, completion: int, lp: dict[str, Any] | None,
             experts: Any = None, cached: int = 0, finished: bool = True) -> dict:
    """``TokenizerManager._handle_batch_output`` for one request (BatchStrOutput branch)."""
    meta: dict[str, Any] = {
        "id": RID,
        "finish_reason": finish,
        "prompt_tokens": len(PROMPT),
        "weight_version": "default",
        "total_retractions": 0,
    }
    if lp is not None:  # convert_logprob_style -> add_logprob_to_meta_info
        meta["input_token_logprobs"] = lp["input"]
        meta["output_token_logprobs"] = lp["output"]
        meta["output_token_logprobs_length"] = lp["length"]
        if "input_top" in lp:  # top_logprobs_num > 0
            meta["input_top_logprobs"] = lp["input_top"]
            meta["output_top_logprobs"] = lp["output_top"]
        if "input_ids" in lp:  # token_ids_logprob is not None
            meta["input_token_ids_logprobs"] = lp["input_ids"]
            meta["output_token_ids_logprobs"] = lp["output_ids"]
    meta["completion_tokens"] = completion
    meta["cached_tokens"] = cached
    if experts is not None:
        meta["routed_experts"] = experts
    if finished:
        meta["e2e_latency"] = 0.25
    return {"text": text, "output_ids": out, "meta_info": meta}


STOP = {"type": "stop", "matched": 203}  # FINISH_MATCHED_TOKEN.to_json()
PREFILL_FINISH = {"type": "length", "length": 1}  # the prefill worker's request ends after token 0


# ------------------------------------------------------------------ HTTP-layer error bodies (http_server.py)
# A message ``_validate_one_request`` raises (``TokenizerManager``, a ``ValueError`` while the request is
# admitted, before any chunk); non-ASCII and a quote to pin the encoding.
TOO_LONG = ("Requested token count exceeds the model's maximum context length of 8 tokens. You requested a "
            "total of 12 tokens: 4 tokens from the input messages and 8 tokens for the completion. « é »")


def stream_error_frame(message: str) -> dict:
    """``serve_generate_request``' ``stream_results``, ``except ValueError as e`` (client still connected)::

        out = {"error": {"message": str(e), "type": "invalid_request_error",
                         "code": getattr(e, "status_code", 400), "retryable": False}}
        yield b"data: " + dumps_json(out) + b"\\n\\n"

    then only ``data: [DONE]``. No ``ValueError`` SGLang 0.5.23 raises on this path has a ``status_code``
    attribute, so ``code`` is 400."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}}


def unary_value_error(message: str) -> dict:
    """The same request with ``stream: false``: ``serve_generate_request``' ``except ValueError as e: return
    _create_error_response(e)``, i.e. ``ORJSONResponse({"error": {"message": str(e)}},
    status_code=getattr(e, "status_code", HTTPStatus.BAD_REQUEST))``: the message alone, status 400 on
    the HTTP status line (orjson: compact, raw UTF-8)."""
    return {"error": {"message": message}}
