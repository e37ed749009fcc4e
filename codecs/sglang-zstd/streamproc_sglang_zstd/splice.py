"""A joined frame that reuses prefill's compressed blocks and compresses only the generated rows.

Recompressing the whole joined payload was 57% of a large join, and most of it redid work the
prefill worker had already done: the prompt rows come first in the join, byte for byte as prefill
compressed them. zstd's multi-threaded compressor builds one frame from independently compressed
jobs in the same way (``ZSTDMT_compressionJob`` in lib/compress/zstdmt_compress.c: each job starts
with ``ZSTD_compressBegin_advanced_internal(cctx, job->prefix.start, job->prefix.size,
ZSTD_dct_rawContent, ...)`` and, if not the first, ``ZSTD_invalidateRepCodes(cctx)``; its blocks
are appended to the one frame), so the format allows it. The joined frame here is:

1. a new frame header: single segment (the window is the content size, so any offset back into
   the prompt rows is legal), the joined content size, a content checksum;
2. prefill's blocks, copied, with the last-block bit of its final block cleared;
3. a few bytes of the generated rows as tiny hand-built blocks (below) that leave the decoder's
   repeat offsets at zstd's initial ``{1, 4, 8}``;
4. the blocks of a fresh frame of the remaining rows (frame header dropped, no checksum);
5. XXH64 of the joined content (the low 4 bytes), as the frame's checksum.

Why step 3: zstd sequences may name a match by a *repeat offset* (one of the last three offsets
used). A compressor starting a frame assumes the repeat offsets are ``{1, 4, 8}``
(``static const U32 repStartValue[ZSTD_REP_NUM] = { 1, 4, 8 };`` in zstd_internal.h) and no
earlier entropy tables; the decoder instead carries over what the
blocks before left. zstdmt avoids that with ``ZSTD_invalidateRepCodes``, which python-zstandard
does not expose. The entropy tables need nothing (a frame's first block never uses
``Repeat_Mode`` or treeless literals: there is nothing to repeat), but the offsets must agree: three
one-sequence blocks whose matches use the explicit offsets 8, then 4, then 1 (each a real 3-byte
match found in the generated rows) shift the decoder's history to exactly ``{1, 4, 8}``
(RFC 8878 §3.1.1.5 "Repeat Offsets"). Bytes between them go in raw blocks. Each such block is
7 bytes: no literals, one sequence, every symbol table in ``RLE_Mode`` so that the bitstream holds
only the offset's extra bits.

When no such matches exist near the start of the generated rows (e.g. narrow dtypes without four
equal bytes in a row), the frame is too large for a single segment, or prefill's frame is not one
this module can walk (a dictionary, or too many blocks for its size), :func:`splice_frame` returns
None and the caller recompresses everything.
"""

from __future__ import annotations

import numpy as np
import xxhash
import zstandard

_MAGIC = b"\x28\xb5\x2f\xfd"
_RAW, _RLE_BLOCK, _COMPRESSED = 0, 1, 2
_MAX_BLOCK = 128 << 10
# A single-segment frame makes decoders keep the whole content as their window; zstd refuses
# windows above this by default (ZSTD_WINDOWLOG_LIMIT_DEFAULT), so larger joins are recompressed.
MAX_SINGLE_SEGMENT = 1 << 27
# How far into the generated rows to look for the three matches that reset the repeat offsets.
SEARCH_BYTES = 64 << 10
# Below this many prompt-row bytes, recompressing everything is cheap and splicing saves nothing.
MIN_PREFIX = 128 << 10
# Prefill's frame is walked block by block in Python. zstd's blocks hold up to 128 KiB; a frame of
# millions of empty 3-byte blocks is valid and decodes in C in milliseconds, but would take seconds
# to walk, so a frame averaging under this many content bytes per block is recompressed instead.
MIN_BYTES_PER_BLOCK = 4096
# The explicit offsets whose matches leave the repeat history at zstd's start value {1, 4, 8}.
_RESET_OFFSETS = (8, 4, 1)
_OFFSET_CODE = {8: (3, 3), 4: (2, 3), 1: (2, 0)}  # offset -> (offset code, extra bits' value)


def _frame_layout(frame: bytes | memoryview, max_blocks: int | None = None) -> tuple[int, int, int] | None:
    """``(first block, last block header, end of blocks)`` offsets of one zstd frame, or None when
    the frame uses a dictionary, its blocks do not walk exactly to its end, or it has more than
    ``max_blocks`` blocks."""
    if len(frame) < 6 or frame[:4] != _MAGIC:
        return None
    fhd = frame[4]
    if fhd & 0x08 or fhd & 0x03:  # reserved bit, or a dictionary id
        return None
    single = fhd >> 5 & 1
    fcs_size = (0, 2, 4, 8)[fhd >> 6] or single  # flag 0: one byte only in single-segment mode
    pos = 5 + (0 if single else 1) + fcs_size
    checksum = 4 if fhd & 0x04 else 0
    end = len(frame) - checksum
    last_header = -1
    blocks = 0
    while pos + 3 <= end:
        blocks += 1
        if max_blocks is not None and blocks > max_blocks:
            return None
        header = int.from_bytes(frame[pos:pos + 3], "little")
        kind, size = header >> 1 & 3, header >> 3
        if kind == 3:
            return None
        last_header = pos
        pos += 3 + (1 if kind == _RLE_BLOCK else size)
        if header & 1:
            return (5 + (0 if single else 1) + fcs_size, last_header, pos) if pos == end else None
    return None


