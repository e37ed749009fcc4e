"""Hostile input to the pure wire layer: the chunk parser decides every message, the id rule is one rule.

(tests/test_wire.py compares the parser with a reference; this file attacks it.)
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamproc.core.errors import ContractError
from streamproc.core.events import Chunk
from streamproc.core.wire import (
    ATTEMPT, FINAL, FORMAT, SEQ, UNREADABLE_HEADERS, ChunkParser, Subjects, check_request_id, chunk_headers,
    valid_request_id,
)

PARSE = ChunkParser(Subjects("streamproc"))
HEAD = "streamproc.chunks."

# Header values as nats-py hands them over: any text (surrogate-escaped bytes included).
header_text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["0", "1", "²", "٠", "１", "-1", "+1", " 1", "1 ", "99999999999999999999", "true", "false", ""]),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "surrogateescape")),
)
headers = st.one_of(st.none(), st.dictionaries(
    st.one_of(st.sampled_from([SEQ, FINAL, ATTEMPT, FORMAT, UNREADABLE_HEADERS]), st.text(max_size=8)),
    header_text, max_size=6))
subjects = st.one_of(
    st.text(max_size=40),
    st.builds(lambda rid, role: f"{HEAD}{rid}.{role}",
              st.one_of(st.text(max_size=20), st.binary(max_size=20).map(
                  lambda b: b.decode("utf-8", "surrogateescape"))),
              st.sampled_from(["agg", "prefill", "decode", "x", ""])),
)


@settings(max_examples=3000, deadline=None)
@given(subjects, headers, st.binary(max_size=8))
def test_parser_returns_a_chunk_or_raises_contract_error_for_any_subject_and_headers(subject, hdrs, body):
    try:
        chunk = PARSE(subject, hdrs, body, "token")
    except ContractError as exc:
        if exc.request_id is not None:
            assert valid_request_id(exc.request_id)  # an answer is only ever addressed to a valid id
        return
    assert isinstance(chunk, Chunk)
    assert valid_request_id(chunk.request_id)
    assert type(chunk.seq) is int and chunk.seq >= 0
    raw = (hdrs or {})[SEQ]
    assert raw.isascii() and raw.isdigit() and int(raw) == chunk.seq


@pytest.mark.parametrize("seq", ["²", "٠", "１２", "1²", "٣"])
def test_non_ascii_digits_are_a_contract_error_naming_the_request(seq):
    with pytest.raises(ContractError) as info:
        PARSE(f"{HEAD}r1.agg", {SEQ: seq}, b"x")
    assert info.value.request_id == "r1"
    assert "Streamproc-Seq" in info.value.reason


@pytest.mark.parametrize("rid", ["a\x0bb", "a\x0cb", "a b", "a\tb", "a\x00b", "a\x7fb", "é", "a*", "a>", "",
                                 "x" * 257])
def test_invalid_request_ids_are_rejected_everywhere_and_never_answered(rid):
    assert not valid_request_id(rid)
    with pytest.raises(ValueError, match="printable ASCII"):
        check_request_id(rid)
    with pytest.raises(ContractError) as info:
        PARSE(f"{HEAD}{rid}.agg", {SEQ: "0"}, b"x")
    assert info.value.request_id is None  # no result subject can be built from it


@pytest.mark.parametrize("rid", ["r-1", "A_b~!#$%&'()+,-/:;<=?@[]^`{|}", "x" * 256])
def test_valid_request_ids_pass_the_rule_and_the_parser(rid):
    assert check_request_id(rid) == rid
    chunk = PARSE(f"{HEAD}{rid}.agg", chunk_headers(rid, "agg", 3), b"x")
    assert (chunk.request_id, chunk.seq) == (rid, 3)


def test_unreadable_header_block_is_a_contract_error_for_its_request():
    with pytest.raises(ContractError) as info:
        PARSE(f"{HEAD}r2.decode", {UNREADABLE_HEADERS: "UnicodeDecodeError"}, b"x")
    assert info.value.request_id == "r2"
    assert "unreadable header block" in info.value.reason


@pytest.mark.parametrize("name", [SEQ, FINAL, ATTEMPT])
def test_a_header_value_of_any_length_is_shown_cut_to_its_start_and_length_in_the_contract_error(name):
    headers = {SEQ: "0", FINAL: "true", ATTEMPT: "0", name: "x" * 1_000_000}
    with pytest.raises(ContractError) as info:
        PARSE(f"{HEAD}r3.agg", headers, b"x")
    assert info.value.request_id == "r3"
    assert name in info.value.reason and "(1000000 characters)" in info.value.reason
    assert len(info.value.reason) < 200


@pytest.mark.parametrize("length, kept", [(55, True), (512, True), (513, False), (65_000, False)])
def test_a_traceparent_past_512_characters_is_taken_as_absent_on_every_path(length, kept):
    """The processor keeps a streamed request's traceparent for its life and copies it into each result:
    a worker's 64 KB one held memory outside every budget and made results JetStream refuses
    (tests/test_durable_worker_attack.py)."""
    from streamproc.catalog import Catalog
    from streamproc.core.correlator import Correlator
    from streamproc.core.passthrough import PassthroughPath
    from streamproc.core.wire import ChunkParser, Subjects, chunk_from_message

    subjects = Subjects("p")
    value = "0" * length
    for final in ("true", "false"):
        headers = {"Streamproc-Seq": "0", "Streamproc-Final": final, "traceparent": value}
        for parse in (ChunkParser(subjects), lambda s, h, b: chunk_from_message(subjects, s, h, b)):
            assert parse("p.chunks.r.agg", headers, b"{}").traceparent == (value if kept else None)
        fused = PassthroughPath(subjects, Correlator(Catalog(), "sglang"))("p.chunks.r.agg", headers, b"{}", 0.0)
        assert (fused is not None) == kept  # declined: the general path drops it
