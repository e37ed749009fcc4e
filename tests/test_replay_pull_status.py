"""``pull_status`` reads each status nats-server sends on a pull's reply subject apart (nats-server 2.x
``server/consumer.go``, ``jetstream.go``, ``client.go``; the table in :mod:`streamproc.nats.replay_pull`),
as nats-py hands it over: the status line's code in ``Status``, its text in ``Description``, the
``Nats-Pending-*`` headers beside them. Before 2026-12-06 any ``409`` whose text held ``MaxBytes`` read
as ``too_big``, so ``409 Exceeded MaxRequestMaxBytes of N`` (the pull asked more than the consumer
allows, a refusal that brings nothing) was taken for a result larger than the pull's room, and
``409 Batch Completed`` (sent after a filled batch's last result) for the end of the pull out."""

from __future__ import annotations

import pytest

from streamproc.core.replay_pull import Pull, PullState
from streamproc.nats.replay_pull import pull_status

PENDING = {"Nats-Pending-Messages": "3", "Nats-Pending-Bytes": "1024"}

# (status, description, extra headers, what pull_status reads)
STATUSES = [
    ("100", "Idle Heartbeat", {"Nats-Last-Consumer": "4", "Nats-Last-Stream": "9"}, "heartbeat"),
    ("503", "", {}, "gone"),
    ("409", "Consumer Deleted", {}, "gone"),
    ("409", "Consumer is push based", {}, "gone"),
    ("409", "Message Size Exceeds MaxBytes", PENDING, "too_big"),
    ("409", "Batch Completed", PENDING, "completed"),
    ("409", "Exceeded MaxRequestMaxBytes of 1048576", {}, "refused"),
    ("409", "Exceeded MaxRequestBatch of 100", {}, "refused"),
    ("409", "Exceeded MaxRequestExpires of 1s", {}, "refused"),
    ("400", "Bad Request - heartbeat value too large", {}, "refused"),
    ("400", "Bad Request - Priority Group missing", {}, "refused"),
    ("412", "Required Api Level", {}, "refused"),
    ("423", "Nats-Pin-Id mismatch", {}, "refused"),
    ("423", "Nats-Wrong-Pin-Id", PENDING, "refused"),
    ("404", "No Messages", {}, "ended"),
    ("408", "Request Timeout", PENDING, "busy"),
    ("408", "Interest Expired", PENDING, "busy"),
    ("408", "Requests Pending", {}, "busy"),
    ("409", "Exceeded MaxWaiting", {}, "busy"),
    ("409", "Leadership Change", {}, "busy"),
    ("409", "Server Shutdown", PENDING, "busy"),
]


@pytest.mark.parametrize(("status", "description", "extra", "kind"), STATUSES,
                         ids=[f"{s} {d}" for s, d, _, _ in STATUSES])
def test_pull_status_tells_each_nats_server_status_apart(status, description, extra, kind):
    headers = {"Status": status, **({"Description": description} if description else {}), **extra}
    assert pull_status(headers) == kind


def test_a_delivery_or_a_message_without_headers_is_no_status():
    assert pull_status(None) is None
    assert pull_status({"Nats-Msg-Id": "x"}) is None


def test_a_pull_refused_for_its_max_bytes_asks_for_one_result_alone_not_for_ever():
    """``409 Exceeded MaxRequestMaxBytes``: the next pull asks for one result with no max_bytes
    (which no request limit refuses), not a pull of the same room again; refused even so, the
    consumer is ``stuck`` (the shell makes it again, bounded by ``renewals_max``)."""
    s = PullState(64, 2.0, 3)
    s.consumer_made()
    s.sent(s.ask(8 << 20, 8 << 20, held=False), 0.0)
    s.status(pull_status({"Status": "409", "Description": "Exceeded MaxRequestMaxBytes of 1048576"}), 0.1)
    assert not s.out and not s.stuck
    assert s.ask(8 << 20, 8 << 20, held=True) is None  # what the reader holds first
    alone = s.ask(8 << 20, 8 << 20, held=False)
    assert alone == Pull(None, 1)
    s.sent(alone, 0.2)
    s.took(0.3)
    assert s.ask(8 << 20, 8 << 20, held=False) == Pull(None, 1)  # this consumer's pulls stay alone
    s.sent(Pull(None, 1), 0.4)
    s.status("refused", 0.5)
    assert s.stuck and not s.out
    s.consumer_made()
    assert not s.alone and not s.stuck


def test_batch_completed_after_a_filled_batch_does_not_end_the_next_pull():
    """``409 Batch Completed`` follows the last result of a pull whose batch filled before its
    max_bytes: that result ended the pull; a next pull already out when the status arrives stays out."""
    s = PullState(2, 2.0, 3)
    s.consumer_made()
    s.sent(s.ask(1000, 1000, held=False), 0.0)
    s.took(0.1)
    s.took(0.1)
    assert not s.out
    s.sent(s.ask(1000, 1000, held=False), 0.2)
    s.status(pull_status({"Status": "409", "Description": "Batch Completed", **PENDING}), 0.3)
    assert s.out
