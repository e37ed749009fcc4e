"""Work the durable processor does once per chunk, pinned by what it calls (docs/benchmarks.md,
"Durable calls per chunk, third pass"): the same results, fewer calls. The figures per chunk are
benchmarks/call_counts.py's; these tests pin each cut where it was made."""

from __future__ import annotations

from streamproc.core.wire import MAX_HEADER_LINES, UNREADABLE_HEADERS, Role, chunk_headers
from streamproc.nats import fast_client
from streamproc.nats.fast_client import encode_header_block, parse_header_block


def test_a_header_block_within_the_line_bound_is_parsed_without_an_over_header_lines_call(monkeypatch):
    """The line count is taken inline; over_header_lines (the unreadable mark) runs only for a block over the bound."""
    calls: list[bytes] = []
    over = fast_client.over_header_lines

    def counted(block: bytes):
        calls.append(block)
        return over(block)

    monkeypatch.setattr(fast_client, "over_header_lines", counted)
    headers = chunk_headers("r1", Role.DECODE, 3, final=True, format="sglang")
    honest = encode_header_block(headers)
    assert parse_header_block(honest) == headers
    assert calls == []

    long = b"NATS/1.0\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADER_LINES)) + b"\r\n"
    lines = long.count(b"\n")
    assert parse_header_block(long) == {
        UNREADABLE_HEADERS: f"{lines} lines, more than the {MAX_HEADER_LINES} a header block may hold"}
    assert calls == [long]
