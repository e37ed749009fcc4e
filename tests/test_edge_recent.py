"""The edge's recent-requests ring (GET /v1/recent): counts that stay right under churn and repeats."""

from streamproc.core.events import ResultInfo, Verdict
from streamproc.edge.recent import RecentRequests


def result(rid: str, seq: int, final: bool = False) -> ResultInfo:
    return ResultInfo(rid, seq, final, Verdict.PASSTHROUGH, None, b"{}")


def entry(ring: RecentRequests, rid: str):
    return next(e for e in ring.newest_first() if e.request_id == rid)


def test_a_request_that_falls_out_of_the_ring_while_running_keeps_its_result_count():
    ring = RecentRequests(2)
    ring.note(result("long", 0), 0.0)
    ring.note(result("long", 1), 0.1)
    ring.note(result("a", 0), 0.2)
    ring.note(result("b", 0), 0.3)  # "long" is evicted here
    assert "long" not in [e.request_id for e in ring.newest_first()]
    ring.note(result("long", 2, final=True), 0.4)
    assert (entry(ring, "long").results, entry(ring, "long").final) == (3, True)


def test_a_repeated_result_is_counted_once():
    ring = RecentRequests(10)
    for seq in (0, 1, 1, 0, 2):
        ring.note(result("r", seq), 0.0)
    assert entry(ring, "r").results == 3
    assert entry(ring, "r").verdicts == {"passthrough": 3}


def test_the_ring_holds_at_most_its_size_newest_first():
    ring = RecentRequests(3)
    for i in range(5):
        ring.note(result(f"r{i}", 0), float(i))
    assert [e.request_id for e in ring.newest_first()] == ["r4", "r3", "r2"]


def test_a_request_still_producing_results_stays_in_the_ring_ahead_of_quieter_ones():
    ring = RecentRequests(2)
    ring.note(result("busy", 0), 0.0)
    ring.note(result("quiet", 0), 0.1)
    ring.note(result("busy", 1), 0.2)  # seen again: the newest
    ring.note(result("new", 0), 0.3)  # evicts the least recently seen, "quiet"
    assert [e.request_id for e in ring.newest_first()] == ["new", "busy"]


def test_a_repeated_earlier_result_after_the_final_one_leaves_the_request_finished():
    ring = RecentRequests(10)
    ring.note(result("r", 0), 0.0)
    ring.note(result("r", 1, final=True), 0.1)
    ring.note(result("r", 0), 0.2)  # a processor republishing after a crash
    assert entry(ring, "r").final and entry(ring, "r").results == 2
