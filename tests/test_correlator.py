"""The correlator on its own, driven with the toy codec (tests/toy_codec.py): each rule shows in bytes."""

from __future__ import annotations

import json

import random

import msgspec

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from toy_codec import CODECS, MigratingToyCodec, bodies, feed, make, resolve

from streamproc.core import errors
from streamproc.correlator import Correlator, CorrelatorConfig, Notice, Result, Settle
from streamproc.testing.harness import leg, shuffle_with_duplicates
from streamproc.wire import Chunk, Role, Verdict


def test_unary_aggregated_chunk_is_published_at_once_and_leaves_no_state():
    c, run = make()
    feed(run, leg("a", Role.AGG, [b"\x00opaque\xff"]))
    [r] = run.results
    assert (r.seq, r.final, r.verdict, r.body) == (0, True, Verdict.PASSTHROUGH, b"\x00opaque\xff")
    assert r.settles == (("a", "agg", 0, 0),)
    assert c.inflight == 0 and c.is_finished("a")


def test_streamed_chunks_are_published_in_seq_order_whatever_the_arrival_order():
    c, run = make()
    chunks = leg("s", Role.AGG, [b"0", b"1", b"2", b"3"])
    feed(run, [chunks[2], chunks[0], chunks[3], chunks[1]])
    assert bodies(run.results) == [b"0", b"1", b"2", b"3"]
    assert [r.final for r in run.results] == [False, False, False, True]
    assert c.inflight == 0


def test_repeated_chunks_are_dropped_and_settled_immediately():
    c, run = make()
    chunks = leg("d", Role.AGG, [b"0", b"1"])
    feed(run, [chunks[0], chunks[0]])
    assert bodies(run.results) == [b"0"]
    assert c.stats.duplicates == 1
    feed(run, [chunks[1], chunks[1]])
    assert bodies(run.results) == [b"0", b"1"]
    assert c.stats.late == 1  # after the final it is a late chunk, still settled
    assert run.settled.count(("d", "agg", 0, 1)) == 2


def test_decode_chunk_needing_prefill_waits_for_the_complete_prefill_leg():
    c, run = make()
    feed(run, leg("p", Role.DECODE, [b"free", b"need:x"]))
    assert bodies(run.results) == [b"free"]  # needs nothing: published at once
    pre = leg("p", Role.PREFILL, [b"P0", b"P1"])
    feed(run, [pre[1]])
    assert len(run.results) == 1  # prefill incomplete: still waiting
    feed(run, [pre[0]])
    assert bodies(run.results) == [b"free", b"need:x|P0+P1"]
    assert run.results[-1].verdict is Verdict.JOINED


def test_prefill_tokens_are_settled_with_the_final_result_only():
    c, run = make()
    feed(run, leg("t", Role.PREFILL, [b"P"]))
    feed(run, leg("t", Role.DECODE, [b"need:0", b"need:1"]))
    first, last = run.results
    assert first.settles == (("t", "decode", 0, 0),)
    assert set(last.settles) == {("t", "decode", 0, 1), ("t", "prefill", 0, 0)}


def test_later_chunks_queue_behind_a_chunk_waiting_for_prefill():
    c, run = make()
    feed(run, leg("q", Role.DECODE, [b"need:0", b"free1", b"free2"]))
    assert run.results == []
    assert set(c.unsettled()) == {("q", "decode", 0, i) for i in range(3)}
    feed(run, leg("q", Role.PREFILL, [b"P"]))
    assert bodies(run.results) == [b"need:0|P", b"free1", b"free2"]


def test_prefill_timeout_applies_the_omission_policy_and_unblocks_the_stream():
    c, run = make(prefill_timeout=5.0)
    feed(run, leg("o", Role.DECODE, [b"need:0", b"free"]), now=100.0)
    assert c.next_deadline() == 105.0
    run.absorb(c.tick(104.9))
    assert run.results == []
    run.absorb(c.tick(105.0))
    assert bodies(run.results) == [b"need:0|omitted:prefill_timeout", b"free"]
    assert run.results[0].verdict is Verdict.OMITTED
    assert c.stats.prefill_timeouts == 1
    # The prefill leg arriving now is late: dropped, settled, never joined.
    feed(run, leg("o", Role.PREFILL, [b"P"]), now=106.0)
    assert len(run.results) == 2 and c.stats.late == 1


def test_omissions_are_counted_by_reason_once_per_request_reading_at_most_two_results():
    """A stream whose every chunk is omitted (prefill timeout) counts its reason once, and the
    codec reads its first omitted result and its final one only: a read per chunk would parse every
    body of such a stream a second time."""
    c, run = make(prefill_timeout=1.0)
    codec = CODECS["toy"]
    before = codec.reads
    feed(run, leg("t1", Role.DECODE, [b"need:0", b"need:1", b"need:2", b"need:3"]), now=0.0)
    run.absorb(c.tick(1.0))
    assert len(run.results) == 4 and all(r.verdict is Verdict.OMITTED for r in run.results)
    assert c.omission_reasons == {"prefill_timeout": 1}
    assert codec.reads - before == 2
    feed(run, leg("t2", Role.DECODE, [b"need:0"]), now=2.0)
    run.absorb(c.tick(3.0))
    assert c.omission_reasons == {"prefill_timeout": 2}


def test_an_unknown_omission_reason_counts_as_other_and_a_huge_body_is_not_read(monkeypatch):
    """The metric's labels stay bounded (a codec's own reasons are ``other``), and a body past
    ``OMISSIONS_READ_BYTES`` (joined rows beside the omitted field) is not parsed on the loop."""
    from streamproc.core.correlator import OMISSIONS_READ_BYTES

    c, run = make(prefill_timeout=1.0)
    codec = CODECS["toy"]
    monkeypatch.setattr(codec, "omissions", lambda body: {"toy": "my_own_reason"})
    feed(run, leg("own", Role.DECODE, [b"need:0"]), now=0.0)
    run.absorb(c.tick(1.0))
    assert c.omission_reasons == {"other": 1}
    monkeypatch.setattr(codec, "omissions", lambda body: pytest.fail("a body past the limit was read"))
    feed(run, leg("big", Role.DECODE, [b"need:0" + b"x" * OMISSIONS_READ_BYTES]), now=2.0)
    run.absorb(c.tick(3.0))
    assert c.omission_reasons == {"other": 1, "unread": 1}


