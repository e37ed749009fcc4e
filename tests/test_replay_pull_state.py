"""A replay consumer's pulls (:mod:`streamproc.core.replay_pull`), pure: the books the client's
``follow(replay=True)`` and the edge's history read keep alike."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamproc.client.results import REPLAY_PULL_EXPIRES
from streamproc.core.replay_pull import Pull, PullState
from streamproc.nats.replay_pull import REPLAY_PULL_HEARTBEAT, REPLAY_PULL_LOST_AFTER
from streamproc.testing.laws import LAW_EXAMPLES

LAWS = settings(max_examples=LAW_EXAMPLES, deadline=None)
STATUSES = ("heartbeat", "ended", "busy", "too_big", "gone")

EVENTS = st.one_of(
    st.tuples(st.just("ask"), st.tuples(st.integers(-10, 5000), st.integers(0, 4096), st.booleans(),
                                         st.none() | st.integers(-3, 2000))),
    st.tuples(st.just("took"), st.none()),
    st.tuples(st.just("status"), st.sampled_from(STATUSES)),
    st.tuples(st.just("time"), st.floats(0, 3)),
    st.tuples(st.just("over"), st.none()),
    st.tuples(st.just("consumer"), st.none()),
)


def state(batch: int = 64) -> PullState:
    return PullState(batch, lost_after=2.0, renewals_max=3)


@LAWS
@given(batch=st.integers(1, 1024), events=st.lists(EVENTS, max_size=80))
def test_a_pull_never_asks_more_than_its_bounds_and_one_is_out_at_a_time(batch, events):
    """Whatever arrives, a pull goes out only when none is out, asks for no more bytes than the room
    it was given (at least half the bound while the reader holds results), for no more results
    than the cap and the queue's room, and for the one that did not fit alone only when the reader
    holds nothing; it brings at most its batch before it is over."""
    s, now = state(batch), 0.0
    for kind, arg in events:
        if kind == "ask":
            room, bound, held, queue_room = arg
            was_out, one_big = s.out, s.one_big
            pull = s.ask(room, bound, held, queue_room)
            if pull is None:
                continue
            assert not was_out
            if pull.room is None:
                assert one_big and not held and pull.batch == 1
            else:
                assert not one_big and pull.room <= room
                assert not held or pull.room >= bound // 2
                assert 1 <= pull.batch <= min(batch, batch if queue_room is None else queue_room)
            s.sent(pull, now)
        elif kind == "took":
            if s.out:
                left = s.left
                s.took(now)
                assert s.out == (left > 1)
            else:
                s.took(now)  # late or stray: nothing goes out on its account
                assert not s.out
        elif kind == "status":
            s.status(arg, now)
        elif kind == "time":
            now += arg
        elif kind == "over":
            s.over()
        elif kind == "consumer":
            s.consumer_made()
            assert not s.out and not s.one_big and s.delivered == 0
        assert not s.out or 0 < s.left <= batch


@LAWS
@given(batch=st.integers(1, 1024), bound=st.integers(0, 4096), offset=st.integers(-2, 2) | st.integers(-4096, 4096),
       held=st.booleans(), queue_room=st.none() | st.integers(-3, 2000), ended=st.booleans())
@example(batch=64, bound=1000, offset=0, held=True, queue_room=None, ended=False)  # exactly half the bound
def test_a_pull_goes_out_whenever_none_is_out_and_the_reader_has_the_room(batch, bound, offset, held, queue_room,
                                                                          ended):
    """The other side of the bound: with no pull out and nothing waiting to come alone, a pull goes
    out for all the room the bound has left as soon as the reader holds nothing or has at least half
    the bound free (half included), for as many results as the cap and the queue's room allow; it
    waits only while the reader holds results and has less than half the bound, or its queue is full."""
    s, room = state(batch), bound // 2 + offset
    if ended:  # a pull that came and went: the same as none yet
        s.sent(Pull(bound, batch), 0.0)
        s.status("ended", 0.1)
    pull = s.ask(room, bound, held, queue_room)
    results = batch if queue_room is None else min(batch, queue_room)
    if (held and room < bound // 2) or results <= 0:
        assert pull is None
    else:
        assert pull == Pull(room, results)


@LAWS
@given(words=st.lists(st.tuples(st.sampled_from(("took", "heartbeat", "idle")),
                               st.integers(0, 20).map(lambda n: n / 4)), max_size=40),  # exact in binary
       batch=st.integers(1, 8))
def test_a_pull_out_is_silent_exactly_when_no_word_came_for_lost_after(words, batch):
    """A result or a heartbeat keeps a pull out alive; ``lost_after`` without either (a pull lost
    in a reconnect, or used up exactly without a status) and it is over: the client renews then."""
    s, now = state(batch), 0.0
    s.sent(Pull(1000, batch), now)
    last_word = now
    for word, gap in words:
        now += gap
        assert s.silent(now) == (s.out and now - last_word > s.lost_after)
        if not s.out:
            break
        if word == "took":
            s.took(now)
            last_word = now
        elif word == "heartbeat":
            s.status("heartbeat", now)
            last_word = now
            assert s.out
    assert not s.silent(now + 1e9) or s.out


@LAWS
@given(taken=st.integers(0, 5), batch=st.integers(6, 64), kind=st.sampled_from(STATUSES),
       one_big=st.booleans())
def test_a_status_moves_the_pull_to_its_state(taken, batch, kind, one_big):
    """``heartbeat``: still out, its silence starts again; any other status ends the pull, and
    ``too_big`` before the pull brought anything means the next result comes alone."""
    s = state(batch)
    if one_big:
        s.sent(Pull(10, 1), 0.0)
        s.status("too_big", 0.0)
        assert s.one_big and not s.out
    pull = s.ask(1000, 1000, held=False)
    assert pull is not None
    s.sent(pull, 0.0)
    for _ in range(taken):
        s.took(0.5)
    was_out = s.out  # a pull of one (the one that did not fit) is over with its result
    s.status(kind, 1.0)
    if kind == "heartbeat":
        assert s.out == was_out and (not was_out or s.until == 1.0 + s.lost_after)
        return
    assert not s.out
    if taken:
        assert not s.one_big  # a result came: the one that did not fit has been read
    else:
        assert s.one_big == (kind == "too_big" or one_big)
    assert (s.ask(1000, 1000, held=True) is None) == s.one_big  # the reader takes what it holds first


def test_the_one_that_did_not_fit_comes_alone_then_pulls_are_sized_again():
    s = state(64)
    s.sent(s.ask(100, 200, held=False), 0.0)
    s.status("too_big", 0.1)
    assert s.ask(100, 200, held=True) is None
    alone = s.ask(100, 200, held=False)
    assert alone == Pull(None, 1)
    s.sent(alone, 0.2)
    s.took(0.3)
    assert not s.out and not s.one_big
    assert s.ask(150, 200, held=True) == Pull(150, 64)


@LAWS
@given(st.lists(st.sampled_from(("renew", "answered", "took")), max_size=40))
def test_a_consumer_is_made_again_at_most_renewals_max_times_in_a_row_without_an_answer(events):
    s, in_a_row = state(), 0
    for event in events:
        if event == "renew":
            in_a_row += 1
            assert s.renew() == (in_a_row <= s.renewals_max)
            s.consumer_made()  # a renewal keeps its count across consumers
        elif event == "answered":
            s.answered()
            in_a_row = 0
        else:
            s.sent(Pull(10, 1), 0.0)
            s.took(0.0)
            in_a_row = 0


def test_a_waiting_pulls_heartbeats_keep_it_from_looking_silent_and_silence_comes_before_its_expiry():
    """The client's pulls wait on the server (``expires``): nats-server refuses a heartbeat unless
    the expiry is at least twice it; several heartbeats fit the silence, and a silent pull is made
    again before its expiry would have ended it."""
    assert 2 * REPLAY_PULL_HEARTBEAT <= REPLAY_PULL_LOST_AFTER < REPLAY_PULL_EXPIRES


def test_busy_pulls_are_sent_again_after_a_doubling_backoff_a_bounded_number_of_times_in_a_row():
    """A pull ended ``busy`` having brought nothing (``409 Exceeded MaxWaiting``, a leader change) is
    sent again after 1, 2, 4... backoffs, at most ``busy_max`` times in a row (then None: give up,
    across the consumers made again meanwhile); a result taken starts the count again."""
    s = PullState(64, lost_after=2.0, renewals_max=3, busy_max=3, busy_backoff=0.05)
    assert [s.busy_retry() for _ in range(3)] == [0.05, 0.1, 0.2]
    s.consumer_made()
    assert s.busy_retry() is None
    s.sent(Pull(10, 2), 0.0)
    s.took(0.0)
    assert s.busy_retry() == 0.05


def test_a_busy_give_up_ends_the_run_so_a_later_consumer_of_the_same_replay_is_retried_again():
    """Past ``busy_max`` the shell gives the run up (edge, MSG.GET known to answer: the rest by
    subject, then a new consumer once a result was read). That consumer's first busy pull is sent
    again after the first backoff, not given up at once because the old run's count stayed past
    ``busy_max`` (no result of a consumer came in between to reset it)."""
    s = PullState(64, lost_after=2.0, renewals_max=3, busy_max=2, busy_backoff=0.05)
    assert [s.busy_retry() for _ in range(3)] == [0.05, 0.1, None]
    s.consumer_made()
    assert s.busy_retry() == 0.05
