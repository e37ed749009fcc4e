"""Joins as Work decisions (core mode): the correlator names the call that may run elsewhere and takes
the outcome back in order; it never starts a thread itself."""

from __future__ import annotations

import pytest
from toy_codec import MigratingToyCodec, chunk, correlator, counting_correlator, errors

from streamproc.core.correlator import Work
from streamproc.wire import Chunk, Result, Role

MiB = 1 << 20


def split(decisions):
    works = [d for d in decisions if isinstance(d, Work)]
    results = [(d.request_id, d.seq) for d in decisions if isinstance(d, Result)]
    return works, results


def test_a_join_becomes_work_its_request_waits_and_other_requests_pass_meanwhile():
    c = correlator()
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"inflate:10", final=True), 0.0)
    works, results = split(c.receive(chunk("pd", "decode", 0, b"a"), 0.0))
    assert len(works) == 1 and results == []
    assert split(c.receive(chunk("pd", "decode", 1, b"b", final=True), 0.0)) == ([], [])  # queued behind
    assert split(c.receive(chunk("agg", "agg", 0, b"x", final=True), 0.0))[1] == [("agg", 0)]
    works[0].run()
    more, results = split(c.finish(works[0], 0.0))
    assert results == [("pd", 0)] and len(more) == 1  # seq 1 is the next join
    more[0].run()
    assert split(c.finish(more[0], 0.0))[1] == [("pd", 1)]
    assert c.inflight == 0 and c.charged_bytes == 0


def test_one_work_is_outstanding_at_a_time_and_the_next_starts_when_it_finishes():
    c = correlator(max_total_bytes=100 * MiB)
    c.offload_joins = True
    works, out = [], []
    for i in range(3):
        size = (40 + i // 2) * MiB  # r2 inflates the most: it is the biggest holder when the budget is full
        out += c.receive(chunk(f"r{i}", "prefill", 0, b"inflate:%d" % size, final=True), 0.0)
        decisions = c.receive(chunk(f"r{i}", "decode", 0, b"d"), 0.0)
        works += split(decisions)[0]
    assert [w.request_id for w in works] == ["r0"]  # r1 waits its turn
    assert errors(out) == [("r2", "overloaded")]  # the toy codec decodes at absorb: r2 passed the budget
    works[0].run()
    nxt, results = split(c.finish(works[0], 0.0))
    assert results == [("r0", 0)] and [w.request_id for w in nxt] == ["r1"]


def test_the_outcome_of_work_for_a_request_that_ended_meanwhile_is_dropped():
    c = correlator(request_timeout=5.0)
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"p", final=True), 0.0)
    (work,), _ = split(c.receive(chunk("pd", "decode", 0, b"a"), 0.0))
    assert errors(c.tick(6.0)) == [("pd", "timeout")]
    work.run()
    assert c.finish(work, 6.0) == []


def test_a_codec_failure_in_work_ends_only_its_request_as_internal():
    c = correlator()
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"p", final=True), 0.0)
    (work,), _ = split(c.receive(chunk("pd", "decode", 0, b"a"), 0.0))
    work._job = lambda: (_ for _ in ()).throw(RuntimeError("codec bug"))
    work.run()
    assert errors(c.finish(work, 0.0)) == [("pd", "internal")]


def test_a_recursion_error_in_work_is_the_bodys_nesting_and_ends_the_request_as_invalid_chunk():
    c = correlator()
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"p", final=True), 0.0)
    (work,), _ = split(c.receive(chunk("pd", "decode", 0, b"a"), 0.0))
    work._job = lambda: (_ for _ in ()).throw(RecursionError("maximum recursion depth exceeded"))
    work.run()
    assert errors(c.finish(work, 0.0)) == [("pd", "invalid_chunk")]


def test_a_request_whose_joins_pass_the_decode_time_budget_is_ended_and_others_go_on():
    c = correlator(max_decode_cpu=0.25)
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"p", final=True), 0.0)
    ticks = iter([0.0, 0.1, 1.0, 1.1, 2.0, 2.1])  # each join takes 0.1 s of (thread) CPU
    clock = ticks.__next__
    published = []
    for seq in range(3):
        (work,), _ = split(c.receive(chunk("pd", "decode", seq, b"d", final=seq == 2), 0.0))
        work.run(clock)
        assert abs(work.cpu - 0.1) < 1e-9
        out = c.finish(work, 0.0)
        published += [(d.seq, d.error) for d in out if isinstance(d, Result)]
    # 0.1 and 0.2 s are within the budget; the third join would make 0.3 s: its result is dropped
    # and the request ends at that seq, overloaded.
    assert published == [(0, None), (1, None), (2, "overloaded")]
    assert c.stats.over_cpu == 1 and c.inflight == 0
    assert split(c.receive(chunk("agg", "agg", 0, b"x", final=True), 0.0))[1] == [("agg", 0)]


