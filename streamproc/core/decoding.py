"""Bounded decoding of untrusted payload encodings (strict Base64, one zstd frame).

A worker's sequence payload is attacker-shaped input: a few kilobytes of zstd can claim gigabytes,
and a Base64 string's decoded size is only known after decoding it. Every helper here checks the
size it is about to produce against a byte ``limit`` *before* allocating it, so a bomb costs at most
``limit`` bytes of memory and never an exception other than :class:`~streamproc.codec.CorruptPayload`.

The helpers know no field names; a codec picks the omission reason for its leg from ``reason``
(:data:`TOO_LARGE` or :data:`CORRUPT`).
"""

from __future__ import annotations

import binascii

import pybase64
import zstandard

from .codec import CorruptPayload, OmissionReason

TOO_LARGE = OmissionReason.TOO_LARGE.value
CORRUPT = "corrupt"  # not an omission reason: the codec turns it into <leg>_corrupt

# Output read per step while measuring a frame that does not declare its size: small enough to keep
# the measuring pass's memory flat, large enough that legitimate payloads need few steps.
_MEASURE_STEP = 1 << 20
# Streaming frames declare a window; allow at least what a default zstd compressor uses at any level
# up to 19 (8 MiB) so ordinary payloads decode even under a small limit.
_MIN_WINDOW = 8 << 20
_MAX_WINDOW = 1 << 27  # zstd's own default ceiling (ZSTD_WINDOWLOG_LIMIT_DEFAULT)


def base64_decoded_bound(limit: int) -> int:
    """The longest Base64 text (with padding) whose decoded size can still be within ``limit``."""
    return 4 * -(-limit // 3)


def decode_base64(text: str | bytes, limit: int) -> bytes:
    """Strict Base64 (RFC 4648 alphabet, padding required, no whitespace), at most ``limit`` bytes out.

    The length is judged before decoding, so an oversized string is rejected without allocating.
    The contract is ``binascii.a2b_base64(text, strict_mode=True)``; pybase64's SIMD decoder
    (``validate=True``) decodes ~50x faster (stdlib decoding was a fifth of a large join) and accepts
    a subset of it with the same bytes out. What pybase64 refuses is judged again by binascii, which
    also accepts a few odd paddings (``"0000="`` on CPython 3.11), so the accepted set is exactly
    stdlib's; tests/test_base64_strict.py pins both directions. Only invalid input pays twice.
    """
    if len(text) > base64_decoded_bound(limit):
        raise CorruptPayload(TOO_LARGE, f"{len(text)} base64 characters decode past the {limit}-byte limit")
    try:
        out = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        out = _decode_base64_stdlib(text)
    if len(out) > limit:
        raise CorruptPayload(TOO_LARGE, f"base64 decodes to {len(out)} bytes, limit {limit}")
    return out


def _decode_base64_stdlib(text: str | bytes) -> bytes:
    """The authoritative strict decoder, for what the fast one refused."""
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError, TypeError) as exc:  # ValueError: non-ASCII str
        raise CorruptPayload(CORRUPT, f"invalid base64: {exc}") from None


def encode_base64(data: bytes | bytearray | memoryview) -> str:
    """Standard padded Base64 text, the form :func:`decode_base64` accepts (pybase64: the same bytes
    as ``binascii.b2a_base64(newline=False)``, built straight into a ``str`` without a bytes copy)."""
    return pybase64.b64encode_as_string(data)


def base64_decoded_size(text: str | bytes) -> int:
    """The most bytes Base64 ``text`` decodes to (3 per 4 characters), without decoding it."""
    return len(text) // 4 * 3


# The longest zstd frame header (RFC 8878 §3.1.1.1: magic 4, descriptor 1, window 1, dictionary id
# up to 4, content size up to 8 bytes) and the Base64 characters that carry it.
_ZSTD_HEADER_MAX = 18
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # RFC 8878 §3.1.1: 0xFD2FB528, little-endian
_ZSTD_HEADER_CHARS = base64_decoded_bound(_ZSTD_HEADER_MAX)


