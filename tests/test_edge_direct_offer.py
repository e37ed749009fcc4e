"""``DirectFrames.offer`` (edge/direct.py) writes a result from the fan-out only when the stream's task
would write it next: results its feed holds in order (``ResultFeed.ready``: a filled gap released them)
go first, so the fan-out declines while any wait, and the stream's seq does not move on; and it counts
what it writes as ``EdgeMetrics.sent`` would. Both are read inline now, ``ready`` as an attribute and the
metrics without the call, one Python call per SSE event less each (docs/benchmarks.md, "seventh
pass"); these pin the rules kept."""

from __future__ import annotations

import collections
import types

from streamproc.core.events import ResultInfo, Verdict
from streamproc.core.reorder import SeqOrder
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


def direct_with(ready: list[ResultInfo]) -> tuple[DirectFrames, types.SimpleNamespace, EdgeMetrics]:
    feed = types.SimpleNamespace(inbox=Parked(), overrun=False, replay=None, request_id="r1",
                                 order=SeqOrder(), ready=collections.deque(ready))
    metrics = EdgeMetrics()
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
