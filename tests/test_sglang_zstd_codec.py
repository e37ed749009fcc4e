"""``sglang-zstd``: the inherited SGLang join over Base64(zstd(rows)), bounded decompression."""

from __future__ import annotations

import base64
import random
import time
import tracemalloc

import msgspec
import numpy as np
import pytest
import zstandard

from streamproc.catalog import codec_class, worker_for
from streamproc.codec import CodecOptions, CorruptPayload
from streamproc.decompress import CORRUPT, TOO_LARGE, encode_base64
from streamproc.simulation import Damage, make_truth
from streamproc.testing.harness import leg, run_pipeline, shuffle_with_duplicates
from streamproc.wire import Role, Verdict
from streamproc_sglang import SGLangCodec
from streamproc_sglang_zstd import Base64ZstdRows, SGLangZstdCodec, SGLangZstdWorker, zstd_bomb

LIMIT = 256 * 1024
OPTIONS = CodecOptions(max_decompressed_bytes=LIMIT)
worker = SGLangZstdWorker(OPTIONS)
codec = SGLangZstdCodec(OPTIONS)


def meta(body: bytes) -> dict:
    return msgspec.json.decode(body)["meta_info"]


def frame_of(value: str) -> bytes:
    return base64.b64decode(value, validate=True)


def pd_join(truth, *, stream, prefill_damage=None, decode_damage=None):
    session = codec.open_session()
    session.absorb_prefill(worker.prefill(truth, stream=stream, damage=prefill_damage))
    bodies = worker.decode(truth, stream=stream, damage=decode_damage)
    return [session.join(body, i == len(bodies) - 1) for i, body in enumerate(bodies)]


def test_zstd_codec_overrides_only_the_routed_experts_sequence_codec():
    assert issubclass(SGLangZstdCodec, SGLangCodec)
    assert SGLangZstdCodec.sequence_codecs["routed_experts"] is Base64ZstdRows
    assert set(SGLangZstdCodec.sequence_codecs) == set(SGLangCodec.sequence_codecs)
    for method in ("open_session", "fold", "error_body"):
        assert getattr(SGLangZstdCodec, method) is getattr(SGLangCodec, method)


def test_catalog_discovers_the_installed_distribution():
    assert codec_class("sglang-zstd") is SGLangZstdCodec
    assert isinstance(worker_for("sglang-zstd"), SGLangZstdWorker)


def test_worker_compresses_engine_output_with_size_and_checksum():
    truth = make_truth(3)
    frame = frame_of(meta(worker.agg(truth, stream=False)[0])["routed_experts"])
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(truth.experts)
    assert params.has_checksum
    assert zstandard.ZstdDecompressor().decompress(frame) == truth.experts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_pd_join_recompresses_the_spliced_rows_and_equals_the_agg_bytes(seed, stream):
    truth = make_truth(seed)
    joined = pd_join(truth, stream=stream)
    assert [body for body, _ in joined] == worker.agg(truth, stream=stream)
    final = frame_of(meta(joined[-1][0])["routed_experts"])
    assert zstandard.get_frame_parameters(final).has_checksum
    assert zstandard.ZstdDecompressor().decompress(final) == truth.experts


def test_aggregated_bodies_pass_through_without_any_decompression(monkeypatch):
    def refuse(self, value):
        raise AssertionError("an aggregated body reached the zstd decoder")

    monkeypatch.setattr(Base64ZstdRows, "decode", refuse)
    truth = make_truth(21, output_len=9)
    bomb = encode_base64(zstd_bomb(1 << 30, declare_size=False))
    doc = msgspec.json.decode(worker.agg(truth, stream=True)[-1])
    doc["meta_info"]["routed_experts"] = bomb
    bodies = worker.agg(truth, stream=True)[:-1] + [msgspec.json.encode(doc)]
    chunks = shuffle_with_duplicates(leg(truth.request_id, Role.AGG, bodies), random.Random(1))
    results = run_pipeline(chunks, format="sglang-zstd", options=OPTIONS).of(truth.request_id)
    assert [r.body for r in results] == bodies
    assert {r.verdict for r in results} == {Verdict.PASSTHROUGH}


@pytest.mark.parametrize("declare", [True, False])
def test_both_bomb_shapes_are_rejected_quickly_with_bounded_memory(declare):
    frame = zstd_bomb(1 << 32, declare_size=declare)  # 4 GiB of zeros in ~128 KiB
    assert zstandard.frame_content_size(frame) == ((1 << 32) if declare else -1)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(CorruptPayload) as info:
            Base64ZstdRows(OPTIONS).decode(encode_base64(frame))
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.reason == TOO_LARGE
    assert peak < 2 * len(frame) + 2 * LIMIT
    assert elapsed < 0.5


def test_worker_bombs_cover_both_frame_shapes_across_requests():
    declared = set()
    for seed in range(16):
        for role in ("prefill", "decode"):
            frame = frame_of(worker.bomb(make_truth(seed), role))
            declared.add(zstandard.frame_content_size(frame) != -1)
            assert len(frame) < 64 * 1024
    assert declared == {True, False}


@pytest.mark.parametrize("target", ["prefill", "decode"])
@pytest.mark.parametrize("damage", list(Damage))
def test_damaged_compressed_payloads_never_expose_stale_rows(target, damage):
    truth = make_truth(31, prompt_len=6, output_len=5, stale="garbage")
    body, verdict = pd_join(truth, stream=True, **{f"{target}_damage": damage})[-1]
    expected = {Damage.DROP: f"{target}_missing", Damage.BOMB: "too_large"}.get(damage, f"{target}_corrupt")
    assert verdict is Verdict.OMITTED
    assert worker.expert_view(body) == (None, expected)


