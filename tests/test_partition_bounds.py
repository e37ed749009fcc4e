"""A durable partition's bounds (streamproc/core/partition_bounds.py): when its queued result
bytes stop its pulls (pure, against a real outbox), and when its held chunks make it shed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.events import Result
from streamproc.core.outbox import Outbox
from streamproc.core.partition_bounds import (MAX_QUEUED_RESULT_BYTES, HeldLimit, QueuedResultShare, held_limit,
                                              queued_result_share)

MiB = 1 << 20


def partition_of(rid: str) -> int:
    """Request ids ``p<n>-...`` live in partition n."""
    return int(rid[1:rid.index("-")])


def queue(outbox: Outbox, rid: str, size: int, seq: int = 0) -> None:
    outbox.take([Result(rid, seq, b"x" * size, False)], rid)


def test_each_partition_gets_an_equal_share_of_the_queued_results_but_never_less_than_four_maximal_ones():
    assert queued_result_share(1, MiB) == MAX_QUEUED_RESULT_BYTES == 64 * MiB
    assert queued_result_share(8, MiB) == 8 * MiB
    assert queued_result_share(64, MiB) == 4 * MiB  # 1 MiB each would not hold four 1 MiB results
    assert queued_result_share(8, 4 * MiB) == 16 * MiB


def test_a_partition_stops_pulling_only_once_its_own_queued_results_pass_its_share():
    outbox = Outbox()
    share = QueuedResultShare(outbox, partition_of, cap=100)
    queue(outbox, "p0-a", 60)
    queue(outbox, "p0-b", 40)
    assert not share.full(0)  # exactly its share
    queue(outbox, "p1-a", 500)  # another partition's backlog: the total passes, partition 0's does not
    assert not share.full(0) and share.full(1)
    queue(outbox, "p0-a", 1, seq=1)
    assert share.full(0)


def test_a_partition_pulls_again_once_its_queued_results_leave():
    outbox = Outbox()
    share = QueuedResultShare(outbox, partition_of, cap=100)
    queue(outbox, "p2-a", 101)
    assert share.full(2)
    outbox.abandon(lambda rid: rid == "p2-a")
    assert outbox.queued_bytes == 0 and not share.full(2)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 80)), max_size=30),
       st.integers(0, 200))
def test_a_partition_is_full_exactly_when_its_queued_bytes_pass_the_cap(results, cap):
    outbox = Outbox()
    share = QueuedResultShare(outbox, partition_of, cap)
    seqs: dict[str, int] = {}
    for n, r, size in results:
        rid = f"p{n}-{r}"
        seqs[rid] = seqs.get(rid, -1) + 1
        queue(outbox, rid, size, seqs[rid])
    for n in range(4):
        queued = sum(size for m, _, size in results if m == n)
        assert share.full(n) is (queued > cap)


def test_a_partition_sheds_past_three_quarters_of_max_ack_pending_down_to_half():
    assert held_limit(2048) == HeldLimit(cap=1536, target=1024)
    limit = held_limit(16)
    assert (limit.cap, limit.target) == (12, 8)
    assert limit.excess(0) == limit.excess(12) == 0  # at 3/4 exactly: nothing shed
    assert limit.excess(13) == 5  # down to 8
    assert limit.excess(16) == 8
    assert held_limit(2) == HeldLimit(cap=1, target=1)  # the least max_ack_pending: one held chunk is fine
    assert held_limit(2).excess(2) == 1


@given(st.integers(2, 1_000_000), st.integers(0, 2_000_000))
def test_shedding_starts_only_above_the_cap_and_always_ends_at_the_target_below_max_ack_pending(max_ack_pending,
                                                                                              held):
    limit = held_limit(max_ack_pending)
    assert 0 < limit.target <= limit.cap < max_ack_pending
    excess = limit.excess(held)
    if held <= limit.cap:
        assert excess == 0
    else:
        assert excess > 0 and held - excess == limit.target
