"""Codec joins: behaviours a mutation run of the pure codec joins found unpinned (each test names the
mutant it kills in its docstring's last line). Bodies are written by hand from the upstream function
named next to each, with the by-hand builders of ``test_upstream_bodies_by_hand`` (SGLang) and
``test_vllm_034_bodies_by_hand`` (vLLM 0.34.0), never from the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import drive_join as join
from helpers import upstream_json as dumps
from sglang_0523_bodies import (
    INPUT_IDS_LP,
    INPUT_LP,
    OUTPUT_IDS_LP,
    OUTPUT_LP,
    PREFILL_FINISH,
    STOP,
    b64,
    sgl_body,
)
from sglang_0523_bodies import OPTIONS as SGL_OPTIONS
from streamproc_sglang import SGLangCodec
from streamproc_vllm import VLLMCodec
from vllm_034_bodies import OPTIONS as VLLM_OPTIONS
from vllm_034_bodies import OUT as VLLM_OUT
from vllm_034_bodies import PROMPT as VLLM_PROMPT
from vllm_034_bodies import TOTAL as VLLM_TOTAL
from vllm_034_bodies import choice as vllm_choice
from vllm_034_bodies import npy_b64, prefill, unary
from vllm_034_bodies import rows as vllm_rows

from streamproc.codec import CodecOptions
from streamproc.wire import Verdict

# ========================================================================================== SGLang


def _sgl_rows(start: int, end: int, ids: int) -> bytes:
    """int32 expert ids of positions [start, end), ``ids`` a row (layers x top-k), none repeated in a row."""
    return np.asarray([[(p * 3 + j) % 97 + j * 97 for j in range(ids)] for p in range(start, end)],
                      dtype="<i4").tobytes()


def _sgl_legs(prompt: int, completion: int, prefill_rows: bytes, decode_rows: bytes) -> tuple[bytes, bytes]:
    """A unary P/D pair, ``TokenizerManager._handle_batch_output`` (no logprobs asked): the prefill body
    ends after token 0 and carries its ``routed_experts`` (``pybase64.b64encode(val.numpy().tobytes())``),
    rows ``[0, prompt)``; the decode body covers ``[0, prompt + completion - 1)``."""
    pre = sgl_body(out=[7], text="a", finish=PREFILL_FINISH, completion=1, lp=None, experts=b64(prefill_rows))
    dec = sgl_body(out=list(range(7, 7 + completion)), text="a" * completion, finish=STOP, completion=completion,
                   lp=None, experts=b64(decode_rows))
    for body in (pre, dec):
        body["meta_info"]["prompt_tokens"] = prompt
    return dumps(pre), dumps(dec)


def _sgl_experts_reason(prefill_body: bytes, decode_body: bytes) -> tuple[str | None, Verdict]:
    [(body, verdict)] = join(SGLangCodec(SGL_OPTIONS), [decode_body], [prefill_body])
    return json.loads(body)["meta_info"].get("routed_experts_unavailable_reason"), verdict


def test_sglang_an_all_zero_prefill_row_of_exactly_sixteen_ids_is_refused_as_stale():
    """A one-token prompt on a model whose row holds 16 ids (4 layers x top-4): the prefill capture is
    one row. SGLang 0.5.23's host cache is zeroed when allocated (``state_capturer/base.py``
    ``BaseHostCache.__init__``: ``self.buffer.zero_()``), so a row no forward wrote reads as 16 zeros,
    which no router picks (top-4 ids of one layer are distinct). A payload of exactly
    ``STALE_ROW_VALUES`` ids is judged too. Kills SJ04 (``count <= STALE_ROW_VALUES`` skips the check)."""
    stale = bytes(16 * 4)
    prefill_body, decode_body = _sgl_legs(1, 3, stale, stale + _sgl_rows(1, 3, 16))
    assert _sgl_experts_reason(prefill_body, decode_body) == ("prefill_corrupt", Verdict.OMITTED)


def test_sglang_a_decode_payload_longer_than_every_position_is_refused_before_it_is_decoded():
    """A request's rows cover ``[0, prompt + completion - 1)`` (``GenerateReqInput.routed_experts_start_len``
    doc: ``[routed_experts_start_len, seqlen - 1)``). With a one-row prefill the row width is exact, so a
    decode payload one row longer than that cannot be a capture of this request: refused from its
    declared size (``too_large``), before it is decoded. Kills SJ02 (the bound one row looser)."""
    prefill_body, decode_body = _sgl_legs(1, 3, _sgl_rows(0, 1, 16), _sgl_rows(0, 4, 16))
    assert _sgl_experts_reason(prefill_body, decode_body) == ("too_large", Verdict.OMITTED)


def test_sglang_rows_that_would_not_be_whole_ids_at_start_zero_are_not_joined():
    """Four prompt tokens and a 24-byte int32 prefill payload: read from SGLang's default start 0 each
    row would be 6 bytes, one and a half ids, which no capture writes (``tobytes()`` of an int32
    ``[tokens, layers, top_k]`` tensor). No reading fits both legs: omitted, never spliced at a width
    that cuts ids in half. Kills SJ13 (the width's itemsize check dropped)."""
    prefill_body, decode_body = _sgl_legs(4, 3, _sgl_rows(0, 1, 6), _sgl_rows(0, 1, 6) + _sgl_rows(1, 2, 3))
    assert _sgl_experts_reason(prefill_body, decode_body) == ("length_mismatch", Verdict.OMITTED)


def test_sglang_prefill_prompt_logprobs_that_are_no_list_are_corrupt_not_copied():
    """``add_logprob_to_meta_info`` writes ``input_token_logprobs`` as a list (``detokenize_logprob_tokens``
    triples), ``[]`` for an empty window. A prefill leg with anything else there is corrupt: decode's
    prompt-side fields go with ``input_logprobs_unavailable_reason: prefill_corrupt``, and the value is
    never copied onto decode's chunk. Kills SJ23 (a non-list prefill value copied as the answer)."""
    lp = {"input": "not a list", "output": OUTPUT_LP[:1], "length": 1}
    pre = sgl_body(out=[201], text="a", finish=PREFILL_FINISH, completion=1, lp=lp)
    dec = sgl_body(out=[201, 202, 203], text="abc", finish=STOP, completion=3,
                   lp={"input": [], "output": OUTPUT_LP, "length": 3})
    [(body, verdict)] = join(SGLangCodec(SGL_OPTIONS), [dumps(dec)], [dumps(pre)])
    meta = json.loads(body)["meta_info"]
    assert "input_token_logprobs" not in meta
    assert meta["input_logprobs_unavailable_reason"] == "prefill_corrupt"
    assert verdict is Verdict.OMITTED


def test_sglang_a_later_chunk_one_token_ids_entry_short_is_never_given_position_0s_entry():
    """Incremental P/D decode stream with ``token_ids_logprob`` whose output tokens 0 and 1 are the same
    id. Decode's ``output_token_ids_logprobs`` starts at output position 1 (``MetadataBuffers.set_buf``
    hands over no token-ids logprobs), and ``stream_output_generation`` slices it at the offset of the
    complete ``output_token_logprobs``, so the second send (positions 1-2) holds position 2's entry
    only. Position 1's entry is on no leg: the field is omitted (``length_mismatch``). Prefill's entry is
    position 0's, never position 1's, even when the token ids match. Kills SJ32 (a short list restored
    from prefill whatever position its chunk starts at)."""
    repeated = [OUTPUT_LP[0], [-0.5, OUTPUT_LP[0][1], OUTPUT_LP[0][2]], OUTPUT_LP[2]]
    pre_lp = {"input": INPUT_LP, "output": repeated[:1], "length": 1, "input_ids": INPUT_IDS_LP,
              "output_ids": OUTPUT_IDS_LP[:1]}
    pre = sgl_body(out=[201], text="a", finish=PREFILL_FINISH, completion=1, lp=pre_lp)
    first = sgl_body(out=[201], text="a", finish=None, completion=1, finished=False,
                     lp={"input": [], "output": repeated[:1], "length": 1, "input_ids": [], "output_ids": []})
    second = sgl_body(out=[201, 203], text="bc", finish=STOP, completion=3,
                      lp={"input": [], "output": repeated[1:], "length": 3, "input_ids": [],
                          "output_ids": OUTPUT_IDS_LP[2:]})
    results = join(SGLangCodec(SGL_OPTIONS), [dumps(first), dumps(second)], [dumps(pre)])
    assert json.loads(results[0][0])["meta_info"]["output_token_ids_logprobs"] == OUTPUT_IDS_LP[:1]
    meta = json.loads(results[1][0])["meta_info"]
    assert "output_token_ids_logprobs" not in meta
    assert meta["output_token_ids_logprobs_unavailable_reason"] == "length_mismatch"
    assert results[1][1] is Verdict.OMITTED


def test_sglang_token_0s_prefill_version_merges_with_decodes_next_span_of_the_same_version():
    """An update that reached the prefill server before token 0 and the decode server only after it:
    prefill's body says token 0 ran on ``v2``, decode's spans give it ``v1`` (``DecodeTransferQueue.
    _commit_transfer_to_req`` appends token 0 without a version) and ``v2`` from token 1. The aggregated
    engine ran the whole answer on ``v2``, and ``compute_weight_version_spans`` merges a change to the
    version already current (``if spans and version == spans[-1].version: spans[-1].end = end``): one
    span ``[0, 3)``. Kills SJ47 (the joined spans never merged)."""
    pre = sgl_body(out=[7], text="a", finish=PREFILL_FINISH, completion=1, lp=None)
    pre["meta_info"]["weight_versions"] = [{"version": "v2", "start": 0, "end": 1}]
    dec = sgl_body(out=[7, 8, 9], text="abc", finish=STOP, completion=3, lp=None)
    dec["meta_info"]["weight_version"] = "v2"
    dec["meta_info"]["weight_versions"] = [{"version": "v1", "start": 0, "end": 1},
                                           {"version": "v2", "start": 1, "end": 3}]
    [(body, verdict)] = join(SGLangCodec(SGL_OPTIONS), [dumps(dec)], [dumps(pre)])
    meta = json.loads(body)["meta_info"]
    assert meta["weight_versions"] == [{"version": "v2", "start": 0, "end": 3}]
    assert meta["weight_version"] == "v2"
    assert verdict is Verdict.JOINED


def test_sglang_one_all_zero_row_among_prefills_rows_is_refused_once_the_width_is_known():
    """SGLang 0.5.23's body states no start or width (``_handle_batch_output`` writes the Base64 bytes
    alone), so prefill's rows alone show no row boundaries; once decode's payload gives the width, a
    single zeroed row (a host-cache slot no forward wrote: ``BaseHostCache.__init__``,
    ``self.buffer.zero_()``) among real ones is found, and nothing is joined. Kills SJ57 (prefill's rows
    not judged at the width the layout found)."""
    prefill_rows = _sgl_rows(0, 1, 16) + bytes(16 * 4) + _sgl_rows(2, 4, 16)
    prefill_body, decode_body = _sgl_legs(4, 3, prefill_rows, bytes(4 * 16 * 4) + _sgl_rows(4, 6, 16))
    assert _sgl_experts_reason(prefill_body, decode_body) == ("prefill_corrupt", Verdict.OMITTED)


def test_sglang_decodes_rows_are_bounded_by_what_the_budget_leaves_after_prefills():
    """The processor's byte budget (``JoinSession.decode_budget``) covers what the session keeps:
    prefill's decoded rows stay held while decode's payload is decoded, so decode may take only what is
    left after them. A budget one byte short of both ends in ``too_large``, not an allocation past it.
    Kills SJ66 (prefill's rows not subtracted)."""
    prefill_rows, decode_rows = _sgl_rows(0, 4, 16), bytes(4 * 16 * 4) + _sgl_rows(4, 6, 16)
    prefill_body, decode_body = _sgl_legs(4, 3, prefill_rows, decode_rows)
    session = SGLangCodec(SGL_OPTIONS).open_session()
    session.absorb_prefill([prefill_body])
    session.decode_budget = len(prefill_rows) + len(decode_rows) - 1
    session.needs_prefill(decode_body, True)
    body, verdict = session.join(decode_body, True)
    assert json.loads(body)["meta_info"]["routed_experts_unavailable_reason"] == "too_large"
    assert verdict is Verdict.OMITTED


# ============================================================================================ vLLM


def _vllm_rows(start: int, end: int, topk: int = 3) -> np.ndarray:
    """Expert ids of positions [start, end), two layers, ``topk`` distinct ids per (position, layer)."""
    ids = [[[(p * 5 + layer * 7 + k * 13) % 40 + k * 40 for k in range(topk)] for layer in range(2)]
           for p in range(start, end)]
    return np.asarray(ids, dtype=np.int32)


def test_vllm_prefill_rows_naming_one_expert_twice_apart_are_corrupt_not_joined():
    """A router picks k distinct experts, so a (position, layer) naming one twice is no capture: rows
    read from a buffer no forward wrote (vLLM 0.34.0 ``routed_experts_capturer.py``: the monolithic
    kernel's ``self.buffer = torch.empty((max_num_tokens * group_size, experts_per_token), ...)``) can
    hold any ids, in any order. A repeat that is not next to its twin (``[5, 9, 5]``) is caught too.
    Kills VJ03 (``duplicate_ids`` comparing neighbours without sorting)."""
    prompt, out = len(VLLM_PROMPT), [51, 52, 53]
    prefill_rows = _vllm_rows(0, prompt)
    prefill_rows[7, 1] = [5, 49, 5]
    prefill = unary(out=out[:1], cached=None, experts=npy_b64(prefill_rows), finish="length")
    decode = unary(out=out, cached=None, experts=npy_b64(_vllm_rows(0, prompt + len(out) - 1)))
    [(body, verdict)] = join(VLLMCodec(VLLM_OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert got["routed_experts"] is None
    assert got["routed_experts_unavailable_reason"] == "prefill_corrupt"


def test_vllm_decode_generated_rows_naming_one_expert_twice_apart_are_corrupt():
    """The same check on decode's own (generated) rows. Kills VJ03."""
    prompt, out = len(VLLM_PROMPT), [51, 52, 53]
    prefill = unary(out=out[:1], cached=None, experts=npy_b64(_vllm_rows(0, prompt)), finish="length")
    decode_rows = _vllm_rows(0, prompt + len(out) - 1)
    decode_rows[prompt + 1, 0] = [17, 3, 17]
    decode = unary(out=out, cached=None, experts=npy_b64(decode_rows))
    [(body, verdict)] = join(VLLMCodec(VLLM_OPTIONS), [dumps(decode)], [dumps(prefill)])
    got = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert got["routed_experts_unavailable_reason"] == "decode_corrupt"


def test_vllm_a_final_decode_chunk_without_finish_or_rows_never_drops_prefills_rows_silently():
    """A decode leg whose last published chunk is a plain token delta (``serve_tokens_stream_generator``
    sends ``finish_reason: None`` and, before the finished output, ``routed_experts: None``: the worker
    stopped there) behind a prefill leg that sent rows: the rows cannot be completed, so the final chunk
    says why (``decode_missing``) instead of ending the stream with no rows and no reason.
    Kills VJ06 (the experts join only on a choice that finishes or carries rows, not on the final chunk)."""
    prompt, out = len(VLLM_PROMPT), [51, 52, 53]
    prefill = unary(out=out[:1], cached=None, experts=npy_b64(_vllm_rows(0, prompt)), finish="length")
    first = {"request_id": "generate-tokens-r9", "usage": None, "output_mode": "tokens",
             "choices": [vllm_choice(out[:2], None, None)]}
    last = {"request_id": "generate-tokens-r9", "usage": None, "output_mode": "tokens",
            "choices": [vllm_choice(out[2:], None, None)]}
    results = join(VLLMCodec(VLLM_OPTIONS), [dumps(first), dumps(last)], [dumps(prefill)])
    body, verdict = results[-1]
    got = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert got["routed_experts"] is None
    assert got["routed_experts_unavailable_reason"] == "decode_missing"


def test_vllm_a_prefill_with_no_cache_hit_hands_decode_a_count_of_zero():
    """A prefill server without ``--enable-prompt-tokens-details`` whose prompt hit no cache: vLLM 0.34.0
    ``Scheduler.update_from_output`` still sets ``kv_transfer_params["remote_prefill_cached_tokens"] =
    prefill_stats.num_cached_tokens``, here 0, the aggregated engine's count. 0 is a count, not a
    missing one. Kills VJ17 (``count > 0``)."""
    decode = unary(out=VLLM_OUT, cached=len(VLLM_PROMPT) - 1, experts=npy_b64(vllm_rows(0, VLLM_TOTAL)))
    [(body, verdict)] = join(VLLMCodec(VLLM_OPTIONS), [dumps(decode)], [dumps(prefill(None, 0))])
    usage = json.loads(body)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                              "multimodal_tokens": None}
    assert "prompt_tokens_details_unavailable_reason" not in usage
    assert verdict is Verdict.JOINED


def test_vllm_an_explicit_null_on_decode_gets_no_experts_marker_when_the_prefill_leg_timed_out():
    """A unary decode body says ``routed_experts: null`` (``GenerateResponseChoice`` dumps every field)
    when the request asked for no rows: a decode that captures them always has its generated rows. So
    with the prefill leg lost there is nothing to omit: the aggregated body's ``null``, no marker.
    Kills VJ20 (the explicit-null early return dropped: ``prefill_timeout`` put on a field never asked)."""
    decode = unary(out=VLLM_OUT, cached=None, experts=None)
    [(body, _)] = join(VLLMCodec(VLLM_OPTIONS), [dumps(decode)], None)
    got = json.loads(body)["choices"][0]
    assert got["routed_experts"] is None
    assert "routed_experts_unavailable_reason" not in got


def test_vllm_legs_that_imply_different_prompt_starts_are_not_joined_as_suffix_coverage():
    """vLLM 0.34.0 ``AuxOutputSchedulerConnector.build_connector_meta`` starts a request's rows at
    ``min(routed_experts_prompt_start, num_prompt_tokens)`` on every leg. A prefill whose rows start at
    ``S = 10`` in front of a decode that sent only its generated rows (``S = P``): the legs disagree on
    ``S``, so no joined array is the aggregated one. The suffix-coverage reading is for a prefill that
    covers the whole prompt (``S = 0``) only. Kills VJ26 (suffix coverage taken whatever prefill's ``S``)."""
    prompt, out = len(VLLM_PROMPT), [51, 52, 53]
    prefill_leg = unary(out=out[:1], cached=None, experts=npy_b64(_vllm_rows(10, prompt)), finish="length")
    decode = unary(out=out, cached=None, experts=npy_b64(_vllm_rows(prompt, prompt + len(out) - 1)))
    [(body, verdict)] = join(VLLMCodec(VLLM_OPTIONS), [dumps(decode)], [dumps(prefill_leg)])
    got = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert got["routed_experts_unavailable_reason"] == "length_mismatch"


def test_vllm_a_joined_array_over_the_decode_limit_is_omitted_as_too_large():
    """Each leg's array is read within ``max_decompressed_bytes``; the joined one is held and encoded
    too, so it is bounded as well. With suffix coverage (a decode capturer with ``start_tokens =
    num_prompt_tokens``) both legs fit while their concatenation (960 + 48 bytes) does not.
    Kills VJ27 (the joined size unchecked)."""
    prompt, out = len(VLLM_PROMPT), [51, 52, 53]
    prefill_leg = unary(out=out[:1], cached=None, experts=npy_b64(_vllm_rows(0, prompt)), finish="length")
    decode = unary(out=out, cached=None, experts=npy_b64(_vllm_rows(prompt, prompt + len(out) - 1)))
    codec = VLLMCodec(CodecOptions(max_decompressed_bytes=1000))
    [(body, verdict)] = join(codec, [dumps(decode)], [dumps(prefill_leg)])
    got = json.loads(body)["choices"][0]
    assert verdict is Verdict.OMITTED
    assert got["routed_experts"] is None
    assert got["routed_experts_unavailable_reason"] == "too_large"


@pytest.mark.parametrize("spans", [
    [{"version": "v2", "start": 2, "end": 2}],  # empty, and not at 0: no output-less body
    [{"version": "v2", "start": 0, "end": 1}, {"version": "v2", "start": 1, "end": 1},
     {"version": "v2", "start": 1, "end": 3}],  # an empty span between two
], ids=["empty-span-not-at-zero", "empty-span-inside"])
def test_sglang_decode_weight_versions_with_an_empty_span_are_removed_as_corrupt(spans):
    """SGLang 0.5.23 writes no empty span but the one of a body without output tokens
    (``add_weight_versions_to_meta_info`` keeps a span that starts at 0; ``compute_weight_version_spans``
    skips a change whose ``end <= spans[-1].end``, and ``record_weight_version_events`` records one only
    for a request with ``output_ids``). Any other empty span is no list upstream writes: removed, with
    ``decode_corrupt``, never published as token 0's attribution. Kills SJ15 (any ``start == end`` taken
    for the no-token span) and SJ16 (empty spans accepted)."""
    pre = sgl_body(out=[7], text="a", finish=PREFILL_FINISH, completion=1, lp=None)
    pre["meta_info"]["weight_versions"] = [{"version": "v1", "start": 0, "end": 1}]
    dec = sgl_body(out=[7, 8, 9], text="abc", finish=STOP, completion=3, lp=None)
    dec["meta_info"]["weight_versions"] = spans
    [(body, verdict)] = join(SGLangCodec(SGL_OPTIONS), [dumps(dec)], [dumps(pre)])
    meta = json.loads(body)["meta_info"]
    assert "weight_versions" not in meta
    assert meta["weight_versions_unavailable_reason"] == "decode_corrupt"
    assert verdict is Verdict.OMITTED
