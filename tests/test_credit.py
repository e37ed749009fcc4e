"""Pull credit of a durable partition (:mod:`streamproc.core.credit`), pure."""

from __future__ import annotations

from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.credit import PullCredit, Watch


def credit(batch: int = 10, now: float = 0.0) -> PullCredit:
    return PullCredit(batch, expires=10.0, lost_after=3.0, retry_after=0.5, now=now)


def test_a_new_pull_is_asked_for_when_half_a_batch_is_consumed():
    c = credit(10)
    c.pulled(0.0)
    assert [c.delivered(0.1) for _ in range(5)] == [False, False, False, False, True]


def test_a_pull_that_ended_unfilled_returns_its_credit():
    c = credit(10)
    c.pulled(0.0)
    assert c.status("408", "10", "Request Timeout", 1.0) is True and c.requested == 0
    assert c.misses == 0


def test_an_idle_heartbeat_proves_the_pull_is_alive():
    c = credit(10)
    c.pulled(0.0)
    assert c.status("100", None, "Idle Heartbeat", 2.9) is False
    assert c.watch(5.0, reconnected=False) == Watch(False, False, False)  # seen at 2.9: not lost yet


def test_a_silent_server_is_noticed_and_asked_again():
    c = credit(10)
    c.pulled(0.0)
    assert c.watch(3.5, reconnected=False) == Watch(lost=True, repair=False, pull=True)
    assert c.requested == 0


def test_two_misses_in_a_row_repair_the_consumer():
    c = credit(10)
    c.pulled(0.0)
    assert c.status("409", None, "Consumer Deleted", 0.1) is False  # after an error status: pause first
    assert c.watch(0.7, reconnected=False).pull
    c.pulled(0.7)
    assert c.watch(4.0, reconnected=False) == Watch(lost=True, repair=True, pull=True)
    assert c.misses == 0


def test_no_responders_pauses_pulls_and_counts_a_miss():
    c = credit(10)
    c.pulled(0.0)
    assert c.status("503", None, "No Responders", 1.0) is False
    assert c.misses == 1 and c.requested == 0
    assert c.watch(1.2, reconnected=False).pull is False and c.watch(1.6, reconnected=False).pull is True


def test_a_reconnect_or_an_expired_pull_writes_its_credit_off():
    c = credit(10)
    c.pulled(0.0)
    assert c.watch(0.1, reconnected=True) == Watch(False, False, True)
    c.pulled(0.1)
    assert c.watch(10.2, reconnected=False).pull and c.requested == 0


def test_a_failed_pull_is_not_counted_and_waits_before_the_next():
    c = credit(10)
    c.pulled(0.0)
    c.pull_failed(0.0)
    assert c.requested == 0 and not c.watch(0.2, reconnected=False).pull and c.watch(0.6, reconnected=False).pull


def test_a_dropped_delivery_uses_up_credit():
    c = credit(10)
    c.pulled(0.0)
    c.dropped()
    assert c.requested == 9


EVENTS = st.one_of(
    st.tuples(st.just("deliver"), st.floats(0, 1)),
    st.tuples(st.just("status"), st.sampled_from([("100", None, ""), ("408", "3", ""), ("409", "2", "Leadership Change"),
                                                  ("409", None, "Consumer Deleted"), ("503", None, ""),
                                                  ("404", None, "No Messages")])),
    st.tuples(st.just("watch"), st.booleans()),
    st.tuples(st.just("drop"), st.none()),
    st.tuples(st.just("fail"), st.none()),
    st.tuples(st.just("time"), st.floats(0, 12)),
)


@outbox_settings
@given(batch=st.integers(1, 64), events=st.lists(EVENTS, max_size=60))
def test_outstanding_credit_stays_within_one_and_a_half_batches_and_a_pull_always_comes_again(batch, events):
    """The shell pulls whenever told to; credit never exceeds low + batch (the client queue bound),
    and however the server behaved, a watchdog round after the pauses asks for messages again."""
    c, now = credit(batch), 0.0
    c.pulled(now)
    just_pulled = True
    for kind, arg in events:
        pull = False
        if kind == "deliver":
            now += arg
            pull = c.delivered(now)
        elif kind == "status":
            pull = c.status(*arg, now)
        elif kind == "watch":
            w = c.watch(now, arg)
            pull = w.pull
        elif kind == "drop":
            c.dropped()
        elif kind == "fail" and just_pulled:  # the pull just counted did not leave
            c.pull_failed(now)
        elif kind == "time":
            now += arg
        just_pulled = pull
        if pull:
            c.pulled(now)
        assert c.requested <= c.low + batch
    # The server answers nothing from here on: the credit is written off and asked for again.
    later = max(now, c.retry_at, c.expires_at) + 0.01
    assert c.watch(later, reconnected=False).pull
