"""P/D join == aggregated, for bodies shaped the way upstream SGLang and vLLM emit them.

The bodies come from ``streamproc_sglang.upstream`` and ``streamproc_vllm.upstream``, builders that
follow upstream's code paths and are independent of the simulator the rest of the suite uses.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import tracemalloc

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from helpers import drive_join as join
from migration_helpers import SGLANG_0523_TIMINGS, without_attempt_values

from streamproc.codec import DEFAULT_MAX_DECOMPRESSED_BYTES, CodecOptions, parse_format_options
from streamproc.config import ConfigError, load
from streamproc.decompress import encode_base64
from streamproc import MigrationRefused
from streamproc.simulation import Truth, make_truth
from streamproc.testing.strategies import truths
from streamproc.wire import Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang import native
from streamproc_sglang import upstream as sgl
from streamproc_sglang.native import EXPERT_DTYPE_SIZES
from streamproc_sglang_zstd import SGLangZstdCodec, zstd_bomb
from streamproc_vllm import VLLMCodec
from streamproc_vllm import upstream as vll

OPTIONS = CodecOptions(max_decompressed_bytes=1 << 20)
SGLANG = SGLangCodec(OPTIONS)
VLLM = VLLMCodec(OPTIONS)
property_settings = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])




def meta(body: bytes) -> dict:
    return msgspec.json.decode(body)["meta_info"]


# ------------------------------------------------------------------------------------ SGLang


@st.composite
def sglang_cases(draw: st.DrawFn) -> tuple[Truth, sgl.Shape]:
    truth = draw(truths(max_prompt=10, max_output=10))
    dtypes = ["int32", "uint16"] + (["uint8"] if truth.num_experts <= 256 else [])
    start = draw(st.integers(0, truth.prompt_len) | st.just(0))
    shape = sgl.Shape(
        streaming=draw(st.sampled_from(["cumulative", "incremental"])),
        dtype=draw(st.sampled_from(dtypes)),
        advertise_dtype=True,
        start_len=start,
        echo_start_len=draw(st.booleans()),
        logprob_start_len=draw(st.sampled_from([-1, 0, truth.prompt_len - 1])),
        decode_coverage=draw(st.sampled_from(["full", "suffix"])),
        **draw(sglang_versions()),
    )
    return truth, shape


def sglang_versions() -> st.SearchStrategy[dict]:
    """The release the bodies follow, with the request options modelled for 0.5.23 only."""
    return st.just({}) | st.fixed_dictionaries({
        "version": st.just("0.5.23"),
        "top_logprobs": st.sampled_from(["none", "nested", "flat", "flat_b64"]),
        "token_ids_logprob": st.booleans(),
        "hidden_states": st.booleans(),
    })


def without_pd_hidden_states(body: bytes) -> bytes:
    """The aggregated body as the P/D join must publish it with ``return_hidden_states``: the list
    needs the prompt's block, which no P/D leg has, so it is removed and the reason appended last
    (``SGLangJoinSession._omit_partial_hidden_states``)."""
    doc = msgspec.json.decode(body)
    doc["meta_info"].pop("hidden_states")
    doc["meta_info"]["hidden_states_unavailable_reason"] = "prefill_missing"
    return sgl.native.encode(doc)


def _sglang_alternative_reading(truth: Truth, shape: sgl.Shape) -> bool:
    """Brute force, independent of the codec: does a different (start, coverage, row width) fit
    the byte counts of an unstated start and publish different rows?"""
    item = EXPERT_DTYPE_SIZES[shape.dtype]
    width = truth.row_bytes // 4 * item
    b_p = (truth.prompt_len - shape.start_len) * width
    b_d = (truth.rows - (truth.prompt_len if shape.decode_coverage == "suffix" else shape.start_len)) * width
    skips = set()
    for start in range(truth.prompt_len + 1):
        for suffix in (False, True):
            for w in range(item, b_d + 1, item):
                expected = (truth.output_len - 1) * w if suffix else (truth.rows - start) * w
                if (truth.prompt_len - start) * w == b_p and expected == b_d:
                    skips.add(0 if suffix else b_p)
    return len(skips) > 1


@property_settings
@given(case=sglang_cases(), stream=st.booleans())
def test_sglang_pd_join_equals_the_aggregated_bodies_byte_for_byte(case, stream):
    truth, shape = case
    # An unstated start > 0 with suffix coverage can mimic start 0 (see docs/codecs.md); workers
    # using both must state the start. Everything else is covered.
    assume(shape.echo_start_len or shape.start_len == 0 or shape.decode_coverage == "full")
    # An unstated start at the prompt's end leaves prefill an empty payload, which is not trusted.
    assume(shape.echo_start_len or shape.start_len < truth.prompt_len or not truth.return_experts)
    expected = sgl.agg(truth, shape, stream=stream)
    joined = join(SGLANG, sgl.decode(truth, shape, stream=stream), sgl.prefill(truth, shape))
    assert len(joined) == len(expected)
    # With hidden states every P/D chunk is OMITTED (below): the rows' fate is read from the body.
    rows_refused = ("routed_experts" not in meta(joined[-1][0]) if shape.hidden_states
                    else joined[-1][1] is Verdict.OMITTED)
    if shape.start_len and not shape.echo_start_len and truth.return_experts and truth.output_len > 1 \
            and rows_refused:
        # Only a genuinely ambiguous inference may be refused, and only as a length mismatch.
        assert meta(joined[-1][0]).get("routed_experts_unavailable_reason") == "length_mismatch"
        assert _sglang_alternative_reading(truth, shape)
        joined, expected = joined[:-1], expected[:-1]
    if shape.hidden_states:
        # No P/D leg has the prompt's hidden states: every chunk omits them, with the reason.
        assert [body for body, _ in joined] == [without_pd_hidden_states(b) for b in expected]
        assert all(verdict is Verdict.OMITTED for _, verdict in joined)
        return
    assert [body for body, _ in joined] == expected
    assert all(verdict in (Verdict.JOINED, Verdict.PASSTHROUGH) for _, verdict in joined)


@property_settings
@given(case=sglang_cases(), cut=st.integers(0, 20))
def test_sglang_fold_and_migration_read_both_streaming_modes(case, cut):
    truth, shape = case
    stream = sgl.agg(truth, shape, stream=True)
    unary = sgl.agg(truth, shape, stream=False)[0]
    if len(stream) > 1:
        # The unary answer's send time is in no chunk of a longer stream: folded to its reason, in the
        # unary key's place (last), where the server stamps (fold.py).
        # A stream's first-token timings (--enable-metrics) count from the tokenizer's receipt, a unary
        # request's from the scheduler's prefill: replaced in place by their reasons.
        doc = msgspec.json.decode(unary)
        meta = doc["meta_info"]
        doc["meta_info"] = {(key + "_unavailable_reason" if key in native.FIRST_TOKEN_TIMINGS else key):
                            ("not_streamed" if key in native.FIRST_TOKEN_TIMINGS else value)
                            for key, value in meta.items()}
        if doc["meta_info"].pop("response_sent_to_client_ts", None) is not None:  # SGLang 0.5.23 writes it
            doc["meta_info"]["response_sent_to_client_ts_unavailable_reason"] = "not_streamed"
        unary = native.encode(doc)
    assert SGLANG.fold(stream) == unary
    # What a migration reports as sent is exactly the tokens the client has seen, in either mode.
    cut = min(cut, len(stream))
    session = SGLANG.open_migration()
    if shape.hidden_states and cut:
        # Hidden states cannot be carried to another worker: the migration says so (migration.py).
        with pytest.raises(MigrationRefused, match="hidden states"):
            session.absorb(stream[:cut])
        return
    session.absorb(stream[:cut])
    sent = truth.chunk_spans()[cut - 1][1] if cut else 0
    assert session.seal().token_ids == truth.output_ids[:sent]


@pytest.mark.parametrize("streaming", ["cumulative", "incremental"])
def test_sglang_resumed_cumulative_or_incremental_stream_reads_as_one_request(streaming):
    truth = make_truth(5, prompt_len=4, output_len=9, chunk_sizes=[2, 2, 2, 3])
    shape = sgl.Shape(streaming=streaming, logprob_start_len=0)
    expected = sgl.agg(truth, shape, stream=True)
    session = SGLANG.open_migration()
    session.absorb(expected[:2])
    emitted = session.seal()
    assert emitted.token_ids == truth.output_ids[:4]
    resumed = sgl.agg(truth.resumed(4), shape, stream=True)
    stitched = [session.stitch(body, i == len(resumed) - 1) for i, body in enumerate(resumed)]
    bodies = [body if out is None else out[0] for body, out in zip(resumed, stitched)]
    for got, want in zip(bodies, expected[2:]):
        got_doc, want_doc = msgspec.json.decode(got), msgspec.json.decode(want)
        # The resumed attempt's timings and retraction count are its own (omitted); the content is the run's.
        assert without_attempt_values(got_doc) == without_attempt_values(want_doc)


def test_sglang_0523_pd_join_passes_decodes_own_timings_through():
    """A P/D request ran on no aggregated engine, so its timings have no aggregated value to equal:
    decode's are measured on the worker that answers, from its own receipt of the request (sent to
    both legs at once) to the end, the wait for prefill and the KV transfer included. They are passed
    through unchanged and unmarked (docs/codecs.md, "Timings"); decode never sets
    ``prefill_finished_time`` (its prebuilt batch sets ``decode_prebuilt_finish_time``), so its
    bodies lack what an aggregated engine's carry."""
    truth = make_truth(20, prompt_len=5, output_len=6, chunk_sizes=[2, 4])
    shape = sgl.Shape(version="0.5.23", metrics=True)
    decode = sgl.decode(truth, shape, stream=True)
    joined = join(SGLANG, decode, sgl.prefill(truth, shape))
    assert Verdict.OMITTED not in {verdict for _, verdict in joined}
    for (body, _), own in zip(joined, decode):
        got, theirs = meta(body), meta(own)
        timed = [key for key in SGLANG_0523_TIMINGS if key in theirs]
        assert timed and {key: got.get(key) for key in timed} == {key: theirs[key] for key in timed}
        assert not any(key + "_unavailable_reason" in got for key in SGLANG_0523_TIMINGS)
    assert "prefill_finished_time" not in meta(joined[-1][0])
    assert "prefill_finished_time" in meta(sgl.agg(truth, shape, stream=True)[-1])


