"""What a join decodes off the event loop is charged to the byte budget (``max_total_bytes``) from the
moment its Work is handed out until ``finish``: the chunks that arrive while it runs meet a budget that
already counts the rows it is decoding, so they end (overloaded) or evict the biggest holders instead of
filling that room (pure; the real sglang and sglang-zstd codecs, and a toy codec that declares its rows)."""

from __future__ import annotations

import pytest
from helpers import inflating_pd_legs
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_codec import InflatingCodec, InflatingSession

from streamproc.catalog import Catalog
from streamproc.codec import JoinSession
from streamproc.correlator import Correlator, CorrelatorConfig, Work
from streamproc.wire import Chunk, Result, Role, Verdict

MiB = 1 << 20


def _offloading(fmt: str, **config) -> Correlator:
    c = Correlator(Catalog(), fmt, CorrelatorConfig(**config))
    c.offload_joins = True  # as core and durable mode run joins
    return c


def _ended(decisions) -> set[str]:
    return {d.request_id for d in decisions if isinstance(d, Result) and d.error}


@pytest.mark.parametrize("fmt, layers, budget", [
    ("sglang-zstd", 512, 96 * MiB),  # 12 KB of prefill inflating to 64 MiB of rows (the attackers test's)
    # Base64 of 8 MiB of raw rows: no inflation past 3/4, but still decoded. Its legs' 21 MiB of bodies
    # and the rows stay within the share a running join's request may hold (join_share: 3/4 of 48 MiB);
    # at 32 MiB its join decodes none of them (too_large).
    ("sglang", 64, 48 * MiB),
])
def test_the_rows_a_running_join_decodes_are_charged_so_chunks_arriving_meanwhile_cannot_fill_their_room(
        fmt, layers, budget):
    prefill, decode = inflating_pd_legs(prompt=4096, format=fmt, layers=layers)
    rows = 4096 * layers * 8 * 4  # prefill's prompt rows: the join decodes (and keeps) them
    c = _offloading(fmt, max_total_bytes=budget, max_buffered_bytes=budget)
    assert c.receive(Chunk("pd", Role.PREFILL, 0, prefill, True), 0.0) == []
    works = [d for d in c.receive(Chunk("pd", Role.DECODE, 0, decode, False), 0.0) if isinstance(d, Work)]
    assert len(works) == 1
    own = len(prefill) + len(decode)  # the joining request's charge: its absorbed and buffered bodies
    held: dict[str, int] = {}
    ended: set[str] = set()
    for seq in range(1, 21):  # 8 backlogs behind a withheld seq 0, 1 MiB a chunk, all growing at once
        for h in range(8):
            rid = f"hog{h}"
            ended |= _ended(c.receive(Chunk(rid, Role.AGG, seq, bytes(MiB), False), 0.0))
            if rid not in ended:
                held[rid] = held.get(rid, 0) + MiB
            live = sum(n for r, n in held.items() if r not in ended)
            assert c.charged_bytes <= budget
            # What is live while the join runs: every charge but the reservation, and the rows it decodes.
            assert own + live + rows <= budget, (own / MiB, live / MiB, rows / MiB)
    assert "pd" not in ended
    works[0].run()
    after = c.finish(works[0], 0.0)
    assert c.charged_bytes <= budget
    assert [d.request_id for d in after if isinstance(d, Result) and not d.error] == ["pd"]


class _DeclaringSession(InflatingSession):
    """Decodes (inflates) ``rows:<n>`` decode chunks in its join, at most its decode budget allows,
    and declares them in ``join_bytes`` (the toy's prefill leg inflates at absorb, on the loop)."""

    decoded = 0  # what the last join decoded, to compare with what was live

    def join_bytes(self, body: bytes, final: bool) -> int | None:
        return int(body[len(b"rows:"):]) if body.startswith(b"rows:") else 0

    def join(self, body: bytes, final: bool):
        want = self.join_bytes(body, final) or 0
        budget = self.decode_budget
        if budget is not None and want > budget - len(self.rows):
            type(self).decoded = 0
            return body, Verdict.OMITTED  # too_large: nothing decoded
        type(self).decoded = want
        return body, Verdict.JOINED


class _DeclaringCodec(InflatingCodec):
    name = "declaring"

    def open_session(self) -> JoinSession:
        return _DeclaringSession()


