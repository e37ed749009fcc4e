"""The hot-path ``ChunkParser`` is :func:`chunk_from_message`, only faster.

The processor parses every incoming chunk with :class:`ChunkParser`; the wire contract is written
down once, in :func:`chunk_from_message`. These tests hold the two together on hostile messages:
for any subject, headers and body they return equal chunks or raise ``ContractError`` for the
same request id, and no input makes either raise anything else.
"""

from __future__ import annotations

import nats.aio.client
import pytest
from hypothesis import HealthCheck, event, find, given, settings
from hypothesis import strategies as st

from streamproc.core import wire
from streamproc.core.errors import ContractError
from streamproc.core.wire import (
    ATTEMPT,
    ERROR,
    FINAL,
    FORMAT,
    JOIN,
    MSG_ID,
    SEQ,
    TRACEPARENT,
    Chunk,
    ChunkParser,
    ResultInfo,
    Role,
    Subjects,
    Verdict,
    chunk_from_message,
    result_from_message,
)

PREFIXES = ("streamproc", "sp.v1", "x")

# Characters that matter to the contract: token separators and wildcards, whitespace, and digits
# that str.isdigit() accepts but int() or ASCII do not (superscripts, other scripts, fullwidth).
ODD = ".*> \t\r\n\x00²³¹٠١٢۳߀०০๑০１９⁰₀①ⅷ𝟗一é\u200b\ufeff\ud7ff\U0001f600"
odd_text = st.text(alphabet=st.sampled_from(ODD) | st.characters(codec="utf-8"), max_size=8)

tokens = st.one_of(
    st.sampled_from(["", "r1", "req-42", "a" * 256, "a" * 257, "é", "a b", "*", ">", "agg", "decode"]),
    odd_text,
)
roles = st.one_of(
    st.sampled_from([r.value for r in Role]),
    st.sampled_from(["", "AGG", "Decode", "prefill ", " agg", "aggregate", "results", ">", "*"]),
    odd_text,
)


request_ids = st.one_of(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="."), min_size=1, max_size=6),
)


@st.composite
def subjects_for(draw: st.DrawFn, prefix: str) -> str:
    """``<prefix>.chunks.<request_id>.<role>``, valid or spoilt in one or two parts, or any text at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=40))
    spoil = draw(st.sampled_from([(), (), ("head",), ("count",), ("token",), ("role",), ("suffix",)])
                 | st.sets(st.sampled_from(["head", "count", "token", "role", "suffix"]), max_size=2))
    head = f"{prefix}.chunks."
    if "head" in spoil:
        head = draw(st.sampled_from([
            f"{prefix}.chunks..", f"{prefix}.chunk.", f"{prefix}.results.", f"{prefix}chunks.", "", "chunks.",
            f"{prefix.upper()}.chunks.", f"x{prefix}.chunks.", f".{prefix}.chunks.", f"{prefix}.chunks",
        ]))
    count = draw(st.sampled_from([0, 2, 2, 3])) if "count" in spoil else 1
    request_tokens = [draw(tokens if "token" in spoil else request_ids) for _ in range(count)]
    role = draw(roles if "role" in spoil else st.sampled_from([r.value for r in Role]))
    suffix = draw(st.sampled_from([".", ".agg", " ", "\n", ""])) if "suffix" in spoil else ""
    return head + ".".join([*request_tokens, role]) + suffix


ascii_digits = st.text(alphabet="0123456789", min_size=1, max_size=22)
# str.isdigit() is true for all of these; int() parses only the decimal ones (not ², ⁰, ①).
digitish = st.text(alphabet="0123456789²³¹⁰₀٠١٢۳१০๑１９𝟗①", min_size=1, max_size=4)
index_values = st.one_of(
    ascii_digits,
    digitish,
    st.sampled_from([
        "0", "00", "7", "9" * 18, "9" * 19, "1" * 18, "", " ", "-1", "+1", " 1", "1 ", "1.0", "1_0",
        "0x1", "1e3", "²", "٠", "١٢", "１", "𝟗", "①", "ⅷ", "一", "0²", "٠0",
    ]),
    odd_text,
)
flag_values = st.one_of(
    st.sampled_from(["true", "false", "True", "FALSE", "1", "0", "", " true", "true ", "yes", "t"]),
    odd_text,
)
other_values = st.one_of(
    st.sampled_from(["", "sglang", "vllm", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]),
    st.text(max_size=20),
)


@st.composite
def header_dicts(draw: st.DrawFn) -> dict[str, str] | None:
    """None, or the contract's headers each present or absent with good and bad values, plus noise."""
    if draw(st.integers(0, 9)) == 0:
        return None
    headers: dict[str, str] = {}
    if draw(st.booleans()):  # a worker's headers: the contract's three, each valid (but Seq may be too long)
        headers[SEQ] = draw(ascii_digits)
        contract = ((FINAL, st.sampled_from(["true", "false"])), (ATTEMPT, st.just("0") | ascii_digits))
    else:
        contract = ((SEQ, index_values), (FINAL, flag_values), (ATTEMPT, index_values))
    for name, values in (*contract, (FORMAT, other_values), (TRACEPARENT, other_values), (MSG_ID, other_values)):
        if draw(st.integers(0, 3)):  # present three times out of four
            headers.setdefault(name, draw(values))
    noise = draw(st.dictionaries(
        st.one_of(st.sampled_from(["streamproc-seq", "STREAMPROC-FINAL", "Streamproc-Seq ", "Traceparent",
                                   "X-Other", ""]), st.text(max_size=12)),
        other_values, max_size=3))
    for key, value in noise.items():
        headers.setdefault(key, value)
    return headers


