"""A request's stored results read with a pull consumer whose pulls are sized by a byte bound.

What the client's ``follow(replay=True)`` (:mod:`streamproc.client.results`) and the edge's replay
(:mod:`streamproc.edge.replay`) share. A push consumer sends as fast as nats-server will, whatever
its reader's pace; a reader that stops it at its bound has been sent more already, which is thrown
away and read again (1.5 GB on the wire for a 250 MiB history, client; up to 1.9 x at the edge).
A pull (``$JS.API.CONSUMER.MSG.NEXT``) asks for ``max_bytes`` = the room the bound has left, so
each stored result is sent about once, at the reader's pace. nats-server ends a pull with a status
message on its reply subject (``404``/``408`` nothing more, ``409`` with ``MaxBytes`` when the next
result is larger than the room the pull offered) unless its batch was filled, or its results used
up its ``max_bytes`` exactly: nats-server 2.x ``consumer.nextWaiting`` ("If we are right now at
zero, set batch to 1 to deliver this one but stop after") then ends it without any status. So a
pull silent for ``REPLAY_PULL_LOST_AFTER`` is over, and the consumer is made again from the next
stored result (its old inbox dropped first: nothing comes twice, no second pull overfills the
bound). A pull that waits on the server (``expires``, the client's live tail) asks for an idle
heartbeat, which keeps it from looking silent; the edge's pulls are ``no_wait`` (the history is
stored): they never wait on the server, and nats-server refuses a heartbeat without an ``expires``
of at least twice it (``nextReqFromMsg``: "heartbeat value too large").
"""

from __future__ import annotations

import json

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

# Messages a pull asks for at most: its bytes are what bound it; this only caps the Msg objects of
# tiny results.
REPLAY_PULL_BATCH = 1024
# A waiting pull's idle heartbeat, and how long a pull without a word (result, heartbeat or status)
# is taken for over: lost (a reconnect, a server restart) or used up exactly (no status).
REPLAY_PULL_HEARTBEAT = 0.5
REPLAY_PULL_LOST_AFTER = 4 * REPLAY_PULL_HEARTBEAT
# Seconds without a pull after which the server deletes a replay's consumer whose reader vanished
# without deleting it (a reader slower than this per pull has its consumer made again, once).
REPLAY_CONSUMER_IDLE = 60.0
# The same for the edge's replay consumers (edge/replay.py), whose reader is the edge: an edge that
# died, or whose delete failed, must not hold more than --max-replay-consumers consumers on the
# server for long, and each one it could not delete is counted against that cap until the server
# has dropped it (edge/source.py, REPLAY_PULL_SLOT_LINGER). Longer than the edge's pulls are apart
# but for a client that stops reading; such a replay makes its consumer again (one 503, a renewal).
REPLAY_EDGE_CONSUMER_IDLE = 10.0
# Consumers made again in a row (gone, or pulls unanswered) with no answer from any of them: then
# the replay ends with an error instead of renewing without end (edge and client alike).
REPLAY_RENEWALS_MAX = 3
# Pulls in a row that a "busy" status (408, 409 Exceeded MaxWaiting, Leadership Change, Server
# Shutdown: pull_status) ended with nothing brought, sent again after a backoff from
# REPLAY_BUSY_BACKOFF seconds, doubled each time (0.05 + ... + 0.8 = 1.55 s in all): past it the edge's
# replay ends with an error instead of leaving its read budget (edge/replay.py, _busy).
REPLAY_BUSY_RETRIES = 5
REPLAY_BUSY_BACKOFF = 0.05


def replay_consumer_config(name: str, subject: str, start: int, idle: float = REPLAY_CONSUMER_IDLE) -> ConsumerConfig:
    """A pull consumer of ``subject`` from stream sequence ``start`` (1 or less: the first stored):
    no acks (read once, in order), in memory, removed by the server ``idle`` seconds after its last pull."""
    where = {"deliver_policy": DeliverPolicy.ALL} if start <= 1 else {
        "deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": start}
    return ConsumerConfig(name=name, filter_subject=subject, ack_policy=AckPolicy.NONE, max_deliver=1,
                          mem_storage=True, num_replicas=1, inactive_threshold=idle, **where)


def replay_consumer_name(inbox: str) -> str:
    """A replay's consumer name, unique by its delivery inbox's last token: a create whose answer was
    lost is deleted by this name."""
    return f"streamproc_replay_{inbox.rsplit('.', 1)[-1]}"


