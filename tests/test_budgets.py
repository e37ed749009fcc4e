"""The correlator's byte budgets, and why duplicates are no progress (pure; a toy codec that inflates)."""

from __future__ import annotations

import msgspec
import pytest
from toy_codec import InflatingCodec, InflatingSession, chunk, correlator, errors

from streamproc.catalog import Catalog
from streamproc.codec import ErrorKind, JoinSession
from streamproc.correlator import Correlator, CorrelatorConfig
from streamproc.wire import Chunk, Result, Role

MiB = 1 << 20


def test_a_withheld_seq_0_backlog_ends_its_request_at_the_per_request_byte_cap_and_frees_it():
    c = correlator(max_buffered_bytes=4 * MiB, max_total_bytes=64 * MiB)
    out = []
    for seq in range(1, 6):
        out += c.receive(chunk("attacker", "agg", seq, bytes(MiB)), 0.0)
    assert errors(out) == [("attacker", ErrorKind.INVALID_CHUNK.value)]
    assert c.charged_bytes == 0 and c.inflight == 0
    assert [d.seq for d in c.receive(chunk("ok", "agg", 0, b"x", final=True), 0.0)] == [0]


def test_the_request_that_would_pass_the_global_budget_is_overloaded_and_the_others_are_untouched():
    c = correlator(max_buffered_bytes=8 * MiB, max_total_bytes=10 * MiB)
    for rid in ("a", "b"):
        assert c.receive(chunk(rid, "agg", 1, bytes(4 * MiB)), 0.0) == []
    out = c.receive(chunk("c", "agg", 1, bytes(4 * MiB)), 0.0)
    assert errors(out) == [("c", ErrorKind.OVERLOADED.value)]
    assert c.charged_bytes == 8 * MiB
    for rid in ("a", "b"):  # their seq 0 arrives: both complete in full
        results = c.receive(chunk(rid, "agg", 0, b"first"), 0.0)
        assert [r.seq for r in results if isinstance(r, Result)] == [0, 1]
    assert c.charged_bytes == 0


def test_decoded_prefill_payloads_are_charged_and_the_request_that_inflates_past_the_budget_is_overloaded():
    c = correlator(max_total_bytes=100 * MiB)
    out = []
    for i in range(3):  # a 12-byte prefill leg that keeps 40 MiB decoded, three times
        rid = f"bomb{i}"
        out += c.receive(chunk(rid, "prefill", 0, b"inflate:%d" % (40 * MiB), final=True), 0.0)
    assert errors(out) == [("bomb2", ErrorKind.OVERLOADED.value)]
    assert c.charged_bytes == 80 * MiB + 2 * len(b"inflate:%d" % (40 * MiB))
    joined = c.receive(chunk("bomb0", "decode", 0, b"d", final=True), 0.0)
    assert [(r.seq, r.body) for r in joined if isinstance(r, Result)] == [(0, b"d|%d" % (40 * MiB))]
    c.receive(chunk("bomb1", "decode", 0, b"d", final=True), 0.0)
    assert c.charged_bytes == 0 and c.inflight == 0


def test_duplicates_and_replays_are_no_progress_for_the_request_timeout():
    c = correlator(request_timeout=10.0)
    c.receive(chunk("held", "agg", 1, b"later"), 0.0)  # seq 0 withheld
    for t in range(1, 12):  # the same chunk again every second
        c.receive(chunk("held", "agg", 1, b"later"), float(t))
    out = c.tick(11.0)
    assert errors(out) == [("held", ErrorKind.TIMEOUT.value)]


def test_an_accepted_chunk_is_progress():
    c = correlator(request_timeout=10.0)
    c.receive(chunk("slow", "agg", 2, b"c"), 0.0)
    c.receive(chunk("slow", "agg", 1, b"b"), 8.0)
    assert errors(c.tick(11.0)) == []
    assert errors(c.tick(18.5)) == [("slow", ErrorKind.TIMEOUT.value)]


def test_sessions_are_told_what_the_global_budget_still_allows_before_they_decode():
    seen: list[int | None] = []

    class Recording(InflatingSession):
        def absorb_prefill(self, bodies):
            seen.append(self.decode_budget)
            super().absorb_prefill(bodies)

        def join(self, body: bytes, final: bool):
            seen.append(self.decode_budget)
            return super().join(body, final)

    class RecordingCodec(InflatingCodec):
        def open_session(self) -> JoinSession:
            return Recording()

    c = Correlator(lambda name: RecordingCodec(), "inflating", CorrelatorConfig(max_total_bytes=100 * MiB))
    c.receive(chunk("other", "agg", 1, bytes(MiB)), 0.0)  # 1 MiB buffered elsewhere
    prefill = b"inflate:%d" % (10 * MiB)
    c.receive(chunk("r", "prefill", 0, prefill, final=True), 0.0)
    c.receive(chunk("r", "decode", 0, b"d"), 0.0)
    # absorb: everything but the other request's 1 MiB and this leg; join: its own rows count as its own
    assert seen == [100 * MiB - MiB - len(prefill), 100 * MiB - MiB - len(prefill) - 1]


