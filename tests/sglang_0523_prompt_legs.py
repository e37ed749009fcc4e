"""The prompt-scored P/D pair of ``test_sglang_0523_token_zero_hostile`` section 6 (a prefill leg with
``logprob_start_len`` 0, ``token_ids_logprob`` and routed experts), shared with
``test_sglang_0523_token_zero_review``."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from helpers import upstream_json as dumps
from sglang_0523_bodies import pd_rows
from sglang_0523_pd_legs import OPTIONS, OUT, PROMPT, flat_top, legs

# Prompt side with ``logprob_start_len`` 0 (``Scheduler.add_input_logprob_return_values``: position 0 has no
# logprob, ``None``, and no top row, ``input_top_logprobs_val = [None]``); values chosen to be found in text.
PROMPT_LP = [[None, 11, None], [-1.1875, 12, None], [-2.1875, 13, None], [-0.3125, 14, None]]
PROMPT_TOP = [None, [[-1.1875, 12, None], [-4.4375, 3, None]], [[-2.1875, 13, None], [-4.6875, 4, None]],
              [[-0.3125, 14, None], [-4.9375, 6, None]]]
# ``token_ids_logprob`` [5, 7]: prefill scored them at token 0; decode reserved that row (0.5.23, ``null``).
PREFILL_IDS_ROW = [[-1.0625, 5, None], [-2.0625, 7, None]]
PREFILL_ONLY = ("1875", "4375", "4688", "6875", "9375", "3125", "1.0625", "2.0625")  # in no decode value


def _flat_input_top(meta: dict[str, Any], *, b64: bool, k: int = 2) -> dict[str, Any]:
    """``meta``'s ``input_top_logprobs`` as ``return_flat_raw_top_logprobs`` answers it (:func:`flat_top`);
    decode's zero rows ``[0, k]``."""
    return flat_top(meta, "input", b64=b64, k=k)


def _prompt_legs(codec_cls, *, streamed: bool | str, apart: str | None, top: str = "nested",
                 experts: bool = True) -> tuple[list[bytes], list[bytes]]:
    """The pair of ``legs(prefill_logprobs=True)`` with a scored prompt (``logprob_start_len`` 0) on the
    prefill leg, decode's ``[]`` (``_GenerationStreamAccumulator.accept``: "Decode server does not send input
    logprobs"), ``token_ids_logprob`` rows (decode's row 0 reserved), and routed experts (prefill: the
    prompt's rows; decode's final body: every row, its prompt rows stale). ``top``: the prompt top rows
    nested, or flat (``list``/``b64``). ``apart``: ``decode`` (decode's token 0 and entry name 8),
    ``prefill`` (prefill's ``output_ids[0]`` is 8) or None (the honest pair)."""
    _agg, pre, dec = legs(streamed=streamed, prefill_logprobs=True, stale="zeros")
    experts_codec = codec_cls(OPTIONS).sequences["routed_experts"]

    def encode(r: np.ndarray) -> str:
        return experts_codec.encode(np.frombuffer(r.tobytes(), np.uint8))

    leg = json.loads(pre[0])
    meta = leg["meta_info"]
    meta["input_token_logprobs"], meta["input_top_logprobs"] = PROMPT_LP, PROMPT_TOP
    meta["output_token_ids_logprobs"] = [PREFILL_IDS_ROW]
    if experts:
        meta["routed_experts"] = encode(pd_rows(len(PROMPT), 1))
    if top != "nested":
        leg["meta_info"] = _flat_input_top(meta, b64=top == "b64")
    if apart == "prefill":
        leg["output_ids"][0] = 8
    decode = []
    for raw in dec:
        body = json.loads(raw)
        meta = body["meta_info"]
        lo = meta["output_token_logprobs_length"] - len(meta["output_token_logprobs"])
        meta["output_token_ids_logprobs"] = [None if p == 0 else [[-0.5 - p, 5, None], [-1.5 - p, 7, None]]
                                             for p in range(lo, meta["output_token_logprobs_length"])]
        if experts and meta["finish_reason"] is not None:
            meta["routed_experts"] = encode(pd_rows(len(PROMPT), len(OUT), stale=True))
        if top != "nested":
            body["meta_info"] = _flat_input_top(meta, b64=top == "b64")
        if apart == "decode" and lo == 0:
            body["output_ids"][0] = 8
            body["meta_info"]["output_token_logprobs"][0] = [-0.125, 8, None]
            body["meta_info"]["output_top_logprobs"][0] = [[-0.125, 8, None], [-2.5, 7, None]]
        decode.append(dumps(body))
    return [dumps(leg)], decode
