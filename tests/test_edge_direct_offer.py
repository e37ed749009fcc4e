"""``DirectFrames.offer`` (edge/direct.py) writes a result from the fan-out only when the stream's task
would write it next: results its feed holds in order (``ResultFeed.ready``: a filled gap released them)
go first, so the fan-out declines while any wait, and the stream's seq does not move on. The test reads
``ready`` as an attribute now, not through a method call per SSE event (docs/benchmarks.md, "seventh
pass"); this pins the rule kept."""

from __future__ import annotations

import collections
import types

from streamproc.core.events import ResultInfo, Verdict
from streamproc.core.reorder import SeqOrder
from streamproc.edge.direct import DirectFrames, WriteBatch


class Parked:
    """An inbox whose stream's task waits with nothing queued (``Inbox.parked``)."""

    def parked(self) -> bool:
        return True


class Metrics:
    def __init__(self) -> None:
        self.sent_results: list[ResultInfo] = []
        self.results_written_directly = 0

    def sent(self, result: ResultInfo) -> None:
        self.sent_results.append(result)


def writable_body() -> types.SimpleNamespace:
    """Uvicorn's cycle, flow and transport as ``offer`` reads them: headers out, chunked, writable."""
    cycle = types.SimpleNamespace(response_started=True, response_complete=False, disconnected=False,
                                  chunked_encoding=True)
    transport = types.SimpleNamespace(is_closing=lambda: False, write=lambda data: None)
    return types.SimpleNamespace(cycle=cycle, flow=types.SimpleNamespace(write_paused=False), transport=transport)


def direct_with(ready: list[ResultInfo]) -> tuple[DirectFrames, types.SimpleNamespace, Metrics]:
    feed = types.SimpleNamespace(inbox=Parked(), overrun=False, replay=None, request_id="r1",
                                 order=SeqOrder(), ready=collections.deque(ready))
    metrics = Metrics()
    direct = DirectFrames(feed, lambda result: b"frame %d" % result.seq, metrics, WriteBatch(lambda: True))  # type: ignore[arg-type]
    direct.out = writable_body()  # type: ignore[assignment]
    return direct, feed, metrics


def result(seq: int) -> ResultInfo:
    return ResultInfo("r1", seq, False, Verdict.PASSTHROUGH, None, b"{}")


def test_offer_writes_the_next_result_when_nothing_waits_in_its_feed():
    direct, feed, metrics = direct_with([])
    assert direct.offer(result(0)) is True
    assert feed.order.next_seq == 1 and direct.pending == [b"frame 0"] and metrics.sent_results == [result(0)]


def test_offer_declines_while_its_feed_holds_results_in_order_and_moves_nothing_on():
    direct, feed, metrics = direct_with([result(5)])
    assert direct.offer(result(0)) is False
    assert feed.order.next_seq == 0 and direct.pending == [] and metrics.sent_results == []
    feed.ready.clear()  # the task took them: the fan-out writes again
    assert direct.offer(result(0)) is True