def test_a_codec_whose_omissions_raises_costs_the_count_not_the_request_or_the_timer(monkeypatch):
    """``Codec.omissions`` is a plugin's override point: when it raises, the result is still
    published, the stream goes on, and the reason counts as ``other`` (it raised out of
    ``Correlator.tick`` with the chunk taken, its result lost and the request stuck: the processor's
    timer task has no handler, so one plugin bug stopped the processor; a reviewer's probe)."""
    c, run = make(prefill_timeout=1.0)
    codec = CODECS["toy"]

    def broken(body: bytes) -> dict[str, str]:
        raise ValueError("plugin bug in omissions()")

    monkeypatch.setattr(codec, "omissions", broken)
    feed(run, leg("t1", Role.DECODE, [b"need:0", b"need:1"]), now=0.0)
    run.absorb(c.tick(1.0))
    assert bodies(run.results) == [b"need:0|omitted:prefill_timeout", b"need:1|omitted:prefill_timeout"]
    assert c.inflight == 0 and c.buffered_bytes() == 0
    assert c.omission_reasons == {"other": 1}


def test_prefill_arriving_after_timeout_but_before_final_is_ignored():
    c, run = make(prefill_timeout=1.0)
    feed(run, leg("w", Role.DECODE, [b"need:0", b"need:1", b"need:2"])[:1], now=0.0)
    run.absorb(c.tick(1.0))
    feed(run, leg("w", Role.PREFILL, [b"P"]), now=1.5)
    feed(run, leg("w", Role.DECODE, [b"need:0", b"need:1", b"need:2"])[1:], now=2.0)
    assert bodies(run.results) == [b"need:0|omitted:prefill_timeout", b"need:1|omitted:prefill_timeout",
                                   b"need:2|omitted:prefill_timeout"]
    assert c.stats.duplicates == 1  # the prefill chunk, counted and settled


def test_request_without_progress_gets_a_final_error_result_and_is_freed():
    c, run = make(request_timeout=10.0)
    feed(run, leg("slow", Role.AGG, [b"0", b"1", b"2"])[:1], now=0.0)
    run.absorb(c.tick(9.9))
    assert c.inflight == 1
    run.absorb(c.tick(10.0))
    assert c.inflight == 0
    err = run.results[-1]
    assert (err.seq, err.final, err.error) == (1, True, "timeout")
    assert err.body.startswith(b"ERR[timeout]")
    assert any(isinstance(n, Notice) and n.request_id == "slow" for n in run.notices)


def test_progress_postpones_the_request_timeout():
    c, run = make(request_timeout=10.0)
    chunks = leg("live", Role.AGG, [b"0", b"1", b"2"])
    feed(run, chunks[:1], now=0.0)
    feed(run, chunks[1:2], now=8.0)
    run.absorb(c.tick(12.0))
    assert c.inflight == 1
    feed(run, chunks[2:], now=12.0)
    assert bodies(run.results) == [b"0", b"1", b"2"]


def test_finished_requests_are_forgotten_after_the_grace_period():
    c, run = make(finished_grace=5.0)
    feed(run, leg("g", Role.AGG, [b"x"]), now=0.0)
    run.absorb(c.tick(4.0))
    assert c.is_finished("g")
    run.absorb(c.tick(5.0))
    assert not c.is_finished("g")


def test_finished_set_is_bounded():
    c, run = make(max_finished=3)
    for i in range(10):
        feed(run, leg(f"f{i}", Role.AGG, [b"x"]))
    assert [c.is_finished(f"f{i}") for i in range(10)] == [False] * 7 + [True] * 3


def test_new_requests_past_max_inflight_get_an_overloaded_error():
    c, run = make(max_inflight=2)
    feed(run, leg("a", Role.AGG, [b"0", b"1"])[:1])
    feed(run, leg("b", Role.AGG, [b"0", b"1"])[:1])
    feed(run, leg("c", Role.AGG, [b"0", b"1"])[:1])
    err = run.of("c")
    assert len(err) == 1 and err[0].error == "overloaded" and err[0].final
    assert c.inflight == 2 and c.stats.overloaded == 1
    # Unary aggregated requests need no state and still pass while saturated.
    feed(run, leg("u", Role.AGG, [b"unary"]))
    assert bodies(run.of("u")) == [b"unary"]


def test_reorder_buffer_is_bounded_per_request():
    c, run = make(max_buffered_chunks=4)
    chunks = leg("big", Role.AGG, [str(i).encode() for i in range(10)])
    feed(run, chunks[1:6])
    [err] = run.of("big")
    assert err.error == "invalid_chunk" and err.seq == 0
    assert set(err.settles) == {ch.token for ch in chunks[1:6]}
    assert c.inflight == 0


@pytest.mark.parametrize(
    "chunks, reason",
    [
        ([Chunk("m", Role.AGG, 0, b"a"), Chunk("m", Role.DECODE, 1, b"b")], "decode chunk for a request"),
        ([Chunk("m", Role.AGG, 0, b"a"), Chunk("m", Role.PREFILL, 0, b"p")], "prefill chunk for an aggregated"),
        ([Chunk("m", Role.AGG, 1, b"a", final=True), Chunk("m", Role.AGG, 2, b"b")], "conflicts with final"),
        ([Chunk("m", Role.AGG, 1, b"a", final=True), Chunk("m", Role.AGG, 0, b"b", final=True)], "conflicts"),
        ([Chunk("m", Role.AGG, 3, b"a"), Chunk("m", Role.AGG, 1, b"b", final=True)], "below an earlier seq"),
        ([Chunk("m", Role.AGG, 0, b"a"), Chunk("m", Role.AGG, 1, b"b", format="other")], "differs"),
        ([Chunk("m", Role.AGG, 0, b"a", format="nope")], "unknown format 'nope'"),
        ([Chunk("m", Role.AGG, 0, b"a", attempt=1)], "migration"),
    ],
)
def test_contract_violations_end_the_request_with_an_error_result(chunks, reason):
    c, run = make()
    feed(run, chunks)
    err = run.results[-1]
    assert err.final and err.error in ("invalid_chunk", "unknown_format")
    assert reason in err.body.decode()
    assert c.inflight == 0
    assert [r.seq for r in run.results] == list(range(len(run.results)))


