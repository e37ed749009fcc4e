"""``chunk_from_block`` (the durable processor's inline chunk handler reading a chunk straight from its raw
NATS header block) against the two-step read it replaces, ``ChunkParser(parse_header_block(block))``: the
same ``Chunk`` or the same ``ContractError`` (kind, message, request id), on the blocks an honest worker
sends and on random hostile ones, as tests/test_result_block.py does for results."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamproc.core.wire import (
    ATTEMPT,
    FINAL,
    FORMAT,
    MAX_HEADER_LINES,
    MAX_TRACEPARENT_LEN,
    SEQ,
    TRACEPARENT,
    UNREADABLE_HEADERS,
    ChunkParser,
    ContractError,
    Role,
    Subjects,
    chunk_headers,
)
from streamproc.nats.fast_client import chunk_from_block, encode_header_block, parse_header_block

SUBJECTS = Subjects("cb")
PARSE = ChunkParser(SUBJECTS)
SUBJECT = SUBJECTS.chunk("req-1", "decode")
TOKEN = object()

NAMES = [
    SEQ,
    FINAL,
    ATTEMPT,
    FORMAT,
    TRACEPARENT,
    UNREADABLE_HEADERS,
    "Nats-Msg-Id",
    " " + SEQ,
    SEQ + " ",
    "\t" + ATTEMPT,
    SEQ.lower(),
    FINAL.upper(),
    "Streamproc Seq",
    "",
    " ",
    "Str\x00eamproc-Seq",
    "Streamproc-Seq\x0b",
    "Streamproc-Attempt\x0c",
]
RAW_NAMES = [n.encode() for n in NAMES] + [b"Streamproc-\xffSeq", b"\xc3\xa9", b"Streamproc-Seq\xc2\xa0"]
VALUES = [
    b"0",
    b"7",
    b" 12 ",
    b"\t3\t",
    b"",
    b" ",
    b"-1",
    b"+1",
    b"1_0",
    b"0x1",
    b"1.0",
    b"\xc2\xb2",
    b"\xd9\xa0",
    b"9" * 18,
    b"9" * 19,
    b"007",
    b"00",
    b"true",
    b"false",
    b" true ",
    b"TRUE",
    b"yes",
    b"1",
    b"\xff",
    b"sglang",
    b" vllm ",
    b"x" * 300,
    b"t" * MAX_TRACEPARENT_LEN,
    b"t" * (MAX_TRACEPARENT_LEN + 1),
    b"\xc3\xa9" * (MAX_TRACEPARENT_LEN // 2 + 1),
    b"a:b",
    b"\xe2\x80\x8b",
    b"\r",
    b"x\ry",
    b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
]
SUBJECT_LIST = [
    SUBJECT,
    SUBJECTS.chunk("req-1", "agg"),
    SUBJECTS.chunk("r", "prefill"),
    "cb.chunks.req-1.nope",
    "cb.chunks.req 1.agg",
    "cb.chunks..agg",
    "cb.chunks.agg",
    "cb.chunks.a.b.agg",
    "cb.chunks.r*.agg",
    "cb.chunks.r>.agg",
    "cb.chunks.\u00e9.agg",
    "cb.chunks.r\x7f.agg",
    "other.chunks.r.agg",
    "cb.chunks." + "r" * 256 + ".agg",
    "cb.chunks." + "r" * 257 + ".agg",
    "cb.chunks.r.agg.",
]


def outcome(fn, subject: str, block: bytes):
    try:
        return fn(subject, block)
    except (ContractError, ValueError) as exc:
        return type(exc), str(exc), getattr(exc, "request_id", None)


def old(subject: str, block: bytes):
    return PARSE(subject, parse_header_block(block), b"body", TOKEN)


def new(subject: str, block: bytes):
    return chunk_from_block(PARSE, subject, block, b"body", TOKEN)


def assert_same(block: bytes, subject: str = SUBJECT) -> None:
    assert outcome(new, subject, block) == outcome(old, subject, block), (subject, block)


HONEST = [
    dict(seq=0),
    dict(seq=41, final=True),
    dict(seq=3, format="sglang"),
    dict(seq=9, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    dict(seq=2, attempt=1),
    dict(seq=5, final=True, format="vllm", traceparent="00-" + "c" * 32 + "-" + "d" * 16 + "-00"),
]


@pytest.mark.parametrize("fields", HONEST)
@pytest.mark.parametrize("role", list(Role))
def test_a_workers_chunk_block_reads_as_the_two_step_parse_reads_it(fields, role):
    subject = SUBJECTS.chunk("req-1", role)
    block = encode_header_block(chunk_headers("req-1", role, **fields))
    assert_same(block, subject)
    chunk = new(subject, block)
    assert (
        chunk.request_id,
        chunk.role,
        chunk.seq,
        chunk.final,
        chunk.attempt,
        chunk.format,
        chunk.token,
    ) == (
        "req-1",
        role,
        fields["seq"],
        fields.get("final", False),
        fields.get("attempt", 0),
        fields.get("format"),
        TOKEN,
    )


def test_a_workers_first_attempt_chunk_is_read_without_the_two_step_parse(monkeypatch):
    """The point of the raw read: an honest first-attempt block never takes the dict nor ChunkParser."""
    import streamproc.nats.fast_client as fast_client

    def refuse(*args):
        raise AssertionError("two-step read called")

    monkeypatch.setattr(fast_client, "parse_header_block", refuse)
    parse = ChunkParser(SUBJECTS)
    monkeypatch.setattr(ChunkParser, "__call__", refuse)
    for fields in HONEST:
        if fields.get("attempt"):
            continue
        chunk = chunk_from_block(
            parse, SUBJECT, encode_header_block(chunk_headers("req-1", "decode", **fields)), b"body", TOKEN
        )
        assert (chunk.seq, chunk.final, chunk.format, chunk.traceparent) == (
            fields["seq"],
            fields.get("final", False),
            fields.get("format"),
            fields.get("traceparent"),
        )


@pytest.mark.parametrize("headers", [None, {SEQ: "4"}, {SEQ: "x"}, {}])
def test_headers_parsed_already_are_read_by_chunk_parser(headers):
    assert outcome(lambda s, h: chunk_from_block(PARSE, s, h, b"body", TOKEN), SUBJECT, headers) == outcome(
        lambda s, h: PARSE(s, h, b"body", TOKEN), SUBJECT, headers
    )


def _line(name: str, value: str | bytes) -> bytes:
    return name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()) + b"\r\n"


HOSTILE = [
    b"NATS/1.0\r\n\r\n",
    b"NATS/1.0\r\nNats-Msg-Id: x\r\n\r\n",  # no seq: missing required header
    b"NATS/1.0\r\n" + _line(UNREADABLE_HEADERS, "bad") + b"\r\n",  # a worker's own mark, no seq
    b"NATS/1.0\r\n" + _line(SEQ, "1") + _line(UNREADABLE_HEADERS, "bad") + b"\r\n",  # a plain seq wins
    b"NATS/1.0\r\n" + _line(UNREADABLE_HEADERS, "b" * 5000) + b"\r\n",  # a long mark: shown cut
    b"NATS/1.0\r\n" + _line(SEQ, "1") * (MAX_HEADER_LINES + 1) + b"\r\n",  # over the line bound
    b"NATS/1.0\r\n" + _line(SEQ, "1") * (MAX_HEADER_LINES - 2) + b"\r\n",  # at it
    b"NATS/1.0\r\n" + _line(SEQ, "1") + _line(SEQ, "x") + b"\r\n",  # the last of a repeated name
    b"NATS/1.0\r\n" + _line(SEQ, "x") + _line(SEQ, "2") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FINAL, "true") + _line(FINAL, "maybe") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FINAL, "maybe") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FINAL, "TRUE") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FINAL, " true ") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FINAL, "") + b"\r\n",  # empty: not 'true' or 'false'
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(ATTEMPT, "") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(ATTEMPT, "00") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(ATTEMPT, "3") + b"\r\n",  # a later attempt: the full parse
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(ATTEMPT, "\xd9\xa0") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FORMAT, "") + b"\r\n",  # empty: no format
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FORMAT, b"\xff\xfe") + b"\r\n",  # replaced, as nats-py
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(FORMAT, "f" * 70000) + b"\r\n",  # huge value
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(TRACEPARENT, "t" * MAX_TRACEPARENT_LEN) + b"\r\n",
    b"NATS/1.0\r\n"
    + _line(SEQ, "2")
    + _line(TRACEPARENT, "t" * (MAX_TRACEPARENT_LEN + 1))
    + b"\r\n",  # dropped
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(TRACEPARENT, " " + "t" * MAX_TRACEPARENT_LEN + " ") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(TRACEPARENT, "\u00e9" * 300) + b"\r\n",  # 600 bytes, 300 chars
    b"NATS/1.0\r\n" + _line(SEQ, "2") + _line(TRACEPARENT, b"\xff" * 300) + b"\r\n",  # 300 replacements
    b"NATS/1.0\r\n" + _line(SEQ, "\u00b2") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "9" * 19) + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "9" * 18) + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "1" * 70000) + b"\r\n",  # huge seq
    b"NATS/1.0\r\n" + f"{SEQ} 2\r\n".encode() + b"\r\n",  # no colon: the line is dropped
    b"NATS/1.0\r\n" + f"{SEQ}: 2\n{FINAL}: true\r\n".encode() + b"\r\n",  # a bare LF stays inside the value
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r{FINAL}: true\r\n".encode() + b"\r\n",  # CR without LF: inside the value
    b"NATS/1.0\r\n" + f"{SEQ}: 2\r\n{FINAL}: true\r".encode() + b"\r\n",
    b"NATS/1.0\r\n" + f"{SEQ}:2\r\n{FINAL}:true\r\n".encode() + b"\r\n",  # no space after the colon
    b"NATS/1.0\r\n" + f"{SEQ}:\t2\t\r\n{FINAL}:\x0btrue\x0c\r\n".encode() + b"\r\n",  # both strips agree
    b"NATS/1.0\r\n"
    + f"{SEQ}: 2\x1c\r\n".encode()
    + b"\r\n",  # str.strip would take \x1c, bytes.strip does not
    b"NATS/1.0\r\n" + _line(SEQ, "2\u00a0") + b"\r\n",
    b"NATS/1.0\r\n" + _line(SEQ, "\u30002") + b"\r\n",
    b"NATS/1.0\r\n" + _line(" " + SEQ + " ", "2") + b"\r\n",  # a name with spaces around: nats-py strips it
    b"NATS/1.0\r\n" + _line(SEQ + "\x00", "2") + b"\r\n",
    b"NATS/1.0\r\n" + b"Streamproc-\xffSeq: 2\r\n" + _line(SEQ, "3") + b"\r\n",  # a non-ASCII name: dropped
    b"NATS/1.0\r\n" + "\u00e9\u00e9: \u00e9\r\n".encode() + _line(SEQ, "3") + b"\r\n",
    b"NATS/1.0 \r\n" + _line(SEQ, "3") + b"\r\n",
    b"NATS/1.0\r\n" + b"\x00" * 64 + b"\r\n" + _line(SEQ, "3") + b"\r\n",  # arbitrary bytes
    b"NATS/1.0\r\n" + _line(SEQ, "3"),  # no closing empty line
    b"NATS/1.0\r\n" + b"\r\n" * 200 + _line(SEQ, "3") + b"\r\n",  # empty lines past the bound
    b"XXXXXXXXXX" + _line(SEQ, "3") + b"\r\n",  # the status line is not looked at
    b"NATS/1.0" + _line(SEQ, "3") + b"\r\n",  # a line starting inside the first 10 bytes
]


@pytest.mark.parametrize("block", HOSTILE)
@pytest.mark.parametrize("subject", SUBJECT_LIST)
def test_hostile_chunk_blocks_read_as_the_two_step_parse_reads_them(block, subject):
    assert_same(block, subject)


line = st.one_of(
    st.tuples(
        st.sampled_from(RAW_NAMES),
        st.sampled_from([b":", b": ", b":  ", b" :", b""]),
        st.sampled_from(VALUES),
    ).map(lambda t: b"".join(t)),
    st.binary(max_size=24),
    st.just(b""),
)


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(line, max_size=12),
    st.sampled_from([b"\r\n", b"\n", b"\r\n\r\n", b"\r"]),
    st.booleans(),
    st.sampled_from(SUBJECT_LIST),
)
def test_random_chunk_blocks_read_as_the_two_step_parse_reads_them(lines, tail, padded, subject):
    block = b"NATS/1.0\r\n" + b"\r\n".join(lines) + tail
    if padded:
        block = block.replace(b"\r\n", b"\r\n" + b"\r\n" * 11, 1)
    assert_same(block, subject)


@settings(max_examples=300, deadline=None)
@given(st.integers(MAX_HEADER_LINES - 4, MAX_HEADER_LINES + 4), st.sampled_from(VALUES))
def test_chunk_blocks_about_the_line_bound_read_as_the_two_step_parse_reads_them(count, value):
    block = b"NATS/1.0\r\n" + (SEQ.encode() + b": " + value + b"\r\n") * count + b"\r\n"
    assert_same(block)


# What the random blocks above never vary: the status line, line ends other than CRLF between lines,
# whitespace bytes.strip and str.strip disagree on or both strip, each chunk name in another case, and
# arbitrary subjects (any text, the request id rule's edges).
WHITESPACE = [
    b"",
    b" ",
    b"\t",
    b"\x0b",
    b"\x0c",
    b"\x1c",
    b"\x1f",
    b"\x85",
    b"\xc2\x85",
    b"\xc2\xa0",
    b"\xe3\x80\x80",
    b"\x00",
    b"\r",
]
CASED_NAMES = [n.encode() for n in (SEQ, FINAL, ATTEMPT, FORMAT, TRACEPARENT, UNREADABLE_HEADERS)]
CASED_NAMES += [n.lower() for n in CASED_NAMES] + [n.upper() for n in CASED_NAMES]
status_bytes = (
    st.just(b"NATS/1.0\r\n")
    | st.binary(max_size=12)
    | st.sampled_from([b"NATS/1.0\n", *(b"NATS/1.0\r\n"[:k] for k in range(10))])
)
spaced_line = st.tuples(
    st.sampled_from(WHITESPACE),
    st.sampled_from(CASED_NAMES),
    st.sampled_from(WHITESPACE),
    st.sampled_from([b":", b"::", b""]),
    st.sampled_from(WHITESPACE),
    st.sampled_from(VALUES),
    st.sampled_from(WHITESPACE),
).map(lambda t: b"".join(t))
subjects = (
    st.sampled_from(SUBJECT_LIST)
    | st.text(max_size=40).map(lambda t: "cb.chunks." + t)
    | st.text(max_size=20)
)


@settings(max_examples=3000, deadline=None)
@given(
    status_bytes,
    st.lists(
        st.tuples(st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r"]), spaced_line), max_size=10
    ),
    st.sampled_from([b"", b"\r\n", b"\r\n\r\n"]),
    subjects,
)
def test_chunk_blocks_of_any_status_bytes_line_ends_whitespace_and_subject_read_the_same(
    status, lines, tail, subject
):
    block = status + b"".join(end + line for end, line in lines) + tail
    assume(len(block) > 10 and block[8] != 32)  # what reaches either read (FastClient._msg_now)
    assert_same(block, subject)


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=11, max_size=300), subjects)
def test_arbitrary_header_bytes_read_as_the_two_step_parse_reads_them(block, subject):
    assume(block[8] != 32)
    assert_same(block, subject)


@pytest.mark.parametrize("value", ["00-\u00e9".encode() + b"a" * 50, "\U0001F600".encode() * 128, b"\xff\xfe" * 4,
                                   b" " + b"a" * 512 + b" ", b"a" * 511 + "\u00e9".encode()])
def test_a_traceparent_that_is_not_ascii_is_dropped_by_the_raw_read_as_by_chunk_parser(value):
    """57787ed drops a non-ASCII traceparent (``wire._traceparent``); its test covered ``ChunkParser`` and
    ``chunk_from_message`` only. The durable processor reads chunks from the raw block here: before,
    it kept ``value`` decoded with U+FFFD (up to 4 bytes a character in every result's header block)."""
    block = b"NATS/1.0\r\nStreamproc-Seq: 3\r\ntraceparent: " + value + b"\r\n\r\n"
    raw = chunk_from_block(PARSE, SUBJECT, block, b"body", TOKEN)
    assert raw.traceparent == PARSE(SUBJECT, parse_header_block(block), b"body", TOKEN).traceparent
    assert raw.traceparent is None or (raw.traceparent.isascii() and len(raw.traceparent) <= 512)