@st.composite
def messages(draw: st.DrawFn) -> tuple[Subjects, str, dict[str, str] | None, bytes]:
    prefix = draw(st.sampled_from(PREFIXES))
    subject = draw(subjects_for(prefix))
    return Subjects(prefix), subject, draw(header_dicts()), draw(st.binary(max_size=32))


def outcome(parse, *args: object) -> tuple[str, object]:
    """A Chunk, or the request id a ContractError names. Any other exception escapes: a defect."""
    try:
        return "chunk", parse(*args)
    except ContractError as exc:
        return "contract_error", exc.request_id


TOKEN = object()  # the shell's ack handle: passed through untouched by both parsers


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_chunk_parser_agrees_with_chunk_from_message(message: tuple) -> None:
    subjects, subject, headers, body = message
    fast = outcome(ChunkParser(subjects), subject, headers, body, TOKEN)
    reference = outcome(chunk_from_message, subjects, subject, headers, body, TOKEN)
    event(fast[0] if fast[0] == "chunk" else f"{fast[0]}, request id {'known' if fast[1] else 'unknown'}")
    assert fast == reference
    if fast[0] == "chunk":
        assert fast[1].token is TOKEN and fast[1].body is body


# Exactly what nats-py hands a subscription callback: it splits the raw header block on CRLF and ':'
# and decodes each value as UTF-8 with errors="replace" (nats.aio.client.Client._parse_header_lines).
header_lines = st.one_of(
    st.tuples(st.just(SEQ.encode()), st.sampled_from([b":", b": ", b":\t"]), index_values.map(str.encode)),
    st.tuples(st.just(SEQ.encode()), st.sampled_from([b": "]), ascii_digits.map(str.encode)),
    st.tuples(st.sampled_from([FINAL, ATTEMPT, FORMAT, TRACEPARENT]).map(str.encode),
              st.sampled_from([b": ", b":"]),
              st.one_of(flag_values.map(str.encode), index_values.map(str.encode), st.binary(max_size=24))),
    st.tuples(st.binary(max_size=12), st.sampled_from([b":", b": ", b""]), st.binary(max_size=24)),
)
@st.composite
def raw_header_blocks(draw: st.DrawFn) -> dict[str, str]:
    lines = draw(st.lists(header_lines, max_size=6))
    if draw(st.booleans()):  # a last Streamproc-Seq line wins over earlier ones
        lines.append((SEQ.encode(), b": ", draw(index_values).encode()))
    block = b"".join(name + sep + value + b"\r\n" for name, sep, value in lines)
    block += draw(st.binary(max_size=16))  # a torn last line
    return nats.aio.client.Client._parse_header_lines(block)


@st.composite
def fuzzed_messages(draw: st.DrawFn) -> tuple[str, str, dict[str, str] | None, bytes]:
    prefix = draw(st.sampled_from(PREFIXES))
    near = subjects_for(prefix)
    subject = draw(st.one_of(near, near, near, st.text(max_size=60)))
    headers = draw(st.one_of(
        st.none(), raw_header_blocks(), raw_header_blocks(),
        st.dictionaries(st.one_of(st.sampled_from([SEQ, FINAL, ATTEMPT]), st.text(max_size=20)),
                        st.text(max_size=30)),
    ))
    return prefix, subject, headers, draw(st.binary(max_size=16))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fuzzed_messages())
