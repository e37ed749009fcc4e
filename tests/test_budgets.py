"""The correlator's byte budgets, and why duplicates are no progress (pure; a toy codec that inflates)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
from toy_codec import InflatingCodec, InflatingSession, chunk, correlator, errors

from streamproc.catalog import Catalog
from streamproc.core.defaults import SEAL_BYTES
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


def test_progress_states_count_in_the_global_budget_and_the_request_holding_the_most_is_overloaded():
    c = Correlator(Catalog(), "sglang", CorrelatorConfig(max_retained_bytes=0, max_buffered_bytes=8 * MiB,
                                                         max_total_bytes=3 * MiB))
    for rid in ("a", "b"):  # 160,000 ids each: 1.25 MiB of progress state apiece
        for seq in range(8):
            assert not errors(c.receive(Chunk(rid, Role.AGG, seq, _ids_body(seq * 20_000, 20_000)), 0.0))
    assert c.charged_bytes >= 2 * 160_000 * 8
    out = []
    for seq in range(8):  # c's state passes the budget while a and b hold more: a (idle longest) goes
        out += c.receive(Chunk("c", Role.AGG, seq, _ids_body(seq * 20_000, 20_000)), 0.0)
    assert errors(out) == [("a", ErrorKind.OVERLOADED.value)]
    for rid in ("b", "c"):  # the others finish in full, and their charge is released
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
    # the session (and its state) lives on into the next attempt, with one entry of the seal list
    assert c.charged_bytes == charged + SEAL_BYTES
    c.abandon(lambda rid: rid == "abandoned")
    assert 3_000 * 8 <= c.charged_bytes < charged
    out = c.receive(Chunk("moved", Role.AGG, 0, _ids_body(3_000, 10), True, attempt=1), 2.0)
    assert [(r.seq, r.final, r.error) for r in out if isinstance(r, Result)] == [(3, True, None)]
    assert c.charged_bytes == 0 and c.inflight == 0


# ------------------------------------------------- who is ended when a budget is full (the offender)

def test_past_the_global_budget_the_request_holding_the_most_bytes_is_ended_not_the_newcomer():
    """Four backlogs each under the per-request cap fill the global budget; a legitimate P/D request's
    200 KB prefill leg is buffered and the biggest backlog is ended (overloaded) to make room."""
    c = correlator(max_buffered_bytes=8 * MiB, max_total_bytes=10 * MiB)
    for seq in range(1, 4):  # hog0 holds 3 MiB, hog1..2 2.5 MiB each (all under the 8 MiB cap)
        assert c.receive(chunk("hog0", "agg", seq, bytes(MiB)), float(seq)) == []
    for rid in ("hog1", "hog2"):
        assert c.receive(chunk(rid, "agg", 1, bytes(5 * MiB // 2)), 5.0) == []
    assert c.receive(chunk("legit", "prefill", 0, bytes(MiB // 2), final=True), 6.0) == []
    assert c.charged_bytes == 8 * MiB + MiB // 2
    out = c.receive(chunk("legit2", "prefill", 0, bytes(1_900_000), final=True), 7.0)
    assert errors(out) == [("hog0", ErrorKind.OVERLOADED.value)]
    [result] = [d for d in out if isinstance(d, Result)]
    assert b"held the most (3145728 bytes)" in result.body and b"processor byte budget exhausted" in result.body
    assert c.stats.over_budget == 1 and c.charged_bytes == 5 * MiB + MiB // 2 + 1_900_000
    for rid in ("legit", "legit2"):  # both legitimate requests complete in full
        joined = c.receive(chunk(rid, "decode", 0, b"d", final=True), 8.0)
        assert [(r.seq, r.error) for r in joined if isinstance(r, Result)] == [(0, None)]


def test_the_newcomer_that_would_hold_the_most_is_the_one_ended_and_ties_go_against_it():
    c = correlator(max_buffered_bytes=8 * MiB, max_total_bytes=10 * MiB)
    for rid in ("a", "b"):
        c.receive(chunk(rid, "agg", 1, bytes(4 * MiB)), 0.0)
    out = c.receive(chunk("big", "agg", 1, bytes(5 * MiB)), 1.0)  # would hold 5 MiB > 4 MiB
    assert errors(out) == [("big", ErrorKind.OVERLOADED.value)]
    assert c.inflight == 2 and c.charged_bytes == 8 * MiB


def test_decoded_payloads_past_the_global_budget_end_the_biggest_holder_first():
    c = correlator(max_buffered_bytes=64 * MiB, max_total_bytes=100 * MiB)
    for seq in range(1, 61):  # a 60 MiB backlog held behind a withheld seq 0
        c.receive(chunk("hog", "agg", seq, bytes(MiB)), 0.0)
    out = c.receive(chunk("pd", "prefill", 0, b"inflate:%d" % (50 * MiB), final=True), 1.0)
    assert errors(out) == [("hog", ErrorKind.OVERLOADED.value)]
    joined = c.receive(chunk("pd", "decode", 0, b"d", final=True), 2.0)
    assert [(r.seq, r.body) for r in joined if isinstance(r, Result)] == [(0, b"d|%d" % (50 * MiB))]
    assert c.charged_bytes == 0 and c.inflight == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(1, 3 * MiB)), max_size=60))
def test_the_global_budget_always_holds_and_every_ended_request_held_the_most(steps):
    """Whatever backlogs arrive: charged bytes never pass the budget, match what the requests hold,
    and each request ended over the budget held at least as much as any request left."""
    c = correlator(max_buffered_bytes=6 * MiB, max_total_bytes=10 * MiB)
    for t, (r, seq, size) in enumerate(steps):
        before = {rid: req.buffered for rid, req in c._active.items()}
        out = c.receive(chunk(f"r{r}", "agg", seq, bytes(size)), float(t))
        assert c.charged_bytes <= 10 * MiB
        assert c.charged_bytes == sum(req.buffered for req in c._active.values())
        ended = [rid for rid, kind in errors(out) if kind == ErrorKind.OVERLOADED.value]
        for rid in ended:
            held = before.get(rid, 0) + (size if rid == f"r{r}" else 0)
            assert all(held >= req.buffered for req in c._active.values()), (rid, held)
