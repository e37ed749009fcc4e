"""The built-in ``vllm`` codec: P/D join rules, omission policy, safe .npy reading, fold, errors."""

from __future__ import annotations

import base64
import io
import json
import random
import tracemalloc

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib import format as npy_format

from streamproc.catalog import Catalog, codec_names, worker_for
from streamproc.codec import CodecOptions, CorruptPayload, ErrorKind
from streamproc.config import load
from streamproc.correlator import Correlator, CorrelatorConfig, Notice
from streamproc.simulation import Damage, Truth, make_truth
from streamproc.wire import Chunk, Result, Role, Verdict
from streamproc_vllm import VLLMCodec, VLLMWorker
from streamproc_vllm.native import StreamExperts
from streamproc_vllm.sequence import Base64Npy, npy_bytes
from vllm_older_bodies import stream as by_hand_stream

WORKER = VLLMWorker()
# Chunks in no upstream shape (``model`` on each, the prompt logprobs on the first, the usage on the last),
# for the tests of how the join treats a stream chunk that carries ``prompt_logprobs``.
NONUPSTREAM = VLLMWorker(nonupstream_chunks=True)
CODEC = VLLMCodec()
REASON = "routed_experts_unavailable_reason"
PL_REASON = "prompt_logprobs_unavailable_reason"


def loads(body: bytes) -> dict:
    return msgspec.json.decode(body)


def experts_of(body: bytes) -> np.ndarray:
    return Base64Npy(CodecOptions()).decode(loads(body)["choices"][0]["routed_experts"])


def with_choice(body: bytes, **fields: object) -> bytes:
    obj = loads(body)
    obj["choices"][0].update(fields)
    return msgspec.json.encode(obj)


_DROP = object()  # with_top(..., key=_DROP) removes the key
PROMPT_LOGPROBS_KEY = "prompt_logprobs"


def with_top(body: bytes, **fields: object) -> bytes:
    obj = loads(body)
    for key, value in fields.items():
        if value is _DROP:
            obj.pop(key, None)
        else:
            obj[key] = value
    return msgspec.json.encode(obj)


def b64npy(array: np.ndarray) -> str:
    return base64.b64encode(npy_bytes(array)).decode()


def join_leg(
    decode: list[bytes],
    prefill: list[bytes] | None = None,
    *,
    unavailable: str = "prefill_timeout",
    codec: VLLMCodec = CODEC,
) -> list[tuple[bytes, Verdict]]:
    """Drive a session as the correlator does: prefill becomes known before the first join needing it."""
    session = codec.open_session()
    known = False
    out = []
    for i, body in enumerate(decode):
        final = i == len(decode) - 1
        if not known and session.needs_prefill(body, final):
            if prefill is None:
                session.prefill_unavailable(unavailable)
            else:
                session.absorb_prefill(prefill)
            known = True
        out.append(session.join(body, final))
    return out


# What the fold of an upstream older stream leaves out of the unary body, each ``null`` with this reason
# beside it. Proved on bodies written by hand from upstream (tests/vllm_older_bodies.py, furionw/vllm @ 9cdf7782
# ``serve_tokens_stream_generator``: ``GenerateStreamResponse(request_id, choices)``, ``usage: null``) by
# tests/test_vllm_older_fold_by_hand.py and test_vllm_older_fold_unary_fields_by_hand.py: the unary
# ``request_id`` is a fresh ``random_uuid()`` (moreh-dev @ 2f585f1b: the chunks' id), ``model`` / ``usage``
# no key or a string / object, ``prompt_logprobs`` / ``kv_transfer_params`` keys no chunk carries.
STREAM_OMITS = {"request_id": "fold_ambiguous", "model": "not_streamed", "usage": "not_streamed",
                PROMPT_LOGPROBS_KEY: "not_streamed", "kv_transfer_params": "not_streamed"}
SUFFIX = "_unavailable_reason"


def as_folded_stream(unary: bytes) -> dict:
    """The unary body as the fold of its upstream stream has it: ``STREAM_OMITS`` null with their reasons."""
    reasons = {f"{k}{SUFFIX}": v for k, v in STREAM_OMITS.items()}
    return {**loads(unary), **dict.fromkeys(STREAM_OMITS), **reasons}


def test_stream_omits_are_what_a_by_hand_upstream_stream_folds_to() -> None:
    """``STREAM_OMITS``, which the fold laws below expect of the simulator's streams, is the fold of the
    by-hand upstream stream (no usage chunk, as the simulator's default stream)."""
    folded = loads(CODEC.fold(by_hand_stream(include_usage=False)))
    assert {k.removesuffix(SUFFIX): v for k, v in folded.items() if k.endswith(SUFFIX)} == STREAM_OMITS
    assert all(folded[k] is None for k in STREAM_OMITS)
    unary = WORKER.agg(make_truth(1), stream=False)[0]
    assert loads(WORKER.streamed_unary(unary)) == as_folded_stream(unary)  # what the laws (law 2) expect


def joined_unary(truth: Truth, **kwargs: object) -> tuple[bytes, Verdict]:
    decode = WORKER.decode(truth, stream=False, **kwargs)
    [(body, verdict)] = join_leg(decode, WORKER.prefill(truth, stream=False))
    return body, verdict


# --------------------------------------------------------------------------- expert rows


def test_full_coverage_decode_rows_are_spliced_over_stale_prompt_rows() -> None:
    truth = make_truth(3, prompt_len=7, output_len=5, decode_coverage="full", stale="garbage")
    decode = WORKER.decode(truth, stream=False)
    stale, _ = WORKER.expert_view(decode[0])
    prompt_bytes = truth.prompt_len * truth.row_bytes
    assert len(stale) == len(truth.experts)
    assert stale[:prompt_bytes] != truth.experts[:prompt_bytes]  # the decode leg really is stale
    body, verdict = joined_unary(truth)
    assert verdict is Verdict.JOINED
    assert WORKER.expert_view(body) == (truth.experts, None)
    assert experts_of(body).shape == (truth.rows, truth.num_layers, truth.top_k)