def test_sglang_empty_prefill_logprob_window_is_a_complete_answer():
    truth = make_truth(3, prompt_len=6, output_len=4)
    shape = sgl.Shape(logprob_start_len=-1)
    assert meta(sgl.prefill(truth, shape)[0])["input_token_logprobs"] == []
    joined = join(SGLANG, sgl.decode(truth, shape, stream=True), sgl.prefill(truth, shape))
    assert [b for b, _ in joined] == sgl.agg(truth, shape, stream=True)
    assert all("input_logprobs_unavailable_reason" not in meta(b) for b, _ in joined)
    assert Verdict.OMITTED not in {v for _, v in joined}


@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint8"])
def test_sglang_27_layer_top6_rows_join_in_every_wire_dtype(dtype):
    truth = make_truth(4, prompt_len=3, output_len=3, num_layers=27, top_k=6, num_experts=64)
    shape = sgl.Shape(dtype=dtype, advertise_dtype=True)
    row_bytes = len(base64.b64decode(meta(sgl.prefill(truth, shape)[0])["routed_experts"])) // truth.prompt_len
    assert row_bytes == 27 * 6 * EXPERT_DTYPE_SIZES[dtype]  # 162 for uint8: not a multiple of 4
    joined = join(SGLANG, sgl.decode(truth, shape, stream=False), sgl.prefill(truth, shape))
    assert joined == [(sgl.agg(truth, shape, stream=False)[0], Verdict.JOINED)]