@pytest.mark.parametrize("complete", [False, True])
def test_a_prefill_seq_past_the_legs_final_ends_the_request_also_once_the_leg_is_complete(complete):
    """A seq after the leg's final one breaks the contract (protocol.md: ``invalid_chunk``). Once the
    prefill leg was complete it was taken for a duplicate instead (it was never seen: only a chunk
    whose seq was seen is one) and its token held as a repeat of a held chunk until the request
    ended: counted among the repeats that the durable watchdog reads stored messages for."""
    c, run = make()
    pre = leg("p", Role.PREFILL, [b"P0", b"P1"])
    feed(run, pre if complete else pre[1:])  # complete: seq 0 and the final seq 1; else seq 0 missing
    late = Chunk("p", Role.PREFILL, 2, b"P2", token="p2")
    feed(run, [late])
    [r] = run.results
    assert (r.seq, r.final, r.error, r.body) == (0, True, "invalid_chunk", b"ERR[invalid_chunk]prefill seq 2 after final seq 1")
    assert set(r.settles) == {*(ch.token for ch in (pre if complete else pre[1:])), "p2"}
    assert c.inflight == 0 and list(c.unsettled()) == []

def test_reject_from_the_shell_ends_an_active_request_at_the_next_seq():
    c, run = make()
    feed(run, leg("r", Role.AGG, [b"0", b"1"])[:1])
    run.absorb(c.reject("r", "missing required header Streamproc-Seq", 0.0, token="bad"))
    assert [(r.seq, r.final, r.error) for r in run.results] == [(0, False, None), (1, True, "invalid_chunk")]
    assert "bad" in run.results[-1].settles


def test_a_malformed_chunk_of_the_current_attempt_ends_the_request_not_dropped_as_sealed():
    """Only an attempt below the current one was given up; one naming the current attempt (here 0,
    the only one) is this request's own broken chunk and ends it."""
    c, run = make()
    feed(run, leg("r", Role.AGG, [b"0", b"1"])[:1])
    run.absorb(c.reject("r", "missing required header Streamproc-Seq", 0.0, token="bad", attempt=0))
    assert [(r.seq, r.final, r.error) for r in run.results] == [(0, False, None), (1, True, "invalid_chunk")]
    assert c.stats.sealed == 0 and c.inflight == 0


def test_the_fused_passthrough_path_declines_a_request_holding_a_repeat_and_takes_it_back_once_settled():
    """``receive_agg`` settles nothing (core mode keeps no tokens): a request that holds a token (a
    repeat of a buffered chunk) is left to ``receive``, whose result for the buffered chunk settles
    the repeat with it (from then on it delivers nothing new); the fused path then takes the request."""
    c, run = make()
    chunks = leg("h", Role.AGG, [b"0", b"1", b"2"])
    feed(run, [chunks[1], chunks[1]])  # the repeat of buffered seq 1 is held
    assert list(c.unsettled()) == [chunks[1].token, chunks[1].token]
    assert c.receive_agg("h", 0, False, b"0", None, 0.0) is False
    feed(run, chunks[:1])
    assert [r.settles for r in run.results] == [(chunks[0].token,), (chunks[1].token, chunks[1].token)]
    assert list(c.unsettled()) == []
    assert c.receive_agg("h", 2, True, b"2", None, 0.0) is True
    assert c.inflight == 0 and c.is_finished("h")


@pytest.mark.parametrize("fused", [False, True])
def test_an_in_order_stream_moves_behind_the_stalled_requests_so_their_timeouts_still_fire(fused):
    """Requests time out in order of last progress: the in-order fast paths (``receive`` and the fused
    ``receive_agg``) move the request to the back of that line, else it would stay at its head with a
    recent ``last`` and hold up every timeout behind it."""
    c, run = make(request_timeout=10.0)
    a = leg("a", Role.AGG, [b"0", b"1", b"2"])
    if fused:
        assert c.receive_agg("a", 0, False, b"0", None, 0.0)
    else:
        feed(run, a[:1], now=0.0)
    feed(run, leg("b", Role.AGG, [b"0", b"1"])[1:], now=1.0)  # stalled: seq 0 never comes
    if fused:
        assert c.receive_agg("a", 1, False, b"1", None, 8.0)
    else:
        feed(run, a[1:2], now=8.0)
    assert c.next_deadline() == 11.0
    run.absorb(c.tick(11.5))
    assert [(r.request_id, r.error) for r in run.results if r.error] == [("b", "timeout")]
    assert c.knows("a") and not c.is_finished("a")


def test_a_request_ended_while_waiting_for_prefill_leaves_the_prefill_wait_line():
    c, run = make(prefill_timeout=5.0)
    feed(run, leg("w", Role.DECODE, [b"need:0", b"1"])[:1], now=0.0)  # waits for its prefill leg
    run.absorb(c.reject("w", "missing required header Streamproc-Seq", 1.0))
    assert run.results[-1].error == "invalid_chunk"
    assert c.next_deadline() == 1.0 + c.config.finished_grace  # only the finished id's expiry is left
    notices = len(run.notices)
    run.absorb(c.tick(6.0))
    assert c.stats.prefill_timeouts == 0 and len(run.notices) == notices and len(run.results) == 1


def test_reject_for_an_unknown_request_publishes_a_single_error_result():
    c, run = make()
    run.absorb(c.reject("new", "unknown role 'x'", 0.0))
    [err] = run.results
    assert (err.seq, err.final, err.error) == (0, True, "invalid_chunk")
    assert c.stats.rejected == 1