def test_suffix_coverage_decode_rows_are_concatenated_after_prefill_rows() -> None:
    truth = make_truth(4, prompt_len=6, output_len=9, decode_coverage="suffix")
    assert experts_of(WORKER.decode(truth, stream=False)[0]).shape[0] == truth.output_len - 1
    body, verdict = joined_unary(truth)
    assert verdict is Verdict.JOINED
    assert WORKER.expert_view(body) == (truth.experts, None)


@pytest.mark.parametrize("coverage", ["full", "suffix"])
def test_zero_stale_prompt_rows_are_replaced_too(coverage: str) -> None:
    truth = make_truth(5, prompt_len=4, output_len=3, decode_coverage=coverage, stale="zeros")
    body, _ = joined_unary(truth)
    assert WORKER.expert_view(body) == (truth.experts, None)


@pytest.mark.parametrize("coverage,omit", [("full", False), ("suffix", False), ("full", True)])
def test_one_token_completion_yields_exactly_prefill_rows(coverage: str, omit: bool) -> None:
    truth = make_truth(6, prompt_len=5, output_len=1, decode_coverage=coverage,
                       decode_omits_one_token_experts=omit)
    decode = WORKER.decode(truth, stream=False)[0]
    assert ("routed_experts" in loads(decode)["choices"][0]) is not omit
    body, verdict = joined_unary(truth)
    assert verdict is Verdict.JOINED
    assert WORKER.expert_view(body) == (truth.experts, None)
    assert experts_of(body).shape[0] == truth.prompt_len


def test_decode_rows_fitting_neither_coverage_are_omitted_as_length_mismatch() -> None:
    truth = make_truth(7, prompt_len=5, output_len=6)
    decode = WORKER.decode(truth, stream=False)[0]
    short = experts_of(decode)[:-2]
    [(body, verdict)] = join_leg([with_choice(decode, routed_experts=b64npy(short))],
                                 WORKER.prefill(truth, stream=False))
    assert verdict is Verdict.OMITTED
    choice = loads(body)["choices"][0]
    assert choice["routed_experts"] is None and choice[REASON] == "length_mismatch"


def test_prefill_rows_not_matching_the_prompt_length_are_omitted() -> None:
    truth = make_truth(8, prompt_len=5, output_len=4)
    prefill = WORKER.prefill(truth, stream=False)[0]
    rows = experts_of(prefill)[:-1]
    [(body, verdict)] = join_leg(WORKER.decode(truth, stream=False),
                                 [with_choice(prefill, routed_experts=b64npy(rows))])
    assert verdict is Verdict.OMITTED
    assert loads(body)["choices"][0][REASON] == "length_mismatch"


@pytest.mark.parametrize("change", ["dtype", "layout"])
def test_legs_with_different_dtype_or_layout_are_omitted_as_shape_mismatch(change: str) -> None:
    truth = make_truth(9, prompt_len=4, output_len=4)
    prefill = WORKER.prefill(truth, stream=False)[0]
    rows = experts_of(prefill)
    rows = rows.astype(np.uint16) if change == "dtype" else rows.reshape(rows.shape[0], -1, 1)
    [(body, verdict)] = join_leg(WORKER.decode(truth, stream=False),
                                 [with_choice(prefill, routed_experts=b64npy(rows))])
    assert verdict is Verdict.OMITTED
    assert loads(body)["choices"][0][REASON] == "shape_mismatch"


def test_experts_use_uint16_when_ids_exceed_a_byte() -> None:
    truth = make_truth(10, num_experts=300, prompt_len=3, output_len=3)
    agg = WORKER.agg(truth, stream=False)[0]
    assert experts_of(agg).dtype == np.uint16
    body, _ = joined_unary(truth)
    assert experts_of(body).dtype == np.uint16
    assert WORKER.expert_view(body) == (truth.experts, None)


# ------------------------------------------------------------------- omission policy