@pytest.mark.parametrize("echo", [True, False])
@pytest.mark.parametrize("coverage", ["full", "suffix"])
def test_sglang_rows_join_from_routed_experts_start_len(echo, coverage):
    truth = make_truth(6, prompt_len=7, output_len=4, num_layers=3, top_k=2)
    shape = sgl.Shape(start_len=3, echo_start_len=echo, decode_coverage=coverage)
    joined = join(SGLANG, sgl.decode(truth, shape, stream=False), sgl.prefill(truth, shape))
    if echo or coverage == "full":
        assert joined == [(sgl.agg(truth, shape, stream=False)[0], Verdict.JOINED)]
    rows = base64.b64decode(meta(joined[0][0]).get("routed_experts", ""))
    assert rows in (b"", truth.expert_rows(3, truth.rows))  # never anything else


def test_sglang_unstated_start_that_two_readings_fit_is_a_length_mismatch():
    # 4 prefill rows + 8 decode rows of 24 bytes also read as 2 prefill rows of 48 bytes + a
    # 4-row suffix: the byte counts cannot tell, so nothing is published.
    truth = make_truth(6, prompt_len=7, output_len=5, num_layers=3, top_k=2)
    shape = sgl.Shape(start_len=3, decode_coverage="full")
    assert _sglang_alternative_reading(truth, shape)
    [(body, verdict)] = join(SGLANG, sgl.decode(truth, shape, stream=False), sgl.prefill(truth, shape))
    assert meta(body)["routed_experts_unavailable_reason"] == "length_mismatch" and verdict is Verdict.OMITTED
    stated = sgl.Shape(start_len=3, decode_coverage="full", echo_start_len=True)
    assert join(SGLANG, sgl.decode(truth, stated, stream=False), sgl.prefill(truth, stated))[0][0] == \
        sgl.agg(truth, stated, stream=False)[0]