def test_an_error_results_text_is_cut_so_it_fits_max_payload():
    """A reason built from a worker's input (a codec's exception, a field it echoes) is cut to
    errors.MAX_ERROR_TEXT bytes as JSON (a start, cut on a character boundary, and its length), in the
    result and its notice: a ~100 kB one was an error result over max_payload, which durable mode
    NAKed until --max-deliver."""
    c, run = make()
    reason = "codec 'x': " + "\u00e9" * 100_000
    run.absorb(c.reject("new", reason, 0.0))
    [err] = run.results
    assert (err.seq, err.final, err.error) == (0, True, "invalid_chunk")
    suffix = f"... ({len(reason)} characters)"
    cut = err.body.decode().removeprefix("ERR[invalid_chunk]")  # the toy codec's envelope
    assert cut.endswith(suffix) and reason.startswith(cut[:-len(suffix)]), cut[:80]
    start = len("codec 'x': ")
    assert len(cut) - len(suffix) == (errors.MAX_ERROR_TEXT - len(suffix) - start) // 6 + start
    assert len(json.dumps(cut)) - 2 <= errors.MAX_ERROR_TEXT  # \u00e9 each, as an ensure_ascii encoder writes it
    assert run.notices[-1].detail == cut


def test_a_result_that_cannot_be_published_is_replaced_by_an_error_at_its_seq_and_ends_the_request():
    c, run = make()
    feed(run, leg("r", Role.AGG, [b"0", b"1", b"2"])[:2])  # seqs 0 and 1 emitted; 1 is too large to publish
    run.absorb(c.unpublishable("r", 1, "larger than max_payload", 0.0))
    assert [(r.seq, r.final, r.error) for r in run.results] == [(0, False, None), (1, False, None), (1, True, "internal")]
    assert b"larger than max_payload" in run.results[-1].body
    assert c.inflight == 0 and c.is_finished("r")
    feed(run, leg("r", Role.AGG, [b"0", b"1", b"2"])[2:])  # a later chunk of it is late: nothing after the error
    assert len(run.results) == 3 and c.stats.late == 1


def test_a_finished_requests_unpublishable_final_result_is_replaced_by_an_error_in_its_chunks_format():
    c, run = make()
    feed(run, [Chunk("u", Role.AGG, 0, b"huge", final=True, format="other")])  # unary: finished at once
    run.absorb(c.unpublishable("u", 0, "larger than max_payload", 0.0, "other"))
    assert [(r.seq, r.final, r.error) for r in run.results] == [(0, True, None), (0, True, "internal")]
    assert run.results[-1].body == b"OTHER-ERR"  # the chunk's format's envelope, not the default's
    assert c.is_finished("u") and c.error_kinds == {"internal": 1}
    run.absorb(c.unpublishable("v", 0, "larger than max_payload", 0.0, "no-such-format"))
    assert b"larger than max_payload" in run.results[-1].body  # an unknown format: the default's


def test_per_request_format_selects_that_codecs_error_envelope():
    c, run = make()
    feed(run, [Chunk("f", Role.AGG, 0, b"a", format="other"), Chunk("f", Role.AGG, 0, b"a", attempt=1)])
    assert run.results[-1].body == b"OTHER-ERR"


def test_an_unknown_format_on_a_unary_aggregated_chunk_still_passes_through():
    c, run = make()
    feed(run, [Chunk("u", Role.AGG, 0, b"body", final=True, format="nope")])
    assert bodies(run.results) == [b"body"]


def test_a_codec_exception_fails_only_its_own_request():
    c, run = make()
    feed(run, leg("bad", Role.DECODE, [b"explode"]))
    feed(run, leg("good", Role.AGG, [b"fine"]))
    assert run.of("bad")[0].error == "internal" and b"toy codec bug" in run.of("bad")[0].body
    assert bodies(run.of("good")) == [b"fine"]


def test_traceparent_is_carried_to_results():
    c, run = make()
    feed(run, [Chunk("tp", Role.AGG, 0, b"x", final=True, traceparent="00-abc-def-01")])
    assert run.results[0].traceparent == "00-abc-def-01"


def test_next_deadline_is_none_when_idle():
    c, _ = make()
    assert c.next_deadline() is None


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.sampled_from(["agg", "pd"]), st.integers(1, 5), st.integers(1, 3), st.booleans()),
        min_size=1, max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_arrival_order_with_duplicates_gives_the_in_order_results(requests, seed):
    chunks = []
    for i, (mode, n, p, needy) in enumerate(requests):
        rid = f"r{i}"
        out = [(b"need:" if needy and k % 2 == 0 else b"") + f"{rid}-{k}".encode() for k in range(n)]
        if mode == "agg":
            chunks += leg(rid, Role.AGG, out)
        else:
            chunks += leg(rid, Role.PREFILL, [f"P{rid}{k}".encode() for k in range(p)])
            chunks += leg(rid, Role.DECODE, out)
    _, ordered = make()
    feed(ordered, chunks)
    _, shuffled = make()
    feed(shuffled, shuffle_with_duplicates(chunks, random.Random(seed), dup_rate=0.5))
    for i in range(len(requests)):
        want = [(r.seq, r.final, r.body, r.verdict) for r in ordered.of(f"r{i}")]
        assert [(r.seq, r.final, r.body, r.verdict) for r in shuffled.of(f"r{i}")] == want
        assert want[-1][1] and all(b"omitted" not in w[2] for w in want)
    assert shuffled.correlator.inflight == 0
    assert set(shuffled.settled) == {c.token for c in chunks}
    assert not [d for d in shuffled.results if isinstance(d, Settle)]


def test_resume_skips_results_another_instance_already_stored():
    c, run = make()
    c.resume("x", 2, False, 0.0)
    chunks = leg("x", Role.AGG, [b"0", b"1", b"2", b"3"])
    feed(run, [chunks[3], chunks[1], chunks[2]])
    assert [(r.seq, r.body) for r in run.results] == [(2, b"2"), (3, b"3")]
    assert ("x", "agg", 0, 1) in run.settled and c.stats.duplicates == 1


