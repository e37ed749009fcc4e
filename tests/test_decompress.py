"""Bounded decoding helpers: strict Base64 and one zstd frame, both limited before allocating."""

from __future__ import annotations

import os
import tracemalloc

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from streamproc.codec import CorruptPayload
from streamproc.decompress import (
    CORRUPT,
    TOO_LARGE,
    base64_decoded_bound,
    decode_base64,
    decompress_zstd,
    encode_base64,
    zstd_decompressor,
    zstd_frame_bound,
)

MIB = 1 << 20


class UntouchedDecompressor:
    """Stands in for a ``ZstdDecompressor`` that must not be used: any attribute read fails the test."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the decompressor was used ({name}): not judged by the header alone")


def reason_of(call) -> str:
    with pytest.raises(CorruptPayload) as info:
        call()
    return info.value.reason


def one_shot(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(data)


def streamed(data: bytes) -> bytes:
    """A frame as a streaming compressor writes it: no content size in the header."""
    cobj = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    return cobj.compress(data) + cobj.flush()


def zero_stream_frame(size: int, *, declare: bool) -> bytes:
    """``size`` zero bytes compressed piecewise, so building a big bomb never holds it in memory."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    cobj = cctx.compressobj(size=size if declare else -1)
    piece = bytes(MIB)
    parts = []
    for _ in range(size // MIB):
        parts.append(cobj.compress(piece))
    parts.append(cobj.compress(bytes(size % MIB)))
    parts.append(cobj.flush())
    return b"".join(parts)


# ------------------------------------------------------------------------ base64


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=64), limit=st.integers(0, 80))
def test_base64_round_trips_within_the_limit_and_is_too_large_beyond_it(data, limit):
    text = encode_base64(data)
    if len(data) <= limit:
        assert decode_base64(text, limit) == data
    else:
        assert reason_of(lambda: decode_base64(text, limit)) == TOO_LARGE


def test_base64_longer_than_the_bound_is_rejected_before_decoding():
    # Invalid characters would be CORRUPT if the text were decoded: TOO_LARGE proves it was not.
    limit = 3000
    text = "!" * (base64_decoded_bound(limit) + 1)
    assert reason_of(lambda: decode_base64(text, limit)) == TOO_LARGE


def test_base64_at_the_bound_is_decoded_then_judged_by_its_real_size():
    assert base64_decoded_bound(2) == 4
    assert reason_of(lambda: decode_base64("AAAA", 2)) == TOO_LARGE  # 3 bytes > 2
    assert decode_base64("AA==", 2) == b"\x00"


@pytest.mark.parametrize("text", ["QQ", "QQ==\n", "Q Q==", "QQ==QQ==", "é", "!!not base64!!", "QUJD\x00"])
def test_base64_is_strict(text):
    assert reason_of(lambda: decode_base64(text, 1000)) == CORRUPT


# -------------------------------------------------------------------------- zstd


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=4096), declare=st.booleans())
def test_zstd_round_trips_with_and_without_a_declared_size(data, declare):
    frame = one_shot(data) if declare else streamed(data)
    assert decompress_zstd(frame, 4096, zstd_decompressor(4096)) == data


@pytest.mark.parametrize("declare", [True, False])
def test_zstd_output_of_exactly_the_limit_passes_and_one_byte_more_is_too_large(declare):
    limit = 10_000
    make = one_shot if declare else streamed
    dctx = zstd_decompressor(limit)
    assert decompress_zstd(make(bytes(limit)), limit, dctx) == bytes(limit)
    assert reason_of(lambda: decompress_zstd(make(bytes(limit + 1)), limit, dctx)) == TOO_LARGE


def test_zstd_bomb_declaring_its_size_is_rejected_from_the_header_alone():
    frame = zero_stream_frame(64 * MIB, declare=True)
    assert zstandard.frame_content_size(frame) == 64 * MIB
    tracemalloc.start()
    try:
        # a decompressor that fails the test if it is touched: the refusal comes from the header alone
        # (a wall-clock bound said this before, and a loaded machine can stretch any bound of that kind)
        assert reason_of(lambda: decompress_zstd(frame, MIB, UntouchedDecompressor())) == TOO_LARGE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


def test_zstd_bomb_without_a_declared_size_is_stopped_past_the_limit_with_bounded_memory():
    frame = zero_stream_frame(64 * MIB, declare=False)
    assert zstandard.frame_content_size(frame) == -1
    limit = 4 * MIB
    tracemalloc.start()
    try:
        assert reason_of(lambda: decompress_zstd(frame, limit, zstd_decompressor(limit))) == TOO_LARGE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MIB  # 1 MiB measuring steps, never the whole output


@pytest.mark.parametrize("declare", [True, False])
def test_zstd_truncated_frame_is_corrupt(declare):
    frame = (one_shot if declare else streamed)(os.urandom(5000))
    assert reason_of(lambda: decompress_zstd(frame[:-7], 10_000, zstd_decompressor(10_000))) == CORRUPT


@pytest.mark.parametrize("declare", [True, False])
def test_zstd_trailing_data_after_the_frame_is_corrupt(declare):
    frame = (one_shot if declare else streamed)(b"rows" * 100)
    assert reason_of(lambda: decompress_zstd(frame + b"extra", 10_000, zstd_decompressor(10_000))) == CORRUPT
    assert reason_of(lambda: decompress_zstd(frame + frame, 10_000, zstd_decompressor(10_000))) == CORRUPT