def pull_subject(api_prefix: str, stream: str, consumer: str) -> str:
    return f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def pull_request(room: int | None, batch: int = REPLAY_PULL_BATCH, expires: float | None = None,
                 no_wait: bool = False, heartbeat: float | None = None) -> dict[str, int | bool]:
    """A pull's request: at most ``batch`` results of at most ``room`` bytes together; ``room``
    None asks for the next result alone, whatever its size (one the last pull's room did not fit).
    ``heartbeat``: the server sends a ``100`` status that often while the pull waits on it."""
    request: dict[str, int | bool] = {"batch": 1} if room is None else {"batch": batch, "max_bytes": room}
    if expires is not None:
        request["expires"] = int(expires * 1e9)
    if heartbeat is not None:
        request["idle_heartbeat"] = int(heartbeat * 1e9)
    if no_wait:
        request["no_wait"] = True
    return request


def encode(request: dict[str, int | bool]) -> bytes:
    return json.dumps(request).encode()


# Every status nats-server sends on a pull's reply subject (2.x ``server/consumer.go``, ``jetstream.go``;
# ``client.go`` for the 503), by what it says of the pull; anything else is read as "busy" (below).
#   "heartbeat": ``100 Idle Heartbeat`` (a waiting pull's; ``100 FlowControl Request`` is a push consumer's)
#   "gone":      ``503`` (no responders: no consumer, or MSG.NEXT not imported), ``409 Consumer Deleted``,
#                ``409 Consumer is push based`` (the name is a push consumer's now: not ours)
#   "too_big":   ``409 Message Size Exceeds MaxBytes`` (``getNextMsg``: the next result is larger than
#                what is left of the pull's max_bytes)
#   "completed": ``409 Batch Completed`` (``deliverMsg``'s caller: sent *after* the last result of a pull
#                whose batch filled before its max_bytes; the pull ended with that result already, and a
#                next pull may be out when it arrives, which it must not end)
#   "refused":   ``409 Exceeded MaxRequestBatch of N``, ``409 Exceeded MaxRequestExpires of D``,
#                ``409 Exceeded MaxRequestMaxBytes of N`` (the consumer's, or the account's
#                max_request_batch, limits), ``400 Bad Request - ...``, ``412 Required Api Level``,
#                ``423 Nats-Pin-Id mismatch``, ``423 Nats-Wrong-Pin-Id``: the pull as asked is refused
#                (``processNextMsgRequest``), brought nothing, and the same pull would be refused again
#   "ended":     ``404 No Messages`` (``processNextMsgRequest``, or ``processWaiting`` at the end of the
#                stream: a no_wait pull found nothing stored at or after where the consumer is)
#   "busy":      ``408 Request Timeout`` (``processWaiting``/``nextWaiting``: its ``expires`` passed),
#                ``408 Interest Expired``, ``408 Requests Pending`` (a no_wait pull while other pulls
#                claim what is pending), ``409 Exceeded MaxWaiting`` (``processNextMsgRequest``: the
#                consumer's waiting queue is full), ``409 Leadership Change`` (``checkPendingRequests``),
#                ``409 Server Shutdown`` (``jetstream.go`` ``signalPullConsumers``), and any status not
#                named here: the pull is over and says nothing of what is stored (results may be stored
#                at and after where the consumer is); the same pull may be sent again, a little later
_GONE = ("Consumer Deleted", "Consumer is push based")
_REFUSED = ("Exceeded MaxRequestBatch", "Exceeded MaxRequestExpires", "Exceeded MaxRequestMaxBytes")


def pull_status(headers: dict[str, str] | None) -> str | None:
    """What a status message on a pull's reply subject says (the table above): ``"heartbeat"``,
    ``"gone"``, ``"too_big"``, ``"completed"``, ``"refused"``, ``"ended"`` or ``"busy"``; None for no status (a
    delivery, or a stray). nats-py puts the status line's code in ``Status``, its text in
    ``Description``."""
    status = (headers or {}).get("Status")
    if status is None:
        return None
    if status == "100":
        return "heartbeat"
    if status == "503":
        return "gone"
    description = (headers or {}).get("Description", "").strip()
    if status == "409":
        if description in _GONE:
            return "gone"
        if description == "Message Size Exceeds MaxBytes":
            return "too_big"
        if description == "Batch Completed":
            return "completed"
        if description.startswith(_REFUSED):
            return "refused"
    if status in ("400", "412", "423"):
        return "refused"
    return "ended" if status == "404" else "busy"