def test_only_joins_that_decode_sequence_data_are_charged_when_the_codec_counts_its_decodes():
    """The budget bounds inflation: a join whose session's ``decodes`` did not grow (a logprob copy) is
    not charged, however long it took; one that decoded rows is."""
    c = counting_correlator(max_decode_cpu=0.25)
    c.offload_joins = True
    c.receive(chunk("pd", "prefill", 0, b"p", final=True), 0.0)
    ticks = iter(x for k in range(10) for x in (k, k + 0.2))  # each join takes 0.2 s of CPU
    published = []
    bodies = [b"logprobs"] * 5 + [b"rows", b"logprobs", b"rows"]
    for seq, body in enumerate(bodies):
        (work,), _ = split(c.receive(chunk("pd", "decode", seq, body, final=seq == len(bodies) - 1), 0.0))
        work.run(ticks.__next__)
        published += [(d.seq, d.error) for d in c.finish(work, 0.0) if isinstance(d, Result)]
    # 5 x 0.2 s of logprob joins charged nothing; the first rows join 0.2 s, the second passes 0.25 s.
    assert published == [(seq, None) for seq in range(7)] + [(7, "overloaded")]
    assert c.stats.over_cpu == 1


def test_waiting_joins_take_turns_so_one_requests_buffered_joins_never_starve_another():
    """A request with several decode chunks buffered kept the join worker for all of them: the next
    one started as soon as the previous finished, ahead of every request already waiting. Now a
    request whose join finishes goes to the back of the queue when others wait (round robin), so
    another request's join waits for at most one join of each request ahead of it."""
    c = correlator()
    c.offload_joins = True
    c.receive(chunk("heavy", "prefill", 0, b"p", final=True), 0.0)
    (work,), _ = split(c.receive(chunk("heavy", "decode", 0, b"a"), 0.0))
    for seq in (1, 2):  # buffered behind the running join
        assert split(c.receive(chunk("heavy", "decode", seq, b"b", final=seq == 2), 0.0)) == ([], [])
    c.receive(chunk("light", "prefill", 0, b"p", final=True), 0.0)
    assert split(c.receive(chunk("light", "decode", 0, b"c", final=True), 0.0)) == ([], [])  # waits its turn
    order, published = [], []
    while work is not None:
        order.append(work.request_id)
        work.run()
        works, results = split(c.finish(work, 0.0))
        published += results
        assert len(works) <= 1  # still one join at a time
        work = works[0] if works else None
    assert order == ["heavy", "light", "heavy", "heavy"]
    assert published == [("heavy", 0), ("light", 0), ("heavy", 1), ("heavy", 2)]
    assert c.inflight == 0 and c.charged_bytes == 0


def test_join_wait_is_the_wait_for_the_prefill_leg_alone_once_per_result():
    """Observed when the prefill leg completes (0 when it was there), not when a join that ran off
    the loop, or waited for the join thread, is finished: the join's own time is not a wait."""
    c = correlator(max_total_bytes=100 * MiB)
    c.offload_joins = True
    c.receive(chunk("a", "prefill", 0, b"inflate:10", final=True), 0.0)
    (work_a,), _ = split(c.receive(chunk("a", "decode", 0, b"a"), 1.0))  # the leg was there: wait 0
    assert split(c.receive(chunk("b", "decode", 0, b"b", final=True), 1.0)) == ([], [])  # waits for its leg
    assert split(c.receive(chunk("b", "prefill", 0, b"inflate:10", final=True), 3.0)) == ([], [])  # queued
    assert (c.join_wait.count, c.join_wait.total) == (2, 2.0)  # 0 for a, 2 s for b, when its leg came
    work_a.run()
    (work_b,), results = split(c.finish(work_a, 9.0))  # a's join took 8 s; b's starts now
    assert results == [("a", 0)]
    work_b.run()
    assert split(c.finish(work_b, 20.0))[1] == [("b", 0)]
    assert (c.join_wait.count, c.join_wait.total) == (2, 2.0)