def test_flipped_payload_byte_is_caught_by_the_frame_checksum():
    truth = make_truth(41, prompt_len=6, output_len=5)
    decode = worker.decode(truth, stream=False)
    doc = msgspec.json.decode(decode[0])
    frame = bytearray(frame_of(doc["meta_info"]["routed_experts"]))
    frame[-1] ^= 0x01
    doc["meta_info"]["routed_experts"] = encode_base64(bytes(frame))
    session = codec.open_session()
    session.absorb_prefill(worker.prefill(truth, stream=False))
    body, verdict = session.join(msgspec.json.encode(doc), True)
    assert (verdict, worker.expert_view(body)) == (Verdict.OMITTED, (None, "decode_corrupt"))


def test_frames_from_a_streaming_compressor_join_too():
    truth = make_truth(51, prompt_len=7, output_len=4)

    def streamed(raw: bytes) -> str:
        cobj = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
        return encode_base64(cobj.compress(raw) + cobj.flush())

    class StreamingWorker(SGLangZstdWorker):
        def encode_experts(self, raw):
            return streamed(raw)

    w = StreamingWorker(OPTIONS)
    session = codec.open_session()
    session.absorb_prefill(w.prefill(truth, stream=False))
    body, verdict = session.join(w.decode(truth, stream=False)[0], True)
    assert verdict is Verdict.JOINED
    assert worker.expert_view(body) == (truth.experts, None)


def test_base64_of_something_that_is_not_zstd_is_corrupt():
    with pytest.raises(CorruptPayload) as info:
        Base64ZstdRows(OPTIONS).decode(encode_base64(b"\x00\x00\x00\x01" * 8))
    assert info.value.reason == CORRUPT


def test_compressed_text_longer_than_any_frame_within_the_limit_is_too_large():
    with pytest.raises(CorruptPayload) as info:
        Base64ZstdRows(CodecOptions(max_decompressed_bytes=1000)).decode("A" * 8000)
    assert info.value.reason == TOO_LARGE


def test_canonical_views_of_zstd_and_plain_bodies_compare_equal():
    from streamproc_sglang import SGLangWorker

    truth = make_truth(61)
    plain = SGLangWorker(OPTIONS)
    packed_view = worker.canonical(worker.agg(truth, stream=False)[0])
    assert packed_view == plain.canonical(plain.agg(truth, stream=False)[0])


# ------------------------------------------------------ level and threads (issue 14, target 3)

def big_join(format_options):
    """A P/D join whose rows (~2.3 MB) are past zstd's 512 KiB single-thread cut-off."""
    options = CodecOptions(max_decompressed_bytes=64 << 20, format_options=format_options)
    truth = make_truth(11, prompt_len=1000, output_len=257, num_layers=1, top_k=1, num_experts=256)
    experts = np.random.default_rng(11).integers(0, 256, size=(1000 + 257 - 1, 58, 2), dtype="<i4").tobytes()
    truth = msgspec.structs.replace(truth, num_layers=58, top_k=2, experts=experts, return_logprob=False,
                                    chunk_sizes=[257])
    zworker = SGLangZstdWorker(options)
    session = SGLangZstdCodec(options).open_session()
    session.absorb_prefill(zworker.prefill(truth, stream=False))
    body, verdict = session.join(zworker.decode(truth, stream=False)[0], True)
    return truth, frame_of(meta(body)["routed_experts"]), verdict


@pytest.mark.parametrize("format_options", [(), (("zstd_threads", "0"),), (("zstd_threads", "2"),),
                                            (("zstd_level", "1"), ("zstd_threads", "2")),
                                            (("zstd_level", "9"),)])
def test_a_joined_frame_at_any_level_and_thread_count_decodes_to_the_true_rows(format_options):
    truth, frame, verdict = big_join(format_options)
    assert verdict is Verdict.JOINED
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(truth.experts) and params.has_checksum
    assert zstandard.ZstdDecompressor().decompress(frame) == truth.experts
    # And through the codec's own bounded decoder, the one a downstream join would use.
    assert Base64ZstdRows(CodecOptions(max_decompressed_bytes=64 << 20)).decode(
        encode_base64(frame)) == truth.experts


def test_the_level_option_changes_the_joined_frame_and_threads_default_to_the_cores():
    _, fast, _ = big_join((("zstd_level", "1"),))
    _, strong, _ = big_join((("zstd_level", "19"), ("zstd_threads", "0")))
    assert len(strong) < len(fast)
    from streamproc_sglang_zstd.sequence import compression_threads, usable_cores
    assert Base64ZstdRows(OPTIONS).threads == compression_threads(usable_cores())
    assert compression_threads(1) == 0 and compression_threads(2) == 2 and compression_threads(64) == 8


def test_job_size_gives_each_thread_two_jobs_when_it_can():
    from streamproc_sglang_zstd.sequence import job_size
    typical, large = (1000 + 256 - 1) * 58 * 8 * 4, 5000 * 58 * 8 * 4
    assert job_size(typical, 2) == 1 << 20  # 2 MiB jobs would leave one thread 0.3 MiB
    assert job_size(large, 2) == 2 << 20
    assert job_size(large, 4) == 1 << 20
    assert job_size(100, 2) == 1 << 20


@pytest.mark.parametrize("option", [("zstd_level", "0"), ("zstd_level", "fast"), ("zstd_level", "23"),
                                    ("zstd_threads", "-1"), ("zstd_threads", "many")])
def test_a_bad_zstd_format_option_is_refused_when_the_codec_is_built(option):
    with pytest.raises(ValueError, match=option[0]):
        SGLangZstdCodec(CodecOptions(format_options=(option,)))
