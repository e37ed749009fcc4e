"""The sglang-zstd codec (``splice.py``, ``sequence.py``): behaviours a mutation run found unpinned (each
test names the mutant it kills). Frames come from python-zstandard, as an engine-side compressor
writes them."""

from __future__ import annotations

import os

import pytest
import zstandard
from streamproc_sglang_zstd import SGLangZstdCodec
from streamproc_sglang_zstd.sequence import usable_cores, zstd_compressor
from streamproc_sglang_zstd.splice import MAX_SINGLE_SEGMENT, splice_frame
from test_zstd_splice import check_decodes, routed_rows, spliced

from streamproc.codec import CodecOptions


def test_a_prefill_frame_ending_in_an_empty_last_block_is_spliced():
    """A streaming compressor that flushed its blocks as rows came (``ZstdCompressionObj.flush
    (COMPRESSOBJ_FLUSH_BLOCK)``, zstd's ``ZSTD_e_flush``) ends the frame with an empty last raw block: a
    3-byte block header and nothing after it but the checksum. The walk reaches it (a header that ends
    exactly at the end of the blocks), so prefill's blocks are reused, not recompressed.
    Kills ZP03 (the walk stops one header short of the frame's end)."""
    data = routed_rows(3000)
    cut = 1000 * 58 * 8 * 4
    prefix, suffix = data[:cut], data[cut:]
    chunker = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj()
    frame = chunker.compress(prefix) + chunker.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) + chunker.flush()
    assert frame[-7:-4] == b"\x01\x00\x00"  # the empty last raw block, then the 4-byte checksum
    joined = splice_frame(frame, prefix, suffix, zstd_compressor(3, 0, 1 << 20, bare=True))
    assert joined is not None and spliced(joined, frame)
    check_decodes(joined, data)


def test_a_prefill_frame_with_rle_blocks_is_walked_and_spliced():
    """A long run of one byte value (e.g. zero rows a capture left unwritten) is a ``RLE_Block`` in the
    frame zstd writes (RFC 8878 §3.1.1.2.2: ``Block_Size`` is the regenerated size, the content one
    byte), so walking the blocks advances 1 byte past an RLE header, not ``Block_Size``. A prefill
    frame whose last blocks are RLE is still spliced. Kills ZP05 (RLE blocks walked as raw ones)."""
    rows = routed_rows(600)
    cut = 300 * 58 * 8 * 4
    prefix, suffix = rows[:cut] + bytes(300_000), rows[cut:]
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(prefix)
    joined = splice_frame(frame, prefix, suffix, zstd_compressor(3, 0, 1 << 20, bare=True))
    assert joined is not None and spliced(joined, frame)
    check_decodes(joined, prefix + suffix)


def test_a_join_above_the_single_segment_limit_is_not_spliced():
    """A spliced frame is single-segment: its window is its whole content, and zstd decoders refuse
    windows above ``ZSTD_WINDOWLOG_LIMIT_DEFAULT`` (2^27) unless told otherwise, so a join past 128 MiB
    is left to the caller's recompression (None). Kills ZP12 (the size limit unchecked)."""
    prefix = routed_rows(200)
    suffix = bytes(MAX_SINGLE_SEGMENT - len(prefix) + 1)  # zeros: compressed in milliseconds
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(prefix)
    assert splice_frame(frame, prefix, suffix, zstd_compressor(3, 0, 1 << 20, bare=True)) is None


@pytest.mark.parametrize("option", [("zstd_threads", "65"), ("zstd_level", "-8")])
def test_options_just_past_their_documented_range_are_refused_when_the_codec_is_built(option):
    """``zstd_threads`` is ``auto`` or 0..64 and ``zstd_level`` -7..22 but not 0 (docs/configuration.md):
    one past either end is refused with the option's name, not taken. Kills ZQ07 (threads unbounded)
    and ZQ12 (level -8 taken)."""
    with pytest.raises(ValueError, match=option[0]):
        SGLangZstdCodec(CodecOptions(format_options=(option,)))


def test_a_fractional_cpu_quota_rounds_up_to_the_cores_it_spans(tmp_path):
    """A cgroup v2 ``cpu.max`` of 1.5 CPUs lets the process run on two cores at once part of the time:
    ``usable_cores`` rounds the quota up (then caps it by the affinity mask), so it gets one zstd worker
    per core it may use. Kills ZQ08 (the quota rounded down)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if cores < 2:
        pytest.skip("needs two usable cores to tell 1.5 rounded up from rounded down")
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(str(tmp_path)) == 2
