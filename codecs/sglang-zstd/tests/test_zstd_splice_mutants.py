"""The zstd splice: behaviours a mutation run of ``splice.py`` found unpinned (each test names the
mutant it kills). Frames come from python-zstandard, as an engine-side compressor writes them."""

from __future__ import annotations

import zstandard
from streamproc_sglang_zstd.sequence import zstd_compressor
from streamproc_sglang_zstd.splice import splice_frame
from test_zstd_splice import check_decodes, routed_rows, spliced


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