def test_sglang_start_at_the_prompt_end_joins_the_generated_rows_only_when_stated():
    truth = make_truth(8, prompt_len=4, output_len=4)
    stated = sgl.Shape(start_len=4, echo_start_len=True)
    joined = join(SGLANG, sgl.decode(truth, stated, stream=False), sgl.prefill(truth, stated))
    assert joined[0][0] == sgl.agg(truth, stated, stream=False)[0]
    # Unstated, prefill's empty payload is indistinguishable from lost rows: omitted, not trusted.
    unstated = sgl.Shape(start_len=4)
    [(body, verdict)] = join(SGLANG, sgl.decode(truth, unstated, stream=False), sgl.prefill(truth, unstated))
    assert meta(body)["routed_experts_unavailable_reason"] == "prefill_corrupt" and verdict is Verdict.OMITTED


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_stale_zero_prefill_rows_are_prefill_corrupt(stream):
    truth = make_truth(9, prompt_len=5, output_len=4, num_layers=8, top_k=2)
    shape = sgl.Shape(stale_prefill=True)
    joined = join(SGLANG, sgl.decode(truth, shape, stream=stream), sgl.prefill(truth, shape))
    final = meta(joined[-1][0])
    assert "routed_experts" not in final and final["routed_experts_unavailable_reason"] == "prefill_corrupt"
    assert joined[-1][1] is Verdict.OMITTED