def test_join_seconds_times_the_join_itself_inline_with_the_shells_clock_and_offloaded_with_work_cpu():
    """One observation per join wherever it ran: an inline join timed with the shell's ``join_clock``
    (the core reads no clock of its own), an offloaded one with the CPU its Work measured."""
    c = correlator()
    ticks = iter([1.0, 1.25])
    c.join_clock = lambda: next(ticks)
    c.receive(chunk("in", "prefill", 0, b"inflate:10", final=True), 0.0)
    assert split(c.receive(chunk("in", "decode", 0, b"a", final=True), 0.0)) == ([], [("in", 0)])
    assert (c.join_seconds.count, c.join_seconds.total) == (1, 0.25)
    c.offload_joins = True
    c.receive(chunk("off", "prefill", 0, b"inflate:10", final=True), 0.0)
    (work,), _ = split(c.receive(chunk("off", "decode", 0, b"a", final=True), 0.0))
    assert c.join_seconds.count == 1  # not yet run
    cpu = iter([2.0, 2.5])
    work.run(lambda: next(cpu))
    assert split(c.finish(work, 0.0))[1] == [("off", 0)]
    assert (c.join_seconds.count, c.join_seconds.total) == (2, 0.75)
    assert c.join_wait.count == 2  # the wait is observed apart, once per result


@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd", "vllm"])
def test_a_final_join_drops_prefills_decoded_rows_so_the_joining_thread_frees_them_not_the_event_loop(fmt):
    """Prefill's rows are kept decoded while later chunks may need them; the final join drops them, so
    they are freed in the thread that ran it (freeing 32 MiB holds the GIL ~2 ms), and the session the
    event loop forgets holds nothing large."""
    from streamproc.catalog import codec_class, worker_for
    from streamproc.codec import CodecOptions
    from streamproc.sim.simulation import make_truth

    worker = worker_for(fmt)
    truth = make_truth(3, prompt_len=64, output_len=4)
    [decode] = worker.decode(truth, stream=False)
    session = codec_class(fmt)(CodecOptions()).open_session()
    session.absorb_prefill(worker.prefill(truth, stream=False))
    _, verdict = session.join(decode, False)
    assert verdict.value == "joined" and session.retained_bytes() > 0  # kept for the chunks to come
    _, verdict = session.join(decode, True)
    assert verdict.value == "joined"
    assert session.retained_bytes() == 0


def test_an_offloaded_join_runs_at_a_lower_scheduling_priority_than_the_event_loop():
    """The join thread drops to nice +JOIN_NICENESS (Linux applies it to the calling thread only), so on
    shared cores the scheduler runs the event loop's passthrough before a join that inflates."""
    import os
    import sys
    import threading
    import time

    from streamproc.nats.input import JOIN_NICENESS, run_join

    if sys.platform != "linux":
        pytest.skip("per-thread nice is Linux behaviour")
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    work = Work("r", lambda: (seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())), (b"", None))[1])
    thread = threading.Thread(target=run_join, args=(work, time.thread_time))
    thread.start()
    thread.join()
    assert seen == [min(19, loop_nice + JOIN_NICENESS)] and work.cpu >= 0
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice  # the caller's is untouched


# ------------------------------------------------------------------ a resumed attempt's stitch

class Driver:
    """Feeds a correlator in order and runs each Work at once, as the join thread would, then
    finishes it; ``in_work`` says whether a Work is running right now."""

    def __init__(self, c) -> None:
        self.c = c
        self.results: list[Result] = []
        self.works: list[Work] = []
        self.in_work = False

    def feed(self, chunks, now: float = 0.0) -> list[Result]:
        start = len(self.results)
        for ch in chunks:
            decisions = self.c.receive(ch, now)
            while decisions:
                d = decisions.pop(0)
                if isinstance(d, Work):
                    self.works.append(d)
                    self.in_work = True
                    try:
                        d.run()
                    finally:
                        self.in_work = False
                    decisions += self.c.finish(d, now)
                elif isinstance(d, Result):
                    self.results.append(d)
        return self.results[start:]