def test_resume_of_a_finished_request_makes_its_chunks_late():
    c, run = make()
    c.resume("done", 3, True, 0.0)
    feed(run, leg("done", Role.AGG, [b"0", b"1", b"2"]))
    assert run.results == [] and c.stats.late == 3


def test_a_request_adopted_as_finished_is_remembered_like_any_finished_one_for_the_grace_within_the_caps():
    """A recovery lookup that finds a request's final result stored adopts it as finished
    (``resume(..., final=True)``): a hostile worker can make one per distinct old id with one late
    chunk each, so those ids must cost what any finished id does, no more: forgotten after
    ``finished_grace`` and held within ``max_finished`` and ``max_finished_bytes``."""
    from streamproc.core.defaults import FINISHED_ENTRY_BYTES
    c, run = make(finished_grace=5.0, max_finished=3)
    for i in range(10):
        c.resume(f"old{i}", 2, True, float(i) / 10)
    assert [c.is_finished(f"old{i}") for i in range(10)] == [False] * 7 + [True] * 3
    assert c.finished_bytes == 3 * (FINISHED_ENTRY_BYTES + len("old0"))
    run.absorb(c.tick(0.9 + 4.9))  # old9 adopted at 0.9: within its grace
    assert c.is_finished("old9") and not c.is_finished("old7")
    run.absorb(c.tick(0.9 + 5.0))
    assert not any(c.knows(f"old{i}") for i in range(10)) and c.finished_bytes == 0
    entry = FINISHED_ENTRY_BYTES + 256
    c, run = make(finished_grace=60.0, max_finished_bytes=4 * entry)
    ids = [f"{i:04d}".ljust(256, "z") for i in range(10)]
    for rid in ids:
        c.resume(rid, 1, True, 0.0)
    assert [c.is_finished(r) for r in ids] == [False] * 6 + [True] * 4 and c.finished_bytes == 4 * entry


def test_resume_never_rewinds_a_request_this_instance_is_serving():
    c, run = make()
    feed(run, leg("live", Role.AGG, [b"0", b"1"])[:1])
    c.resume("live", 0, False, 0.0)
    c.resume("live", 5, False, 0.0)
    feed(run, leg("live", Role.AGG, [b"0", b"1"])[1:])
    assert bodies(run.results) == [b"0", b"1"]
    assert c.knows("live")


def test_shed_ends_the_longest_idle_requests_holding_tokens_of_the_selected_group_first():
    c = Correlator(resolve, "toy", CorrelatorConfig())
    for t, r in enumerate(["a", "b", "x", "c"]):  # prefill legs held, waiting for a decode leg
        c.receive(Chunk(r, Role.PREFILL, 0, b"p", final=True, token=f"{r}-p"), float(t))
    c.receive(Chunk("a", Role.DECODE, 1, b"d", token="a-d1"), 10.0)  # a progressed: back of the line
    c.receive(Chunk("s", Role.AGG, 0, b"s"), 10.0)  # streams in order: holds nothing
    assert c.held_tokens(lambda rid: 1 if rid == "x" else 0) == {0: 4, 1: 1}
    out = c.shed(lambda rid: rid != "x", 2, 11.0, "partition full")
    results = [d for d in out if d.__class__.__name__ == "Result"]
    assert [(r.request_id, r.error, r.settles) for r in results] == [
        ("b", "overloaded", ("b-p",)), ("c", "overloaded", ("c-p",))]
    assert results[0].body == b"ERR[overloaded]partition full" and c.stats.shed == 2
    assert c.held_tokens(lambda rid: 0) == {0: 3}  # a (prefill + buffered decode), x


def test_held_repeats_of_one_stored_message_count_once_when_the_shell_names_it():
    """A redelivery of a held chunk is held with the original (the same stored message: settled
    together); the server counts it once against max_ack_pending, so must the shedding."""
    c = Correlator(resolve, "toy", CorrelatorConfig())
    for t, r in enumerate(["a", "b"]):
        c.receive(Chunk(r, Role.PREFILL, 0, b"p", final=True, token=f"{r}:1"), float(t))
        c.receive(Chunk(r, Role.PREFILL, 0, b"p", final=True, token=f"{r}:1"), float(t))  # redelivered
    c.receive(Chunk("b", Role.PREFILL, 0, b"p", final=True, token="b:2"), 2.0)  # published again: stored twice
    c.receive(Chunk("b", Role.DECODE, 2, b"d", token="b:3"), 2.0)  # buffered behind seq 0
    stored = {"a:1": 1, "b:1": 2, "b:2": 3, "b:3": 4}.__getitem__  # token -> its stream sequence
    assert c.held_tokens(lambda rid: 0) == {0: 6}
    assert c.held_tokens(lambda rid: 0, stored) == {0: 4}
    out = c.shed(lambda rid: True, 1, 3.0, "partition full", stored)  # a frees 1: enough
    assert [(d.request_id, d.settles) for d in out if d.__class__.__name__ == "Result"] == [("a", ("a:1", "a:1"))]


