"""Codec migrations (absorb, seal, stitch): behaviours a mutation run of the pure codec migration
sessions found unpinned (each test names the mutant it kills). Bodies are written by hand from the
upstream function named next to each, never from the simulator."""

from __future__ import annotations

import pytest
from helpers import upstream_json as dumps
from streamproc_sglang.migration import check_request as sglang_check_request
from streamproc_vllm import VLLMCodec
from streamproc_vllm.migration import resume_request
from vllm_034_bodies import OPTIONS as VLLM_OPTIONS
from vllm_034_bodies import RID as VLLM_RID
from vllm_034_bodies import choice as vllm_choice

from streamproc.codec import Emitted, MigrationRefused


def test_vllm_a_published_chunk_of_the_second_sample_alone_is_refused_as_n_greater_than_1():
    """vLLM 0.34.0 streams ``n > 1`` one child's delta per chunk (``ParentRequest.get_outputs``: "If
    streaming, just return the current output"; ``serve_tokens_stream_generator`` tags its choice
    ``index=output.index``), so a published chunk of sample 1 has a single choice. Its tokens are not
    sample 0's: resuming it as one request would replay another sample's tokens as the prompt.
    Kills VM01 (only several choices in one body taken for ``n > 1``)."""
    c = vllm_choice([61], None, None)
    c["index"] = 1
    body = {"request_id": VLLM_RID, "usage": None, "output_mode": "tokens", "choices": [c]}
    session = VLLMCodec(VLLM_OPTIONS).open_migration()
    with pytest.raises(MigrationRefused, match="n > 1"):
        session.absorb([dumps(body)])


def test_vllm_a_request_with_an_empty_prompt_is_not_resumed_as_one_made_of_the_emitted_tokens():
    """vLLM 0.34.0 refuses an empty prompt (``InputProcessor._validate_prompt_len``: "The {prompt_type}
    prompt cannot be empty"), so ``token_ids: []`` is no request a client was sent results for;
    resumed, its prompt would be the emitted tokens alone. Refused, with why.
    Kills VM12 (an empty ``token_ids`` list taken as a prompt)."""
    request = dumps({"token_ids": [], "sampling_params": {"max_tokens": 8}})
    with pytest.raises(MigrationRefused, match="no token_ids"):
        resume_request(request, Emitted([51, 52], {}))


def test_sglang_a_beam_search_of_width_2_is_refused():
    """SGLang 0.5.23 runs beam search for any ``sampling_params.beam_width`` above 1
    (``BeamCoordinator.request_beam_width``: ``beam_width or 1``) and streams nothing of it before the
    final body, whose ``beam_results`` a stitch cannot restate: the narrowest search, width 2, is
    refused like any other. Kills SM23 (only widths above 2 refused)."""
    request = dumps({"input_ids": [101, 102, 103], "sampling_params": {"beam_width": 2, "max_new_tokens": 8}})
    with pytest.raises(MigrationRefused, match="beam search"):
        sglang_check_request(request)