def _ids_body(start: int, count: int, vllm: bool = False) -> bytes:
    """One streamed body carrying ``count`` output token ids (the shape each format's migration reads)."""
    ids = list(range(start, start + count))
    if vllm:
        return msgspec.json.encode({"request_id": "r", "choices": [{"index": 0, "token_ids": ids}]})
    return msgspec.json.encode({"text": "", "output_ids": ids, "meta_info": {"id": "r", "completion_tokens": 1}})


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd", "vllm"])
def test_a_never_ending_stream_is_ended_when_its_migration_progress_state_passes_the_per_request_cap(fmt):
    # Past max_retained_bytes the published bodies are folded into the codec's progress state (the
    # emitted token ids): each new seq is progress, so only a byte bound can end such a request.
    c = Correlator(Catalog(), fmt, CorrelatorConfig(max_retained_bytes=64 * 1024, max_buffered_bytes=2 * MiB,
                                                    max_total_bytes=64 * MiB))
    out: list = []
    seq = 0
    while not errors(out) and seq < 200:
        out += c.receive(Chunk("endless", Role.AGG, seq, _ids_body(seq * 20_000, 20_000, fmt == "vllm"), False,
                               format=fmt), 0.0)
        seq += 1
    assert errors(out) == [("endless", ErrorKind.OVERLOADED.value)]
    error = next(d for d in out if isinstance(d, Result) and d.error)
    assert b"progress state" in error.body
    # 2 MiB is 262,144 ids at 8 bytes: passed within the 14th body of 20,000 at the latest; every
    # body up to the one that passed it was published, then the error result
    assert seq <= 14
    assert [d.seq for d in out if isinstance(d, Result)] == list(range(seq + 1))
    assert c.charged_bytes == 0 and c.inflight == 0


def test_progress_states_count_in_the_global_budget_and_only_the_request_that_passes_it_is_overloaded():
    c = Correlator(Catalog(), "sglang", CorrelatorConfig(max_retained_bytes=0, max_buffered_bytes=8 * MiB,
                                                         max_total_bytes=3 * MiB))
    for rid in ("a", "b"):  # 160,000 ids each: 1.25 MiB of progress state apiece
        for seq in range(8):
            assert not errors(c.receive(Chunk(rid, Role.AGG, seq, _ids_body(seq * 20_000, 20_000)), 0.0))
    assert c.charged_bytes >= 2 * 160_000 * 8
    out = []
    for seq in range(8):
        out += c.receive(Chunk("c", Role.AGG, seq, _ids_body(seq * 20_000, 20_000)), 0.0)
    assert errors(out) == [("c", ErrorKind.OVERLOADED.value)]
    for rid in ("a", "b"):  # the others finish in full, and their charge is released
        last = c.receive(Chunk(rid, Role.AGG, 8, _ids_body(0, 1), True), 0.0)
        assert [(r.seq, r.final, r.error) for r in last if isinstance(r, Result)] == [(8, True, None)]
    assert c.charged_bytes == 0 and c.inflight == 0


def test_a_progress_charge_survives_a_migration_and_is_released_when_the_request_ends_or_is_abandoned():
    c = Correlator(Catalog(), "sglang", CorrelatorConfig(max_retained_bytes=0))
    for rid in ("moved", "abandoned"):
        for seq in range(3):
            c.receive(Chunk(rid, Role.AGG, seq, _ids_body(seq * 1_000, 1_000)), 0.0)
    charged = c.charged_bytes
    assert charged >= 2 * 3_000 * 8
    reply, _ = c.migrate("moved", 1.0)
    assert reply.emitted_tokens == 3_000
    assert c.charged_bytes == charged  # the session (and its state) lives on into the next attempt
    c.abandon(lambda rid: rid == "abandoned")
    assert 3_000 * 8 <= c.charged_bytes < charged
    out = c.receive(Chunk("moved", Role.AGG, 0, _ids_body(3_000, 10), True, attempt=1), 2.0)
    assert [(r.seq, r.final, r.error) for r in out if isinstance(r, Result)] == [(3, True, None)]
    assert c.charged_bytes == 0 and c.inflight == 0