def test_sglang_decode_generated_rows_of_one_repeated_id_are_decode_corrupt():
    truth = make_truth(20, prompt_len=3, output_len=4, num_layers=8, top_k=2)
    shape = sgl.Shape()
    decode = msgspec.json.decode(sgl.decode(truth, shape, stream=False)[0])
    rows = bytearray(base64.b64decode(decode["meta_info"]["routed_experts"]))
    row = truth.row_bytes
    rows[-row:] = (7).to_bytes(4, "little") * (row // 4)  # the last generated row: expert 7 everywhere
    decode["meta_info"]["routed_experts"] = base64.b64encode(bytes(rows)).decode()
    [(body, verdict)] = join(SGLANG, [msgspec.json.encode(decode)], sgl.prefill(truth, shape))
    assert meta(body)["routed_experts_unavailable_reason"] == "decode_corrupt" and verdict is Verdict.OMITTED


def test_sglang_one_token_pd_answer_keeps_the_aggregated_key_order():
    truth = make_truth(10, prompt_len=5, output_len=1)
    shape = sgl.Shape()
    decode = sgl.decode(truth, shape, stream=False)[0]
    doc = msgspec.json.decode(decode)
    del doc["meta_info"]["routed_experts"]  # a one-token decode may omit them (SGLang #39146)
    joined = join(SGLANG, [msgspec.json.encode(doc)], sgl.prefill(truth, shape))
    expected = sgl.agg(truth, shape, stream=False)[0]
    assert list(meta(joined[0][0])) == list(meta(expected))
    assert joined[0][0] == expected


# -------------------------------------------------------------------------------------- vLLM


@st.composite
def vllm_cases(draw: st.DrawFn) -> tuple[Truth, vll.Shape]:
    truth = draw(truths(max_prompt=10, max_output=10))
    shape = vll.Shape(
        prompt_logprobs=draw(st.booleans()),
        include_usage=draw(st.booleans()),
        decode_coverage=draw(st.sampled_from(["full", "suffix"])),
        version=draw(st.sampled_from(["serve-disagg", "0.34.0"])),
        # serve-disagg's unary GenerateResponse: without usage (vllm-project/vllm, furionw/vllm, and stored
        # protocol.py versions whose choices have routed_experts) or with it (moreh-dev/vllm).
        older_unary=draw(st.sampled_from(["vllm-project", "moreh-dev"])),
    )
    return truth, shape


def _prompt_count_unknown(shape: vll.Shape) -> bool:
    """No body tells the join the prompt count: serve-disagg's unary GenerateResponse without usage
    (the prefill leg, a unary decode) and stream chunks whose usage comes after the finishing chunk."""
    return shape.version == "serve-disagg" and shape.older_unary == "vllm-project"


def _suffix_omitted(body: bytes) -> bytes:
    """The aggregated body with its finishing choice's rows omitted as ``length_mismatch``: suffix rows
    behind prefill's are exact only when prefill's rows start at 0 (S = 0, not backed off), which only
    the prompt count confirms."""
    obj = msgspec.json.decode(body)
    for choice in obj["choices"]:
        if choice.get("routed_experts") is not None:
            choice["routed_experts"] = None
            choice["routed_experts_unavailable_reason"] = "length_mismatch"
    return vll.dump(obj)


@property_settings
@given(case=vllm_cases(), stream=st.booleans())
def test_vllm_pd_join_equals_the_aggregated_bodies_byte_for_byte(case, stream):
    truth, shape = case
    expected = vll.agg(truth, shape, stream_=stream)
    joined = join(VLLM, vll.decode(truth, shape, stream_=stream), vll.prefill(truth, shape))
    if _prompt_count_unknown(shape) and shape.decode_coverage == "suffix":
        omitted = [_suffix_omitted(body) for body in expected]
        assert [body for body, _ in joined] == omitted
        changed = [a != b for a, b in zip(omitted, expected)]
        assert [verdict is Verdict.OMITTED for _, verdict in joined] == changed
        return
    assert [body for body, _ in joined] == expected
    assert all(verdict in (Verdict.JOINED, Verdict.PASSTHROUGH) for _, verdict in joined)
    if stream:
        assert all(b"prompt_logprobs" not in body for body, _ in joined)
        assert VLLM.fold([b for b, _ in joined]) == VLLM.fold(expected)


@pytest.mark.parametrize("prompt_len", [1, 5])
def test_vllm_unrequested_prompt_logprobs_stay_null_with_sampled_logprobs(prompt_len):
    truth = make_truth(11, prompt_len=prompt_len, output_len=3)
    shape = vll.Shape(prompt_logprobs=False)
    [(body, verdict)] = join(VLLM, vll.decode(truth, shape, stream_=False), vll.prefill(truth, shape))
    obj = msgspec.json.decode(body)
    assert obj["prompt_logprobs"] is None and "prompt_logprobs_unavailable_reason" not in obj
    assert obj["choices"][0]["logprobs"] is not None
    assert (body, verdict) == (vll.agg(truth, shape, stream_=False)[0], Verdict.JOINED)


def test_vllm_usage_only_final_chunk_keeps_routed_experts_on_the_finishing_choice():
    truth = make_truth(12, prompt_len=4, output_len=5, chunk_sizes=[2, 3])
    shape = vll.Shape(include_usage=True)
    decode = vll.decode(truth, shape, stream_=True)
    assert msgspec.json.decode(decode[-1])["choices"] == []
    dropped = msgspec.json.decode(decode[-2])
    del dropped["choices"][0]["routed_experts"]
    joined = join(VLLM, [*decode[:-2], msgspec.json.encode(dropped), decode[-1]], vll.prefill(truth, shape))
    choice = msgspec.json.decode(joined[-2][0])["choices"][0]
    assert choice["routed_experts"] is None and choice["routed_experts_unavailable_reason"] == "decode_missing"
    assert joined[-2][1] is Verdict.OMITTED


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_stale_zero_prefill_rows_are_prefill_corrupt(stream):
    truth = make_truth(13, prompt_len=4, output_len=3, top_k=2)
    stale = vll.prefill(truth, vll.Shape(stale_prefill=True))
    joined = join(VLLM, vll.decode(truth, vll.Shape(), stream_=stream), stale)
    finishing = [msgspec.json.decode(b)["choices"] for b, _ in joined]
    choice = [c[0] for c in finishing if c and c[0]["finish_reason"] is not None][0]
    assert choice["routed_experts"] is None and choice["routed_experts_unavailable_reason"] == "prefill_corrupt"


def test_vllm_duplicate_expert_ids_in_decode_rows_are_decode_corrupt():
    truth = make_truth(14, prompt_len=3, output_len=4, top_k=3)
    decode = msgspec.json.decode(vll.decode(truth, vll.Shape(decode_coverage="suffix"), stream_=False)[0])
    rows = vll._rows(truth, truth.prompt_len, truth.rows).copy()
    rows[1, 0, 1] = rows[1, 0, 0]
    decode["choices"][0]["routed_experts"] = vll.encode_rows(rows)
    [(body, verdict)] = join(VLLM, [msgspec.json.encode(decode)], vll.prefill(truth, vll.Shape()))
    choice = msgspec.json.decode(body)["choices"][0]
    assert choice["routed_experts_unavailable_reason"] == "decode_corrupt" and verdict is Verdict.OMITTED


# -------------------------------------------------------------------------------- size budget


def test_default_ceiling_holds_a_128k_token_capture_of_the_widest_open_moe_models():
    tokens = 128 * 1024
    for layers, top_k in [(61, 8), (94, 8), (92, 8)]:  # DeepSeek-V3/Kimi-K2, Qwen3-235B, GLM-4.5
        assert tokens * layers * top_k * 4 <= DEFAULT_MAX_DECOMPRESSED_BYTES


@pytest.mark.parametrize("declare", [True, False])
@pytest.mark.parametrize("size", [1 << 30, 256 << 20])  # past the ceiling, and below it
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_zstd_bombs_are_refused_by_the_bodys_own_row_count_in_bounded_memory(declare, size, leg):
    codec = SGLangZstdCodec(CodecOptions())  # the default ceiling
    encode = codec.sequences["routed_experts"].encode
    truth = make_truth(16, prompt_len=6, output_len=5)
    shape = sgl.Shape()
    prefill = sgl.prefill(truth, shape, encode=encode)
    decode = sgl.decode(truth, shape, stream=False, encode=encode)
    bomb = encode_base64(zstd_bomb(size, declare_size=declare))
    if leg == "prefill":
        doc = msgspec.json.decode(prefill[0])
        doc["meta_info"]["routed_experts"] = bomb
        prefill = [msgspec.json.encode(doc)]
    else:
        doc = msgspec.json.decode(decode[0])
        doc["meta_info"]["routed_experts"] = bomb
        decode = [msgspec.json.encode(doc)]
    tracemalloc.start()
    try:
        [(body, verdict)] = join(codec, decode, prefill)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta(body)["routed_experts_unavailable_reason"] == "too_large" and verdict is Verdict.OMITTED
    assert peak < 100 << 20


@pytest.mark.parametrize("dtype", ["int32", "uint8"])
def test_zstd_codec_joins_upstream_shapes_unchanged(dtype):
    codec = SGLangZstdCodec(OPTIONS)
    encode = codec.sequences["routed_experts"].encode
    truth = make_truth(17, prompt_len=5, output_len=6, num_layers=27, top_k=6)
    for shape in (sgl.Shape(dtype=dtype, advertise_dtype=True), sgl.Shape(start_len=2, echo_start_len=True)):
        for stream in (False, True):
            joined = join(codec, sgl.decode(truth, shape, stream=stream, encode=encode),
                          sgl.prefill(truth, shape, encode=encode))
            assert [b for b, _ in joined] == sgl.agg(truth, shape, stream=stream, encode=encode)


# ------------------------------------------------------------------------ streaming option


def _resume_after(codec, truth, shape, published: int) -> list[dict]:
    expected = sgl.agg(truth, shape, stream=True)
    session = codec.open_migration()
    session.absorb(expected[:published])
    emitted = len(session.seal().token_ids)
    resumed = sgl.agg(truth.resumed(emitted), shape, stream=True)
    out = []
    for i, body in enumerate(resumed):
        stitched = session.stitch(body, i == len(resumed) - 1)
        out.append(without_attempt_values(msgspec.json.decode(body if stitched is None else stitched[0])))
    return out


def _docs(bodies: list[bytes]) -> list[dict]:
    return [without_attempt_values(msgspec.json.decode(b)) for b in bodies]


def test_sglang_migration_after_the_first_chunk_follows_the_streaming_option():
    # One published chunk reads the same in both modes: only the operator's option can tell.
    truth = make_truth(18, prompt_len=4, output_len=7, chunk_sizes=[3, 2, 2])
    shape = sgl.Shape(streaming="cumulative")
    told = SGLangCodec(CodecOptions(format_options=(("streaming", "cumulative"),)))
    assert _resume_after(told, truth, shape, 1) == _docs(sgl.agg(truth, shape, stream=True)[1:])
    assert _resume_after(SGLANG, truth, shape, 1) != _docs(sgl.agg(truth, shape, stream=True)[1:])
    # Once two chunks were seen the stream's own counts decide, whatever the option says.
    incremental = sgl.Shape(streaming="incremental")
    assert _resume_after(told, truth, incremental, 2) == _docs(sgl.agg(truth, incremental, stream=True)[2:])


def test_streaming_option_and_format_option_syntax_are_validated():
    with pytest.raises(ValueError, match="streaming"):
        SGLangCodec(CodecOptions(format_options=(("streaming", "sideways"),)))
    assert parse_format_options(" streaming=cumulative , x=1") == (("streaming", "cumulative"), ("x", "1"))
    with pytest.raises(ConfigError, match=r"--format-option \(flag --format-option='streaming'\)"):
        load({}, {"format_option": "streaming"})
    assert load({"STREAMPROC_FORMAT_OPTION": "streaming=cumulative"}).codec_options().option("streaming", "") \
        == "cumulative"


def test_vllm_migration_reads_emitted_tokens_from_upstream_stream_chunks():
    truth = make_truth(19, prompt_len=3, output_len=6, chunk_sizes=[2, 2, 2])
    bodies = vll.agg(truth, vll.Shape(include_usage=True), stream_=True)
    for published, sent in [(1, 2), (2, 4)]:
        session = VLLM.open_migration()
        session.absorb(bodies[:published])
        assert session.seal().token_ids == truth.output_ids[:sent]
    # The finishing chunk was sent (only the usage-only chunk, or nothing, follows): nothing to resume.
    for published in (3, 4):
        with pytest.raises(MigrationRefused, match="already finished"):
            VLLM.open_migration().absorb(bodies[:published])


_RSS_PROBE = r"""
import resource, sys
import msgspec
from streamproc.codec import CodecOptions
from streamproc.decompress import encode_base64
from streamproc.simulation import make_truth
from streamproc_sglang import upstream as sgl
from streamproc_sglang_zstd import SGLangZstdCodec

window_log = int(sys.argv[1])
codec = SGLangZstdCodec(CodecOptions())  # the default 512 MiB ceiling
encode = codec.sequences["routed_experts"].encode
truth = make_truth(21, prompt_len=6, output_len=5)
prefill = sgl.prefill(truth, sgl.Shape(), encode=encode)
decode = msgspec.json.decode(sgl.decode(truth, sgl.Shape(), stream=False, encode=encode)[0])
rle = lambda last: (last | 1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\x00"
frame = b"\x28\xb5\x2f\xfd\x00" + bytes([(window_log - 10) << 3]) + rle(0) * 8191 + rle(1)  # 1 GiB
decode["meta_info"]["routed_experts"] = encode_base64(frame)
body = msgspec.json.encode(decode)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
session = codec.open_session()
session.absorb_prefill(prefill)
joined, _ = session.join(body, True)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(msgspec.json.decode(joined)["meta_info"]["routed_experts_unavailable_reason"], grown // 1024)
"""


@pytest.mark.parametrize("window_log", [17, 27])  # a 128 KiB window, and the largest zstd allows by default
def test_a_1_gib_zstd_bomb_raises_peak_rss_by_less_than_100_mib_under_the_default_ceiling(window_log):
    run = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(window_log)], capture_output=True, text=True,
                         timeout=120, check=True)
    reason, grown_mib = run.stdout.split()
    assert reason == "too_large"
    # The requirement is < 100 MiB; bounded by the body's rows it stays near zero (decoding up to the
    # ceiling instead costs ~100-130 MiB with a 128 MiB window, which this bound catches).
    assert int(grown_mib) < 50


