"""The recovery decisions (streamproc/core/recovery.py): when a chunk waits for the stores, and
where and how an adopted request resumes. Pure, against a real correlator over the toy format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from toy_codec import make

from streamproc.core.events import Chunk, Role
from streamproc.core.recovery import (Adoption, StoreRead, adoption, delivery_count, needs_lookup, previous_hold_left,
                                      resume_point, store_read)
from streamproc.core.wire import FINAL, SEQ

V1 = "$JS.ACK.S.c.{}.1.1.1700000000000000000.0"
FIRST = V1.format(1)


def chunk(rid: str, seq: int = 0, *, role: Role = Role.AGG, attempt: int = 0, final: bool = False) -> Chunk:
    return Chunk(rid, role, seq, b"x", final=final, attempt=attempt)


@pytest.mark.parametrize("reply, count", [
    ("$JS.ACK.STREAMPROC_CHUNKS.streamproc-p0.3.17.12.1700000000000000000.0", 3),  # v1: 9 tokens
    ("$JS.ACK.hub.ACCHASH.STREAMPROC_CHUNKS.streamproc-p0.5.17.12.1700000000000000000.0.rnd", 5),  # v2
    ("_INBOX.abc", 1),
    ("", 1),
])
def test_delivery_count_reads_the_ack_subject(reply, count):
    assert delivery_count(reply) == count


@pytest.mark.parametrize("seq, role, deliveries, lookup", [
    (0, Role.AGG, 1, False),  # the first delivery of a first output chunk starts a request
    (0, Role.DECODE, 1, False),
    (1, Role.AGG, 1, True),  # a later chunk may continue one served elsewhere
    (0, Role.PREFILL, 1, True),  # a prefill leg may belong to a request whose decode leg is stored
    (0, Role.AGG, 2, True),  # a redelivery: an earlier copy may have been turned into results
])
def test_a_chunk_of_an_unknown_request_needs_a_lookup_unless_it_surely_starts_it(
        seq, role, deliveries, lookup):
    assert needs_lookup(seq, role, V1.format(deliveries)) is lookup


def test_the_resume_point_follows_the_last_stored_result():
    assert resume_point({SEQ: "4"}) == (5, False)
    assert resume_point({SEQ: "4", FINAL: "true"}) == (5, True)
    assert resume_point({SEQ: "x"}) is None and resume_point(None) is None and resume_point({}) is None


@pytest.mark.parametrize("point, sealed, how", [
    (None, False, Adoption.AFRESH),  # nothing stored, never sealed: its chunks all wait unacknowledged
    ((5, False), False, Adoption.RESUME),
    ((5, True), False, Adoption.RESUME),  # finished: its later chunks are late
    ((5, True), True, Adoption.RESUME),  # finished after a migrate: nothing is published again, no history
    ((5, False), True, Adoption.RESUME_WITH_HISTORY),  # the migration session is rebuilt from the bodies
    (None, True, Adoption.RESUME_WITH_HISTORY),  # sealed before its first result was stored: resumed at 0
])
def test_an_adopted_request_reads_its_stored_bodies_only_when_sealed_and_unfinished(point, sealed, how):
    assert adoption(point, sealed) is how


def test_a_previous_owners_chunks_come_back_within_ack_wait_and_slack_of_taking_the_partition():
    assert previous_hold_left(4.0, 1.0, 10.0, 11.5) == pytest.approx(3.5)  # taken 1.5 s ago
    assert previous_hold_left(4.0, 1.0, 10.0, 15.0) == 0.0  # exactly due
    assert previous_hold_left(4.0, 1.0, 10.0, 16.0) < 0  # all back: nothing of theirs still held
    assert previous_hold_left(4.0, 1.0, None, 99.0) == 5.0  # not held here: the whole hold may be ahead


@given(ack_wait=st.floats(0.1, 600), slack=st.floats(0, 5), taken=st.floats(0, 1e6), later=st.floats(0, 1e3),
       more=st.floats(0.001, 1e3))
def test_the_previous_hold_only_runs_down_and_never_exceeds_a_whole_hold(ack_wait, slack, taken, later, more):
    now = taken + later
    left = previous_hold_left(ack_wait, slack, taken, now)
    assert left <= ack_wait + slack == previous_hold_left(ack_wait, slack, None, now)
    assert previous_hold_left(ack_wait, slack, taken, now + more) < left


def test_the_first_delivery_of_a_new_requests_first_chunk_is_decided_without_reading_the_stores():
    c, _ = make()
    assert store_read(c, chunk("new"), FIRST, ()) is None


@pytest.mark.parametrize("unknown, reply, sealed", [
    (chunk("r", 1), FIRST, ()),  # a later seq
    (chunk("r", role=Role.PREFILL), FIRST, ()),  # a prefill leg
    (chunk("r"), V1.format(2), ()),  # a redelivery
    (chunk("r", attempt=1), FIRST, ()),  # an attempt a migrate granted elsewhere
    (chunk("r"), FIRST, {"r"}),  # a first chunk of a request with a seal record: maybe the sealed attempt's
])
def test_a_chunk_of_an_unknown_request_that_may_continue_one_served_elsewhere_is_looked_up(
        unknown, reply, sealed):
    c, _ = make()
    assert store_read(c, unknown, reply, sealed) is StoreRead.LOOKUP


def test_a_known_requests_chunks_of_its_own_attempt_need_no_read_whatever_their_seq_or_delivery():
    c, _ = make()
    c.receive(chunk("r"), 0.0)
    assert c.knows("r")
    for later in (chunk("r", 1), chunk("r", role=Role.PREFILL), chunk("r")):
        assert store_read(c, later, V1.format(3), {"r"}) is None


def test_a_later_attempt_of_an_active_request_retakes_it_from_the_stores():
    c, _ = make()
    c.receive(chunk("r"), 0.0)
    assert c.attempt_of("r") == 0
    assert store_read(c, chunk("r", attempt=1), FIRST, ()) is StoreRead.RETAKE


def test_a_later_attempt_of_a_finished_request_is_late_not_retaken():
    c, _ = make()
    c.receive(chunk("r"), 0.0)
    c.receive(chunk("r", 1, final=True), 0.0)
    assert c.is_finished("r") and c.knows("r")
    assert store_read(c, chunk("r", attempt=1), FIRST, ()) is None