DAMAGE_REASON = {
    Damage.DROP: "missing",
    Damage.GARBAGE: "corrupt",
    Damage.TRUNCATE: "corrupt",
    Damage.WRONG_TYPE: "corrupt",
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("damage", list(Damage))
def test_damaged_leg_omits_experts_with_a_reason(leg: str, damage: Damage, stream: bool) -> None:
    truth = make_truth(11, prompt_len=6, output_len=7)
    # NONUPSTREAM: its first stream chunk carries prompt_logprobs, which the join fills from prefill.
    prefill = NONUPSTREAM.prefill(truth, stream=stream, damage=damage if leg == "prefill" else None)
    decode = NONUPSTREAM.decode(truth, stream=stream, damage=damage if leg == "decode" else None)
    results = join_leg(decode, prefill)
    body, verdict = results[-1]
    expected = "too_large" if damage is Damage.BOMB else f"{leg}_{DAMAGE_REASON[damage]}"
    assert verdict is Verdict.OMITTED
    assert WORKER.expert_view(body) == (None, expected)
    assert "routed_experts" in loads(body)["choices"][0]  # omitted as null plus reason, never stale
    folded = loads(CODEC.fold([b for b, _ in results]))
    assert folded["prompt_logprobs"] is not None  # the rest of the join still happened
    assert all("token" in e for e in folded["choices"][0]["logprobs"]["content"])


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_timeout_omits_prompt_logprobs_and_experts(stream: bool) -> None:
    truth = make_truth(12, prompt_len=5, output_len=6)
    # NONUPSTREAM: a stream chunk with prompt_logprobs to omit (no upstream chunk has the key).
    results = join_leg(NONUPSTREAM.decode(truth, stream=stream), None, unavailable="prefill_timeout")
    first, first_verdict = results[0]
    last, last_verdict = results[-1]
    assert first_verdict is Verdict.OMITTED and last_verdict is Verdict.OMITTED
    assert loads(first)["prompt_logprobs"] is None
    assert loads(first)[PL_REASON] == "prefill_timeout"
    assert WORKER.expert_view(last) == (None, "prefill_timeout")


def test_non_json_prefill_leg_is_corrupt() -> None:
    truth = make_truth(13, prompt_len=3, output_len=3)
    [(body, verdict)] = join_leg(WORKER.decode(truth, stream=False), [b"\x00 not json"])
    assert verdict is Verdict.OMITTED
    obj = loads(body)
    assert obj[PL_REASON] == "prefill_corrupt"
    assert obj["choices"][0][REASON] == "prefill_corrupt"


def test_decode_chunk_needing_nothing_passes_through_its_original_bytes() -> None:
    truth = make_truth(14, prompt_len=4, output_len=9, return_logprob=False, return_experts=False)
    decode = WORKER.decode(truth, stream=True)
    assert len(decode) > 2
    results = join_leg(decode, WORKER.prefill(truth, stream=True))
    for (body, verdict), original in zip(results, decode):
        assert verdict is Verdict.PASSTHROUGH
        assert body is original


# ------------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_come_from_prefill() -> None:
    truth = make_truth(15, prompt_len=6, output_len=2)
    assert loads(WORKER.decode(truth, stream=False)[0])["prompt_logprobs"] is None
    body, _ = joined_unary(truth)
    assert loads(body)["prompt_logprobs"] == loads(WORKER.agg(truth, stream=False)[0])["prompt_logprobs"]


@pytest.mark.parametrize("prompt_len", [1, 4])
def test_prompt_logprobs_stay_null_when_prefill_has_none_even_with_sampled_logprobs(prompt_len: int) -> None:
    # prompt_logprobs and logprobs are independent sampling parameters: sampled logprobs alone say
    # nothing about the prompt, and nothing is invented for a one-token prompt.
    truth = make_truth(16, prompt_len=prompt_len, output_len=3)
    prefill = [with_top(WORKER.prefill(truth, stream=False)[0], prompt_logprobs=None)]
    [(body, verdict)] = join_leg(WORKER.decode(truth, stream=False), prefill)
    obj = loads(body)
    assert obj["choices"][0]["logprobs"] is not None
    assert obj["prompt_logprobs"] is None and PL_REASON not in obj
    assert verdict is not Verdict.OMITTED


def test_prompt_logprobs_without_a_prefill_leg_are_unknown_and_omitted() -> None:
    truth = make_truth(16, prompt_len=1, output_len=3, return_logprob=False)
    [(body, verdict)] = join_leg(WORKER.decode(truth, stream=False), None)
    obj = loads(body)
    assert obj["prompt_logprobs"] is None and obj[PL_REASON] == "prefill_timeout"
    assert verdict is Verdict.OMITTED


def test_one_token_prompt_with_prefill_list_keeps_it() -> None:
    truth = make_truth(17, prompt_len=1, output_len=2)
    assert loads(WORKER.prefill(truth, stream=False)[0])["prompt_logprobs"] == [None]
    body, verdict = joined_unary(truth)
    assert loads(body)["prompt_logprobs"] == [None] and verdict is Verdict.JOINED


def test_first_stream_chunk_before_usage_treats_the_prompt_as_multi_token() -> None:
    truth = make_truth(18, prompt_len=1, output_len=4, chunk_sizes=[2, 2])
    results = join_leg(NONUPSTREAM.decode(truth, stream=True), None, unavailable="prefill_timeout")
    first = loads(results[0][0])
    assert first["prompt_logprobs"] is None and first[PL_REASON] == "prefill_timeout"


def test_stream_chunks_never_gain_prompt_logprobs() -> None:
    # GenerateStreamResponse has no prompt_logprobs key; a chunk without it gets none.
    truth = make_truth(19, prompt_len=4, output_len=4, chunk_sizes=[2, 2])
    decode = [with_top(body, prompt_logprobs=_DROP) for body in WORKER.decode(truth, stream=True)]
    for body, _ in join_leg(decode, WORKER.prefill(truth, stream=True)):
        obj = loads(body)
        assert PROMPT_LOGPROBS_KEY not in obj and PL_REASON not in obj
    for body, _ in join_leg(decode, None):
        assert PL_REASON not in loads(body)


def test_decode_prompt_logprobs_that_differ_from_prefills_are_replaced_by_prefills() -> None:
    # Until 2026-12-05 omitted as inconsistent_legs. Upstream decode legs send either rows never written
    # (NIXL-loaded prompt, LogprobsTensors.empty_cpu) or another engine's floats (vLLM 0.34.0 recompute);
    # prefill scored the prompt as the aggregated engine does (tests/test_vllm_upstream_fidelity.py).
    truth = make_truth(20, prompt_len=4, output_len=2)
    prefill = WORKER.prefill(truth, stream=False)
    want = loads(prefill[0])["prompt_logprobs"]
    own = loads(prefill[0])["prompt_logprobs"]
    own[1] = {"1": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:1"}}
    decode = with_top(WORKER.decode(truth, stream=False)[0], prompt_logprobs=own)
    [(body, verdict)] = join_leg([decode], prefill)
    assert verdict is Verdict.JOINED
    obj = loads(body)
    assert obj["prompt_logprobs"] == want and PL_REASON not in obj


def test_equal_prompt_logprobs_on_both_legs_are_kept() -> None:
    truth = make_truth(21, prompt_len=4, output_len=2)
    prefill = WORKER.prefill(truth, stream=False)
    same = loads(prefill[0])["prompt_logprobs"]
    decode = with_top(WORKER.decode(truth, stream=False)[0], prompt_logprobs=same)
    [(body, verdict)] = join_leg([decode], prefill)
    assert verdict is Verdict.JOINED
    assert loads(body)["prompt_logprobs"] == same and PL_REASON not in loads(body)


# ----------------------------------------------------------------------- token labels


def test_missing_token_labels_are_filled_in_every_decode_chunk() -> None:
    truth = make_truth(22, prompt_len=3, output_len=9, chunk_sizes=[3, 3, 3])
    decode = WORKER.decode(truth, stream=True)
    session = CODEC.open_session()
    session.absorb_prefill(WORKER.prefill(truth, stream=True))
    session.join(decode[0], False)
    middle, verdict = session.join(decode[1], False)  # needs no prefill, still changed
    assert verdict is Verdict.JOINED
    choice = loads(middle)["choices"][0]
    labels = [e["token"] for e in choice["logprobs"]["content"]]
    assert choice["token_ids"] == truth.output_ids[3:6]
    assert labels == [f"token_id:{t}" for t in truth.output_ids[3:6]]


def test_non_finite_logprobs_are_clamped() -> None:
    truth = make_truth(23, prompt_len=3, output_len=3, chunk_sizes=[1, 1, 1])
    decode = WORKER.decode(truth, stream=True)
    obj = loads(decode[1])
    obj["choices"][0]["logprobs"]["content"][0]["logprob"] = float("-inf")
    middle = json.dumps(obj).encode()  # the stdlib writes -Infinity, as Python workers do
    assert b"-Infinity" in middle
    session = CODEC.open_session()
    session.absorb_prefill(WORKER.prefill(truth, stream=True))
    session.join(decode[0], False)
    body, verdict = session.join(middle, False)
    assert verdict is Verdict.JOINED
    entry = loads(body)["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == -9999.0 and entry["token"] == f"token_id:{truth.output_ids[1]}"


def test_labelled_middle_chunk_passes_through() -> None:
    truth = make_truth(24, prompt_len=3, output_len=3, chunk_sizes=[1, 1, 1])
    middle = WORKER.agg(truth, stream=True)[1]  # already labelled, no experts
    session = CODEC.open_session()
    session.absorb_prefill(WORKER.prefill(truth, stream=True))
    session.join(WORKER.decode(truth, stream=True)[0], False)
    body, verdict = session.join(middle, False)
    assert verdict is Verdict.PASSTHROUGH and body is middle


def test_needs_prefill_only_for_first_and_final_decode_chunks() -> None:
    truth = make_truth(25, prompt_len=3, output_len=8, chunk_sizes=[2, 2, 2, 2])
    decode = WORKER.decode(truth, stream=True)
    session = CODEC.open_session()
    session.absorb_prefill(WORKER.prefill(truth, stream=True))
    wanted = []
    for i, body in enumerate(decode):
        final = i == len(decode) - 1
        wanted.append(session.needs_prefill(body, final))
        session.join(body, final)
    assert wanted == [True, False, False, True]
    fresh = CODEC.open_session()
    fresh.absorb_prefill(WORKER.prefill(truth, stream=True))
    fresh.join(decode[0], False)
    stray = with_choice(decode[1], routed_experts=loads(decode[-1])["choices"][0]["routed_experts"])
    assert fresh.needs_prefill(stray, False)  # expert rows mid-stream could be stale: wait for prefill


# ------------------------------------------------------------------------- safe .npy


def npy_header(descr: str, shape: tuple) -> bytes:
    out = io.BytesIO()
    npy_format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def test_npy_bomb_is_rejected_from_the_header_without_allocating() -> None:
    declared_shape = (1 << 24, 64, 8)  # 16 GiB of uint16
    bomb = base64.b64encode(npy_header("<u2", declared_shape) + b"\x00" * 64).decode()
    codec = Base64Npy(CodecOptions(max_decompressed_bytes=1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPayload) as caught:
            codec.decode(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.reason == "too_large"
    assert peak < 1 << 20  # far below the 16 GiB declared (and below even the limit)


def test_array_above_the_limit_is_too_large() -> None:
    array = np.zeros((100, 4, 2), dtype=np.uint8)
    with pytest.raises(CorruptPayload) as caught:
        Base64Npy(CodecOptions(max_decompressed_bytes=799)).decode(b64npy(array))
    assert caught.value.reason == "too_large"
    assert Base64Npy(CodecOptions(max_decompressed_bytes=800)).decode(b64npy(array)).shape == (100, 4, 2)


def test_base64_longer_than_the_limit_is_rejected_before_decoding() -> None:
    oversized = "!" * (4 << 20)  # would be corrupt if decoded; the size check must come first
    with pytest.raises(CorruptPayload) as caught:
        Base64Npy(CodecOptions(max_decompressed_bytes=1 << 20)).decode(oversized)
    assert caught.value.reason == "too_large"


class _Tripwire:
    fired = False

    def __reduce__(self):  # unpickling this would call _fire
        return (_fire, ())


def _fire() -> None:
    _Tripwire.fired = True


@pytest.mark.parametrize("case", [
    "pickled_objects", "float_dtype", "structured_dtype", "rank_0", "rank_9", "extra_data", "truncated",
    "bad_magic", "not_a_string", "whitespace_in_base64", "non_ascii",
])
def test_npy_reader_rejects_anything_but_small_integer_arrays(case: str) -> None:
    good = npy_bytes(np.arange(24, dtype=np.uint8).reshape(3, 4, 2))
    if case == "pickled_objects":
        out = io.BytesIO()
        np.save(out, np.array([_Tripwire()], dtype=object), allow_pickle=True)
        value: object = base64.b64encode(out.getvalue()).decode()
    elif case == "float_dtype":
        value = b64npy(np.zeros((2, 2, 2), dtype=np.float32))
    elif case == "structured_dtype":
        value = b64npy(np.zeros(3, dtype=[("a", "<i4"), ("b", "<i4")]))
    elif case == "rank_0":
        value = b64npy(np.array(3, dtype=np.int32))
    elif case == "rank_9":
        value = b64npy(np.zeros((1,) * 9, dtype=np.int32))
    elif case == "extra_data":
        value = base64.b64encode(good + b"\x00").decode()
    elif case == "truncated":
        value = base64.b64encode(good[:-3]).decode()
    elif case == "bad_magic":
        value = base64.b64encode(b"\x93NUMPX" + good[6:]).decode()
    elif case == "not_a_string":
        value = [1, 2, 3]
    elif case == "whitespace_in_base64":
        text = base64.b64encode(good).decode()
        value = text[:8] + "\n" + text[8:]
    else:
        value = base64.b64encode(good).decode()[:-4] + "é==="
    with pytest.raises(CorruptPayload) as caught:
        Base64Npy(CodecOptions()).decode(value)
    assert caught.value.reason == "corrupt"
    assert not _Tripwire.fired


def npy_with_header(header: str, data: bytes = b"") -> bytes:
    """A version 1.0 ``.npy`` file with ``header`` as written, padded as numpy pads it."""
    text = header.encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


# Headers numpy's reader accepts but whose array numpy cannot build: a zero-size shape with a
# dimension past intp, or whose byte count overflows, and a bool dimension.
UNBUILDABLE_NPY = {
    "dimension_past_intp": ("(9223372036854775808, 0)", b""),
    "overflowing_zero_size": ("(0, 4611686018427387904)", b""),
    "zero_size_unreshapeable": ("(4611686018427387904, 4611686018427387904, 0)", b""),
    "bool_dimension": ("(True, 4)", b"\x00" * 16),
}


@pytest.mark.parametrize("case", list(UNBUILDABLE_NPY))
def test_an_npy_shape_numpy_cannot_build_is_corrupt_not_a_codec_failure(case: str) -> None:
    """read_npy promises CorruptPayload and nothing else; numpy's ValueError or TypeError from
    ``reshape`` escaped it, and the join, which catches CorruptPayload, failed: a P/D request whose
    prefill leg carried such a value ended with an ``internal`` error result (``codec 'vllm' failed:
    ValueError: Maximum allowed dimension exceeded``) instead of its joined results with the rows
    omitted as ``prefill_corrupt``."""
    shape, data = UNBUILDABLE_NPY[case]
    value = base64.b64encode(npy_with_header(
        "{'descr': '<i4', 'fortran_order': False, 'shape': %s, }" % shape, data)).decode()
    with pytest.raises(CorruptPayload) as caught:
        Base64Npy(CodecOptions()).decode(value)
    assert caught.value.reason == "corrupt"
    truth = make_truth(14, prompt_len=6, output_len=4)
    prefill = [with_choice(body, routed_experts=value) for body in WORKER.prefill(truth, stream=False)]
    correlator = Correlator(Catalog(), "vllm")
    results = []
    for chunk in chunks(truth, Role.PREFILL, prefill) + chunks(truth, Role.DECODE, WORKER.decode(truth, stream=False)):
        results += results_of(correlator.receive(chunk, 0.0))
    [result] = results
    assert result.error is None, result.body
    assert result.verdict is Verdict.OMITTED
    assert WORKER.expert_view(result.body) == (None, "prefill_corrupt")


def test_fortran_order_npy_reads_as_the_same_rows() -> None:
    array = np.asfortranarray(np.arange(24, dtype=np.uint16).reshape(3, 4, 2))
    decoded = Base64Npy(CodecOptions()).decode(b64npy(array))
    assert np.array_equal(decoded, array)


# ------------------------------------------------------------------------------ fold


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)
_DELTA = st.fixed_dictionaries({}, optional={
    "role": _JSON, "content": _JSON, "reasoning": _JSON,
    "tool_calls": st.lists(st.fixed_dictionaries({}, optional={
        "index": _JSON, "id": _JSON, "type": _JSON,
        "function": st.fixed_dictionaries({}, optional={"name": _JSON, "arguments": _JSON}) | _JSON}) | _JSON,
        max_size=3) | _JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_DELTA | _JSON, min_size=1, max_size=4))
def test_a_derender_stream_of_any_deltas_folds_without_raising(deltas: list) -> None:
    """A worker's derender chunks are its own: whatever their deltas hold (a tool call's ``index`` as a
    list or an object, a ``function`` that is a string), the fold answers a body, never an exception
    (the edge's unary answer of a stream would be a 500)."""
    chunks = [msgspec.json.encode({"request_id": "r", "output_mode": "derender", "choices": [
        {"index": 0, "finish_reason": None, "token_ids": [k], "delta": delta}]}) for k, delta in enumerate(deltas)]
    folded = json.loads(CODEC.fold(chunks))
    assert folded["choices"][0]["token_ids"] == list(range(len(deltas)))


def _derender_body(top: dict, place: str, value: dict, mode: str = "derender") -> bytes:
    """A 0.34.0 derender body as pydantic writes it (compact): ``GenerateDerenderStreamChoice`` /
    ``GenerateDerenderChoice``, the ``GenerateStreamChoiceBase`` / ``GenerateChoiceBase`` fields first."""
    choice = {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [7, 8],
              "routed_experts": None, "sampling_mask": None, "weight_versions": None, place: value, "logprobs": None}
    return json.dumps({**top, "output_mode": mode, "choices": [choice]}, separators=(",", ":")).encode()


def test_a_stream_chunk_of_any_output_mode_folds_alone_and_a_unary_body_does_not() -> None:
    """A stream's only chunk is no unary answer (``serve_tokens_stream_generator`` /
    ``serve_tokens_full_generator``): a derender chunk carries ``delta`` where the unary answer has
    ``message``, and every chunk lacks the unary body's ``model``, ``created`` and prompt-side keys, which
    the fold of a longer stream writes. So the edge folds it; ``folds_alone`` said True for a derender
    chunk only, and a tokens or text chunk was served as sent. The look tells the chunk
    (``{"request_id":...,"usage":``) from the unary body (``request_id``, then ``model``), which is still
    served as it came."""
    delta = {"role": "assistant", "content": "Hi"}
    stream_top = {"request_id": "r-\\\"x", "usage": None}
    chunks = [_derender_body(stream_top, "delta", delta),
              _derender_body({**stream_top, "prompt_token_ids": list(range(3000))}, "delta", delta),
              _derender_body({"request_id": "r", "usage": {"prompt_tokens": 3, "total_tokens": 5,
                                                           "completion_tokens": 2}}, "delta", delta)]
    others = [_derender_body(stream_top, "text", "Hi", mode="text"),
              _derender_body({"request_id": "r", "usage": None, "prompt_token_ids": [1]}, "delta", delta,
                             mode="tokens")]
    message = {"role": "assistant", "content": "Hi", "refusal": None, "audio": None, "function_call": None,
               "reasoning": None}
    unary_top = {"request_id": 'a","usage":', "model": None, "created": 1, "usage": None}
    served = [_derender_body(unary_top, "message", message)]
    assert [CODEC.folds_alone(body) for body in chunks + others] == [True] * len(chunks + others)
    assert [CODEC.folds_alone(body) for body in served] == [False] * len(served)
    for body in chunks:
        assert json.loads(CODEC.fold([body]))["choices"][0]["message"] == message
    for body in others:
        assert list(json.loads(CODEC.fold([body])))[:3] == ["request_id", "model", "created"]


def test_a_lone_body_that_opens_as_a_stream_chunk_but_is_no_json_object_is_answered_as_sent() -> None:
    """``folds_alone`` is a bounded look at a body's opening (``{"request_id":...,"usage":``); since every
    stream chunk's opening is sent to ``fold`` (any ``output_mode``), a worker's body that opens so and then
    is no JSON object (cut short, a byte that is no UTF-8, nesting deeper than the parser's recursion)
    raised in ``fold``, and the edge answered 500 ``cannot fold 1 results`` where it serves any other lone
    body as sent. Now ``fold`` answers such a lone body as sent; in a longer stream it still cannot be
    folded (ValueError, as before)."""
    opening = b'{"request_id":"r","usage":'
    bodies = [opening + b'null,"output_mode":"tokens","choices":[',
              opening + b'null,"output_mode":"text","choices":[],"x":"\xff"}',
              opening + b"[" * 100_000 + b"]" * 100_000 + b"}"]
    assert [CODEC.folds_alone(body) for body in bodies] == [True] * len(bodies)
    assert [CODEC.fold([body]) for body in bodies] == bodies
    good = _derender_body({"request_id": "r", "usage": None}, "text", "Hi", mode="text")
    for body in bodies:
        with pytest.raises(ValueError):
            CODEC.fold([good, body])


def test_a_folded_message_whose_content_is_unknown_keeps_content_null_beside_its_reason() -> None:
    """A reasoning-only derender stream (vLLM 0.34.0 ``Parser.parse_delta``: ``reasoning`` pieces, no
    ``content`` piece; ``serve_tokens_stream_generator`` puts ``role`` on the first) fits a unary content
    of ``None`` and of ``""``, so the fold omits it. The codec omits a field as its join and stitch do
    (``routed_experts``, ``metrics``, ``created``: ``null`` in place, the reason beside it), which keeps
    ``ChatMessage``'s keys, ``content`` always among them (``model_dump()``); the fold deleted the key."""
    deltas = [{"role": "assistant", "reasoning": "Let me "}, {"reasoning": "think."}]
    chunks = [_derender_body({"request_id": "r", "usage": None}, "delta", delta) for delta in deltas]
    message = json.loads(CODEC.fold(chunks))["choices"][0]["message"]
    assert list(message.items()) == [("role", "assistant"), ("content", None), ("refusal", None), ("audio", None),
                                     ("function_call", None), ("reasoning", "Let me think."),
                                     ("content_unavailable_reason", "fold_ambiguous")]


@pytest.mark.parametrize("seed", range(12))
def test_agg_stream_folds_to_the_agg_unary_body(seed: int) -> None:
    truth = make_truth(seed, return_logprob=seed % 3 != 0, return_experts=seed % 4 != 1)
    folded = CODEC.fold(WORKER.agg(truth, stream=True))
    unary = as_folded_stream(WORKER.agg(truth, stream=False)[0])  # STREAM_OMITS: no chunk carries them
    assert WORKER.canonical(folded) == WORKER.canonical(msgspec.json.encode(unary))
    assert loads(folded) == unary  # same keys and values, not only the same decoded rows


@pytest.mark.parametrize("seed", range(12))
def test_joined_decode_stream_folds_to_the_joined_unary_and_the_agg_run(seed: int) -> None:
    truth = make_truth(seed, decode_coverage="suffix" if seed % 2 else "full",
                       stale="zeros" if seed % 3 == 0 else "garbage")
    stream = join_leg(WORKER.decode(truth, stream=True), WORKER.prefill(truth, stream=True))
    unary, _ = joined_unary(truth)
    folded = CODEC.fold([body for body, _ in stream])
    assert WORKER.canonical(folded) == WORKER.canonical(msgspec.json.encode(as_folded_stream(unary)))
    assert WORKER.canonical(unary) == WORKER.canonical(WORKER.agg(truth, stream=False)[0])


def test_fold_rejects_non_json_chunks() -> None:
    """In a stream of several bodies (a lone one is answered as sent: the test above)."""
    good = _derender_body({"request_id": "r", "usage": None}, "text", "Hi", mode="text")
    with pytest.raises(ValueError):
        CODEC.fold([good, b"not json"])


def test_a_derender_stream_of_many_tool_call_pieces_folds_in_linear_time() -> None:
    """The fold appended each ``DeltaToolCall`` piece's arguments to the call's string so far (``+=``
    on a dict entry copies it each time): a stream of 4,096 chunks (the per-request chunk limit) of
    1 kB argument pieces (4 MB) took seconds of CPU in the edge's unary answer, on the event loop."""
    import time

    chunk = msgspec.json.encode({"request_id": "r", "output_mode": "derender", "choices": [
        {"index": 0, "finish_reason": None, "token_ids": [1],
         "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "x" * 1000}}]}}]})
    started = time.process_time()
    folded = json.loads(CODEC.fold([chunk] * 4096))
    assert time.process_time() - started < 2.0
    assert len(folded["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == 4096 * 1000


def test_a_prefill_leg_of_many_logprob_chunks_is_absorbed_in_linear_time() -> None:
    """``fold_objects`` built each choice's ``logprobs.content`` as ``(content or []) + entries`` per
    chunk, copying the list so far each time: a prefill leg of 4,096 chunks (the per-request chunk
    limit) of 256 entries each (3.4 MB) took 17 s of CPU in ``absorb_prefill``, on the event loop."""
    import time

    chunk = msgspec.json.encode({"choices": [{"index": 0, "logprobs": {"content": [{}] * 256}, "token_ids": [1]}]})
    session = CODEC.open_session()
    started = time.process_time()
    session.absorb_prefill([chunk] * 4096)
    assert time.process_time() - started < 2.0
    folded = loads(CODEC.fold([chunk] * 3))
    assert folded["choices"][0]["logprobs"]["content"] == [{}] * 768 and folded["choices"][0]["token_ids"] == [1] * 3


# ---------------------------------------------------------------------- error bodies


@pytest.mark.parametrize("kind,error_type,code", [
    (ErrorKind.TIMEOUT, "GatewayTimeout", 504),
    (ErrorKind.OVERLOADED, "ServiceUnavailableError", 503),
    (ErrorKind.INVALID_CHUNK, "BadGateway", 502),
    (ErrorKind.UNKNOWN_FORMAT, "BadGateway", 502),
    (ErrorKind.INTERNAL, "InternalServerError", 500),
    (ErrorKind.MIGRATION_REFUSED, "ServiceUnavailableError", 503),
    (ErrorKind.UNAVAILABLE, "ServiceUnavailableError", 503),
])
def test_error_envelope_is_vllms_error_response(kind: ErrorKind, error_type: str, code: int) -> None:
    assert code == kind.http_status  # the envelope's code is the status the edge answers with
    body = CODEC.error_body("it broke", kind)
    # ErrorResponse{error: ErrorInfo{message, type, param, code}}, in that key order.
    assert body == msgspec.json.encode(
        {"error": {"message": "it broke", "type": error_type, "param": None, "code": code}})


# ------------------------------------------------------------- sequence codec registry


class _HexNpy(Base64Npy):
    """A derived format's encoding: hex instead of Base64 around the same .npy bytes."""

    def decode(self, value: object) -> np.ndarray:
        if not isinstance(value, str):
            raise CorruptPayload("corrupt", "not a string")
        try:
            data = bytes.fromhex(value)
        except ValueError:
            raise CorruptPayload("corrupt", "not hex") from None
        return super().decode(base64.b64encode(data).decode())

    def encode(self, rows: np.ndarray) -> object:
        return npy_bytes(np.ascontiguousarray(rows)).hex()


class _HexCodec(VLLMCodec):
    name = "vllm-hex"
    sequence_codecs = {**VLLMCodec.sequence_codecs, "routed_experts": _HexNpy}


def test_a_subclass_overrides_one_fields_sequence_codec() -> None:
    truth = make_truth(26, prompt_len=4, output_len=3)
    hexed = [with_choice(b, routed_experts=npy_bytes(experts_of(b)).hex())
             for b in (WORKER.prefill(truth, stream=False)[0], WORKER.decode(truth, stream=False)[0])]
    [(body, verdict)] = join_leg([hexed[1]], [hexed[0]], codec=_HexCodec())
    assert verdict is Verdict.JOINED
    value = loads(body)["choices"][0]["routed_experts"]
    rows = _HexNpy(CodecOptions()).decode(value)
    assert rows.astype("<i4").tobytes() == truth.experts
    assert loads(body)["prompt_logprobs"] is not None  # everything else is inherited
    assert isinstance(VLLMCodec().sequences["routed_experts"], Base64Npy)
    assert not isinstance(VLLMCodec().sequences["routed_experts"], _HexNpy)


# ------------------------------------------------------------------- worker inspection


def test_expert_view_and_canonical_read_the_agg_body() -> None:
    truth = make_truth(27)
    agg = WORKER.agg(truth, stream=False)[0]
    assert WORKER.expert_view(agg) == (truth.experts, None)
    assert WORKER.canonical(agg)["choices"][0]["routed_experts"] == truth.experts
    assert WORKER.expert_view(b"\xff not json") == (None, None)


def test_opaque_agg_bodies_carry_undecodable_values() -> None:
    rng = random.Random(1)
    truth = make_truth(28, output_len=12)
    seen_non_json = seen_opaque = 0
    for _ in range(20):
        for body in WORKER.opaque_agg(truth, stream=True, rng=rng):
            try:
                obj = loads(body)
            except msgspec.DecodeError:
                seen_non_json += 1
                continue
            if isinstance(obj, dict) and "routed_experts" in obj["choices"][0]:
                seen_opaque += 1
                assert WORKER.expert_view(body)[0] != truth.experts
    assert seen_non_json and seen_opaque


# ------------------------------------------------------------------ through the correlator


def chunks(truth: Truth, role: Role, bodies: list[bytes]) -> list[Chunk]:
    return [Chunk(truth.request_id, role, seq, body, final=seq == len(bodies) - 1, format="vllm",
                  token=(role.value, seq)) for seq, body in enumerate(bodies)]


def results_of(decisions: list) -> list[Result]:
    return [d for d in decisions if isinstance(d, Result)]


def test_catalog_discovers_the_vllm_codec_and_worker() -> None:
    assert "vllm" in codec_names()
    assert isinstance(Catalog()("vllm"), VLLMCodec)
    assert isinstance(worker_for("vllm"), VLLMWorker)


@pytest.mark.parametrize("seed", range(6))
def test_correlator_joins_shuffled_duplicated_pd_legs(seed: int) -> None:
    rng = random.Random(seed)
    truth = make_truth(seed, output_len=10, decode_coverage="suffix" if seed % 2 else "full")
    worker = worker_for("vllm")
    inputs = chunks(truth, Role.DECODE, worker.decode(truth, stream=True)) + \
        chunks(truth, Role.PREFILL, worker.prefill(truth, stream=True))
    inputs += rng.sample(inputs, 3)
    rng.shuffle(inputs)
    correlator = Correlator(Catalog(), "vllm")
    results = []
    for now, chunk in enumerate(inputs):
        results += results_of(correlator.receive(chunk, float(now)))
    assert [r.seq for r in results] == list(range(len(truth.chunk_sizes)))
    assert results[-1].final and all(r.error is None for r in results)
    assert results[0].verdict is Verdict.JOINED and results[-1].verdict is Verdict.JOINED
    folded = CODEC.fold([r.body for r in results])
    expected = as_folded_stream(worker.agg(truth, stream=False)[0])  # STREAM_OMITS: no chunk carries them
    assert worker.canonical(folded) == worker.canonical(msgspec.json.encode(expected))


def test_correlator_prefill_timeout_omits_with_reason() -> None:
    truth = make_truth(30, prompt_len=5, output_len=4)
    correlator = Correlator(Catalog(), "vllm", CorrelatorConfig(prefill_timeout=2.0))
    [decode] = chunks(truth, Role.DECODE, WORKER.decode(truth, stream=False))
    assert results_of(correlator.receive(decode, 0.0)) == []
    decisions = correlator.tick(2.5)
    [result] = results_of(decisions)
    assert any(isinstance(d, Notice) and d.event == "prefill_timeout" for d in decisions)
    assert result.final and result.verdict is Verdict.OMITTED
    assert WORKER.expert_view(result.body) == (None, "prefill_timeout")
    assert loads(result.body)[PL_REASON] == "prefill_timeout"


def test_correlator_passes_agg_bodies_through_byte_for_byte() -> None:
    rng = random.Random(7)
    truth = make_truth(31, output_len=8)
    bodies = WORKER.opaque_agg(truth, stream=True, rng=rng)
    correlator = Correlator(Catalog(), "vllm")
    results = []
    for chunk in chunks(truth, Role.AGG, bodies):
        results += results_of(correlator.receive(chunk, 0.0))
    assert [r.body for r in results] == bodies
    assert all(r.verdict is Verdict.PASSTHROUGH for r in results)


# --------------------------------------------------------------------------- codec options


def test_stream_routed_experts_defaults_to_unknown_and_reaches_the_codec_from_the_configuration() -> None:
    assert VLLMCodec().stream_experts is StreamExperts.UNKNOWN
    for value in ("unknown", "yes", "no"):
        settings = load({"STREAMPROC_FORMAT": "vllm", "STREAMPROC_FORMAT_OPTION": f"stream_routed_experts={value}"})
        assert Catalog(settings.codec_options())("vllm").stream_experts is StreamExperts(value)


@pytest.mark.parametrize("value", ["maybe", "", "No", "true", "auto"])
def test_a_bad_stream_routed_experts_option_is_refused_when_the_codec_is_built(value: str) -> None:
    with pytest.raises(ValueError, match=rf"stream_routed_experts={value!r}: expected unknown, yes or no"):
        VLLMCodec(CodecOptions(format_options=(("stream_routed_experts", value),)))


def test_a_bad_stream_routed_experts_option_stops_the_processor_before_it_connects() -> None:
    from streamproc.nats.processor import Processor, StartupError  # nats-py only here

    settings = load({}, {"nats_url": "nats://127.0.0.1:1", "format": "vllm",
                         "format_option": "stream_routed_experts=maybe"})
    with pytest.raises(StartupError, match=r"codec 'vllm' failed to load: .*stream_routed_experts='maybe'"):
        Processor(settings)