def zstd_declared_size(text: str | bytes) -> int | None:
    """The content size the zstd frame in Base64 ``text`` declares in its header, read from the first
    24 characters alone (~0.6 µs); None when the frame declares none or is no zstd frame (then
    :func:`decompress_zstd` measures it, or refuses it)."""
    try:
        head = pybase64.b64decode(text[:_ZSTD_HEADER_CHARS], validate=True)
        declared = zstandard.frame_content_size(head)
    except (binascii.Error, ValueError, TypeError, zstandard.ZstdError):
        return None
    return declared if declared >= 0 else None


def zstd_frame_bound(size: int) -> int:
    """Largest single zstd frame a conforming compressor emits for ``size`` input bytes.

    ``ZSTD_COMPRESSBOUND`` plus room for the frame header and checksum: a "compressed" payload
    larger than this for the decompression limit cannot be a legitimate frame within the limit.
    """
    small_input_margin = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + small_input_margin + 32


def zstd_decompressor(limit: int) -> zstandard.ZstdDecompressor:
    """A decompressor whose window is bounded too (a frame may ask for a window larger than its output).

    zstd contexts are not thread safe: create one per codec instance, not per module.
    """
    window = _MIN_WINDOW
    while window < limit and window < _MAX_WINDOW:
        window <<= 1
    return zstandard.ZstdDecompressor(max_window_size=window)


def decompress_zstd(frame: bytes | memoryview, limit: int, dctx: zstandard.ZstdDecompressor) -> bytes:
    """Exactly one zstd frame, decompressed to at most ``limit`` bytes.

    A frame that declares a nonzero content size is judged by the header alone. A frame that
    declares none (streaming compressors), or 0, is first measured by streaming through it in 1 MiB
    steps, discarding the output and stopping at ``limit + 1`` bytes (past 0 for one that declares
    0), then decompressed by a streaming pass that stops at the frame's end, so whatever follows it
    is seen. A header that declares 0 is never taken at its word: python-zstandard's one-shot
    ``decompress`` returns ``b""`` for it without reading the blocks, and zstd's streaming decoder
    runs on into concatenated frames, counting empty and skippable ones as nothing. Trailing data
    after the frame (any frame included), a truncated frame and a checksum mismatch are all
    :data:`CORRUPT`.
    """
    if bytes(frame[:4]) != _ZSTD_MAGIC:  # a skippable frame reads as declaring 0 and decodes to nothing
        raise CorruptPayload(CORRUPT, "not a zstd frame: no zstd magic number")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(CORRUPT, f"not a zstd frame: {exc}") from None
    if declared > limit:
        raise CorruptPayload(TOO_LARGE, f"zstd frame declares {declared} bytes, limit {limit}")
    try:
        if declared > 0:
            return dctx.decompress(frame, allow_extra_data=False)
        try:
            size = _measure(frame, limit if declared < 0 else 0, dctx)
        except CorruptPayload as exc:
            if declared < 0:
                raise
            raise CorruptPayload(CORRUPT, "zstd frame declares 0 bytes and holds more") from exc
        # The frame's output is now known to be ``size`` bytes, so this pass holds at most that.
        one = dctx.decompressobj(read_across_frames=False)
        out = one.decompress(frame)
        if not one.eof:
            raise CorruptPayload(CORRUPT, "zstd frame is truncated")
        if one.unused_data:
            raise CorruptPayload(CORRUPT, f"{len(one.unused_data)} bytes follow the zstd frame")
        if len(out) != size:
            raise CorruptPayload(CORRUPT, f"zstd frame decoded to {len(out)} bytes, measured {size}")
        return out
    except zstandard.ZstdError as exc:
        raise CorruptPayload(CORRUPT, f"zstd: {exc}") from None
    except MemoryError:
        raise CorruptPayload(TOO_LARGE, "zstd frame needs more memory than is available") from None


def _measure(frame: bytes | memoryview, limit: int, dctx: zstandard.ZstdDecompressor) -> int:
    total = 0
    reader = dctx.stream_reader(frame, read_across_frames=False)
    with reader:
        while True:
            step = reader.read(min(_MEASURE_STEP, limit + 1 - total))
            if not step:
                return total
            total += len(step)
            if total > limit:
                raise CorruptPayload(TOO_LARGE, f"zstd frame decompresses past the {limit}-byte limit")
