"""``routed_experts`` as ``Base64(zstd(raw int32 rows))``: the one thing this format changes.

Both directions are bounded and strict: the Base64 text may not exceed what a legitimate frame for
``max_decompressed_bytes`` could need, the frame must be exactly one zstd frame, and its decompressed
size is judged from the header (or by a bounded streaming pass) before any output is allocated.
"""

from __future__ import annotations

import zstandard

from streamproc.codec import CodecOptions, CorruptPayload, SequenceCodec
from streamproc.decompress import (
    CORRUPT,
    decode_base64,
    decompress_zstd,
    encode_base64,
    zstd_decompressor,
    zstd_frame_bound,
)

LEVEL = 3


def zstd_compressor() -> zstandard.ZstdCompressor:
    """The engine-side settings: content size in the header (cheap bounds) and a content checksum
    (detects value-level corruption that a size check cannot)."""
    return zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)


class Base64ZstdRows(SequenceCodec[bytes]):
    """Raw int32 rows <-> Base64 text of one zstd frame.

    zstd contexts are not thread safe, so each instance (one per codec instance) owns its own.
    """

    def __init__(self, options: CodecOptions) -> None:
        super().__init__(options)
        self._limit = options.max_decompressed_bytes
        self._frame_limit = zstd_frame_bound(self._limit)
        self._cctx = zstd_compressor()
        self._dctx = zstd_decompressor(self._limit)

    def decode(self, value: object) -> bytes:
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        frame = decode_base64(value, self._frame_limit)
        return decompress_zstd(frame, self._limit, self._dctx)

    def decode_within(self, value: object, limit: int) -> bytes:
        """The same, but the frame may inflate to at most ``limit`` (what the body's counts allow)."""
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        limit = min(limit, self._limit)
        frame = decode_base64(value, zstd_frame_bound(limit))
        return decompress_zstd(frame, limit, self._dctx)

    def encode(self, rows: bytes | bytearray | memoryview) -> str:
        return encode_base64(self._cctx.compress(rows))
