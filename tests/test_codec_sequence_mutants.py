"""Codec sequence encodings (``routed_experts`` payloads): behaviours a mutation run of the pure codec
sequence readers found unpinned (each test names the mutant it kills)."""

from __future__ import annotations

import base64
import io

import pytest
from numpy.lib import format as npy_format
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
