"""Pull credit of a durable partition (:mod:`streamproc.core.credit`), pure."""

from __future__ import annotations

from durable_helpers import outbox_settings
from hypothesis import given
from hypothesis import strategies as st

from streamproc.core.credit import DELIVERY_OVERHEAD, SIZE_ALLOWANCE, PullCredit, Watch, pull_max_bytes, uncut_batch


def credit(batch: int = 10, now: float = 0.0, careful_batch: int | None = None, hold: float = 2.0) -> PullCredit:
    return PullCredit(batch, expires=10.0, lost_after=3.0, retry_after=0.5, now=now, careful_batch=careful_batch,
                      hold=hold)


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


def test_a_partition_behind_its_deliveries_is_neither_written_off_nor_pulled_for():
    """Deliveries wait for the handler (held up behind parked bytes): the server answers, so the pulls
    out are not lost, and another pull would only add to what waits."""
    c = credit(10)
    c.pulled(0.0)
    assert c.watch(5.0, reconnected=False, behind=True) == Watch(False, False, False) and c.requested == 10
    assert c.watch(12.0, reconnected=False, behind=True) == Watch(False, False, False)  # past the pull's expiry too
    assert c.watch(14.0, reconnected=False) == Watch(False, False, True) and c.requested == 0  # caught up: expired
    c.pulled(14.0)
    assert c.watch(17.5, reconnected=False) == Watch(lost=True, repair=False, pull=True)  # silent, not behind
    c.pulled(17.5)
    assert c.watch(17.6, reconnected=True, behind=True).pull and c.requested == 0  # a reconnect: forgotten


@given(partitions=st.integers(1, 1024), max_payload=st.integers(1, 64 << 20), total=st.integers(0, 1 << 30))
def test_the_two_pulls_a_partition_may_have_out_share_the_pull_budget(partitions, max_payload, total):
    """A partition may have two pulls out (PullCredit sends the next while one still waits behind the
    current one): together, over the partitions, they ask for at most the budget, unless the floor of
    one maximal delivery per pull binds; every pull takes one maximal delivery."""
    share = total // partitions
    one = pull_max_bytes(share, max_payload)
    floor = max_payload + DELIVERY_OVERHEAD
    assert one >= floor
    assert 2 * one <= share or one == floor
    assert partitions * 2 * one <= max(total, partitions * 2 * floor)


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
    st.tuples(st.just("redelivered"), st.none()),
    st.tuples(st.just("expect"), st.floats(0, 12)),
    st.tuples(st.just("status"), st.sampled_from([("409", "4", "Message Size Exceeds MaxBytes"),
                                                  ("409", "0", "Batch Completed")])),
)


@outbox_settings
@given(batch=st.integers(1, 64), careful=st.integers(1, 64), events=st.lists(EVENTS, max_size=60))
def test_outstanding_credit_stays_within_one_and_a_half_batches_and_a_pull_always_comes_again(batch, careful, events):
    """The shell pulls whenever told to; credit never exceeds low + batch (the client queue bound),
    careful pulls or not, and however the server behaved, a watchdog round after the pauses asks for
    messages again. A pull asks for the careful batch exactly while redeliveries are expected."""
    c, now = credit(batch, careful_batch=careful), 0.0
    last = c.pulled(now)
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
            c.pull_failed(now, last)
        elif kind == "time":
            now += arg
        elif kind == "redelivered":
            c.redelivered(now)
        elif kind == "expect":
            c.expect_redeliveries(now + arg)
        just_pulled = pull
        if pull:
            last = c.pulled(now)
            assert last == (min(careful, batch) if c.careful(now) else batch)
        assert 0 <= c.requested <= c.low + batch
    # The server answers nothing from here on: the credit is written off and asked for again.
    later = max(now, c.retry_at, c.expires_at) + 0.01
    assert c.watch(later, reconnected=False).pull


def test_a_taken_partition_pulls_careful_batches_until_its_redeliveries_are_due_then_full_ones():
    c = credit(256, careful_batch=16)
    c.expect_redeliveries(11.0)  # ack_wait + slack after it was taken
    assert c.pulled(0.0) == 16
    assert c.delivered(0.1)  # 15 outstanding: a second full careful pull goes out behind it
    assert c.pulled(0.1) == 16 and c.requested == 31
    assert [c.delivered(0.2) for _ in range(15)] == [False] * 14 + [True]
    assert c.pulled(0.2) == 16 and c.requested == 32
    assert not c.delivered(10.9) and c.delivered(11.0)  # 30 outstanding: fast now, refill at half of 256
    assert c.pulled(11.0) == 256


def test_a_careful_partition_keeps_a_second_pull_waiting_behind_the_current_one():
    c = credit(256, careful_batch=1)
    c.expect_redeliveries(5.0)
    assert c.pulled(0.0) == 1
    assert c.status("100", None, "Idle Heartbeat", 0.5) is True  # one of one outstanding: ask for the next
    assert c.pulled(0.5) == 1 and c.requested == 2
    assert c.delivered(0.6) is True and c.pulled(0.6) == 1 and c.requested == 2


