"""Codec folds (a stream into the unary body): behaviours a mutation run of the pure codec folds found
unpinned (each test names the mutant it kills). Bodies are written by hand from the upstream function
named next to each, with the by-hand builders of ``test_vllm_034_bodies_by_hand``, never from the
simulator."""

from __future__ import annotations

import json

from streamproc_vllm import VLLMCodec
from vllm_034_bodies import OPTIONS as VLLM_OPTIONS
from vllm_034_bodies import RID as VLLM_RID
from vllm_034_bodies import choice as vllm_choice
from vllm_034_bodies import usage as vllm_usage


def test_vllm_an_n_2_stream_whose_second_sample_speaks_first_folds_to_choices_in_index_order():
    """vLLM 0.34.0 streams ``n > 1`` one child's delta at a time (``ParentRequest.get_outputs``: "If
    streaming, just return the current output"), each chunk's choice tagged ``index=output.index``
    (``serve_tokens_stream_generator``), in whichever order the children's outputs arrive. The unary
    request answers the children in index order (``output_aggregator[completion_output.index]``), so the
    folded body lists choice 0 first even when choice 1 streamed first.
    Kills VF06 (choices kept in the order they first appeared)."""
    def chunk(index: int, ids: list[int], finish: str | None) -> bytes:
        c = vllm_choice(ids, finish, None)
        c["index"] = index
        return json.dumps({"request_id": VLLM_RID, "usage": None, "output_mode": "tokens",
                           "choices": [c]}).encode()

    usage_chunk = {"request_id": VLLM_RID, "usage": vllm_usage(4, None, exclude_none=True),
                   "output_mode": "tokens", "choices": []}
    bodies = [chunk(1, [61], None), chunk(0, [51], None), chunk(1, [62], "stop"), chunk(0, [52], "stop"),
              json.dumps(usage_chunk).encode()]
    folded = json.loads(VLLMCodec(VLLM_OPTIONS).fold(bodies))
    assert [(c["index"], c["token_ids"], c["finish_reason"]) for c in folded["choices"]] == [
        (0, [51, 52], "stop"), (1, [61, 62], "stop")]