def test_any_header_bytes_and_subject_give_a_chunk_or_a_contract_error(message: tuple) -> None:
    prefix, subject, headers, body = message
    try:
        chunk = ChunkParser(Subjects(prefix))(subject, headers, body)
    except ContractError as exc:
        event("contract_error")
        assert exc.request_id is None or isinstance(exc.request_id, str)
        return
    event("chunk")
    assert isinstance(chunk, Chunk)
    assert isinstance(chunk.seq, int) and 0 <= chunk.seq < 10**18
    assert isinstance(chunk.attempt, int) and 0 <= chunk.attempt < 10**18


def test_generated_messages_reach_every_branch() -> None:
    """The property cannot pass vacuously: its inputs include accepted chunks and both kinds of rejection."""
    def parsed(message: tuple) -> tuple[str, object]:
        subjects, subject, headers, body = message
        return outcome(chunk_from_message, subjects, subject, headers, body)

    quiet = settings(max_examples=5000, database=None, suppress_health_check=list(HealthCheck))
    find(messages(), lambda m: parsed(m)[0] == "chunk" and m[2].get(SEQ) != "0", settings=quiet)
    find(messages(), lambda m: parsed(m) == ("contract_error", None), settings=quiet)
    find(messages(), lambda m: parsed(m)[0] == "contract_error" and parsed(m)[1] is not None, settings=quiet)


def test_well_formed_chunk_is_parsed_without_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path answers a well-formed message alone: the property compares two parsers, not one."""
    def unreachable(*args: object, **kwargs: object) -> Chunk:
        raise AssertionError("fell back to chunk_from_message")

    parse = ChunkParser(Subjects("sp"))
    monkeypatch.setattr(wire, "chunk_from_message", unreachable)
    chunk = parse("sp.chunks.r1.decode", {SEQ: "3", FINAL: "true", ATTEMPT: "0", FORMAT: "sglang"}, b"{}")
    assert chunk == Chunk("r1", Role.DECODE, 3, b"{}", True, 0, "sglang", None, None)


@pytest.mark.parametrize("seq", ["²", "1²", "³", "¹⁰", "①"])
def test_digit_that_is_not_a_decimal_seq_is_a_contract_error(seq: str) -> None:
    """str.isdigit() accepts superscripts and circled digits that int() cannot parse.

    Both parsers used to let int() raise a bare ValueError, which the NATS inputs do not catch
    (they handle ContractError), so one such header crashed the message callback.
    """
    subjects = Subjects("sp")
    headers = {SEQ: seq}
    with pytest.raises(ContractError) as reference:
        chunk_from_message(subjects, "sp.chunks.r1.agg", headers, b"")
    with pytest.raises(ContractError) as fast:
        ChunkParser(subjects)("sp.chunks.r1.agg", headers, b"")
    assert reference.value.request_id == fast.value.request_id == "r1"
    with pytest.raises(ContractError):
        ChunkParser(subjects)("sp.chunks.r1.agg", {SEQ: "0", ATTEMPT: seq}, b"")


# ------------------------------------------------------------------ results (the edge's parse, once per SSE event)

def reference_result(subjects: Subjects, subject: str, headers: dict[str, str] | None, body: bytes) -> ResultInfo:
    """``result_from_message`` as it was written before its common case was read inline: one helper
    call per field (docs/benchmarks.md, "Calls per SSE event")."""
    request_id = subjects.request_id_of_result(subject)
    h = headers or {}
    verdict = h.get(JOIN)
    return ResultInfo(
        request_id=request_id,
        seq=wire._parse_index(h.get(SEQ), SEQ, request_id, required=True),
        final=wire._parse_flag(h.get(FINAL), FINAL, request_id),
        verdict=(wire._VERDICTS.get(verdict) or wire._parse_verdict(verdict, request_id)) if verdict else None,
        # Header values as a reader holds them (ResultInfo.held_bytes charges their length): an error
        # text's non-ASCII characters each "?", a traceparent that is not ASCII absent (no W3C one).
        error=None if h.get(ERROR) is None else "".join(c if ord(c) < 128 else "?" for c in h[ERROR]),
        body=body,
        traceparent=h.get(TRACEPARENT) if h.get(TRACEPARENT, "").isascii() else None,
    )


def result_outcome(parse, *args: object) -> tuple[str, object]:
    """The ResultInfo, or the exception's type, text and request id."""
    try:
        return "result", parse(*args)
    except (ContractError, ValueError) as exc:
        return type(exc).__name__, (str(exc), getattr(exc, "request_id", None))


