"""``DirectFrames.offer`` (edge/direct.py) writes a result from the fan-out only when the stream's task
would write it next: results its feed holds in order (``ResultFeed.ready``: a filled gap released them)
go first, so the fan-out declines while any wait, and the stream's seq does not move on; and it counts
what it writes as ``EdgeMetrics.sent`` would. Both are read inline now, ``ready`` as an attribute and the
metrics without the call, one Python call per SSE event less each (docs/benchmarks.md, "seventh
pass"); these pin the rules kept."""

from __future__ import annotations

import collections
import sys
import types

import hypothesis.strategies as st
from hypothesis import given, settings
from streamproc.core.events import ResultInfo, Verdict
from streamproc.core.reorder import SeqOrder
from streamproc.edge import sse
from streamproc.edge.direct import DirectFrames, WriteBatch
from streamproc.edge.metrics import EdgeMetrics


class Parked:
    """An inbox whose stream's task waits with nothing queued (``Inbox.parked``)."""

    def parked(self) -> bool:
        return True


def writable_body() -> types.SimpleNamespace:
    """Uvicorn's cycle, flow and transport as ``offer`` reads them: headers out, chunked, writable."""
    cycle = types.SimpleNamespace(response_started=True, response_complete=False, disconnected=False,
                                  chunked_encoding=True)
    transport = types.SimpleNamespace(is_closing=lambda: False, write=lambda data: None)
    flow = types.SimpleNamespace(write_paused=False)
    return types.SimpleNamespace(cycle=cycle, flow=flow, transport=transport)


def direct_with(ready: list[ResultInfo],
                encode=None) -> tuple[DirectFrames, types.SimpleNamespace, EdgeMetrics]:
    feed = types.SimpleNamespace(inbox=Parked(), overrun=False, replay=None, request_id="r1",
                                 order=SeqOrder(), ready=collections.deque(ready))
    metrics = EdgeMetrics()
    if encode is None:
        encode = lambda result: b"frame %d" % result.seq  # noqa: E731
    direct = DirectFrames(feed, encode, metrics, WriteBatch(lambda: True))  # type: ignore[arg-type]
    direct.out = writable_body()  # type: ignore[assignment]
    return direct, feed, metrics


def result(seq: int, verdict: Verdict | None = Verdict.PASSTHROUGH) -> ResultInfo:
    return ResultInfo("r1", seq, False, verdict, None, b"{}")


def test_offer_writes_the_next_result_when_nothing_waits_in_its_feed():
    direct, feed, metrics = direct_with([])
    assert direct.offer(result(0)) is True
    assert feed.order.next_seq == 1 and direct.pending == [b"frame 0"] and metrics.results_sent == 1


def test_offer_declines_while_its_feed_holds_results_in_order_and_moves_nothing_on():
    direct, feed, metrics = direct_with([result(5)])
    assert direct.offer(result(0)) is False
    assert feed.order.next_seq == 0 and direct.pending == [] and metrics.results_sent == 0
    feed.ready.clear()  # the task took them: the fan-out writes again
    assert direct.offer(result(0)) is True


def test_offer_counts_what_it_writes_as_edge_metrics_sent_does():
    """Each verdict and none ("unknown"); an error result never goes direct (next_in_line declines
    it), so the task's path counts it, with its kind, through ``sent``."""
    direct, _, metrics = direct_with([])
    expected = EdgeMetrics()
    verdicts = [Verdict.PASSTHROUGH, Verdict.JOINED, None, Verdict.PASSTHROUGH, Verdict.OMITTED,
                Verdict.STITCHED]
    for seq, verdict in enumerate(verdicts):
        assert direct.offer(result(seq, verdict)) is True
        expected.sent(result(seq, verdict))
    failed = ResultInfo("r1", len(verdicts), False, None, "codec_error: boom", b"{}")
    assert direct.offer(failed) is False
    assert (metrics.results_sent, metrics.by_verdict, metrics.by_error_kind) == (
        expected.results_sent, expected.by_verdict, expected.by_error_kind)
    assert metrics.by_verdict == {"passthrough": 2, "joined": 1, "unknown": 1, "omitted": 1, "stitched": 1}
    assert metrics.results_written_directly == len(verdicts)


@given(next_seq=st.integers(0, 4), done=st.booleans(), waiting=st.lists(st.integers(0, 6), max_size=2),
       seq=st.integers(0, 6), final=st.booleans(), error=st.sampled_from([None, "", "timeout: late"]))
@settings(max_examples=400, deadline=None)
def test_offer_takes_a_result_exactly_when_next_in_line_would(next_seq: int, done: bool, waiting: list[int],
                                                              seq: int, final: bool, error: str | None):
    """``offer`` reads ``SeqOrder.next_in_line``'s test inline (docs/benchmarks.md, "eighth pass"): on any
    order state and result, it takes the result exactly when ``next_in_line`` says True, and leaves the
    order as ``next_in_line`` leaves it (next seq, pending results, done)."""
    direct, feed, metrics = direct_with([])
    twin = SeqOrder()
    for order in (feed.order, twin):
        order.next_seq, order.done = next_seq, done
        order.pending.update({s: result(s) for s in waiting})
    offered = ResultInfo("r1", seq, final, Verdict.PASSTHROUGH, error, b"{}")
    expected = twin.next_in_line(offered)
    assert direct.offer(offered) is expected
    order = feed.order
    assert (order.next_seq, order.pending, order.done) == (twin.next_seq, twin.pending, twin.done)
    assert metrics.results_sent == int(expected)


BODIES = [b"", b"plain", b'{"text":" token"}', b"a\nb", b"a\rb", b"a\r\nb", b"\n", b"\r", b"end\n",
          b"\rstart", b"\x0b\x0c\x85 not line breaks", "caf\u00e9\u2028".encode()]


def test_offer_frames_a_result_as_result_event_does_without_calling_it():
    """``offer`` formats a one-line body's frame itself where the stream's encoding is
    ``sse.result_event`` (docs/benchmarks.md, "eighth pass"): the same bytes as ``sse.event`` for every
    body (line breaks go through ``result_event``), and no call for a one-line body (one per event before)."""
    direct, _, _ = direct_with([], encode=sse.result_event)
    calls = [0]
    code = sse.result_event.__code__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls[0] += 1

    sys.setprofile(profile)
    try:
        for seq in range(3):
            assert direct.offer(ResultInfo("r1", seq, False, None, None, b'{"n":%d}' % seq)) is True
    finally:
        sys.setprofile(None)
    assert calls[0] == 0
    assert direct.pending == [b'id: %d\ndata: {"n":%d}\n\n' % (seq, seq) for seq in range(3)]
    direct.pending.clear()
    for seq, body in enumerate(BODIES, start=3):
        assert direct.offer(ResultInfo("r1", seq, False, None, None, body)) is True
        assert direct.pending[-1] == sse.event(body, id=seq), body
