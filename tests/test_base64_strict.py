"""pybase64 in ``core.decoding`` must accept and produce exactly what stdlib strict Base64 does.

The join decodes untrusted worker text with pybase64 for speed; the wire contract is still
``binascii.a2b_base64(text, strict_mode=True)``: the same strings accepted (same bytes out), the same
strings refused (as ``CorruptPayload``), on padding, alphabet, whitespace and non-ASCII edge cases.
"""

from __future__ import annotations

import binascii

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamproc.codec import CorruptPayload
from streamproc.decompress import CORRUPT, decode_base64, encode_base64

LIMIT = 1 << 20
# Every character class strict mode treats specially: the alphabet, padding, whitespace, the
# URL-safe alphabet, NUL, other ASCII punctuation and non-ASCII.
ALPHABET = "ABCDQRSYZabcwxyz0189+/=" + " \n\r\t" + "-_*.\x00" + "\u00e9\u20ac"


def stdlib(text: str | bytes) -> bytes | None:
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        return None


def ours(text: str | bytes) -> bytes | None:
    try:
        return decode_base64(text, LIMIT)
    except CorruptPayload as exc:
        assert exc.reason == CORRUPT
        return None


def mutated(data: bytes, where: int, what: str, action: str) -> str:
    """A valid encoding with one character inserted, replaced, or the text cut at one position."""
    text = binascii.b2a_base64(data, newline=False).decode()
    where = where % (len(text) + 1)
    if action == "insert":
        return text[:where] + what + text[where:]
    if action == "replace":
        return text[:where] + what + text[where + 1:]
    return text[:where]


EDGE_CASES = [
    "", "QQ==", "QQ=", "QQ", "Q", "Q===", "====", "QQ==QQ==", "=QQ=", "Q=Q=", "QQ=a", "QQ==\n", "\nQQ==",
    "QU JD", "QUJD\r\n", "QUJ=", "QR==", "QUI=", "QUJDRA===", "-_-_", "QUJD\x00", "\u00e9QUI", "QUJ\u20ac",
    "QUJDRA", "QUJDR", "QUJ*", "0000=", "QUJD=QQ==", "QUJD====",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_pybase64_decoding_accepts_and_refuses_the_edge_cases_strict_binascii_does(text: str):
    assert ours(text) == stdlib(text)
    if text.isascii():
        assert ours(text.encode()) == stdlib(text.encode())


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=24))
@example("QQ==")
def test_pybase64_decoding_matches_strict_binascii_on_random_text(text: str):
    assert ours(text) == stdlib(text)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=64), st.integers(min_value=0), st.sampled_from(ALPHABET),
       st.sampled_from(["insert", "replace", "cut"]))
def test_pybase64_decoding_matches_strict_binascii_on_damaged_encodings(data, where, what, action):
    text = mutated(data, where, what, action)
    assert ours(text) == stdlib(text)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=4096))
def test_pybase64_encoding_is_byte_for_byte_stdlib_and_round_trips(data: bytes):
    text = encode_base64(data)
    assert isinstance(text, str)
    assert text == binascii.b2a_base64(data, newline=False).decode("ascii")
    assert decode_base64(text, LIMIT) == data
    assert encode_base64(memoryview(data)) == text == encode_base64(bytearray(data))