def test_zstd_checksum_mismatch_is_corrupt():
    frame = bytearray(one_shot(bytes(range(256)) * 8))
    frame[-1] ^= 0xFF  # the last four bytes are the content checksum
    assert reason_of(lambda: decompress_zstd(bytes(frame), 10_000, zstd_decompressor(10_000))) == CORRUPT


@pytest.mark.parametrize("data", [b"", b"x", b"not a zstd frame at all", b"\x28\xb5\x2f\xfd"])
def test_zstd_non_frames_are_corrupt(data):
    assert reason_of(lambda: decompress_zstd(data, 10_000, zstd_decompressor(10_000))) == CORRUPT


def test_zstd_frame_asking_for_a_huge_window_is_refused():
    # Window_Descriptor 0x80: 2**26 bytes, beyond the 8 MiB a 1 MiB limit allows; no content size.
    last_rle_block_of_10 = (1 | 1 << 1 | 10 << 3).to_bytes(3, "little") + b"\x00"
    frame = b"\x28\xb5\x2f\xfd" + b"\x00" + bytes([(26 - 10) << 3]) + last_rle_block_of_10
    assert reason_of(lambda: decompress_zstd(frame, MIB, zstd_decompressor(MIB))) == CORRUPT
    assert decompress_zstd(frame, MIB, zstd_decompressor(128 * MIB)) == bytes(10)


def test_zstd_accepts_a_memoryview():
    frame = one_shot(b"abc" * 50)
    assert decompress_zstd(memoryview(frame), 1000, zstd_decompressor(1000)) == b"abc" * 50


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 300_000), seed=st.integers(0, 2**32 - 1))
def test_zstd_frame_bound_covers_incompressible_input(size, seed):
    data = os.urandom(size) if seed % 2 else bytes(size)
    assert len(one_shot(data)) <= zstd_frame_bound(size)
    assert len(streamed(data)) <= zstd_frame_bound(size)


# zstd's streaming decoder runs on into whatever follows a frame (concatenated and skippable frames
# are part of the format, RFC 8878 §3), and python-zstandard's one-shot ``decompress`` returns b""
# for a header that declares 0 bytes without reading the blocks (``Decompressor_decompress``:
# ``decompressedSize == 0`` -> empty bytes). Neither may let a value that is not exactly one valid
# frame through: an empty frame is the engine's encoding of zero rows (``BaseTopkCapturer.get_topk``
# with ``start_len`` at the prompt's end returns ``req_to_token[...][start_len : seqlen - 1]``, empty).
_EMPTY_FRAME = zstandard.ZstdCompressor(write_checksum=True).compress(b"")  # declares 0 bytes
_SKIPPABLE = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip"


@pytest.mark.parametrize("tail", [_EMPTY_FRAME, _SKIPPABLE, streamed(b"")], ids=["empty", "skippable", "streamed-empty"])
@pytest.mark.parametrize("declare", [True, False])
def test_zstd_a_frame_followed_by_a_frame_of_no_content_is_corrupt(tail, declare):
    frame = (one_shot if declare else streamed)(b"rows" * 100)
    assert reason_of(lambda: decompress_zstd(frame + tail, 10_000, zstd_decompressor(10_000))) == CORRUPT


@pytest.mark.parametrize("tail", [b"garbage", _EMPTY_FRAME, one_shot(b"rows" * 100), _SKIPPABLE],
                         ids=["garbage", "empty", "frame", "skippable"])
def test_zstd_a_frame_declaring_no_content_is_judged_like_any_other(tail):
    assert decompress_zstd(_EMPTY_FRAME, 10_000, zstd_decompressor(10_000)) == b""
    assert reason_of(lambda: decompress_zstd(_EMPTY_FRAME + tail, 10_000, zstd_decompressor(10_000))) == CORRUPT


@pytest.mark.parametrize("frame", [_SKIPPABLE, _SKIPPABLE + _EMPTY_FRAME, _SKIPPABLE + one_shot(b"rows")],
                         ids=["alone", "then-empty", "then-frame"])
def test_zstd_a_skippable_frame_is_no_payload(frame):
    """``frame_content_size`` reads a skippable frame as declaring 0 bytes; it is no zstd data frame."""
    assert reason_of(lambda: decompress_zstd(frame, 10_000, zstd_decompressor(10_000))) == CORRUPT


def test_zstd_a_header_declaring_no_content_over_blocks_that_hold_some_is_corrupt():
    single_segment_of_0 = b"\x28\xb5\x2f\xfd\x20\x00"
    raw_last_block = (1 | 5 << 3).to_bytes(3, "little") + b"hello"
    assert reason_of(lambda: decompress_zstd(single_segment_of_0 + raw_last_block, 10_000,
                                             zstd_decompressor(10_000))) == CORRUPT
    bad_checksum = bytearray(_EMPTY_FRAME)
    bad_checksum[-1] ^= 0xFF
    assert reason_of(lambda: decompress_zstd(bytes(bad_checksum), 10_000, zstd_decompressor(10_000))) == CORRUPT


def test_zstd_a_header_declaring_no_content_over_a_bomb_is_stopped_with_bounded_memory():
    """Window 128 MiB (not single segment) and 2 GiB of RLE blocks behind a content size of 0."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0x80]) + bytes([(27 - 10) << 3]) + (0).to_bytes(4, "little")
    rle = (1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\x00"
    frame = header + rle * (16 << 10) + (1 | 1 << 1 | 1 << 3).to_bytes(3, "little") + b"\x00"
    assert zstandard.frame_content_size(frame) == 0
    tracemalloc.start()
    try:
        assert reason_of(lambda: decompress_zstd(frame, 512 * MIB, zstd_decompressor(512 * MIB))) == CORRUPT
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MIB