@pytest.mark.parametrize("pd", [False, True], ids=["agg", "pd"])
@pytest.mark.parametrize("fmt", ["sglang", "sglang-zstd", "vllm"])
def test_a_resumed_attempts_chunks_are_stitched_in_work_with_the_bytes_of_the_inline_stitch(fmt, pd):
    """A resumed attempt's stitch may inflate and splice rows (sglang-zstd decompresses them): with
    joins offloaded it runs in its chunk's Work, after the join, never on the event loop, and
    finish() publishes what the inline path publishes, byte for byte, without stitching again."""
    from streamproc.catalog import Catalog, worker_for
    from streamproc.core.correlator import Correlator, CorrelatorConfig
    from streamproc.sim.simulation import make_truth
    from streamproc.testing.harness import leg
    from streamproc.wire import Role, Verdict

    worker = worker_for(fmt)
    if fmt == "vllm":  # a stream with usage (stream_options.include_usage), which the stitch restates;
        from streamproc_vllm import upstream  # the default stream has none: nothing to stitch
        from streamproc_vllm.worker import VLLMWorker

        worker = VLLMWorker(shape=upstream.Shape(include_usage=True))
    truth = make_truth(7, request_id="m", prompt_len=40, output_len=12, chunk_sizes=[3, 3, 3, 3])
    first = leg("m", Role.AGG, worker.agg(truth, stream=True))[:2]  # 6 tokens published, then it moves
    if pd:
        resumed = (leg("m", Role.PREFILL, worker.prefill_resumed(truth, 6, stream=True), attempt=1)
                   + leg("m", Role.DECODE, worker.decode_resumed(truth, 6, stream=True), attempt=1))
    else:
        resumed = leg("m", Role.AGG, worker.agg_resumed(truth, 6, stream=True), attempt=1)
    views = {}
    for offload in (False, True):
        c = Correlator(Catalog(), fmt, CorrelatorConfig())
        c.offload_joins = offload
        run = Driver(c)
        run.feed(first)
        reply, _ = c.migrate("m", 0.0)
        assert reply.attempt == 1 and reply.emitted_tokens == 6
        migration, stitched_in_work = c._active["m"].migration, []
        stitch = migration.stitch
        migration.stitch = lambda body, final: stitched_in_work.append(run.in_work) or stitch(body, final)
        works_before = len(run.works)
        later = run.feed(resumed)
        published = len(worker.agg_resumed(truth, 6, stream=True))  # the resumed attempt's results
        assert len(later) == published and any(r.verdict is Verdict.STITCHED for r in later)
        assert stitched_in_work == [offload] * len(later)  # once per result; in Work iff offloaded
        if offload:  # every resumed result came out of finish(), one Work each
            assert len(run.works) - works_before == len(later)
        views[offload] = [(r.seq, r.final, r.verdict, r.error, r.body) for r in run.results]
    assert views[True] == views[False]


class FailingStitch(MigratingToyCodec):
    """The migrating toy, whose stitch raises (a codec bug)."""

    def open_migration(self):
        session = super().open_migration()
        session.stitch = lambda body, final: (_ for _ in ()).throw(RuntimeError("stitch bug"))
        return session


def resumed_toy(codec, offload: bool, **config):
    """A toy request with one published result, migrated: its correlator and driver, at attempt 1."""
    from streamproc.core.correlator import Correlator, CorrelatorConfig

    c = Correlator(lambda name: codec, codec.name, CorrelatorConfig(**config))
    c.offload_joins = offload
    run = Driver(c)
    run.feed([Chunk("m", Role.AGG, 0, b"1 2")])
    c.migrate("m", 0.0)
    return c, run


def test_a_stitch_that_raises_in_work_ends_the_request_as_the_inline_stitch_does():
    views = []
    for offload in (False, True):
        _, run = resumed_toy(FailingStitch(), offload)
        run.feed([Chunk("m", Role.AGG, 0, b"3", True, attempt=1)])
        assert len(run.works) == offload
        views.append([(r.seq, r.final, r.verdict, r.error, r.body) for r in run.results])
    assert views[0] == views[1] and views[0][-1][3] == "internal"


def test_a_resumed_attempts_stitch_in_work_is_charged_to_the_decode_time_budget():
    """The stitch may inflate rows: its Work's CPU counts, whatever the join session's decodes say."""
    c, _ = resumed_toy(MigratingToyCodec(), True, max_decode_cpu=0.25)
    ticks = iter([0.0, 0.2, 1.0, 1.2])  # each stitch takes 0.2 s of CPU
    errors_seen = []
    for seq in (0, 1):
        (work,) = [d for d in c.receive(Chunk("m", Role.AGG, seq, b"3", seq == 1, attempt=1), 0.0)
                   if isinstance(d, Work)]
        work.run(ticks.__next__)
        errors_seen += [(d.seq, d.error) for d in c.finish(work, 0.0) if isinstance(d, Result)]
    assert errors_seen == [(1, None), (2, "overloaded")] and c.stats.over_cpu == 1
