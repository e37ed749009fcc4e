"""Codec sequence encodings (``routed_experts`` payloads): behaviours a mutation run of the pure codec
sequence readers found unpinned (each test names the mutant it kills)."""

from __future__ import annotations

import base64
import io

import pytest
import zstandard
from numpy.lib import format as npy_format
from streamproc_sglang.sequence import Base64Int32Rows
from streamproc_sglang_zstd import Base64ZstdRows
from streamproc_vllm.sequence import Base64Npy

from streamproc.codec import CodecOptions, CorruptPayload


def test_vllm_npy_with_two_negative_dimensions_is_corrupt_not_a_crash():
    """vLLM's reader is ``np.load(io.BytesIO(base64.b64decode(s)))`` of what ``numpy2base64`` wrote
    (``np.save(buffer, array, allow_pickle=False)``); a hostile header is parsed by numpy as given, and
    ``read_array_header_1_0`` accepts negative dimensions. Two of them multiply to a positive size that
    matches the data, so only the dimension check stops it before ``reshape`` raises a ValueError (the
    reader raises CorruptPayload and nothing else). Kills VS01 (negative dimensions unchecked)."""
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (-2, -3)})
    value = base64.b64encode(header.getvalue() + bytes(24)).decode()
    with pytest.raises(CorruptPayload) as caught:
        Base64Npy(CodecOptions(max_decompressed_bytes=1 << 20)).decode(value)
    assert caught.value.reason == "corrupt"


def _zstd_value(size: int) -> str:
    """Base64 of one zstd frame of ``size`` zero bytes, its content size in the header (python-zstandard's
    one-shot ``compress``, as an engine-side compressor writes it)."""
    return base64.b64encode(zstandard.ZstdCompressor(level=3).compress(bytes(size))).decode()


def test_sglang_zstd_decode_within_never_inflates_past_the_codecs_own_limit():
    """``decode_within`` lowers the caller's limit to ``max_decompressed_bytes``: the join asks for up
    to ``prompt_tokens x 16 KiB`` for prefill's rows, which can exceed the operator's ceiling. A frame
    over the ceiling is ``too_large`` whatever the caller allowed. Kills ZQ01 (the caller's limit
    taken as is)."""
    rows = Base64ZstdRows(CodecOptions(max_decompressed_bytes=1000))
    with pytest.raises(CorruptPayload) as caught:
        rows.decode_within(_zstd_value(2000), 10_000)
    assert caught.value.reason == "too_large"


def test_sglang_zstd_a_frame_declaring_more_than_the_limit_reserves_nothing():
    """``decoded_bound`` is what the correlator reserves of the byte budget before a join: a frame whose
    header declares more than the limit is refused before any output is allocated, so it reserves 0, not
    its declared size (a 16-byte header can declare terabytes). Kills ZQ02 (the declared size reserved)."""
    rows = Base64ZstdRows(CodecOptions(max_decompressed_bytes=1 << 20))
    assert rows.decoded_bound(_zstd_value(5000), 4096) == 0
    assert rows.decoded_bound(_zstd_value(3000), 4096) == 3000


def test_sglang_base64_rows_reserve_at_most_the_codecs_ceiling():
    """SGLang's ``routed_experts`` is ``pybase64.b64encode(val.numpy().tobytes())``
    (``TokenizerManager._handle_batch_output``). ``decoded_bound`` is what the correlator reserves of the
    byte budget before the join: the strict decoder refuses a text whose decoded size passes
    ``max_decompressed_bytes`` before allocating, so a payload over the ceiling reserves the ceiling,
    not its own size. Kills SS01 (the decoded size reserved unbounded)."""
    rows = Base64Int32Rows(CodecOptions(max_decompressed_bytes=1000))
    big = base64.b64encode(bytes(4000)).decode()
    assert rows.decoded_bound(big, 1 << 20) == 1000
    assert 400 <= rows.decoded_bound(base64.b64encode(bytes(400)).decode(), 1 << 20) < 1000  # its own size
