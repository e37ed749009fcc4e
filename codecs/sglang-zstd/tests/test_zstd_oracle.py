"""The compressed join against an uncompressed byte oracle: the plain ``sglang`` codec on the same truth.

Both runs go through the real correlator. Their results must agree everywhere, byte for byte, except
for the encoding of ``meta_info.routed_experts``, whose decompressed rows must equal the plain run's
Base64-decoded rows. So compression changes exactly one field's encoding and nothing else.
"""

from __future__ import annotations

import base64
import random

import msgspec
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from streamproc.codec import CodecOptions
from streamproc.simulation import Damage, make_truth
from streamproc.testing.harness import leg, run_pipeline, shuffle_with_duplicates
from streamproc.testing.laws import law_settings
from streamproc.testing.strategies import truths
from streamproc.wire import Role
from streamproc_sglang import SGLangWorker
from streamproc_sglang_zstd import SGLangZstdWorker

OPTIONS = CodecOptions(max_decompressed_bytes=256 * 1024)
RAW = dict[str, msgspec.Raw]


def pd_results(worker, fmt, truth, stream, prefill_damage, decode_damage, seed):
    chunks = leg(truth.request_id, Role.PREFILL, worker.prefill(truth, stream=stream, damage=prefill_damage))
    chunks += leg(truth.request_id, Role.DECODE, worker.decode(truth, stream=stream, damage=decode_damage))
    chunks = shuffle_with_duplicates(chunks, random.Random(seed))
    return run_pipeline(chunks, format=fmt, options=OPTIONS, settle_at=1000.0).of(truth.request_id)


def assert_same_except_experts_encoding(truth, stream, prefill_damage=None, decode_damage=None, seed=0):
    args = (truth, stream, prefill_damage, decode_damage, seed)
    plain = pd_results(SGLangWorker(OPTIONS), "sglang", *args)
    packed = pd_results(SGLangZstdWorker(OPTIONS), "sglang-zstd", *args)
    def shape(results):
        return [(r.seq, r.final, r.verdict, r.error) for r in results]

    assert shape(packed) == shape(plain)
    for p, z in zip(plain, packed):
        p_doc, z_doc = msgspec.json.decode(p.body, type=RAW), msgspec.json.decode(z.body, type=RAW)
        assert list(z_doc) == list(p_doc)
        for key in p_doc:
            if key != "meta_info":
                assert bytes(z_doc[key]) == bytes(p_doc[key]), key
        p_meta = msgspec.json.decode(p_doc["meta_info"], type=RAW)
        z_meta = msgspec.json.decode(z_doc["meta_info"], type=RAW)
        assert list(z_meta) == list(p_meta)
        for key in p_meta:
            if key != "routed_experts":
                assert bytes(z_meta[key]) == bytes(p_meta[key]), key  # native encoding kept byte for byte
        if "routed_experts" in p_meta:
            oracle = base64.b64decode(msgspec.json.decode(p_meta["routed_experts"]), validate=True)
            frame = base64.b64decode(msgspec.json.decode(z_meta["routed_experts"]), validate=True)
            params = zstandard.get_frame_parameters(frame)
            assert params.has_checksum and params.content_size == len(oracle)
            assert zstandard.ZstdDecompressor().decompress(frame) == oracle
            assert oracle == truth.experts  # and the oracle itself is the ground truth


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_compressed_join_equals_the_uncompressed_oracle_for_fixed_truths(seed, stream):
    truth = make_truth(seed, output_len=1 if seed == 5 else None, decode_omits_one_token_experts=seed == 5)
    assert_same_except_experts_encoding(truth, stream, seed=seed)


@law_settings
@given(
    truth=truths(),
    stream=st.booleans(),
    prefill_damage=st.none() | st.sampled_from(list(Damage)),
    decode_damage=st.none() | st.sampled_from(list(Damage)),
    seed=st.integers(0, 2**32 - 1),
)
def test_compressed_join_equals_the_uncompressed_oracle(truth, stream, prefill_damage, decode_damage, seed):
    assert_same_except_experts_encoding(truth, stream, prefill_damage, decode_damage, seed)
