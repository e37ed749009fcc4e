"""A partition's seal list (streamproc/core/seal_list.py): which requests' first chunks are looked up
because a seal record may make them the sealed attempt's, and for how long."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.seal_list import ALL_SEALED, SealList, seal_lists


def test_the_records_read_when_a_partition_is_taken_land_in_their_partitions_seal_lists():
    lists = seal_lists([("a", 5.0), ("b", 3.0), ("c", 1.0)], {"a": 0, "b": 1, "c": 0}.__getitem__, 60.0, 100.0)
    assert sorted(lists) == [0, 1]
    assert lists[0].listed() == ["a", "c"] and lists[1].listed() == ["b"]
    assert "a" in lists[0] and "b" not in lists[0]


def test_a_seal_recorded_here_lists_its_request_and_drops_the_records_expired_by_then():
    # Read at 100: "old" was written 50 s before (expires at 110), "young" 5 s before (at 155).
    seals = seal_lists([("old", 50.0), ("young", 5.0)], lambda rid: 0, 60.0, 100.0)[0]
    seals.note("mine", 111.0)  # "old" expired at 110
    assert seals.listed() == ["young", "mine"]
    assert "old" not in seals and "mine" in seals


def test_a_record_expiring_exactly_now_is_kept_one_moment_more():
    seals = SealList(10.0)
    seals.note("a", 0.0)
    seals.note("b", 10.0)
    assert seals.listed() == ["a", "b"]


def test_a_request_sealed_again_moves_to_the_back_with_its_new_expiry():
    seals = SealList(10.0)
    seals.note("a", 0.0)
    seals.note("b", 1.0)
    seals.note("a", 2.0)
    assert seals.listed() == ["b", "a"]
    seals.note("c", 11.5)  # b (expires at 11) goes; a (at 12) stays
    assert seals.listed() == ["a", "c"]


def test_records_that_never_expire_are_never_dropped():
    seals = SealList(math.inf)
    seals.note("a", 0.0)
    seals.note("b", 1e12)
    assert seals.listed() == ["a", "b"]


def test_a_partition_taken_without_its_records_lists_every_request_whatever_is_noted():
    ALL_SEALED.note("x", 0.0)
    assert "x" in ALL_SEALED and "anything" in ALL_SEALED


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.floats(0, 5)), max_size=40), st.floats(0.5, 20))
def test_a_noted_request_is_listed_and_what_is_left_is_what_has_not_expired_in_noting_order(notes, ttl):
    seals = SealList(ttl)
    now = 0.0
    expiry: dict[str, float] = {}  # the model: last note per request, in noting order
    for rid, step in notes:
        now += step
        seals.note(rid, now)
        expiry.pop(rid, None)
        expiry[rid] = now + ttl
        assert rid in seals
        listed = seals.listed()
        assert listed == [r for r in expiry if r in listed]  # noting order, each request once
        # Every unexpired record is listed; only expired ones may have gone, from the front.
        assert {r for r, until in expiry.items() if until >= now} <= set(listed)
        gone = [r for r in expiry if r not in listed]
        assert gone == list(expiry)[:len(gone)]
        assert all(expiry[r] < now for r in gone)
        for r in gone:
            del expiry[r]