@pytest.mark.parametrize("role", [Role.AGG, Role.DECODE])
def test_a_held_repeat_is_settled_with_its_originals_result_and_counts_towards_shedding_no_more(role):
    """A repeat of a buffered output chunk (a redelivery of its stored message, or the worker's copy
    without ``Nats-Msg-Id``) is held so its ack cannot release the original before the original's
    result is stored; from that result on it delivers nothing new, so that result settles it. Held
    until the request ended (before 2026-12-06), it stayed in ``held_tokens`` after its stored message
    was acknowledged: three honest requests streaming in order, each with one repeated chunk, were
    counted as holding 4 stored messages among them (the decode one also its prefill leg), and the
    watchdog's ``shed`` ended them ``overloaded``."""
    c = Correlator(resolve, "toy", CorrelatorConfig())

    def stored(token: object) -> int:
        return int(str(token).split("#")[0])  # "<stored message>#<delivery>", as the stream sequence

    out = []
    for i, rid in enumerate(["a", "b", "c"]):
        m = 10 * i  # stored messages m (seq 0), m + 1 (seq 1), m + 2 (seq 1 published again), m + 3 (seq 2)
        if role is Role.DECODE and rid == "c":  # a P/D request: its prefill leg is held until its final result
            out += c.receive(Chunk(rid, Role.PREFILL, 0, b"P", final=True, token=f"{m + 9}#1"), 0.0)
        out += c.receive(Chunk(rid, role, 1, b"1", token=f"{m + 1}#1"), 0.0)  # buffered behind seq 0
        out += c.receive(Chunk(rid, role, 1, b"1", token=f"{m + 1}#2"), 0.0)  # redelivered: held with it
        out += c.receive(Chunk(rid, role, 1, b"1", token=f"{m + 2}#1"), 0.0)  # the worker's copy: held too
        # held while seq 1 waits: its two stored messages (and c's prefill leg), the redelivery once
        assert c.held_tokens("abc".index, stored)[i] == 2 + (role is Role.DECODE and rid == "c")
        out += c.receive(Chunk(rid, role, 0, b"0", token=f"{m}#1"), 1.0)  # the gap closes
    results = [d for d in out if d.__class__.__name__ == "Result"]
    assert [(r.request_id, r.seq, r.settles) for r in results] == [
        (rid, seq, settles) for m, rid in ((0, "a"), (10, "b"), (20, "c"))
        for seq, settles in ((0, (f"{m}#1",)), (1, (f"{m + 1}#1", f"{m + 1}#2", f"{m + 2}#1")))]
    held = {0: 1} if role is Role.DECODE else {}  # c's prefill leg, until c's final result
    assert c.held_tokens(lambda rid: 0, stored) == held and c.held_tokens(lambda rid: 0) == held
    assert list(c.unsettled()) == (["29#1"] if role is Role.DECODE else [])
    shed = [d for d in c.shed(lambda rid: rid != "c", 1, 2.0, "partition full", stored)
            if d.__class__.__name__ == "Result"]
    assert shed == [] and c.stats.shed == 0  # nothing a, b hold is unacknowledged: nothing to free
    for i, rid in enumerate(["a", "b", "c"]):
        [r] = [d for d in c.receive(Chunk(rid, role, 2, b"2", final=True, token=f"{10 * i + 3}#1"), 3.0)
               if d.__class__.__name__ == "Result"]
        assert (r.seq, r.final, r.error) == (2, True, None)
        assert r.settles == ((f"{10 * i + 3}#1", "29#1") if role is Role.DECODE and rid == "c" else (f"{10 * i + 3}#1",))
    assert c.inflight == 0 and list(c.unsettled()) == []

def test_the_stored_message_of_a_held_token_is_asked_only_of_requests_that_hold_a_repeat():
    """Counting held chunks per stored message runs on a timer (the durable watchdog, every 0.25 s)
    and ``stored`` reads a token's ack subject: asked of every held token, 10,000 held prefill legs
    took 15 ms a count instead of 2 (2026-12-05). Only a repeat of a held chunk can deliver a stored
    message twice, so a request holding none is counted without asking."""
    asked: list[object] = []

    def stored(token: object) -> int:
        asked.append(token)
        return {"a:1": 1, "b:1": 2, "b:2": 3, "c:1": 4}[token]  # type: ignore[index]

    c = Correlator(resolve, "toy", CorrelatorConfig())
    c.receive(Chunk("a", Role.PREFILL, 0, b"p", token="a:1"), 0.0)
    c.receive(Chunk("b", Role.PREFILL, 0, b"p", token="b:1"), 0.0)
    c.receive(Chunk("b", Role.PREFILL, 1, b"p", final=True, token="b:2"), 0.0)
    c.receive(Chunk("c", Role.PREFILL, 0, b"p", token="c:1"), 0.0)
    c.receive(Chunk("c", Role.PREFILL, 0, b"p", token="c:1"), 1.0)  # redelivered: held with the original
    assert c.held_tokens(lambda rid: 0, stored) == {0: 4}
    assert sorted(asked) == ["c:1", "c:1"]  # only c holds a repeat
    asked.clear()
    out = c.shed(lambda rid: True, 1, 3.0, "partition full", stored)  # a frees 1: enough
    assert [d.request_id for d in out if d.__class__.__name__ == "Result"] == ["a"]
    assert asked == []


def test_shed_passes_over_requests_that_hold_no_token_however_idle():
    """Shedding frees held deliveries: a request that holds none frees nothing, so it is not ended,
    even when it is the least recently progressing one."""
    c = Correlator(resolve, "toy", CorrelatorConfig())
    c.receive(Chunk("s", Role.AGG, 0, b"s"), 0.0)  # streams in order: holds nothing, idle longest
    c.receive(Chunk("h", Role.PREFILL, 0, b"p", final=True, token="h-p"), 1.0)  # held, waiting for decode
    out = c.shed(lambda rid: True, 1, 2.0, "partition full")
    assert [(d.request_id, d.error) for d in out if d.__class__.__name__ == "Result"] == [("h", "overloaded")]
    assert c.stats.shed == 1 and c.knows("s") and not c.is_finished("s")


def test_at_max_inflight_the_request_idle_longest_is_ended_to_admit_a_new_one():
    c, run = make(max_inflight=3, shed_min_idle=1.0)
    for t, rid in enumerate(["held0", "held1", "live"]):  # seq 1 buffered, seq 0 never sent
        feed(run, leg(rid, Role.AGG, [b"0", b"1", b"2"])[1:2], now=float(t))
    feed(run, leg("held0", Role.AGG, [b"0", b"1", b"2"])[1:2], now=5.0)  # a duplicate: no progress
    feed(run, leg("live", Role.AGG, [b"0", b"1", b"2"])[2:], now=5.0)  # a new seq: progress
    feed(run, leg("new", Role.AGG, [b"0", b"1"])[:1], now=5.5)
    assert [(r.request_id, r.error) for r in run.results] == [("held0", "overloaded"), ("new", None)]
    assert b"made no progress for 5.5 s" in run.results[0].body
    assert c.stats.evicted == 1 and c.stats.overloaded == 0 and c.inflight == 3
    feed(run, leg("new2", Role.AGG, [b"0", b"1"])[:1], now=5.6)  # held1 (4.6 s idle) goes next
    assert [r.request_id for r in run.results[2:]] == ["held1", "new2"]