def _frame_header(content_size: int) -> bytes:
    """Single segment, content checksum, the smallest content-size field that holds the size."""
    if content_size < 256:
        flag, field = 0, content_size.to_bytes(1, "little")
    elif content_size < 65536 + 256:
        flag, field = 1, (content_size - 256).to_bytes(2, "little")
    elif content_size < 1 << 32:
        flag, field = 2, content_size.to_bytes(4, "little")
    else:
        flag, field = 3, content_size.to_bytes(8, "little")
    return _MAGIC + bytes([flag << 6 | 1 << 5 | 1 << 2]) + field


def _block_header(kind: int, size: int, last: bool = False) -> bytes:
    return (int(last) | kind << 1 | size << 3).to_bytes(3, "little")


def _match_block(offset: int) -> bytes:
    """A compressed block holding one 3-byte match at an explicit ``offset`` and no literals."""
    code, extra = _OFFSET_CODE[offset]
    body = bytes([
        0x00,  # Literals_Section_Header: Raw_Literals_Block, 5-bit size 0
        0x01,  # Number_of_Sequences
        0x54,  # Symbol_Compression_Modes: LL, OF and ML in RLE_Mode
        0x00,  # LL code 0: literal length 0
        code,  # OF code: Offset_Value = (1 << code) + extra = offset + 3
        0x00,  # ML code 0: match length 3
        extra | 1 << code,  # bitstream: the offset's extra bits, then the end mark
    ])
    return _block_header(_COMPRESSED, len(body)) + body


def _reset_points(prefix_tail: bytes, suffix_head: bytes) -> list[int] | None:
    """Positions in ``suffix_head`` of a 3-byte match at offset 8, then 4, then 1 (each after the
    previous match), with ``prefix_tail`` (the 8 bytes before it) as history; None if not found."""
    data = np.frombuffer(prefix_tail + suffix_head, dtype=np.uint8)
    base = len(prefix_tail)
    points, start = [], base
    for offset in _RESET_OFFSETS:
        n = len(data) - 2 - start  # candidates pos in [start, len - 3]
        if n <= 0:
            return None
        hits = np.ones(n, dtype=bool)
        for k in range(3):
            hits &= data[start + k:start + k + n] == data[start + k - offset:start + k - offset + n]
        found = np.flatnonzero(hits)
        if not len(found):
            return None
        pos = start + int(found[0])
        points.append(pos - base)
        start = pos + 3
    return points


def splice_frame(prefill_frame: bytes | memoryview, prefix: bytes, suffix: bytes | memoryview,
                 compressor: zstandard.ZstdCompressor) -> bytes | None:
    """One zstd frame of ``prefix + suffix`` whose first part is ``prefill_frame``'s blocks
    (``prefill_frame`` must decompress to ``prefix``), or None when this shape cannot be built.
    ``compressor`` compresses the rest; it must write neither a checksum nor a dictionary id
    (the frame's own header and checksum are written here)."""
    total = len(prefix) + len(suffix)
    if len(prefix) < MIN_PREFIX or total > MAX_SINGLE_SEGMENT or len(suffix) < 3 * len(_RESET_OFFSETS):
        return None
    layout = _frame_layout(prefill_frame, len(prefix) // MIN_BYTES_PER_BLOCK + 64)
    if layout is None:
        return None
    first, last_header, end = layout
    prefill_frame, suffix = memoryview(prefill_frame), memoryview(suffix)  # slices without copies
    points = _reset_points(bytes(prefix[-8:]), bytes(suffix[:SEARCH_BYTES]))
    if points is None:
        return None
    parts = [_frame_header(total), prefill_frame[first:last_header],
             bytes([prefill_frame[last_header] & 0xFE]), prefill_frame[last_header + 1:end]]
    done = 0
    for offset, pos in zip(_RESET_OFFSETS, points):
        if pos > done:  # the bytes before this match, verbatim
            parts += [_block_header(_RAW, pos - done), suffix[done:pos]]
        parts.append(_match_block(offset))
        done = pos + 3
    if done < len(suffix):
        # No dictionary: on skewed routed-expert rows the prompt rows as history made the generated
        # rows' frame 0.3-0.7% larger, not smaller, and cost 3-6 ms to load (5,000-row join).
        tail = compressor.compress(suffix[done:])
        tail_layout = _frame_layout(tail)
        if tail_layout is None or tail[4] & 0x04:
            return None
        parts.append(memoryview(tail)[tail_layout[0]:tail_layout[2]])
    else:
        parts.append(_block_header(_RAW, 0, last=True))
    digest = xxhash.xxh64()
    digest.update(prefix)
    digest.update(suffix)
    parts.append((digest.intdigest() & 0xFFFFFFFF).to_bytes(4, "little"))
    return b"".join(parts)
