"""Format-fidelity review of the ``sglang`` codec against SGLang 0.5.23: request modes in P/D.

Source: the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl`` (paths relative to
``sglang/srt/``). Bodies are written by hand from the functions quoted here: nothing comes from the
simulator (``worker.py``) or ``upstream.py``.

P/D decode streams token 0 before any forward of its own: ``DecodeTransferQueue._commit_transfer_to_req``
appends it from the metadata buffer, and ``process_batch_result_prebuilt``
(``scheduler_components/batch_result_processor.py``) sends it::

    for req in batch.reqs:
        req.update_finish_state()
        if req.finished(): ... release_kv_cache(req, self.tree_cache, checkpoint=True)
    # Note: Logprobs should be handled on the prefill engine.
    self.output_streamer.stream_output(batch.reqs, batch.return_logprob)
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from helpers import assert_same_body
from helpers import drive_join as join
from helpers import upstream_json as dumps
from streamproc_sglang import SGLangCodec

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
PROMPT = [101, 102, 103, 104]
OUT = [201, 202, 203]
LAYERS, TOPK = 2, 2
STOP = {"type": "length", "length": 3}
ONE = {"type": "length", "length": 1}
PREFILL_FINISH = {"type": "length", "length": 0}  # process_disagg_prefill_inflight_queue: FINISH_LENGTH(0)


def meta(*, finish: Any, completion: int, lp: dict[str, Any] | None = None, hidden: Any = None,
         experts: str | None = None) -> dict[str, Any]:
    """0.5.23 ``TokenizerManager._handle_batch_output``: the keys in the order it writes them."""
    m: dict[str, Any] = {"id": "rid", "finish_reason": finish, "prompt_tokens": len(PROMPT),
                         "weight_version": "default", "num_retractions": 0}
    if lp is not None:
        m.update(lp)
    m.update({"reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": 0})
    if finish is not None:  # OutputStreamer.accept: spans for a finished request only
        m["weight_versions"] = [{"version": "default", "start": 0, "end": completion}]
    m["cached_tokens_details"] = None
    if hidden is not None:  # if hidden_states is not None: meta_info["hidden_states"] = hidden_states
        m["hidden_states"] = hidden
    if experts is not None:
        m["routed_experts"] = experts
    if finish is not None:
        m["e2e_latency"] = 0.5
    return m


# ============================================================================ return_hidden_states="last"

# Aggregated: process_batch_result_prefill -> _append_prefill_hidden_states appends the prompt's last
# vector (``elif req.return_hidden_states == "last": req.hidden_states.append(req_hidden_states[-1]...)``),
# then each step's _append_decode_hidden_states replaces it (``req.hidden_states[:] = [...]``), and
# OutputStreamer.accept sends ``req.hidden_states[-1] if req.hidden_states else None``.
# P/D: the prefill leg never appends (process_batch_result_disagg_prefill), nor does decode before
# its first step: the token-0 chunk (and a one-token answer's only chunk) carries None, which
# _handle_batch_output does not write. Neither that chunk nor the prefill leg shows that hidden states
# were asked for, and the join may read no other chunk (law 5): a known limit, pinned here.

def h(position: int) -> list[float]:
    return [position + 0.5, -position - 0.25]


def hidden_last_stream(pd: bool) -> list[bytes]:
    first = meta(finish=None, completion=1, hidden=None if pd else h(len(PROMPT) - 1))
    return [dumps({"text": "a", "output_ids": OUT[:1], "meta_info": first}),
            dumps({"text": "ab", "output_ids": OUT[:2], "meta_info": meta(finish=None, completion=2, hidden=h(4))}),
            dumps({"text": "abc", "output_ids": OUT, "meta_info": meta(finish=STOP, completion=3, hidden=h(5))})]


def test_last_mode_hidden_states_missing_from_decodes_token_0_chunk_pass_without_a_value_or_reason():
    prefill = [dumps({"text": "a", "output_ids": OUT[:1], "meta_info": meta(finish=PREFILL_FINISH, completion=1)})]
    decode, agg = hidden_last_stream(pd=True), hidden_last_stream(pd=False)
    results = join(SGLangCodec(OPTIONS), decode, prefill)
    (first, verdict), rest = results[0], results[1:]
    assert first is decode[0] and verdict is Verdict.PASSTHROUGH  # nothing spliced, nothing claimed
    assert "hidden_states" in json.loads(agg[0])["meta_info"]  # what no leg can give
    for (out, _), want in zip(rest, agg[1:]):  # later chunks: decode's last step is the aggregated one
        assert_same_body(out, want)


def test_last_mode_one_token_answer_has_no_hidden_states_in_pd():
    prefill = [dumps({"text": "a", "output_ids": OUT[:1], "meta_info": meta(finish=PREFILL_FINISH, completion=1)})]
    decode = dumps({"text": "a", "output_ids": OUT[:1], "meta_info": meta(finish=ONE, completion=1)})
    [(out, verdict)] = join(SGLangCodec(OPTIONS), [decode], prefill)
    assert out is decode and verdict is Verdict.PASSTHROUGH
    assert "hidden_states_unavailable_reason" not in json.loads(out)["meta_info"]


# ============================================================================ skip_tokenizer_init

# --skip-tokenizer-init: the detokenizer is bypassed and _handle_batch_output takes its
# BatchTokenIDOutput branch: ``out_dict = {"output_ids": ..., "meta_info": meta_info}`` (no "text";
# cumulative: ``state.output_ids``, incremental: the delta), logprob entries without text
# (``return_text_in_logprobs and not self.skip_tokenizer_init`` is False: detokenize_logprob_tokens
# gives ``(logprob, token_id, None)``), and ``routed_experts`` a tensor Base64-encoded right there
# (``pybase64.b64encode(val.numpy().tobytes())``). The join must not need the text.

def rows(start: int, end: int, salt: int = 0) -> bytes:
    ids = [[(p * 7 + j * 3 + 1 + salt) % 61 + (j % TOPK) * 61 for j in range(LAYERS * TOPK)] for p in range(start, end)]
    return np.asarray(ids, dtype="<i4").tobytes()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


INPUT_LP = [[None, 101, None], [-1.5, 102, None], [-0.25, 103, None], [-2.0, 104, None]]
OUTPUT_LP = [[-0.125, 201, None], [-0.5, 202, None], [-0.75, 203, None]]


def lp(start: int, end: int, *, input_side: bool) -> dict[str, Any]:
    """add_logprob_to_meta_info, logprob_start_len=0 (the whole prompt scored)."""
    return {"input_token_logprobs": INPUT_LP if input_side else [], "output_token_logprobs": OUTPUT_LP[start:end],
            "output_token_logprobs_length": end}


@pytest.mark.parametrize("cumulative", [True, False])
def test_skip_tokenizer_init_pd_stream_joins_to_the_aggregated_stream(cumulative):
    def leg(pd: bool) -> list[bytes]:
        out = []
        for lo, end in ((0, 1), (1, 2), (2, 3)):
            start = 0 if cumulative else lo
            experts = None
            if end == 3:
                experts = b64((rows(0, 4, salt=9) if pd else rows(0, 4)) + rows(4, 6))
            m = meta(finish=STOP if end == 3 else None, completion=end, lp=lp(start, end, input_side=not pd),
                     experts=experts)
            out.append(dumps({"output_ids": OUT[start:end], "meta_info": m}))
        return out

    prefill = [dumps({"output_ids": OUT[:1], "meta_info": meta(finish=PREFILL_FINISH, completion=1,
                                                              lp=lp(0, 1, input_side=True), experts=b64(rows(0, 4)))})]
    joined = join(SGLangCodec(OPTIONS), leg(pd=True), prefill)
    for (out, verdict), want in zip(joined, leg(pd=False)):
        assert_same_body(out, want)
        assert verdict is Verdict.JOINED
    unary = {"output_ids": OUT, "meta_info": meta(finish=STOP, completion=3, lp=lp(0, 3, input_side=True),
                                                  experts=b64(rows(0, 6)))}
    assert_same_body(SGLangCodec(OPTIONS).fold([out for out, _ in joined]), dumps(unary))
