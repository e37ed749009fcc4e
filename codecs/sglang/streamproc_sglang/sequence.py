"""SGLang's ``routed_experts`` wire encoding: Base64 of raw little-endian rows, no header.

The id size is the worker's ``SGLANG_ROUTED_EXPERTS_DTYPE`` (int32 by default, uint16 or uint8),
which the join reads from ``meta_info.routed_experts_dtype``; this codec only moves bytes.

The shape is not on the wire (reference notes §3.1); the join derives the row size from the
prefill leg's ``prompt_tokens``. Rows stay ``bytes`` so a join is two slices and one concatenation.
"""

from __future__ import annotations

from streamproc.codec import CorruptPayload, SequenceCodec
from streamproc.decompress import CORRUPT, base64_decoded_size, decode_base64, encode_base64


class Base64Int32Rows(SequenceCodec[bytes]):
    """``routed_experts`` as strict Base64 text; the decoded size is bounded before decoding."""

    def decode(self, value: object) -> bytes:
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        return decode_base64(value, self.options.max_decompressed_bytes)

    def decoded_bound(self, value: object, limit: int) -> int:
        """What :meth:`decode` allocates: the Base64 text's decoded length (nothing for a value it refuses)."""
        if not isinstance(value, str):
            return 0
        return min(base64_decoded_size(value), self.options.max_decompressed_bytes)

    def encode(self, rows: bytes | bytearray | memoryview) -> str:
        return encode_base64(rows)