verdict_values = st.one_of(st.sampled_from([v.value for v in Verdict] + ["", "Joined", "joined "]), odd_text)


@st.composite
def result_messages(draw: st.DrawFn) -> tuple[Subjects, str, dict[str, str] | None, bytes]:
    prefix = draw(st.sampled_from(PREFIXES))
    subject = f"{prefix}.results." + draw(request_ids | tokens)
    if draw(st.integers(0, 9)) == 0:
        return Subjects(prefix), subject, None, b""
    headers: dict[str, str] = {}
    if draw(st.booleans()):  # a processor's headers: valid, but Seq may be too long
        headers[SEQ] = draw(ascii_digits)
        contract = ((FINAL, st.sampled_from(["true", "false"])), (JOIN, st.sampled_from([v.value for v in Verdict])))
    else:
        contract = ((SEQ, index_values), (FINAL, flag_values), (JOIN, verdict_values))
    for name, values in (*contract, (ERROR, other_values), (TRACEPARENT, other_values), (MSG_ID, other_values)):
        if draw(st.integers(0, 3)):
            headers.setdefault(name, draw(values))
    return Subjects(prefix), subject, headers, draw(st.binary(max_size=16))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(result_messages())
def test_result_from_message_agrees_with_its_helpers(message: tuple) -> None:
    """The inline seq and flag reads give the same result, or the same error, as the helpers."""
    got = result_outcome(result_from_message, *message)
    event(got[0])
    assert got == result_outcome(reference_result, *message)


@pytest.mark.parametrize(("headers", "expected"), [
    ({SEQ: "9" * 18}, "result"), ({SEQ: "9" * 19}, "ContractError"), ({SEQ: "²"}, "ContractError"),
    ({SEQ: "0", FINAL: "True"}, "ContractError"), ({}, "ContractError"), ({SEQ: "1", JOIN: "x"}, "ContractError"),
])
def test_result_from_message_edges(headers: dict[str, str], expected: str) -> None:
    """The bounds the inline reads must keep (the property above finds them too, but not every run)."""
    assert result_outcome(result_from_message, Subjects("sp"), "sp.results.r1", headers, b"")[0] == expected
    assert result_outcome(reference_result, Subjects("sp"), "sp.results.r1", headers, b"")[0] == expected


def test_a_result_whose_header_block_was_unreadable_says_so() -> None:
    """RobustClient marks a header block nats-py cannot read; a result carrying only that mark was
    refused as "missing Streamproc-Seq" (the edge's log, the client helpers' MalformedResult), where
    a chunk says what happened. Now results say it too (the mark is read only off the fast path)."""
    headers = {wire.UNREADABLE_HEADERS: "UnicodeDecodeError: bad status"}
    with pytest.raises(ContractError, match="unreadable header block"):
        wire.result_from_message(wire.Subjects(), "streamproc.results.r1", headers, b"{}")


@pytest.mark.parametrize("traceparent", ["\U0001F600" * wire.MAX_TRACEPARENT_LEN, "00-\u00e9" + "a" * 50])
def test_a_traceparent_that_is_not_ascii_is_not_kept(traceparent):
    """Every result, error results too, carries its request's traceparent: one of 512 non-ASCII
    characters took up to 2 KiB of each header block, past what ``max_error_result_size`` counts
    (a W3C traceparent is ASCII). Both parses drop it, as one past ``MAX_TRACEPARENT_LEN``."""
    subjects = Subjects("sp")
    headers = {SEQ: "0", TRACEPARENT: traceparent}
    assert wire.chunk_from_message(subjects, "sp.chunks.r1.agg", headers, b"").traceparent is None
    assert ChunkParser(subjects)("sp.chunks.r1.agg", headers, b"").traceparent is None
    ascii_one = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    kept = ChunkParser(subjects)("sp.chunks.r1.agg", {SEQ: "0", TRACEPARENT: ascii_one}, b"")
    assert kept.traceparent == ascii_one
