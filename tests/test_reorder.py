"""One request's results read back in order (:class:`streamproc.core.reorder.SeqOrder`), pure.

Every reader (the client helpers, the edge's feeds, the simulator's verifier) hands results out
through it; until these tests only NATS tests reached it, and none of its bounds or edge cases was
pinned (mutants of each rule survived the pure suite).
"""

from __future__ import annotations

import copy

import pytest
from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.events import ResultInfo
from streamproc.core.reorder import SeqOrder


def result(seq: int, final: bool = False, error: str | None = None) -> ResultInfo:
    return ResultInfo("r", seq, final, None, error, b"%d" % seq)


@st.composite
def readings(draw):
    """A request of ``n`` results (the last final), read back as a shuffled list with repeats,
    after an optional resume point that may lie past its final result."""
    n = draw(st.integers(1, 12))
    deliveries = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=40))
    deliveries += draw(st.permutations(range(n)))  # every seq arrives at least once, somewhere
    deliveries = draw(st.permutations(deliveries))
    after = draw(st.none() | st.integers(0, n + 1))
    return n, deliveries, after


@outbox_settings
@given(readings())
def test_results_are_handed_out_in_seq_order_each_once_after_the_resume_point(case):
    n, deliveries, after = case
    start = 0 if after is None else after + 1
    order = SeqOrder(after)
    out = [r.seq for s in deliveries for r in order.push(result(s, final=s == n - 1))]
    assert out == list(range(start, n))
    assert order.done
    # The final result at or before the resume point: the client has it all, nothing is handed out.
    assert order.ended_before_resume == (start > n - 1)
    assert order.pending == {}


@outbox_settings
@given(readings())
def test_every_delivery_not_handed_out_or_waiting_counts_as_dropped(case):
    """A model with no reorder buffer: a delivery is dropped when the request is already done, when
    its seq is at or before the resume point (except the final one there, which ends the request),
    or when its seq came before."""
    n, deliveries, after = case
    start = 0 if after is None else after + 1
    order = SeqOrder(after)
    seen: set[int] = set()
    done = False
    dropped = 0
    for s in deliveries:
        final = s == n - 1
        order.push(result(s, final=final))
        if done:
            dropped += 1
        elif s < start:
            if final:
                done = True
            else:
                dropped += 1
        elif s in seen:
            dropped += 1
        else:
            seen.add(s)
            done = seen >= set(range(start, n))
        assert order.done == done
        assert order.dropped == order.duplicates == dropped


def test_an_error_result_ends_the_reading_even_when_it_is_not_marked_final():
    order = SeqOrder()
    assert [r.seq for r in order.push(result(2))] == []
    assert [r.seq for r in order.push(result(0))] == [0]
    assert [r.seq for r in order.push(result(1, error="timeout"))] == [1]  # 2 waited: never handed out
    assert order.done and order.pending == {}
    assert order.push(result(3, final=True)) == []


def test_at_most_max_pending_results_wait_for_a_missing_seq_and_a_repeat_of_one_costs_nothing():
    order = SeqOrder(max_pending=3)
    for s in (1, 2, 3):
        assert order.push(result(s)) == []
    assert order.push(result(2)) == []  # a repeat of a waiting result: dropped, not an overflow
    assert order.dropped == 1
    with pytest.raises(OverflowError):
        order.push(result(4))
    assert sorted(order.pending) == [1, 2, 3]  # the refused one was not kept


def test_the_result_that_closes_the_gap_gets_in_when_max_pending_results_wait_for_it():
    """max_pending bounds the results that wait; the missing one waits for nothing: it is handed out
    with all of them (it used to raise OverflowError, failing a reading whose gap had just closed)."""
    order = SeqOrder(max_pending=3)
    for s in (1, 2, 3):
        order.push(result(s))
    assert [r.seq for r in order.push(result(0))] == [0, 1, 2, 3]
    assert order.pending == {}
    resumed = SeqOrder(after=4, max_pending=2)
    for s in (6, 7):
        resumed.push(result(s))
    assert [r.seq for r in resumed.push(result(5))] == [5, 6, 7]


def test_a_resume_point_hands_out_only_the_results_after_it():
    order = SeqOrder(after=2)
    assert order.push(result(2)) == []
    assert [r.seq for r in order.push(result(3))] == [3]