# ------------------------------------------------------------------ routed experts for the live page


def truth_matrix(truth: Truth, start: int):
    """The truth's routed-expert rows from token position ``start``, one row per position."""
    import numpy as np

    return np.frombuffer(truth.expert_rows(start, truth.rows), dtype="<i4").reshape(truth.rows - start, -1)


@pytest.mark.parametrize("dtype", ["int32", "uint16", "uint8"])
@pytest.mark.parametrize("start_len", [0, 3])
def test_sglang_routed_experts_hook_reads_upstream_shaped_joined_bodies(dtype, start_len):
    """The live page's view (``Codec.routed_experts``) of a P/D answer built from upstream-shaped legs
    (``streamproc_sglang.upstream``, not the simulator): the truth's rows in every wire dtype, from
    ``routed_experts_start_len``, split at the prompt."""
    truth = make_truth(4, prompt_len=7, output_len=4, num_layers=3, top_k=2, num_experts=64)
    shape = sgl.Shape(dtype=dtype, advertise_dtype=True, start_len=start_len, echo_start_len=True)
    [(body, verdict)] = join(SGLANG, sgl.decode(truth, shape, stream=False), sgl.prefill(truth, shape))
    assert verdict is Verdict.JOINED
    view = SGLANG.routed_experts(body, verdict=verdict)
    assert (view.present, view.problem, view.omitted) == (True, None, {})
    assert view.start == start_len and view.splice == truth.prompt_len - start_len
    assert view.matrix.tolist() == truth_matrix(truth, start_len).tolist()
    assert [(s.source, s.start, s.stop) for s in view.spans] == [
        ("prefill", 0, truth.prompt_len - start_len), ("decode", truth.prompt_len - start_len, truth.rows - start_len)]