def test_at_max_inflight_a_request_idle_exactly_shed_min_idle_is_ended_to_admit_a_new_one():
    c, run = make(max_inflight=1, shed_min_idle=1.0)
    feed(run, leg("held", Role.AGG, [b"0", b"1"])[1:], now=0.0)  # seq 1 buffered, seq 0 never sent
    feed(run, leg("new", Role.AGG, [b"0", b"1"])[:1], now=1.0)
    assert [(r.request_id, r.error) for r in run.results] == [("held", "overloaded"), ("new", None)]
    assert c.stats.evicted == 1


def test_at_max_inflight_requests_that_progressed_within_the_minimum_idle_are_kept_and_the_newcomer_refused():
    c, run = make(max_inflight=2, shed_min_idle=1.0)
    feed(run, leg("a", Role.AGG, [b"0", b"1"])[:1], now=0.0)
    feed(run, leg("b", Role.AGG, [b"0", b"1"])[:1], now=0.5)
    feed(run, leg("c", Role.AGG, [b"0", b"1"])[:1], now=0.9)  # a burst: nobody idle 1 s yet
    assert [(r.request_id, r.error) for r in run.results] == [("a", None), ("b", None), ("c", "overloaded")]
    assert b"2 requests in flight" in run.results[-1].body
    feed(run, leg("a", Role.AGG, [b"0", b"1"])[1:], now=0.95)
    assert c.inflight == 1


def test_the_finished_ids_are_bounded_in_bytes_oldest_forgotten_first():
    from streamproc.core.defaults import FINISHED_ENTRY_BYTES
    entry = FINISHED_ENTRY_BYTES + 256
    c, run = make(max_finished_bytes=10 * entry)
    ids = [f"{i:04d}".ljust(256, "z") for i in range(25)]
    for i, rid in enumerate(ids):
        if i % 2:
            feed(run, leg(rid, Role.AGG, [b"0"]))  # unary: the fast path
        else:
            feed(run, leg(rid, Role.AGG, [b"0", b"1"]))  # streamed: _forget
    assert [c.is_finished(r) for r in ids] == [False] * 15 + [True] * 10
    assert c.finished_bytes == 10 * entry
    # Within the bound, a late duplicate of a finished request gets no new result.
    feed(run, leg(ids[-1], Role.AGG, [b"0"]))
    assert c.stats.late == 1 and len(run.results) == 13 * 2 + 12
    run.absorb(c.tick(1e9))  # every grace expired: all forgotten, none charged
    assert c.finished_bytes == 0 and not c.is_finished(ids[-1])


def test_a_finished_id_is_charged_once_however_often_it_is_remembered():
    """``unpublishable`` for a request already finished keeps it finished: the id is not charged twice."""
    from streamproc.core.defaults import FINISHED_ENTRY_BYTES
    c, run = make()
    feed(run, leg("s", Role.AGG, [b"0", b"1"]))
    run.absorb(c.unpublishable("s", 1, "larger than max_payload", 0.0))
    assert run.results[-1].error == "internal"
    assert c.finished_bytes == FINISHED_ENTRY_BYTES + len("s")
    run.absorb(c.tick(1e9))
    assert c.finished_bytes == 0 and not c.is_finished("s")


def test_next_deadline_includes_when_a_finished_id_expires():
    c, run = make(finished_grace=30.0)
    feed(run, leg("u", Role.AGG, [b"x"]), now=10.0)  # unary: no active state, only the finished id
    assert c.next_deadline() == 40.0
    run.absorb(c.tick(40.0))
    assert not c.is_finished("u") and c.next_deadline() is None


def test_a_request_may_buffer_exactly_max_buffered_bytes_and_not_one_byte_more():
    c, run = make(max_buffered_bytes=4)
    chunks = leg("b", Role.AGG, [b"0", b"12", b"34", b"5", b"6"])
    feed(run, chunks[1:3])  # 4 bytes wait for seq 0
    assert run.results == [] and c.inflight == 1
    feed(run, chunks[3:4])
    assert [(r.seq, r.error) for r in run.results] == [(0, "invalid_chunk")]
    assert b"more than 4 bytes of buffered chunks" in run.results[0].body


def test_the_finished_ids_charge_follows_every_way_in_and_out():
    c, run = make()
    feed(run, leg("u", Role.AGG, [b"x"]))
    feed(run, leg("s", Role.AGG, [b"0", b"1"]))
    c.resume("r", 3, True, 0.0)
    c.abandon(lambda rid: False, unstored=["u"])
    from streamproc.core.defaults import FINISHED_ENTRY_BYTES
    assert c.finished_bytes == 2 * FINISHED_ENTRY_BYTES + len("s") + len("r")


