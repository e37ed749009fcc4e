"""Hypothesis strategies for ground truths (format-agnostic)."""

from __future__ import annotations

from hypothesis import strategies as st

from ..sim.simulation import Truth, make_truth


@st.composite
def truths(draw: st.DrawFn, *, max_prompt: int = 12, max_output: int = 12, request_id: str | None = None) -> Truth:
    """Small but structurally complete truths: every edge of the P/D join is reachable.

    Sizes include one-token prompts and one-token outputs (the P/D edge cases); expert values
    come from a seeded PRNG so each example costs microseconds to build.
    """
    seed = draw(st.integers(0, 2**32 - 1))
    return make_truth(
        seed,
        request_id=request_id or f"r{seed:x}",
        prompt_len=draw(st.integers(1, max_prompt)),
        output_len=draw(st.integers(1, max_output)),
        num_layers=draw(st.integers(1, 3)),
        top_k=draw(st.integers(1, 2)),
        num_experts=draw(st.sampled_from([8, 256, 300])),
        return_logprob=draw(st.booleans()),
        return_experts=draw(st.booleans() | st.just(True)),
        finish=draw(st.sampled_from(["length", "stop"])),
        stale=draw(st.sampled_from(["garbage", "zeros"])),
        decode_omits_one_token_experts=draw(st.booleans()),
        decode_coverage=draw(st.sampled_from(["full", "suffix"])),
    )
