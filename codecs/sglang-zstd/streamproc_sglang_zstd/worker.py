"""A simulated SGLang worker whose engine compresses ``routed_experts`` with zstd.

Only the encoding hooks differ from :class:`~streamproc_sglang.SGLangWorker`, so every leg keeps the
native shapes and P/D artefacts (stale decode rows, missing prompt logprobs) the laws exercise.
"""

from __future__ import annotations

import struct
import zlib
from typing import ClassVar

from streamproc.decompress import encode_base64
from streamproc.simulation import Truth
from streamproc_sglang import SGLangWorker
from streamproc_sglang.codec import SGLangCodec

from .codec import SGLangZstdCodec
from .sequence import zstd_compressor

_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOCK = 128 << 10  # zstd's maximum block size
_WINDOW_128K = bytes([(17 - 10) << 3])  # Window_Descriptor: exponent 7 -> 2**17 bytes
_RLE = 1


def zstd_bomb(content_size: int, *, declare_size: bool) -> bytes:
    """A valid zstd frame of RLE blocks that decompresses to ``content_size`` zero bytes.

    Four bytes per 128 KiB of output, built by hand in microseconds. ``declare_size`` puts the size in
    the frame header (a one-shot compressor); without it the size is unknown until decompressed
    (a streaming compressor), which is the case a decoder must bound while decompressing.
    """
    if declare_size:
        header = _MAGIC + b"\xc0" + _WINDOW_128K + struct.pack("<Q", content_size)  # 8-byte content size
    else:
        header = _MAGIC + b"\x00" + _WINDOW_128K
    blocks = []
    left = content_size
    while True:
        size = min(left, _BLOCK)
        left -= size
        last = left == 0
        blocks.append((last | _RLE << 1 | size << 3).to_bytes(3, "little") + b"\x00")
        if last:
            return header + b"".join(blocks)


class SGLangZstdWorker(SGLangWorker):
    format: ClassVar[str] = "sglang-zstd"
    codec_class: ClassVar[type[SGLangCodec]] = SGLangZstdCodec

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cctx = zstd_compressor()  # the "engine's" own compressor, not the codec's

    def encode_experts(self, raw: bytes) -> object:
        return encode_base64(self._cctx.compress(raw))

    def bomb(self, truth: Truth, role: str) -> object:
        """A few KiB that decompress to at least four times the limit. Whether the frame declares its
        size depends on the request and leg, so both decoder paths are exercised."""
        limit = self.options.max_decompressed_bytes
        declare = zlib.crc32(f"{truth.request_id}/{role}".encode()) & 1 == 0
        return encode_base64(zstd_bomb(max(4 * limit, limit + (1 << 20)), declare_size=declare))