def test_the_next_result_is_not_next_in_line_when_it_ends_the_reading():
    """A final or error result at the next seq ends the reading: ``push`` must take it (done)."""
    order = SeqOrder()
    assert order.next_in_line(result(0)) and order.next_seq == 1
    assert not order.next_in_line(result(1, error="timeout"))
    assert not order.next_in_line(result(1, final=True))
    assert order.next_seq == 1 and not order.done


@outbox_settings
@given(readings(), st.integers(-2, 2), st.booleans(), st.booleans())
def test_next_in_line_says_yes_only_where_push_would_hand_out_that_one_result_and_end_nothing(
        case, near, final, error):
    """The edge's fast path (``edge/direct.py``) calls ``next_in_line`` instead of ``push``: a True
    must mean exactly what ``push`` would have done (nothing else became ready, the reading goes on),
    and a False must change nothing, so the caller can push the result after all."""
    n, deliveries, after = case
    order = SeqOrder(after)
    for s in deliveries[: len(deliveries) // 2]:  # part of the reading: some results wait, maybe
        order.push(result(s, final=s == n - 1))
    r = result(max(0, order.next_seq + near), final=final, error="internal" if error else None)
    pushed = copy.deepcopy(order)
    before = (order.next_seq, dict(order.pending), order.done, order.duplicates)
    if order.next_in_line(r):
        assert pushed.push(r) == [r]
        assert (order.next_seq, order.pending, order.done) == (pushed.next_seq, pushed.pending, pushed.done)
        assert not order.done
    else:
        assert (order.next_seq, dict(order.pending), order.done, order.duplicates) == before


def test_a_final_below_a_seq_already_handed_out_ends_the_reading_as_contradicted_not_clean():
    """Results 0-9 handed out (none final), then a final at seq 2 (a writer with publish rights on the
    results subject, or a broken processor: no processor makes one). Until 2026-12-07 it ended the
    reading as ``ended_before_resume``, a clean end with results missing."""
    order = SeqOrder()
    for seq in range(10):
        assert order.push(result(seq)) == [result(seq)]
    assert order.push(result(2, final=True)) == []
    assert order.done and order.contradicted == 2 and not order.ended_before_resume
    assert order.push(result(10, final=True)) == []  # the ending holds


@pytest.mark.parametrize("after", [5, 9])
def test_a_final_below_the_resume_point_after_a_later_seq_was_seen_is_contradicted(after):
    """A resume reads its Last-Event-ID's result again: seen not final, it rules out an earlier final."""
    order = SeqOrder(after)
    assert order.push(result(after)) == []
    assert order.push(result(2, final=True)) == []
    assert order.done and order.contradicted == 2 and not order.ended_before_resume


@pytest.mark.parametrize("after", [0, 5])
def test_a_final_at_the_resume_points_seq_after_its_non_final_copy_is_contradicted(after):
    """The resume point's result read again (not final), then a final, not an error, at that same
    seq (a forger's, stored before the request's next result): one seq has one result, so the client
    that had it as not final does not have it all. Until 2026-12-07 it ended the reading clean."""
    order = SeqOrder(after)
    assert order.push(result(after)) == []
    assert order.push(result(after, final=True)) == []
    assert order.done and order.contradicted == after and not order.ended_before_resume


@pytest.mark.parametrize(("final", "after"), [(4, 4), (4, 6), (0, 0), (0, 3)])
def test_the_final_at_or_before_the_resume_point_with_nothing_past_it_seen_still_ends_clean(final, after):
    """The honest cases: a Last-Event-ID at or past the final seq, earlier results read again first."""
    order = SeqOrder(after)
    for seq in range(final):
        assert order.push(result(seq)) == []
    assert order.push(result(final, final=True)) == []
    assert order.done and order.ended_before_resume and order.contradicted is None


def test_a_repeat_of_the_final_handed_out_is_a_duplicate_not_a_contradiction():
    order = SeqOrder()
    for seq in range(4):
        order.push(result(seq, final=seq == 3))
    assert order.push(result(3, final=True)) == [] and order.contradicted is None and order.duplicates == 1


@st.composite
def honest_readings(draw):
    """An honest request's results 0..n (the last final, or a final error result), each delivered
    one or more times (a JetStream replay overlapping the live subscription, a processor's republish
    after a crash), in any order, after an optional resume point at, before or past the final; each
    delivery offered first to ``next_in_line`` (the edge's direct path) or not."""
    n = draw(st.integers(0, 10))
    deliveries = draw(st.permutations(list(range(n + 1))))
    deliveries = draw(st.permutations(deliveries + draw(st.lists(st.integers(0, n), max_size=30))))
    after = draw(st.none() | st.integers(0, n + 2))
    direct = draw(st.lists(st.booleans(), min_size=len(deliveries), max_size=len(deliveries)))
    error = draw(st.sampled_from([None, "timeout", "internal"]))
    return n, deliveries, after, direct, error


@outbox_settings
@given(honest_readings())
def test_no_interleaving_of_an_honest_request_s_results_is_ever_contradicted(case):
    """The risk of ``contradicted``: an honest stream ended with an error. Seqs end at the final
    (a migrated request's continue at the seal's ``result_seq``: still one run 0..n), so however
    copies of them interleave, and wherever the reader resumes, the reading ends clean."""
    n, deliveries, after, direct, error = case
    order = SeqOrder(after)
    out = []
    for seq, fast in zip(deliveries, direct):
        r = result(seq, final=seq == n, error=error if seq == n else None)
        if fast and order.next_in_line(r):
            out.append(seq)
        else:
            out.extend(x.seq for x in order.push(r))
        assert order.contradicted is None, (seq, out)
    start = 0 if after is None else after + 1
    if error is not None and start > n + 1:
        # A resume point past the final error result: the client cannot have had that error as its
        # last event, and a restarted processor's error below the results sent looks the same
        # (test_a_resume_past_results_the_client_had_still_hands_out_the_error_below_them): the end said.
        assert out == [n] and order.done and not order.ended_before_resume
        return
    assert out == list(range(start, n + 1)) and order.done
    assert order.ended_before_resume == (start > n)


@pytest.mark.parametrize("after", [None, 3])
def test_a_processor_s_error_result_below_what_the_reader_has_is_handed_out_as_the_end(after):
    """Core mode, a processor restarted mid-request: results 0-5 came from the old one, the new one
    never saw their chunks and ends the request with its ``timeout`` error result at seq 0 (as a
    refused migrate of a request it never saw ends it with ``migration_refused`` at seq 0). Since
    6c39a77 that was ``contradicted`` (an edge said another writer's final), the error lost."""
    order = SeqOrder(after)
    for seq in range(6):
        order.push(result(seq))
    error = result(0, final=True, error="timeout")
    assert order.push(error) == [error]
    assert order.done and order.contradicted is None and not order.ended_before_resume
    assert order.push(result(6, final=True)) == [] and order.duplicates >= 1


@pytest.mark.parametrize("after", [5, 7])
def test_a_resume_past_results_the_client_had_still_hands_out_the_error_below_them(after):
    """The same restarted processor's error at seq 0, read by a client resuming after the results it
    had (Last-Event-ID 5): the replay's first result is that error, below the resume point. It ended
    the reading clean ("the client has it all"), so the client took a failed request for a finished
    one; only an error at the resume point itself is one the client had."""
    order = SeqOrder(after)
    error = result(0, final=True, error="timeout")
    assert order.push(error) == [error]
    assert order.done and not order.ended_before_resume and order.contradicted is None
    at_resume = SeqOrder(after)
    assert at_resume.push(result(after, final=True, error="timeout")) == []
    assert at_resume.done and at_resume.ended_before_resume


@pytest.mark.parametrize("last", [0, 3])
def test_an_error_at_the_seq_of_the_last_result_the_reader_had_is_below_it_and_handed_out(last):
    """The restarted processor's error at seq 0 when result 0 is all the old one published (or at the last
    result's seq): the reader had a result at that seq, so the error is below it (``error_below``: no SSE
    id), and a resume from that seq (Last-Event-ID 0, the client had result 0, not the error) hands it out;
    5f0b9b9 ended that resume clean, as if the client had the error."""
    for after in [None, *range(last + 1)]:
        order = SeqOrder(after)
        for seq in range(last + 1):
            order.push(result(seq))
        error = result(last, final=True, error="timeout")
        assert order.push(error) == [error], after
        assert order.done and order.error_below and not order.ended_before_resume, after
    honest = SeqOrder(last)  # the error in seq order, the client's last event: it has it
    for seq in range(last):
        honest.push(result(seq))
    assert honest.push(result(last, final=True, error="timeout")) == [] and honest.ended_before_resume