# Rounds of: a P/D join handed out (its rows in MiB), the backlog chunks (by hog) that arrive while
# it is out, and whether it then runs and finishes (else the next round's join queues behind it).
_rounds = st.lists(st.tuples(st.integers(1, 48), st.lists(st.integers(0, 5), max_size=40), st.booleans()),
                   min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(rounds=_rounds, budget=st.integers(8, 64))
def test_while_a_work_is_out_the_budget_counts_its_reservation_and_the_join_decodes_within_it(rounds, budget):
    """Any interleaving of backlogs growing (1 MiB chunks behind a withheld seq 0), P/D joins handed
    out (``rows:<n MiB>``) and run: at every step everything charged (the reservation included) is
    within ``max_total_bytes``, and so is everything live while a join runs (the open backlogs, the
    P/D requests' bodies) plus what it decodes; the backlogs end (overloaded) instead."""
    c = Correlator(lambda name: _DeclaringCodec(), "declaring",
                   CorrelatorConfig(max_total_bytes=budget * MiB, max_buffered_bytes=budget * MiB))
    c.offload_joins = True
    limit = budget * MiB
    out: list[Work] = []
    seqs: dict[str, int] = {}
    bodies: dict[str, bytes] = {}  # each P/D request's decode chunk

    def run_one() -> None:
        work = out.pop(0)
        work.run()
        # What was live as it ran: the backlogs still open, the P/D requests' bodies (the running
        # one's until finish, ended or not), and what the join decoded.
        live = MiB * sum(seqs[r] for r in seqs if c.next_seq_of(r) is not None)
        live += sum(1 + len(b) for r, b in bodies.items() if r == work.request_id or c.next_seq_of(r) is not None)
        assert live + _DeclaringSession.decoded <= limit, (live / MiB, _DeclaringSession.decoded / MiB)
        take(c.finish(work, 0.0))

    def take(decisions) -> None:
        out.extend(d for d in decisions if isinstance(d, Work))
        assert len(out) <= 1
        assert c.charged_bytes <= limit

    for joins, (size, hogs, run) in enumerate(rounds):
        rid = f"pd{joins}"
        bodies[rid] = b"rows:%d" % (size * MiB)
        take(c.receive(Chunk(rid, Role.PREFILL, 0, b"p", True), 0.0))
        take(c.receive(Chunk(rid, Role.DECODE, 0, bodies[rid], True), 0.0))
        for k in hogs:
            hog = f"hog{k}"
            seqs[hog] = seqs.get(hog, 0) + 1
            take(c.receive(Chunk(hog, Role.AGG, seqs[hog], bytes(MiB), False), 0.0))
        if run and out:
            run_one()
    while out:
        run_one()
    assert c.charged_bytes == MiB * sum(seqs[r] for r in seqs if c.next_seq_of(r) is not None)


@pytest.mark.parametrize("wait", ["for the prefill leg", "for the join thread"])
def test_a_decode_chunk_that_waits_is_not_kept_parsed_beyond_its_charge(wait):
    """``needs_prefill`` parses an sglang decode chunk; one that then waits (its prefill leg is not
    there, or another join holds the thread) kept that parsed form, charged at its body length:
    ``{"<wide key>":{}}`` entries parse to ~30x it. 200 such waiting chunks held ~25x what the
    budget counted (tracemalloc); a flood of 1,000 took ``streamproc run`` to 1.4 GiB VmHWM."""
    import tracemalloc

    import msgspec

    meta = {"id": "d", "finish_reason": None, "prompt_tokens": 4, "completion_tokens": 2,
            "output_token_logprobs": [[None, 7, None]], "hidden": [{chr(0x4E00 + i): {}} for i in range(2000)]}
    decode = msgspec.json.encode({"text": "ab", "output_ids": [7, 8], "meta_info": meta})
    prefill = msgspec.json.encode({"text": "a", "output_ids": [7], "meta_info": {
        "id": "p", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": 4, "completion_tokens": 1}})
    c = _offloading("sglang", max_total_bytes=96 * MiB, max_buffered_bytes=96 * MiB)
    assert c.receive(Chunk("first", Role.PREFILL, 0, prefill, True), 0.0) == []
    assert [d for d in c.receive(Chunk("first", Role.DECODE, 0, decode, False), 0.0) if isinstance(d, Work)]
    tracemalloc.start()
    try:
        before = c.charged_bytes
        for i in range(200):
            if wait == "for the join thread":
                assert c.receive(Chunk(f"r{i}", Role.PREFILL, 0, prefill, True), 0.0) == []
            assert c.receive(Chunk(f"r{i}", Role.DECODE, 0, decode, False), 0.0) == []
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    charged = c.charged_bytes - before
    assert held <= 2 * charged, (held / MiB, charged / MiB)


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd"])
@pytest.mark.parametrize("items, prompt", [(8, 10_000), (64, 1_000), (8, 40_000)])
def test_a_batch_join_allocates_no_more_than_its_request_and_its_reservation_are_charged(fmt, items, prompt):
    """A batch body's join parses each prefill item again, copies its lists into decode's item and
    re-encodes every item, all held until the joined body is built. Charged at the decode body's
    length, 8 items of 40,000 prompt logprobs allocated 57 MiB beyond everything charged while the
    request held 65 MiB of the 96 MiB budget (tracemalloc). Now what is live while it runs stays
    within the charge (the reservation included); copies that would not fit are omitted (``too_large``)."""
    import gc
    import tracemalloc

    from streamproc.catalog import worker_for
    from streamproc.simulation import make_truth

    truth = make_truth(3, request_id="pd", prompt_len=prompt, output_len=8)
    worker = worker_for(fmt)
    prefill = b"[" + b",".join([worker.prefill(truth, stream=False)[-1]] * items) + b"]"
    decode = b"[" + b",".join([worker.decode(truth, stream=False)[-1]] * items) + b"]"
    c = _offloading(fmt, max_total_bytes=96 * MiB, max_buffered_bytes=96 * MiB)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert c.receive(Chunk("pd", Role.PREFILL, 0, prefill, True), 0.0) == []
        works = [d for d in c.receive(Chunk("pd", Role.DECODE, 0, decode, True), 0.0) if isinstance(d, Work)]
        assert len(works) == 1
        charged = c.charged_bytes
        tracemalloc.reset_peak()
        works[0].run()
        # Live while it ran: everything allocated since the legs arrived (the decode body's parse
        # included), and the two bodies, made before tracing started.
        live = tracemalloc.get_traced_memory()[1] - base + len(prefill) + len(decode)
    finally:
        tracemalloc.stop()
    results = [d for d in c.finish(works[0], 0.0) if isinstance(d, Result)]
    assert [(r.request_id, r.error) for r in results] == [("pd", None)]
    assert results[0].verdict in (Verdict.JOINED, Verdict.OMITTED)
    assert live <= charged, (live / MiB, charged / MiB)


def test_a_running_joins_request_holds_at_most_three_quarters_of_the_budget_its_rows_included():
    """join_share: the request whose join runs cannot be ended to make room, so what it holds (its
    bodies, the rows it decoded already, its reservation) stops at 3/4 of ``max_total_bytes``, and
    the last quarter stays for the chunks other requests buffer meanwhile."""
    c = Correlator(lambda name: _DeclaringCodec(), "declaring", CorrelatorConfig(max_total_bytes=4000,
                                                                                  max_buffered_bytes=4000))
    c.offload_joins = True
    assert c.receive(Chunk("pd", Role.PREFILL, 0, b"inflate:1000", True), 0.0) == []  # 1000 rows decoded
    works = [d for d in c.receive(Chunk("pd", Role.DECODE, 0, b"rows:100000", True), 0.0) if isinstance(d, Work)]
    assert len(works) == 1
    assert c.charged_bytes == 3000  # 12 + 11 bytes of bodies, 1000 of rows, the rest reserved
    assert _ended(c.receive(Chunk("other", Role.AGG, 1, bytes(1000), False), 0.0)) == set()  # the last quarter
    assert c.charged_bytes == 4000
    works[0].run()
    assert [(d.request_id, d.error) for d in c.finish(works[0], 0.0) if isinstance(d, Result)] == [("pd", None)]


def test_a_request_ended_while_its_join_runs_stays_charged_until_the_join_is_finished():
    """Its bodies and rows live on in the joining thread: ending the request (here its timeout) frees
    their charge only when ``finish`` takes the Work back."""
    c = Correlator(lambda name: _DeclaringCodec(), "declaring", CorrelatorConfig(max_total_bytes=4000,
                                                                                  request_timeout=5.0))
    c.offload_joins = True
    c.receive(Chunk("pd", Role.PREFILL, 0, b"inflate:1000", True), 0.0)
    [work] = [d for d in c.receive(Chunk("pd", Role.DECODE, 0, b"rows:100000", True), 0.0) if isinstance(d, Work)]
    assert c.charged_bytes == 3000
    assert _ended(c.tick(6.0)) == {"pd"}
    assert c.charged_bytes == 3000 and c.inflight == 0
    work.run()
    assert c.finish(work, 6.0) == []
    assert c.charged_bytes == 0
