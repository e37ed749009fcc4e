"""vLLM's ``routed_experts`` wire encoding: Base64 of a ``.npy`` file, read without trusting it.

vLLM documents ``np.load(io.BytesIO(base64.b64decode(s)))`` as the reader. That call would follow
whatever the header says: a pickled object array, or a shape that asks for terabytes. The join
only ever needs small integer arrays, so this reader accepts exactly those and checks every bound
from the header *before* touching the data.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from numpy.lib import format as npy_format

from streamproc.codec import CorruptPayload, SequenceCodec
from streamproc.decompress import CORRUPT, TOO_LARGE, decode_base64, encode_base64

MAX_RANK = 8
# Room for the .npy preamble on top of the data limit. numpy itself refuses headers over
# 10,000 characters unless told otherwise, so 64 KiB is generous for any header it would read.
HEADER_ALLOWANCE = 64 * 1024
_INTEGER_KINDS = frozenset("iub")  # signed, unsigned, bool: expert ids are never anything else


def npy_bytes(array: np.ndarray) -> bytes:
    """The ``.npy`` serialisation of ``array`` as vLLM writes it (``np.save``, no pickles)."""
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def read_npy(data: bytes, max_bytes: int) -> np.ndarray:
    """Parse ``.npy`` bytes into an integer array of at most ``max_bytes`` data bytes.

    Raises :class:`CorruptPayload` (reason ``corrupt`` or ``too_large``) and nothing else.
    """
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy warns on Python-2 era headers; we just judge them
            if version == (1, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
            elif version == (2, 0):
                shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
            else:
                raise CorruptPayload(CORRUPT, f"unsupported .npy version {version}")
    except CorruptPayload:
        raise
    except Exception as exc:  # numpy raises ValueError/EOFError/TypeError on hostile headers
        raise CorruptPayload(CORRUPT, f"bad .npy header: {exc}") from None
    if dtype.hasobject or dtype.kind not in _INTEGER_KINDS or dtype.fields is not None or dtype.subdtype:
        raise CorruptPayload(CORRUPT, f".npy dtype {dtype.str} is not an integer type")
    if not 1 <= len(shape) <= MAX_RANK:
        raise CorruptPayload(CORRUPT, f".npy rank {len(shape)} outside 1..{MAX_RANK}")
    if any(dim < 0 for dim in shape):
        raise CorruptPayload(CORRUPT, f".npy shape {shape} has a negative dimension")
    size = math.prod(shape) * dtype.itemsize  # Python ints: a hostile shape cannot overflow this
    if size > max_bytes:
        raise CorruptPayload(TOO_LARGE, f".npy declares {size} bytes, limit {max_bytes}")
    offset = stream.tell()
    if len(data) - offset != size:
        raise CorruptPayload(CORRUPT, f".npy holds {len(data) - offset} data bytes, header says {size}")
    try:  # a zero-size shape with a dimension past intp, or a bool one, is read but cannot be built
        flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset)
        return flat.reshape(shape, order="F" if fortran_order else "C")
    except (ValueError, TypeError) as exc:
        raise CorruptPayload(CORRUPT, f".npy shape cannot be built: {exc}") from None


class Base64Npy(SequenceCodec[np.ndarray]):
    """``routed_experts`` as a JSON string: strict Base64 of ``.npy`` bytes (vLLM §3.2)."""

    def decode(self, value: object) -> np.ndarray:
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        limit = self.options.max_decompressed_bytes
        # The shared strict decoder judges the decoded size before decoding.
        return read_npy(decode_base64(value, limit + HEADER_ALLOWANCE), limit)

    def encode(self, rows: np.ndarray) -> object:
        return encode_base64(npy_bytes(np.ascontiguousarray(rows)))