def test_vllm_routed_experts_hook_reads_upstream_shaped_joined_bodies():
    """The same for vLLM's ``.npy`` rows on the finishing choice (``streamproc_vllm.upstream``)."""
    truth = make_truth(11, prompt_len=5, output_len=4, num_layers=3, top_k=2, num_experts=300)  # uint16 ids
    shape = vll.Shape(prompt_logprobs=True)
    [(body, verdict)] = join(VLLM, vll.decode(truth, shape, stream_=False), vll.prefill(truth, shape))
    assert verdict is Verdict.JOINED
    view = VLLM.routed_experts(body, verdict=verdict)
    assert (view.present, view.problem, view.omitted) == (True, None, {})
    assert view.start == 0 and view.splice == truth.prompt_len
    assert view.matrix.tolist() == truth_matrix(truth, 0).tolist()
    assert [(s.source, s.start, s.stop) for s in view.spans] == [
        ("prefill", 0, truth.prompt_len), ("decode", truth.prompt_len, truth.rows)]


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prefill_without_usage_joins_same_start_rows_and_catches_a_backed_off_prefill(stream):
    """serve-disagg's GenerateResponse without usage (Shape(older_unary="vllm-project"); stored protocol.py
    versions declare routed_experts on its choices but no usage): no body gives the prompt count P. Full
    coverage still joins, since both legs' rows start at the same S exactly when decode's rows before its
    O - 1 generated ones are as many as prefill's (P - S either way). A prefiller that backed off a token
    (``_truncate_request_for_prefill``: P - 1 rows) breaks that equality: omitted, never a short array."""
    truth = make_truth(13, prompt_len=5, output_len=4, chunk_sizes=[2, 2])
    shape = vll.Shape(older_unary="vllm-project", include_usage=False)
    prefill = vll.prefill(truth, shape)
    assert b'"usage"' not in prefill[0]
    joined = join(VLLM, vll.decode(truth, shape, stream_=stream), prefill)
    assert [body for body, _ in joined] == vll.agg(truth, shape, stream_=stream)
    assert joined[-1][1] is Verdict.JOINED

    backed_off = msgspec.json.decode(prefill[0])
    rows = vll._rows(truth, 0, truth.prompt_len - 1)
    backed_off["choices"][0]["routed_experts"] = vll.encode_rows(rows)
    joined = join(VLLM, vll.decode(truth, shape, stream_=stream), [vll.dump(backed_off)])
    choice = msgspec.json.decode(joined[-1][0])["choices"][0]
    assert choice["routed_experts"] is None
    assert choice["routed_experts_unavailable_reason"] == "length_mismatch"
    assert joined[-1][1] is Verdict.OMITTED