def test_a_redelivery_makes_pulls_careful_for_the_hold_and_each_one_extends_it():
    c = credit(256, careful_batch=16, hold=2.0)
    assert not c.careful(0.0) and c.pulled(0.0) == 256
    c.redelivered(1.0)
    assert c.careful(2.9) and c.pulled(2.9) == 16
    c.redelivered(2.9)
    assert c.careful(4.8) and not c.careful(4.9)


def test_a_pull_cut_by_max_bytes_makes_pulls_careful_and_a_batch_completed_does_not():
    c = credit(256, careful_batch=16, hold=2.0)
    c.pulled(0.0)
    c.status("409", "0", "Batch Completed", 0.1)
    assert not c.careful(0.1)
    assert c.status("409", "250", "Message Size Exceeds MaxBytes", 0.2) is True and c.requested == 6
    assert c.careful(0.2) and c.pulled(0.2) == 16


def test_the_careful_batch_is_never_larger_than_the_fast_one_nor_its_refill_point():
    c = credit(10, careful_batch=64)
    assert c.careful_batch == 10 and c.careful_low == 5
    assert credit(1, careful_batch=1).careful_low == 0  # one pull at a time, as on the fast path


def test_a_failed_careful_pull_returns_exactly_its_own_credit():
    c = credit(256, careful_batch=16)
    c.expect_redeliveries(5.0)
    c.pull_failed(0.0, c.pulled(0.0))
    assert c.requested == 0


@given(max_payload=st.integers(1, 64 << 20), max_bytes=st.integers(0, 1 << 30),
       sizes=st.lists(st.integers(0, 1 << 30), min_size=1, max_size=200))
def test_a_pull_of_the_uncut_batch_always_ends_on_its_count_never_on_its_bytes(max_payload, max_bytes, sizes):
    """nats-server's charge per delivered message (consumer.go ``nextWaiting``: ``if sz <= wr.b { wr.b -= sz }``,
    else 409 MaxBytes), for any message a server with this max_payload delivers (payload and headers up to
    max_payload, subject and ack subject within DELIVERY_OVERHEAD): a pull that asks for uncut_batch
    messages is never cut, whenever max_bytes takes one maximal message (the shell's does: pull_max_bytes); and
    it is the largest such batch."""
    largest = max_payload + DELIVERY_OVERHEAD
    batch = uncut_batch(max_bytes, max_payload)
    assert batch >= 1
    if max_bytes < largest:
        return
    left, n = max_bytes, batch
    for size in sizes:
        sz = min(size, largest)
        assert sz <= left, "the pull was cut by bytes"
        left -= sz
        n -= 1
        if n == 0:
            break
    assert (batch + 1) * largest > max_bytes  # one more maximal message would not fit


def sized(batch: int = 256, max_bytes: int = 16 << 20) -> PullCredit:
    return PullCredit(batch, expires=10.0, lost_after=3.0, retry_after=0.5, careful_batch=uncut_batch(max_bytes, 1 << 20),
                      hold=2.0, max_bytes=max_bytes, size_window=10.0)


def test_fast_pulls_ask_for_what_max_bytes_holds_at_the_largest_delivery_seen_so_a_redelivery_cannot_cut_them():
    c = sized()
    assert c.pulled(0.0) == c.careful_batch == 15  # nothing seen yet: a batch max_bytes always holds
    big = (1 << 20) - 4096 + 200  # a ~1 MB chunk, its subject and ack subject
    c.delivered(0.1, big)
    b = c.pulled(0.2)
    assert b == 16 and b * (big + SIZE_ALLOWANCE) <= 16 << 20 < (b + 1) * (big + SIZE_ALLOWANCE)
    assert c.fast_low == 16  # and the refill point with it: the outstanding bytes stay near two pulls'


def test_small_deliveries_keep_the_full_batch():
    c = sized(max_bytes=(2 << 20) + 65536)  # 8 partitions
    for _ in range(300):
        c.delivered(0.1, 4096 + 200)
    assert c.pulled(0.2) == 256 and c.fast_low == 128
    c.delivered(0.3, 8192 + 200)  # 8 KiB chunks: 229 of them (with the header allowance) fill max_bytes
    assert c.pulled(0.4) == 229


@given(max_payload=st.integers(1, 64 << 20), share=st.integers(0, 1 << 30), sizes=st.lists(st.integers(0, 1 << 30),
                                                                                     min_size=1, max_size=300))
