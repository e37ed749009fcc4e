"""End to end through streamproc's pure pipeline harness (the correlator that runs in production)."""

from __future__ import annotations

import base64
import random

import msgspec
import pytest
import zstandard

from streamproc.codec import CodecOptions
from streamproc.simulation import Damage, make_truth
from streamproc.testing.harness import leg, run_pipeline, shuffle_with_duplicates
from streamproc.wire import Role, Verdict
from streamproc_sglang_zstd import SGLangZstdWorker, zstd_bomb

OPTIONS = CodecOptions(max_decompressed_bytes=128 * 1024)
worker = SGLangZstdWorker(OPTIONS)


def run(chunks, seed=0):
    chunks = shuffle_with_duplicates(chunks, random.Random(seed))
    return run_pipeline(chunks, format="sglang-zstd", options=OPTIONS, settle_at=1000.0)


def pd_chunks(truth, stream, **damage):
    prefill = worker.prefill(truth, stream=stream, damage=damage.get("prefill"))
    decode = worker.decode(truth, stream=stream, damage=damage.get("decode"))
    return leg(truth.request_id, Role.PREFILL, prefill) + leg(truth.request_id, Role.DECODE, decode)


@pytest.mark.parametrize("stream", [False, True])
def test_aggregated_compressed_and_opaque_values_pass_through_byte_for_byte(stream):
    for seed in range(12):
        truth = make_truth(seed)
        bodies = worker.opaque_agg(truth, stream=stream, rng=random.Random(seed)) if seed % 2 \
            else worker.agg(truth, stream=stream)
        results = run(leg(truth.request_id, Role.AGG, bodies), seed).of(truth.request_id)
        assert [r.body for r in results] == bodies
        assert all(r.verdict is Verdict.PASSTHROUGH for r in results)


def test_aggregated_bomb_passes_through_untouched():
    truth = make_truth(5)
    doc = msgspec.json.decode(worker.agg(truth, stream=False)[0])
    doc["meta_info"]["routed_experts"] = base64.b64encode(zstd_bomb(1 << 34, declare_size=False)).decode()
    body = msgspec.json.encode(doc)
    (result,) = run(leg(truth.request_id, Role.AGG, [body])).of(truth.request_id)
    assert result.body == body and result.verdict is Verdict.PASSTHROUGH


@pytest.mark.parametrize("stream", [False, True])
def test_pd_join_restores_the_aggregated_run_with_real_prefill_rows(stream):
    for seed in range(8):
        truth = make_truth(seed, stale="garbage")
        results = run(pd_chunks(truth, stream), seed).of(truth.request_id)
        assert [r.body for r in results] == worker.agg(truth, stream=stream)
        frame = base64.b64decode(msgspec.json.decode(results[-1].body)["meta_info"]["routed_experts"])
        assert zstandard.ZstdDecompressor().decompress(frame) == truth.experts
        assert results[-1].verdict is Verdict.JOINED


@pytest.mark.parametrize("damage", list(Damage))
@pytest.mark.parametrize("target", ["prefill", "decode"])
def test_missing_or_corrupt_payloads_are_omitted_never_stale(damage, target):
    truth = make_truth(77, prompt_len=9, output_len=7, stale="zeros")
    results = run(pd_chunks(truth, True, **{target: damage})).of(truth.request_id)
    rows, reason = worker.expert_view(results[-1].body)
    assert rows is None
    expected = {Damage.DROP: f"{target}_missing", Damage.BOMB: "too_large"}.get(damage, f"{target}_corrupt")
    assert reason == expected
    assert results[-1].verdict is Verdict.OMITTED


def test_prefill_that_never_arrives_times_out_into_an_omission():
    truth = make_truth(78, prompt_len=4, output_len=3, return_logprob=False)
    chunks = leg(truth.request_id, Role.DECODE, worker.decode(truth, stream=False))
    (result,) = run(chunks).of(truth.request_id)
    assert worker.expert_view(result.body) == (None, "prefill_timeout")
    assert result.verdict is Verdict.OMITTED
