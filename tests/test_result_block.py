"""``result_from_block`` (the edge's fan-out reading a result straight from its raw NATS header block)
against the two-step read it replaces, ``result_from_message(parse_header_block(block))``: the same
``ResultInfo`` or the same error, on the blocks an honest processor sends and on random hostile ones."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamproc.core.wire import (ERROR, FINAL, JOIN, MAX_HEADER_LINES, SEQ, TRACEPARENT, UNREADABLE_HEADERS,
                                  ContractError, Result, Subjects, Verdict, result_from_message, result_headers)
from streamproc.nats.fast_client import encode_header_block, parse_header_block, result_from_block

SUBJECTS = Subjects("rb")
SUBJECT = SUBJECTS.result("req-1")

NAMES = [SEQ, FINAL, JOIN, ERROR, TRACEPARENT, UNREADABLE_HEADERS, "Nats-Msg-Id", " " + SEQ, SEQ + " ", "\t" + JOIN,
         SEQ.lower(), FINAL.upper(), "Streamproc Seq", "", " ", "Str\x00eamproc-Seq", "Streamproc-Seq\x0b"]
RAW_NAMES = [n.encode() for n in NAMES] + [b"Streamproc-\xffSeq", b"\xc3\xa9", b"Streamproc-Seq\xc2\xa0"]
VALUES = [b"0", b"7", b" 12 ", b"\t3\t", b"", b" ", b"-1", b"+1", b"1_0", b"0x1", b"1.0", b"\xc2\xb2", b"\xd9\xa0",
          b"9" * 18, b"9" * 19, b"007", b"true", b"false", b" true ", b"TRUE", b"yes", b"1", b"\xff",
          b"joined", b" passthrough", b"omitted ", b"stitched", b"Joined", b"x" * 300, b"a:b", b"\xe2\x80\x8b",
          b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b"boom: it broke"] + \
         [v.value.encode() for v in Verdict]


def outcome(fn, block: bytes):
    try:
        return fn(block)
    except (ContractError, ValueError) as exc:
        return type(exc), str(exc), getattr(exc, "request_id", None)


def old(block: bytes):
    return result_from_message(SUBJECTS, SUBJECT, parse_header_block(block), b"body")


def new(block: bytes):
    return result_from_block(SUBJECTS, SUBJECT, block, b"body")


def assert_same(block: bytes) -> None:
    assert outcome(new, block) == outcome(old, block), block


@pytest.mark.parametrize("result", [
    Result("req-1", 0, b"body", False, verdict=Verdict.PASSTHROUGH),
    Result("req-1", 41, b"body", True, verdict=Verdict.JOINED),
    Result("req-1", 3, b"body", False, verdict=None),
    Result("req-1", 5, b"body", True, verdict=Verdict.OMITTED, error="upstream_failed: it broke"),
    Result("req-1", 9, b"body", False, verdict=Verdict.STITCHED, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
])
def test_a_processors_result_block_reads_as_the_two_step_parse_reads_it(result):
    block = encode_header_block(result_headers(result))
    assert_same(block)
    info = new(block)
    assert (info.seq, info.final, info.verdict, info.error) == (result.seq, result.final, result.verdict, result.error)


def test_a_processors_result_block_is_read_without_the_two_step_parse(monkeypatch):
    """The point of the raw read: an honest block never takes the dict (the fallback is for the rest)."""
    import streamproc.nats.fast_client as fast_client

    def refuse(block: bytes):
        raise AssertionError("parse_header_block called")

    monkeypatch.setattr(fast_client, "parse_header_block", refuse)
    for verdict in [*Verdict, None]:
        for final in (False, True):
            result = Result("req-1", 12, b"body", final, verdict=verdict, error="e" if final else None,
                            traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
            info = new(encode_header_block(result_headers(result)))
            assert (info.seq, info.final, info.verdict, info.error, info.traceparent) == (
                12, final, verdict, result.error, result.traceparent)


@pytest.mark.parametrize("block", [
    b"NATS/1.0\r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: x\r\n\r\n",  # no seq: missing required header
    b"NATS/1.0\r\n" + f"{UNREADABLE_HEADERS}: bad\r\n".encode() + b"\r\n",  # a worker's own mark, no seq
    b"NATS/1.0\r\n" + f"{SEQ}: 1\r\n{UNREADABLE_HEADERS}: bad\r\n".encode() + b"\r\n",  # a plain seq wins
    b"NATS/1.0\r\n" + f"{SEQ}: 1\r\n".encode() * (MAX_HEADER_LINES + 1) + b"\r\n",  # over the line bound
    b"NATS/1.0\r\n" + f"{SEQ}: 1\r\n".encode() * (MAX_HEADER_LINES - 2) + b"\r\n",  # at it
    b"NATS/1.0\r\n" + f"{SEQ}: 1\r\n{SEQ}: x\r\n".encode() + b"\r\n",  # the last of a repeated name
    b"NATS/1.0\r\n" + f"{SEQ}: x\r\n{SEQ}: 2\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{JOIN}: nope\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{JOIN}: \r\n".encode() + b"\r\n",  # empty: no verdict
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{FINAL}: maybe\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{FINAL}: TRUE\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{FINAL}:  true \r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{FINAL}: \r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{JOIN}: Joined\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: \xb2\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}: {'9' * 19}\r\n".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ} 2\r\n".encode() + b"\r\n",  # no colon: the line is dropped
    b"NATS/1.0\r\n" + f"{SEQ}: 2\n{FINAL}: true\r\n".encode() + b"\r\n",  # a bare LF stays inside the value
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{ERROR}: \xff\xfe\r\n".encode("latin-1") + b"\r\n",  # replaced, as nats-py
])
def test_hostile_result_blocks_read_as_the_two_step_parse_reads_them(block):
    assert_same(block)


line = st.one_of(
    st.tuples(st.sampled_from(RAW_NAMES), st.sampled_from([b":", b": ", b":  ", b" :", b""]),
              st.sampled_from(VALUES)).map(lambda t: b"".join(t)),
    st.binary(max_size=24),
    st.just(b""),
)


@settings(max_examples=3000, deadline=None)
@given(st.lists(line, max_size=12), st.sampled_from([b"\r\n", b"\n", b"\r\n\r\n"]), st.booleans())
def test_random_header_blocks_read_as_the_two_step_parse_reads_them(lines, tail, padded):
    block = b"NATS/1.0\r\n" + b"\r\n".join(lines) + tail
    if padded:
        block = block.replace(b"\r\n", b"\r\n" + b"\r\n" * 11, 1)
    assert_same(block)


@settings(max_examples=300, deadline=None)
@given(st.integers(MAX_HEADER_LINES - 4, MAX_HEADER_LINES + 4), st.sampled_from(VALUES))
def test_blocks_about_the_line_bound_read_as_the_two_step_parse_reads_them(count, value):
    block = b"NATS/1.0\r\n" + (SEQ.encode() + b": " + value + b"\r\n") * count + b"\r\n"
    assert_same(block)


# What the random blocks above never vary: the status line (both reads skip its 10 bytes unseen, and
# the callers check only that a block is longer and that byte 8 is no space: lines may start inside
# those 10 bytes and run on past them), line ends other than CRLF between lines, whitespace that
# bytes.strip and str.strip disagree on (\x1c-\x1f, U+0085, U+00A0, U+3000) or both strip (\x0b,
# \x0c), and each result name in another case.
WHITESPACE = [b"", b" ", b"\t", b"\x0b", b"\x0c", b"\x1c", b"\x1f", b"\x85", b"\xc2\x85", b"\xc2\xa0", b"\xe3\x80\x80",
              b"\x00"]
CASED_NAMES = [n.encode() for n in (SEQ, FINAL, JOIN, ERROR, TRACEPARENT, UNREADABLE_HEADERS)]
CASED_NAMES += [n.lower() for n in CASED_NAMES] + [n.upper() for n in CASED_NAMES]
status_bytes = (st.just(b"NATS/1.0\r\n") | st.binary(max_size=12)
                | st.sampled_from([b"NATS/1.0\n", *(b"NATS/1.0\r\n"[:k] for k in range(10))]))
spaced_line = st.tuples(st.sampled_from(WHITESPACE), st.sampled_from(CASED_NAMES), st.sampled_from(WHITESPACE),
                        st.sampled_from([b":", b"::", b""]), st.sampled_from(WHITESPACE), st.sampled_from(VALUES),
                        st.sampled_from(WHITESPACE)).map(lambda t: b"".join(t))


@settings(max_examples=3000, deadline=None)
@given(status_bytes, st.lists(st.tuples(st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r"]), spaced_line),
                              max_size=10),
       st.sampled_from([b"", b"\r\n", b"\r\n\r\n"]))
def test_blocks_of_any_status_bytes_line_ends_and_whitespace_read_as_the_two_step_parse_reads_them(status, lines, tail):
    block = status + b"".join(end + line for end, line in lines) + tail
    assume(len(block) > 10 and block[8] != 32)  # what reaches either read (FastClient._msg_now)
    assert_same(block)