def test_a_fast_pull_before_any_delivery_was_seen_is_never_cut_by_bytes(max_payload, share, sizes):
    """With nothing seen to size it by, a fast pull asks for the uncut batch: a pull of fetch_batch cut
    by max_bytes makes pulls careful for the hold (one message each at 8 partitions), and with a
    pull's max_bytes at half the share that cut a fresh drain of 8 KiB chunks to half its rate."""
    max_bytes = pull_max_bytes(share, max_payload)
    c = PullCredit(256, expires=10.0, lost_after=3.0, retry_after=0.5, careful_batch=uncut_batch(max_bytes, max_payload),
                   hold=2.0, max_bytes=max_bytes)
    batch = c.pulled(0.0)
    left = max_bytes
    for size in sizes[:batch]:
        sz = min(size, max_payload + DELIVERY_OVERHEAD)  # what a server with this max_payload can deliver
        assert sz <= left, "the first pull was cut by bytes"
        left -= sz
    assert c.careful(0.0) is False


def test_a_large_delivery_is_forgotten_two_windows_later():
    c = sized()
    c.delivered(1.0, 1 << 20)
    assert c.pulled(5.0) < 256
    c.delivered(6.0, 1000)
    assert c.pulled(10.5) < 256  # the window before still had it
    assert c.pulled(20.6) == c.careful_batch  # nothing seen in either window: unsized, so uncut
    c.delivered(20.7, 1000)
    assert c.pulled(20.8) == 256


@given(sizes=st.lists(st.integers(0, (1 << 20) + 4096), min_size=1, max_size=50),
       max_bytes=st.integers((2 << 20) + 65536, 16 << 20))
def test_a_sized_pull_holds_a_batch_of_the_largest_delivery_seen(sizes, max_bytes):
    """No message of at most the largest size seen (plus the header allowance) cuts a fast pull: its
    batch of them fits max_bytes, as nats-server's nextWaiting charges them."""
    c = sized(max_bytes=max_bytes)
    for size in sizes:
        c.delivered(0.1, size)
    batch = c.pulled(0.2)
    assert batch * (max(sizes) + SIZE_ALLOWANCE) <= max_bytes or batch == c.careful_batch
    assert c.careful_batch <= batch <= 256


def test_a_delivery_sizes_fast_pulls_for_its_window_and_the_next_one_exactly_and_no_longer():
    """The size window rolls at ``window_end`` itself: the largest delivery of a window sizes pulls
    through the next window (the larger of the two windows' largest wins) and is gone after it."""
    half = 512 << 10  # 16 MiB // (512 KiB + SIZE_ALLOWANCE) = 31 per pull; the uncut batch is 15
    c = sized()
    c.delivered(1.0, half)
    assert c.pulled(5.0) == 31
    c.delivered(6.0, 1000)
    assert c.pulled(10.0) == 31  # rolled at 10.0: the window before had it, the new one nothing yet
    c.delivered(12.0, 1000)  # smaller than the window before's largest, which still sizes the pull
    assert c.pulled(15.0) == 31
    assert c.pulled(20.0) == 256  # rolled again at 20.0: 1000 bytes the largest seen since 10.0
    assert c.pulled(30.0) == c.careful_batch == 15  # nothing seen in either window: unsized, so uncut


def test_a_shorter_redelivery_wait_does_not_cut_a_longer_one_short():
    c = credit(10, careful_batch=2, hold=2.0)
    c.expect_redeliveries(30.0)  # a taken partition: redeliveries due until ack_wait
    c.redelivered(1.0)  # one arrived: careful for the hold, 3.0, but not less than before
    assert c.careful(29.0) and c.pulled(29.0) == 2
    assert not c.careful(30.0)


def test_a_failed_pull_returns_the_credit_it_was_counted_with_not_a_full_batch():
    c = credit(10, careful_batch=2)
    assert c.pulled(0.0) == 10
    c.expect_redeliveries(5.0)
    c.pull_failed(0.1, c.pulled(0.1))  # the careful pull of 2 did not leave
    assert c.requested == 10


def test_an_idle_heartbeat_asks_for_no_pull_while_an_error_status_pause_lasts():
    c = credit(10)
    c.pulled(0.0)
    assert c.status("409", None, "Consumer Deleted", 1.0) is False  # credit written off, pause 0.5 s
    assert c.status("100", None, "Idle Heartbeat", 1.2) is False
    assert c.status("100", None, "Idle Heartbeat", 1.5) is True


def test_a_503_status_counts_a_miss_whatever_its_description():
    c = credit(10)
    c.pulled(0.0)
    c.status("503", None, "", 1.0)  # nats-server's no-responders status line carries no description
    c.status("503", None, "", 2.0)
    assert c.misses == 2 and c.watch(2.6, reconnected=False).repair


def test_credit_is_written_off_only_after_more_than_lost_after_without_a_sign():
    c = credit(10)
    c.pulled(0.0)
    assert c.watch(3.0, reconnected=False).lost is False  # exactly lost_after: not yet
    assert c.watch(3.01, reconnected=False).lost is True