_STEP = st.one_of(
    st.tuples(st.just("chunk"), st.sampled_from(["a", "b"]), st.sampled_from(["prefill", "decode", "agg"]),
              st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("redeliver"), st.integers(0, 50)),  # the same stored message, a new token
    st.tuples(st.just("republish"), st.integers(0, 50)),  # the same chunk, another stored message
    st.tuples(st.just("migrate"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("shed"), st.integers(1, 4)),
    st.tuples(st.just("abandon"), st.sampled_from(["a", "b"])),
    st.tuples(st.just("tick"), st.integers(1, 400)),
)


@settings(max_examples=400, deadline=None)
@given(steps=st.lists(_STEP, max_size=40))
# a prefill seq past the complete leg's final (ends the request), a prefill chunk after the leg timed out
@example(steps=[("chunk", "a", "prefill", 0, True, False), ("chunk", "a", "prefill", 1, False, False)])
@example(steps=[("chunk", "a", "decode", 0, False, True), ("chunk", "a", "prefill", 0, False, False), ("tick", 40),
                ("chunk", "a", "prefill", 1, False, False)])
# a redelivery, and a republish, of a buffered chunk, then the chunk before it
@example(steps=[("chunk", "a", "agg", 1, False, False), ("redeliver", 0), ("chunk", "a", "agg", 0, False, False)])
@example(steps=[("chunk", "b", "decode", 1, False, False), ("republish", 0), ("chunk", "b", "decode", 0, False, False)])
def test_held_tokens_per_stored_message_match_a_recount_of_the_unsettled_tokens(steps):
    """``held_tokens(group, stored)`` asks for stored messages only of requests holding a repeat
    (``_Request.repeats``, 2026-12-05): a repeat held without counting it would count a redelivery
    twice (requests shed below the server's limit), a path that released held tokens without resetting
    the count would ask again of every later leg (the watchdog's 15 ms). Recounted here from outside:
    the tokens delivered and not yet settled (by a result, a Settle, a seal or an abandon), per
    request, as distinct stored messages. (Fails with either ``repeats += 1`` or the seal's reset
    removed; the other resets precede the request's end.) A prefill chunk after the leg was given up
    (``prefill_timeout``) may repeat one the correlator holds: it no longer knows which seqs it held.

    And when held tokens are settled: the deliveries of one stored message are settled together (a
    redelivery's ack is the original's: acked alone, it would release the original before its result
    is stored), and a result that settles a chunk settles every delivery of that chunk so far (a
    repeat delivers nothing new once its original's result is stored: held on, it counted towards
    shedding until its request ended; failed before 2026-12-06)."""
    codec = MigratingToyCodec()
    c = Correlator(lambda name: codec, codec.name, CorrelatorConfig(request_timeout=300.0))
    roles = {"prefill": Role.PREFILL, "decode": Role.DECODE, "agg": Role.AGG}
    published: list[Chunk] = []  # each a stored message (its token names it: "<message>#<delivery>")
    unsettled: dict[str, str] = {}  # token -> request id
    chunk_of: dict[str, tuple] = {}  # token -> (request id, role, seq, attempt) of the chunk it delivers
    settled_chunks: set[tuple] = set()  # chunks a result settled a token of, in this step
    settled_messages: set[str] = set()  # stored messages a token of was settled, in this step
    deliveries = 0
    now = 0.0
    repeated: set[str] = set()  # requests sent a copy of a chunk since they last held nothing
    gave_up: set[str] = set()  # requests whose prefill leg timed out (in their current attempt)

    asked: set[str] = set()

    def stored(token: object) -> int:
        asked.add(token)  # type: ignore[arg-type]
        return int(str(token).split("#")[0])

    def take(decisions) -> None:
        for d in decisions:
            if isinstance(d, Notice) and d.event == "prefill_timeout":
                gave_up.add(d.request_id)
            tokens = getattr(d, "settles", None) or getattr(d, "tokens", ())
            for t in tokens:
                assert t in unsettled, f"{t} settled twice or never delivered"
                del unsettled[t]
                settled_messages.add(t.split("#")[0])
                if isinstance(d, Result):
                    settled_chunks.add(chunk_of[t])

    def deliver(chunk: Chunk, message: int) -> None:
        nonlocal deliveries
        deliveries += 1
        token = f"{message}#{deliveries}"
        unsettled[token] = chunk.request_id
        chunk_of[token] = (chunk.request_id, chunk.role, chunk.seq, chunk.attempt)
        take(c.receive(msgspec.structs.replace(chunk, token=token), now))

    for step in steps:
        now += 1.0
        settled_chunks.clear()
        settled_messages.clear()
        kind = step[0]
        if kind == "chunk":
            _, rid, role, seq, final, needy = step
            body = b"need:x" if needy and role != "prefill" else b"p" if role == "prefill" else b"1"
            attempt = c.attempt_of(rid) or 0  # the granted attempt's chunks (a seal drops earlier ones)
            chunk = Chunk(rid, roles[role], seq, body, final=final, attempt=attempt)
            if any((p.request_id, p.role, p.seq, p.attempt) == (rid, chunk.role, seq, attempt) for p in published):
                repeated.add(rid)  # another copy of that chunk, as far as the correlator can tell
            elif role == "prefill" and rid in gave_up:
                repeated.add(rid)  # maybe a copy of a prefill chunk held when the leg was given up
            published.append(chunk)
            deliver(chunk, len(published) - 1)
        elif kind == "redeliver" and published:
            repeated.add(published[step[1] % len(published)].request_id)
            deliver(published[step[1] % len(published)], step[1] % len(published))
        elif kind == "republish" and published:
            published.append(published[step[1] % len(published)])
            repeated.add(published[-1].request_id)
            deliver(published[-1], len(published) - 1)
        elif kind == "migrate":
            reply, decisions = c.migrate(step[1], now)
            take(decisions)
            if reply.__class__.__name__ == "Sealed":
                gave_up.discard(step[1])  # the next attempt has its own prefill leg
        elif kind == "shed":
            take(c.shed(lambda rid: True, step[1], now, "partition full", stored))
        elif kind == "abandon":
            for t in c.abandon(lambda rid, gone=step[1]: rid == gone):
                del unsettled[t]
        elif kind == "tick":
            now += step[1]
            take(c.tick(now))
        by_request: dict[str, set[int]] = {}
        for t, rid in unsettled.items():
            by_request.setdefault(rid, set()).add(int(t.split("#")[0]))
        asked.clear()
        assert c.held_tokens(lambda rid: 0, stored) == ({0: sum(map(len, by_request.values()))} if by_request else {})
        # asked only of a request that may hold a repeat: one sent a copy since it last held nothing
        # (a count not reset where its tokens were released would ask a later attempt's own legs)
        repeated &= set(by_request)
        assert {unsettled[t] for t in asked} <= repeated, (asked, repeated)
        assert c.held_tokens(lambda rid: 0) == ({0: len(unsettled)} if unsettled else {})
        # every unsettled token was delivered by this step's end: none may be left of what was settled
        left = [t for t in unsettled if t.split("#")[0] in settled_messages]
        assert not left, f"{left} held after another delivery of their stored message was settled"
        left = [t for t in unsettled if chunk_of[t] in settled_chunks]
        assert not left, f"{left} held after a result settled their chunk"
