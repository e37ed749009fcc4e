"""A JetStream stream's results of one request stored before its feed registered.

With a results stream, the edge's recent ring reads every new result through one ordered consumer
whose messages are dispatched to the open streams (:mod:`.fanout`). A stream opened at a moment
when that consumer had delivered up to stream sequence ``upto`` gets every later result from the
dispatch; the earlier ones, if any, are read here from the stream, oldest first, until the next
one is past ``upto``. Nothing is missed and nothing is read twice: sequences up to ``upto`` were
delivered to the edge before the registration (and dropped: no feed yet), later ones after it. A
result both replayed and dispatched (the same seq) is dropped by the feed's ``SeqOrder`` anyway.

First one probe: ``$JS.API.STREAM.MSG.GET`` with ``{"seq": 1, "next_by_subj": subject}`` (the first
message of the subject, as nats-py 2.16 ``JetStreamManager.get_msg(..., next=True)`` asks). For a
request with nothing stored yet (a client that opens before its request starts, the usual case)
that "no message found" is the whole replay: one request, no consumer. A request with results
stored (a late attach, a resume) then asks once more, and if more is stored, reads the rest with a
temporary ordered consumer of its subject from there, as every open did before (one request per stored result measured
1.6-3.2k results/s at ~170 µs of CPU each; this consumer 26-44k/s at 20-34 µs), stopping at
``upto`` or when the consumer reports nothing more pending (every sequence up to ``upto`` is stored
already, so a later one is past it), and unsubscribing it. (The consumer is made only once a
result is known to be left: made first and asked for its pending count, it pushed the history
while that answer was on its way, and a reader of a long history overran its bound before reading.)

The temporary consumer is a pull consumer (:mod:`streamproc.nats.replay_pull`, shared with the
client's ``follow(replay=True)``): one pull out at a time, sent from the reader's loop once the
last one ended and the subscription's pending bound (``--stream-buffer-bytes``) has room for half
of it, asking for ``max_bytes`` = that room (``no_wait``: what it reads is stored already); a result
larger than the room comes alone once nothing is queued. So a reader slower than the stream, a
real client on a slow link as much as one that pauses, is sent each stored result once, at its
pace. The consumer is deleted when the replay drops it (its ``inactive_threshold`` is for an edge
that died); a pull silent for ``REPLAY_PULL_LOST_AFTER`` once what it brought is read (used up
exactly, which nats-server ends without a status, or lost in a reconnect) or a consumer gone
(``503``, ``409 Consumer Deleted``) makes a new one from the next stored result, as after a pause. A
pull ended by a ``408``/``409`` that says nothing of what is stored (a full waiting queue, a leader
change: :meth:`Replay._busy`) goes again after a backoff, a bounded number of times in a row.

Before 2026-12-05 it was an ordered push consumer, which pushes as fast as nats-server sends (its
flow control does not hold it to the bound: nats-server ``consumer.processFlowControl`` doubles the
window at every answer, up to ``JsFlowControlMaxPending`` = 32 MiB). Where the edge may not
publish ``$JS.API.CONSUMER.MSG.NEXT`` (the shipped configuration before 2026-12-05: refused, read
from the error callback like MSG.GET's refusal, or no responders to the first pull; ``pulls`` is
then ``refused``, tried again every 60 s) the replay reads by subject, and where
``STREAM.MSG.GET`` is refused too, with a push consumer still: one of explicit acks held to the read
budget by its ``max_ack_pending`` (:meth:`Replay._push_consumer`, since 2026-12-06; before, an
ordered one, outside the budget). When nats-py drops a message of a push consumer
(``SlowConsumerError``, :meth:`Replay.overflowed`), the replay *pauses*: it unsubscribes at
once (no more of the history is taken in), keeps what was queued before the dropped message, hands
that out, and then goes on from the next stored result with a new consumer, as after the probe.
Memory stays within the bound; the reader gets every result in order; each pause costs one
``STREAM.MSG.GET`` and one consumer per bound's worth of results the reader took, and what the
server sent past the drop is thrown away and read again (1.2-1.4 x the history at a 4 or 8 MiB
bound, 1.6-1.9 x at 1 MiB, measured at nats-server's /connz). A pull consumer pauses the same way
for a result larger than the bound (nats-py drops it even into an empty queue).

A live stream whose client fell its bound behind the dispatch reads on the same way: a replay
from the first result it did not take (``start``) up to what the ring had delivered when it
rejoined (:meth:`ResultSource.catch_up`). Where ``STREAM.MSG.GET`` is refused, such a catch-up
reads with consumers alone (``by_consumer``): each made at the next sequence to read, unprobed,
and paused as above. So does an open's replay (since 2026-12-06; before, an open fell back to an
ordered consumer from the stream's start, outside the read budget), after one STREAM.INFO saying
whether its subject has anything stored (:func:`subject_split`; nothing: no consumer). A result larger than the
bound, which only MSG.GET can read, then raises :class:`~.msg_get.Refused`. A catch-up's start
is a result of the subject (``expect``): found gone, ``lost`` tells the feed, which then reports a
gap after ``--gap-timeout`` even when no later result of the request comes (its final one gone too).

Temporary consumers count against ``--max-replay-consumers`` from their creation until the server
has dropped them (``CONSUMER_LINGER`` after their unsubscribe). Past it a replay reads the next
result by subject; one reading with consumers alone cannot, and waits for a consumer (``waiting``):
the source keeps the next one freed for it, first come first, so replays that may read by subject
do so while it waits (``ResultSource._replay_slot_freed``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
from typing import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from ..core.errors import StoredHistoryUnreadable
from ..core.read_budget import push_window
from ..core.replay_pull import Pull, PullState
from ..core.wire import ERROR, FINAL, SEQ
from ..nats.fast_client import parse_header_block
from ..nats.replay_pull import (
    REPLAY_BUSY_BACKOFF,
    REPLAY_BUSY_RETRIES,
    REPLAY_EDGE_CONSUMER_IDLE,
    REPLAY_PULL_BATCH,
    REPLAY_PULL_LOST_AFTER,
    REPLAY_RENEWALS_MAX,
    encode,
    pull_request,
    pull_status,
    pull_subject,
    replay_consumer_config,
    replay_consumer_name,
)
from . import pending
from .msg_get import ApiPermission, Refused
from .probes import Probes
from .read_budget import ReadGate

# Pull consumers being let go (Replay._let_go), also after their reader's task was cancelled: held here,
# as the event loop keeps only weak references to tasks.
_LETTING_GO: set[asyncio.Task] = set()
NO_MESSAGE = 10037  # JSNoMessageFoundErr (nats-server server/errors.json): no message at or after seq
# A push consumer's ack wait: its results are acknowledged as they are handed out, so only a reader
# away this long sees one again (a redelivery, skipped by its stream sequence).
PUSH_ACK_WAIT = 120.0


class StoredMessage(msgspec.Struct):
    subject: str
    seq: int
    hdrs: str | None = None  # base64 of the header block
    data: str | None = None  # base64 of the body


class ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class MsgGetResponse(msgspec.Struct):
    message: StoredMessage | None = None
    error: ApiError | None = None


_decode = msgspec.json.Decoder(MsgGetResponse).decode


class SplitState(msgspec.Struct):
    last_seq: int = 0
    subjects: dict[str, int] = {}


class SplitInfo(msgspec.Struct):
    """What :func:`subject_split` reads of a STREAM.INFO answer: decoded alone, not as nats-py's
    whole ``StreamInfo`` (an open's cost)."""
    created: str = ""
    state: SplitState = msgspec.field(default_factory=SplitState)
    error: ApiError | None = None


_decode_split = msgspec.json.Decoder(SplitInfo).decode


async def subject_split(nc: NatsClient, api_prefix: str, stream: str, subject: str,
                        timeout: float) -> SplitInfo:
    """``stream``'s last sequence now and how many results of ``subject`` it holds: one STREAM.INFO
    with ``subjects_filter`` (a small answer, uncharged). nats-server takes the last sequence before
    the count (``jsStreamInfoRequest``: ``stateWithDetail``, then ``SubjectsTotals``). Raises
    nats-py's errors, ``APIError`` for the server's."""
    reply = await nc.request(f"{api_prefix}.STREAM.INFO.{stream}",
                             msgspec.json.encode({"subjects_filter": subject}), timeout=timeout)
    info = _decode_split(reply.data)
    if info.error is not None:
        raise APIError(code=info.error.code, err_code=info.error.err_code, description=info.error.description)
    return info


def _parts(message: StoredMessage) -> tuple[str, dict[str, str] | None, bytes]:
    block = base64.b64decode(message.hdrs) if message.hdrs else b""
    headers = parse_header_block(block) if len(block) > 10 and block[8] != 32 else None
    return message.subject, headers, base64.b64decode(message.data) if message.data else b""


def _seek_mark(message: StoredMessage) -> tuple[int, bool, bool] | None:
    """A stored result's seq, whether it is final and whether it is an error result (a resume's search,
    :meth:`Replay._seek`); None when its headers say no seq."""
    block = base64.b64decode(message.hdrs) if message.hdrs else b""  # the headers alone, as _parts reads them
    headers = (parse_header_block(block) if len(block) > 10 and block[8] != 32 else None) or {}
    text = headers.get(SEQ)
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text), headers.get(FINAL) == "true", ERROR in headers


def stream_seq(reply: str | None) -> int | None:
    """The stream sequence in a JetStream delivery's ``$JS.ACK`` reply subject, as nats-py 2.16's
    ``Client._process_msg`` reads it; None when ``reply`` is no ack subject."""
    try:
        return int(Msg.Metadata._get_metadata_fields(reply or "")[5])
    except (ValueError, IndexError, TypeError, nats.errors.NotJSMessageError):
        return None


# How a pull refusal by a request limit (not by the permission) opens its reason (ApiPermission.refused):
# the log's hint names the limits to raise instead of the permission to grant (source.py).
PULLS_LIMITED = "pulls refused even for one result"


def _answered(gate: ReadGate, charge: int, asked: asyncio.Future) -> None:
    """A MSG.GET's task ended (answered, refused, timed out): its charge is free; its exception, if
    its reader left, is read here (nobody else will)."""
    _LETTING_GO.discard(asked)
    gate.release(charge)
    if not asked.cancelled():
        asked.exception()


class Replay:
    """``await replay.next()``: the next stored result of ``subject`` with a stream sequence up to
    ``upto`` as (subject, headers, body), or None when there is none left (then call nothing but
    :meth:`close`). Raises :class:`~.msg_get.Refused` when a ``STREAM.MSG.GET`` goes unanswered
    (refused by permissions, no responders, timeout), else nats-py's errors
    (``nats.errors.TimeoutError`` from the temporary consumer, ``APIError`` for any other
    JetStream error); :meth:`close` frees the temporary consumer, also after an error."""

    def __init__(self, nc: NatsClient, api_prefix: str, stream: str, subject: str, upto: int,
                 timeout: float, consumer_options: dict | None = None,
                 watch: Callable[..., None] | None = None,
                 access: ApiPermission | None = None, may_subscribe: Callable[[bool], bool] | None = None,
                 start: int = 1, by_consumer: bool | None = False, expect: int | None = None,
                 release: Callable[[], None] | None = None, pulls: ApiPermission | None = None,
                 gate: ReadGate | None = None, largest: Callable[[], int] | None = None,
                 read_by_subject: Callable[[], None] | None = None, acks: ApiPermission | None = None) -> None:
        self.nc = nc
        self.api_prefix = api_prefix
        self.api_subject = f"{api_prefix}.STREAM.MSG.GET.{stream}"
        self.stream = stream
        self.subject = subject
        self.upto = upto
        self.timeout = timeout
        self.consumer_options = consumer_options or {}  # pending limits, inactive threshold
        # watch(sub, True) once the consumer exists, watch(sub, False) when a push consumer is gone,
        # watch(sub, False, deleted) when a pull consumer is (deleted or left to its inactive
        # threshold): the source calls overflowed() when nats-py drops one of its messages (SlowConsumerError).
        self.watch = watch
        self.access = access  # told of each answer; guards a request while MSG.GET is not known to work
        # False while the edge holds --max-replay-consumers consumers: the next result comes by
        # subject, or, read with consumers alone (its argument True), the replay waits (``waiting``)
        self.may_subscribe = may_subscribe
        # A True from may_subscribe holds a slot until its consumer exists (or failed): then release()
        self.release = release
        self.next_seq = start  # 1 for an open; where a live stream fell behind (ResultSource.catch_up)
        self.read = 0  # messages replayed (tests)
        self.sub = None  # the temporary ordered consumer, after a probe found a stored result
        self.done = upto < start
        # Paused after a drop: the stream sequence of the first message nats-py dropped (what is
        # queued from there on is not handed out: there may be a hole after it), else None.
        self.cut: int | None = None
        self.pauses = 0  # times the reader fell the bound behind and the consumer was stopped (tests)
        self.paused = False  # a pause ended: the next stored result comes by subject (see next)
        self.by_subject = False  # a consumer handed out nothing before its pause: no more consumers
        self.taken = 0  # results handed out by the current consumer
        # Read with consumers only, each made at next_seq without asking MSG.GET first: True when
        # MSG.GET is refused; None (a catch-up's) becomes True when a MSG.GET goes unanswered;
        # False (an open's) raises Refused then (see the module docstring).
        self.by_consumer = by_consumer
        # A stream sequence known to hold a result of the subject (a catch-up's start): the first
        # result read must be that one; if it is not stored any more, ``lost`` says so.
        self.expect = expect
        self.lost = False
        self.closed = False  # close() was called: a consumer made after it is unsubscribed at once
        # next() returned None for want of a consumer (by_consumer past the cap), not because it is
        # done: the reader waits for one to be freed and asks again.
        self.waiting = False
        # The open's probe, sent at the open (:meth:`ask`): True until its answer is read. Then
        # ``_outcome`` holds what it found (a message, or the error to raise) for next(); nothing
        # found, ``settled`` is told (the feed drops this replay without waking its reader).
        self.asking = False
        self._token = ""
        self._probes: Probes | None = None
        self._outcome: StoredMessage | BaseException | None = None
        self._answer_waiter: asyncio.Future[None] | None = None
        self.settled: Callable[[Replay], None] | None = None
        self.wake: Callable[[], None] | None = None  # the reader's inbox: something to read here
        # Pull consumers (the module docstring): whether the edge may publish CONSUMER.MSG.NEXT on
        # the stream (None: never try; refused: push consumers, as before). With a pull consumer
        # (``consumer`` its name, delivering to ``inbox``) its pulls' books are ``pull_state``: one
        # out at a time, the one that did not fit, results delivered, consumers made again in a row
        # without a result taken (bounded).
        self.pulls = pulls
        self.consumer: str | None = None
        self.inbox = ""
        self.pull_state = PullState(REPLAY_PULL_BATCH, REPLAY_PULL_LOST_AFTER, REPLAY_RENEWALS_MAX,
                                    REPLAY_BUSY_RETRIES, REPLAY_BUSY_BACKOFF)
        self.made_at = 0.0  # when the pull consumer was made (the pulls' clock): a refusal since is its
        # The edge's budget of stored bytes asked of the server and not yet received (read_budget.py):
        # a pull is charged its max_bytes before it is sent (``charged``: what is left of it), given
        # back as its results arrive and the rest when it ends; a MSG.GET the largest answer it may
        # bring (``largest``: the largest result the stream may hold) until the answer is in.
        self.gate = gate
        self.largest = largest
        self.read_by_subject = read_by_subject  # told of each result read by subject for want of pulls (metrics)
        self.charged = 0
        self._arrived = 0  # results the pull out brought so far, counted as they arrive
        # A push consumer (pulls refused) with a read budget: made with max_ack_pending ``window``
        # and charged ``push_charge`` (core/read_budget.py, push_window) until it is unsubscribed
        # and a flush is answered behind that; its results are acknowledged as they are handed out
        # (``acks``: may the edge publish ``$JS.ACK.<stream>.>``; refused, it makes a new consumer
        # each window of results instead, as the server sends no more to one that does not ack).
        self.window = 0
        self.push_charge = 0
        self.acks = acks
        self._probe_charge = 0
        # An open's replay (``expect`` None) with consumers alone asks first whether anything of its
        # subject is stored (:func:`subject_split`): a push consumer of nothing would wait its whole
        # timeout, and the usual open (before its request starts) takes no consumer slot.
        self._sized = False
        # told when a refusal turns it (``by_consumer`` None) to consumers alone (an open's: metrics)
        self.turned: Callable[[], None] | None = None
        # The current consumer found nothing of the subject stored at or after where it started (a
        # push consumer's num_pending 0 at its creation) or where it was (a pull's "404 No Messages"
        # before it brought anything): once what is queued is handed out, the replay is done. Read
        # with consumers alone, a "no messages" was taken for a result larger than the bound
        # (``by_subject``: Refused, the feed's ordered consumer from the stream's start) and a push
        # consumer of nothing was waited on its whole timeout (Lost), where the STREAM.INFO failed
        # or the results went between it and the consumer (tests/test_edge_replay_nothing_found.py).
        self.exhausted = False
        # A resume's Last-Event-ID (an open's replay, set by the source): the first read looks for
        # the stored result with that seq (:meth:`_seek`) instead of reading every earlier one.
        self.seek: int | None = None

    async def ask(self, probes: Probes, settled: Callable[[Replay], None], wake: Callable[[], None]) -> None:
        """Send the open's probe now (MSG.GET known to answer): its answer is read in the NATS read
        loop (:mod:`.probes`), and the reader is woken (``wake``) only when it found something or
        failed; nothing stored, ``settled(self)`` and nothing else. A failed publish is raised
        by the next :meth:`next`, as a failed request was."""
        if self.done or self.seek is not None:  # a resume searches from the reader's next() first
            return
        if self.gate is not None:
            # No budget free now: not asked at the open; the reader's next() asks, waiting its turn
            charge = self.gate.try_acquire(self._get_size(), self._get_size())
            if not charge:
                return
            self._probe_charge = charge
        self._probes, self.settled, self.wake = probes, settled, wake
        self.asking = True
        try:
            self._token = await probes.ask(self.api_subject, self._request(self.next_seq), self.timeout, self.answered)
        except Exception as exc:  # noqa: BLE001 - raised to the reader, as nc.request's would have been
            self.asking, self._outcome = False, exc
            self._probe_given_back()

    def answered(self, data: bytes | None, exc: BaseException | None) -> None:
        """The probe's answer (``data``) or failure (``exc``: ``TimeoutError``, ``LookupError`` for
        no responders), as :meth:`_get` reads a request's: in the read loop, so it never raises."""
        if not self.asking:
            return
        self.asking = False
        self._probe_given_back()
        outcome: StoredMessage | BaseException | None
        if isinstance(exc, LookupError):
            outcome = self._no_responders()
        elif exc is not None:
            outcome = self._no_answer()
        else:
            try:
                outcome = self._answer(data or b"")
            except Exception as error:  # noqa: BLE001 - APIError, a malformed answer: the reader's error
                outcome = error
        waiter = self._answer_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if outcome is None:  # nothing stored up to upto: done, nobody to wake
            if self.settled is not None:
                self.settled(self)
            return
        self._outcome = outcome
        if self.wake is not None:
            self.wake()

    async def next(self) -> tuple[str, dict[str, str] | None, bytes] | None:
        if self.asking:  # the open's probe is out: its answer first (ask)
            self._answer_waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._answer_waiter = None
            if self.closed:
                return None
        if self._outcome is not None:
            outcome, self._outcome = self._outcome, None
            if isinstance(outcome, BaseException):
                raise outcome
            return await self._found_first(outcome)
        if self.done:
            return None
        if self.sub is None:
            if self.by_consumer:
                if not self._sized and self.read == 0 and self.expect is None:
                    self._sized = True
                    nothing = await self._nothing_stored()
                    if nothing or self.closed:
                        self.done = nothing
                        return None
                if self.may_subscribe is not None and not self.may_subscribe(True):
                    self.waiting = True  # nothing to read by subject with: wait for a free consumer
                    return None
                return await self._subscribe(self.next_seq, reserved=self.may_subscribe is not None)
            # The probe (the first stored result, if any), or more stored? Asked before a consumer
            # exists (it would push at once, while nobody reads): the consumer is made only when
            # there is something for it, starting at that one.
            try:
                if self.seek is not None and self.read == 0:
                    after, self.seek = self.seek, None
                    message = await self._seek(after)
                else:
                    message = await self._get(self.next_seq)
                if self.closed:  # closed from another task while the answer was on its way
                    return None
            except Refused as exc:
                if self.by_consumer is not None:
                    raise
                # Refused until the re-probe: no responders (a -ERR is the source's: _on_error), and
                # a silence while MSG.GET never answered, as fall_back counts it (a silence after it
                # answered is a busy server). Not counted, a silence had every later open ask MSG.GET
                # and wait out its timeout before its first result (tests/test_edge_msg_get_unanswered.py).
                access = self.access
                if access is not None and (exc.denied or not access.confirmed):
                    access.refused(exc.reason)
                self.by_consumer = True
                if self.turned is not None:
                    self.turned()
                return await self.next()
            if message is None:
                return None
            return await self._found_first(message)
        return await self._read()

    async def _found_first(self, message: StoredMessage) -> tuple[str, dict[str, str] | None, bytes] | None:
        """A stored result found by subject: handed out, or the first of a temporary consumer."""
        by_subject = self.read == 0 or self.paused or self.by_subject
        if not by_subject and self.gate is not None and self._pulls_refused():
            # Pulls refused: a push consumer's flow control lets nats-server send 2 MiB and more
            # (its window doubles at each answer, up to 32 MiB) past the read budget, and many of
            # them had the edge's connection cut as a slow consumer (tests/test_edge_replay_budget.py).
            # Each result by subject instead, every request charged to the budget.
            by_subject = True
            if self.read_by_subject is not None:
                self.read_by_subject()
        if by_subject or (self.may_subscribe is not None and not self.may_subscribe(False)):
            # Handed out as it came: the probe's; after a pause, so that every pause moves the
            # reader on by a result at least, even one larger than the bound by itself (nats-py
            # drops it from any consumer: a consumer per attempt, forever, otherwise). A consumer
            # that was paused before it handed out anything had such a result first: the rest
            # of this history is read by subject, a request per result, no consumer per result.
            # So is the next result while the edge holds its --max-replay-consumers.
            self.paused = False
            self.next_seq = message.seq + 1
            self.read += 1
            self.done = message.seq >= self.upto
            return _parts(message)
        return await self._subscribe(message.seq, reserved=self.may_subscribe is not None)

    async def _seek(self, after: int) -> StoredMessage | None:
        """The stored result a resume after result seq ``after`` reads from: the result ``after``
        (read again: dropped as a repeat), a final one at or before it (read again: it ends the
        stream, as the client has it all) or the last one stored when none is past ``after`` (a
        Last-Event-ID ahead of what is stored), found by a binary search of MSG.GETs
        (``next_by_subj``, each charged to the read budget); else the first stored, from the start
        as before (not stored any more, or a store out of seq order the search meets); None when
        nothing is stored. A later seq stored before ``after``'s result and never probed is not read:
        that resume ends with the gap error (tests/test_edge_resume_hostile_store.py).

        A resume read every stored result from the start and dropped those the client had: 20
        resumes after the 999th of 1,000 16 KiB results had nats-server send the edge 315 MiB,
        1,000 x what the clients were sent (tests/test_edge_resume_cost.py). Results of a request are
        stored in seq order (its processor publishes them so; a republished one is a duplicate
        within the stream's duplicate window), so no later seq is stored before the first copy of
        ``after``: only a copy of ``after`` stored again past the duplicate window after later seqs
        would be found instead of the first and skip them. So the search stops at the first copy it
        finds: going on halving for a later one cost a MSG.GET per halving of the rest of the stream,
        and only such a copy could be found (``Last-Event-ID: 0`` after a request's first result,
        stored first in a stream of 4,096: 20 messages to the edge, now 8, as many as an open of it).

        The first MSG.GET asks for the subject's first stored result, as an open's probe does:
        nothing stored (a request not started, or any id a client names) ends it there. Halving the
        whole stream first, such a resume asked ~log2 of the stream's length where an open asks once."""
        first = await self._get(self.next_seq)
        if first is None or self.closed:
            return first
        mark = _seek_mark(first)
        if mark is None or mark[0] >= after or mark[1]:  # from the start, or found: ``after``, or a final one before
            return first
        at: StoredMessage | None = None
        done = self.done
        lo, hi = first.seq + 1, self.upto
        last = first  # the last result found at or before ``after``
        later = False  # a result past ``after`` was found
        try:
            while lo <= hi:
                mid = (lo + hi) // 2
                message = await self._get(mid)
                if self.closed:
                    return None
                if message is None or message.seq > hi:  # nothing of the subject from mid to hi
                    hi = mid - 1
                    continue
                mark = _seek_mark(message)
                if mark is None:
                    return first
                seq, final, error = mark
                if seq > after:
                    later = True
                    hi = mid - 1
                    continue
                last = message
                if seq == after and (error or final) and at is None:
                    # An error at the resume point may be one stored after the result ``after`` the
                    # client had (a restarted processor's at its own seq 0: SeqOrder.push hands it out,
                    # below that result, only once it saw the result). Stored before it, so looked for
                    # below; the error is where the read starts when there is none. So is a final that
                    # is no error: one stored after a non-final copy of that seq (a forger's) would end
                    # the resume clean, where the copy read first makes SeqOrder report it (contradicted).
                    at = message
                    hi = mid - 1
                    continue
                if seq == after or final:  # found: no later copy is looked for (results are in seq order)
                    at = message
                    break
                lo = message.seq + 1
        finally:
            self.done = done
        # Every result found was at or before ``after`` (a client ahead of what is stored): from the
        # last one stored, as the request goes on from there.
        if at is None:
            return first if later else last
        return at

    async def _nothing_stored(self) -> bool:
        """Nothing of the subject is stored (so nothing up to ``upto``)? Unanswered: made anyway, and
        the consumer says so (``exhausted``), as when the results went meanwhile."""
        try:
            info = await subject_split(self.nc, self.api_prefix, self.stream, self.subject, self.timeout)
        except Exception:  # noqa: BLE001 - refused, unanswered: its consumer says what is stored
            return False
        return info.state.subjects.get(self.subject, 0) == 0

    def _pulls_refused(self) -> bool:
        """Pulls are refused and no re-probe of them is due (which ``usable`` would claim)."""
        pulls = self.pulls
        return (pulls is not None and pulls.state == "refused"
                and pulls.clock() - pulls.refused_at < pulls.reprobe)

    async def _subscribe(self, seq: int, reserved: bool = False) -> tuple[str, dict[str, str] | None, bytes] | None:
        """Read on with a new temporary consumer from stream sequence ``seq`` (``reserved``: in a
        slot may_subscribe gave, released once the consumer failed, or exists and watch counts it,
        so that the slot is never seen free between the two)."""
        try:
            if self.by_consumer and self.by_subject:  # a result past the bound, which only MSG.GET reads
                raise Refused(f"a result larger than the bound, and no answer on {self.api_subject}",
                              denied=False)
            self.exhausted = False
            if self.pulls is not None and self.pulls.usable():
                sub = await self._pull_consumer(seq)
            elif self.gate is not None:
                sub = await self._push_consumer(seq)
            else:
                sub = await self.nc.jetstream().subscribe(
                    self.subject, stream=self.stream, ordered_consumer=True,
                    config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq),
                    **self.consumer_options)
        except BaseException:
            if reserved and self.release is not None:
                self.release()
            raise
        self.sub = sub
        self.taken = 0
        if self.watch is not None:
            self.watch(self.sub, True)
        if reserved and self.release is not None:
            self.release()
        if self.closed:  # closed from another task meanwhile (ResultSource._stop_replays): nobody reads it,
            await self._drop_consumer()  # and the server keeps it CONSUMER_LINGER, counted as any dropped one
            return None
        return await self._read()

    async def _read(self) -> tuple[str, dict[str, str] | None, bytes] | None:
        sub = self.sub
        while True:
            if self.consumer is not None:
                if self.pull_refused():
                    return await self._renew()  # its first pull was refused (-ERR): a push consumer
                await self._pull(sub)
            msg = pending.take(sub)  # Subscription.next_msg without its tasks per message (pending.py)
            if msg is not None and self.consumer is not None and not (msg.reply or "").startswith("$JS.ACK."):
                status = self._pull_ended(msg)
                if status == "gone":  # no consumer (deleted, idle too long) or nobody answers pulls
                    return await self._renew(refused=(f"no responders on {self.pulls.subject}.<consumer>"
                                                      if self._no_responders_to_pulls(msg) and self.pulls
                                                      else None))
                if status == "busy" and self.pull_state.got == 0 and not await self._busy(sub, msg):
                    return None  # closed during its backoff
                if status == "refused" and self.pull_state.stuck:  # refused even for one result alone:
                    # a limit of the server or account on pull requests, which every consumer meets:
                    # read by subject meanwhile, as where pulls are not permitted (until the re-probe)
                    description = (msg.headers or {}).get("Description", "")[:200]
                    return await self._renew(refused=f"{PULLS_LIMITED}: {description}")
                continue
            if self.cut is not None and (msg is None or msg.metadata.sequence.stream >= self.cut):
                # Paused, and what was queued before the drop is read: on from the next stored result.
                await self._stop_consumer()
                return await self.next()
            if msg is not None:
                if self.window and msg.metadata.sequence.stream < self.next_seq:
                    await self._ack(msg)  # redelivered (its reader was away PUSH_ACK_WAIT): handed out already
                    continue
                break
            if self.exhausted:  # nothing (more) stored up to upto: what is queued is handed out
                self._found(None)
                await self._finish()
                return None
            if self.window and self.taken >= self.window:
                # This push consumer handed out as many as the server sends it unacknowledged: with its
                # acks refused (or lost) no more comes. A new consumer from the next stored result.
                if not (self.acks is not None and self.acks.state == "refused"):
                    woken = await pending.wait(sub, min(self.timeout, REPLAY_PULL_LOST_AFTER))
                    if self.sub is not sub:
                        return None
                    if woken or self.cut is not None:
                        continue
                await self._drop_consumer()
                return await self.next()
            if self.consumer is not None and self.pull_state.out:
                loop = asyncio.get_running_loop()
                since = loop.time()
                # A no_wait pull never waits on the server: it delivers or ends at once. Nothing
                # queued and no word for REPLAY_PULL_LOST_AFTER, it is over without a status (its
                # results used up its max_bytes exactly: replay_pull.py) or lost (a reconnect).
                silence = min(self.timeout, REPLAY_PULL_LOST_AFTER)
                woken = await pending.wait(sub, silence)
                if self.sub is not sub:  # closed meanwhile
                    return None
                if woken or self.cut is not None or self.pull_refused():
                    continue
                if loop.time() - since >= silence:
                    return await self._renew()  # from the next stored result, with a new consumer
                raise nats.errors.TimeoutError  # woken for nothing (the stream is gone): the feed says why
            woken = await pending.wait(sub, self.timeout)
            if self.sub is not sub:  # closed meanwhile (the feed ended): nothing more from here
                return None
            if not woken and self.cut is None:
                raise nats.errors.TimeoutError
        reply = pending.flow_control_due(sub)
        if reply is not None:
            await self.nc.publish(reply)
        meta = msg.metadata
        if self.consumer is not None:
            self.pull_state.took(asyncio.get_running_loop().time())
            if self.pull_state.delivered == 1 and self.pulls is not None and self.pulls.state != "allowed":
                self.pulls.allowed()  # a pull was answered (a re-probe after a refusal ends it)
        self._found(meta.sequence.stream)
        if meta.sequence.stream > self.upto:  # later ones come from the dispatch
            await self._finish()
            return None
        self.read += 1
        self.taken += 1
        self.next_seq = meta.sequence.stream + 1
        if self.window and self.taken > self.window and self.acks is not None and self.acks.state != "allowed":
            self.acks.allowed()  # sent past its max_ack_pending: an ack went through (a refusal ends)
        if meta.sequence.stream >= self.upto or meta.num_pending == 0:
            await self._finish()  # this one is the last stored up to upto
        elif self.window:
            await self._ack(msg)  # handed out: the server may send the next one
        return msg.subject, msg.headers, msg.data

    async def _push_consumer(self, seq: int):
        """A push consumer of the subject from stream sequence ``seq`` that nats-server sends at most
        ``window`` results unacknowledged (``max_ack_pending``: ``consumer.go`` ``getNextMsg`` stalls
        at ``errMaxAckPending``; no flow control), charged to the read budget for as long as it
        exists (:func:`~streamproc.core.read_budget.push_window`). An ordered push consumer's flow
        control let the server send 2 MiB and more each (its window doubles at each answer, up to
        32 MiB), whatever the budget: 32 slow late attaches had the edge's connection cut where
        neither pulls nor MSG.GET were permitted (tests/test_edge_replay_budget.py)."""
        assert self.gate is not None
        options = self.consumer_options
        window, charge = push_window(self._largest(), options.get("pending_bytes_limit") or 0,
                                     self.gate.budget.limit, (options.get("pending_msgs_limit") or 0) - 1)
        self.push_charge = await self.gate.acquire(charge, charge)
        # Made as nats-py's js.subscribe makes it (the consumer, then the subscription of its deliver
        # subject, which the server waits for), but keeping the creation's answer: its num_pending
        # says whether anything of the subject is stored from ``seq`` (``exhausted``).
        limits = {k: v for k, v in options.items() if k.startswith("pending_")}
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq,
                                ack_policy=AckPolicy.EXPLICIT, max_ack_pending=window,
                                ack_wait=PUSH_ACK_WAIT, num_replicas=1, mem_storage=True,
                                filter_subject=self.subject, deliver_subject=self.nc.new_inbox(),
                                inactive_threshold=options.get("inactive_threshold"))
        js = self.nc.jetstream()
        name = None
        try:
            info = await js.add_consumer(self.stream, config=config)
            name = info.name
            sub = await js.subscribe_bind(self.stream, config, name, manual_ack=True, **limits)
        except BaseException:
            # Given back even when the delete is cancelled too (an anyio cancel scope cancels every
            # await after the first): with ``sub`` None, Feed.close_now drops this replay unclosed.
            charge, self.push_charge = self.push_charge, 0
            try:
                if name is not None:
                    await self._delete(name)
            finally:
                self.gate.release(charge)
            raise
        self.window = window
        self.exhausted = info.num_pending == 0  # no interest before subscribe_bind: nothing sent yet
        return sub

    async def _ack(self, msg: Msg) -> None:
        """Acknowledge a push consumer's result (not while acks are refused: a consumer per window then)."""
        if msg.reply and (self.acks is None or self.acks.usable()):
            await self.nc.publish(msg.reply, b"+ACK")

    async def _pull_consumer(self, seq: int):
        """A pull consumer of the subject from stream sequence ``seq`` and the subscription of its
        inbox (no callback: read as the reader asks, with the feed's pending bounds, which its
        pulls never pass). Nothing is sent before :meth:`_pull` asks."""
        nc = self.nc
        inbox = nc.new_inbox()
        name = replay_consumer_name(inbox)
        limits = {k: v for k, v in self.consumer_options.items() if k.startswith("pending_")}
        sub = await nc.subscribe(inbox, **limits)
        if self.gate is not None:
            pending.on_arrival(sub, self._arrival)
        try:
            await nc.jetstream(prefix=self.api_prefix).add_consumer(
                self.stream, config=replay_consumer_config(name, self.subject, seq, REPLAY_EDGE_CONSUMER_IDLE))
        except BaseException:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
            await self._delete(name)  # it may exist: the answer, not the request, was lost
            raise
        self.consumer, self.inbox = name, inbox
        self.pull_state.consumer_made()
        self.made_at = self.pulls.clock() if self.pulls is not None else 0.0
        return sub

    def pull_refused(self) -> bool:
        """The pull consumer's pulls were refused since it was made (its first one, by the
        connection's -ERR: ``ResultSource._on_error``): read on with a push consumer."""
        pulls = self.pulls
        return (self.consumer is not None and self.pull_state.delivered == 0 and pulls is not None
                and pulls.state == "refused" and pulls.refused_at >= self.made_at)

    async def _pull(self, sub) -> None:
        """Ask for the next results once the previous pull ended: as many bytes as the bound has
        room for (at least half of it), or the one that did not fit alone once nothing is queued.
        ``no_wait``: every result up to ``upto`` is stored already; nothing waits on the server."""
        if self.done or self.cut is not None or self.exhausted:
            return
        queued, queued_msgs = sub._pending_size, sub._pending_queue.qsize()
        bound = self.consumer_options.get("pending_bytes_limit") or 0
        msgs_bound = self.consumer_options.get("pending_msgs_limit") or 0
        # nats-py drops a message that brings the queue to its bound (Client._process_msg: >=),
        # and the status that ends a pull takes a place in the queue too
        room = bound - queued - 1 if bound > 0 else 1 << 30
        # held: a message queued (an empty queue holds no bytes, so its room is at least half the bound)
        pull = self.pull_state.ask(room, bound, held=queued_msgs > 0,
                                   batch=msgs_bound - queued_msgs - 1 if msgs_bound > 0 else None)
        if pull is None:
            return
        gate = self.gate
        if gate is not None:
            # Its turn in the edge's read budget: a smaller pull when little is free, never less
            # than the largest result (else it brings nothing); the one that did not fit, alone.
            largest = self._largest()
            want = largest if pull.room is None else pull.room
            granted = await gate.acquire(want, min(want, largest))
            if self.sub is not sub or self.done or self.cut is not None:  # closed or stopped meanwhile
                gate.release(granted)
                return
            if pull.room is not None:
                pull = Pull(min(pull.room, granted), pull.batch)
            self.charged, self._arrived = granted, 0
        request = pull_request(pull.room, pull.batch, no_wait=True)
        self.pull_state.sent(pull, asyncio.get_running_loop().time())
        try:
            await self.nc.publish(pull_subject(self.api_prefix, self.stream, self.consumer or ""), encode(request),
                                  reply=self.inbox)
        except BaseException:
            self.pull_state.over()
            self._give_back()
            raise

    def _arrival(self, msg: Msg) -> None:
        """A message reached the pull consumer's inbox (in the NATS read loop, before its reader
        takes it): its bytes are the server's no more; a status that ends the pull, or the last
        result its batch asked for, gives back the rest of the pull's charge."""
        if not self.charged:
            return
        if (msg.reply or "").startswith("$JS.ACK."):
            self._arrived += 1
            headers = msg.headers
            size = len(msg.data) + len(msg.subject) + len(msg.reply) + (
                sum(len(k) + len(v) + 4 for k, v in headers.items()) if headers else 0)
            if self._arrived >= self.pull_state.left + self.pull_state.got:
                size = self.charged  # its batch is in: the pull is over
        else:
            status = pull_status(msg.headers)
            if status is None or status in ("heartbeat", "completed"):
                return  # completed: given back with the batch's last result (a next pull may be out)
            size = self.charged
        size = min(size, self.charged)
        self.charged -= size
        assert self.gate is not None
        self.gate.release(size)

    def _give_back(self) -> None:
        """The pull out is over (lost, failed, its consumer dropped): what it did not bring is free."""
        charged, self.charged = self.charged, 0
        if charged and self.gate is not None:
            self.gate.release(charged)

    def _largest(self) -> int:
        """The largest result the stream may hold (its max_msg_size, or the server's max_payload)."""
        return max(1, self.largest()) if self.largest is not None else 1 << 20

    def _get_size(self) -> int:
        """The most a STREAM.MSG.GET answer may bring: the largest result, in Base64, and its JSON."""
        return (self._largest() + 2) // 3 * 4 + 4096

    def _probe_given_back(self) -> None:
        charge, self._probe_charge = self._probe_charge, 0
        if charge and self.gate is not None:
            self.gate.release(charge)

    @property
    def pulled(self) -> int:
        """Pulls sent, all consumers (tests)."""
        return self.pull_state.sent_total

    def _pull_ended(self, msg: Msg) -> str | None:
        """A status on the pull consumer's inbox: the pull out is over (what :func:`pull_status`
        says; a stray or a heartbeat changes nothing)."""
        status = pull_status(msg.headers)
        if status is None or status in ("heartbeat", "completed") or msg.subject != self.inbox:
            return None
        self.pull_state.status(status, asyncio.get_running_loop().time())
        if status == "ended" and self.pull_state.got == 0:  # 404 No Messages
            if self.by_consumer:
                # nothing stored at or after where the consumer is (no_wait): no later pull, and
                # done once what is queued is handed out (not "a result larger than the bound")
                self.exhausted = True
                return status
            # nothing stored at or after next_seq any more (deleted, expired): the rest comes by
            # subject (which says so, or finds a later one), as after a pause
            self.cut = self.next_seq
        return status

    async def _busy(self, sub, msg: Msg) -> bool:
        """A pull ended ``busy`` (pull_status) having brought nothing: nats-server's ``408 Request
        Timeout`` / ``Interest Expired`` / ``Requests Pending`` (``processWaiting``, ``nextWaiting``,
        ``processNextMsgRequest``), ``409 Exceeded MaxWaiting`` (``processNextMsgRequest``, when
        ``o.waiting.add(wr)`` fails: the waiting queue is full), ``409 Leadership Change`` (``checkPendingRequests``)
        or ``409 Server Shutdown`` (``signalPullConsumers``). None says anything of what is stored at or
        after next_seq, and the consumer is still there: the same pull goes again after a doubling
        backoff (its charge was given back at the status: _arrival), at most REPLAY_BUSY_RETRIES times
        in a row. Past that, read with consumers alone (or MSG.GET not known to answer), the replay ends with
        :class:`StoredHistoryUnreadable` (the feed's ``Lost``); until 2026-12-06 it was cut here, which
        took the consumer for one that met a result larger than the bound: ``Refused``, and the feed
        fell back to an ordered consumer from the stream's start, outside the read budget. With
        MSG.GET the rest comes by subject (charged), as after a pause. True: read on (False: closed
        meanwhile)."""
        delay = self.pull_state.busy_retry()
        if delay is None:
            status = " ".join(filter(None, ((msg.headers or {}).get("Status"),
                                            (msg.headers or {}).get("Description", "")[:200])))
            # MSG.GET not known to answer (refused at the open, or unknown and unconfirmed since):
            # refused there, this consumer's nothing brought would be taken for a result larger than
            # the bound (_stop_consumer: by_subject), a fallback. Unknown at the open (None) but
            # answered since (this replay asks it before its first consumer) counts as known: until
            # 2026-12-06 such a replay ended Lost here instead of reading the rest by subject.
            if not self._msg_get_answers():
                raise StoredHistoryUnreadable(
                    f"{self.pull_state.busy_max + 1} pulls in a row of {self.subject} ended with nothing brought, "
                    f"the last with {status!r}")
            self.cut = self.next_seq
            return True
        await asyncio.sleep(delay)
        return self.sub is sub and not self.closed

    def _msg_get_answers(self) -> bool:
        """MSG.GET is known to answer: so at the open (``by_consumer`` False), or unknown then
        (None) and answered since, with no refusal after (the access is ``confirmed``)."""
        if self.by_consumer is None:
            return self.access is not None and self.access.confirmed
        return not self.by_consumer

    def _no_responders_to_pulls(self, msg: Msg) -> bool:
        """Whether a "gone" on the pull consumer's inbox says the edge's account cannot reach
        CONSUMER.MSG.NEXT (no import): a ``503`` no responders to the consumer's first pull while no
        pull was ever answered. nats-server answers pulls with 503 only from ``client.go``'s no
        responders (``consumer.go`` sends 404/408/409 statuses), so a consumer deleted before its first
        pull looks the same; once a pull was answered (``allowed``) that is what it is, and a
        ``409 Consumer Deleted`` never says anything of the permission."""
        return (self.pull_state.delivered == 0 and (msg.headers or {}).get("Status") == "503"
                and (self.pulls is None or self.pulls.state != "allowed"))

    async def _renew(self, refused: str | None = None) -> tuple[str, dict[str, str] | None, bytes] | None:
        """The pull consumer is gone (or its pulls went unanswered): on from the next stored
        result, by subject and then a new consumer, as after a pause. ``refused`` (why): its first
        pull got no responders (the edge's account does not import CONSUMER.MSG.NEXT), or its pulls
        were refused even for one result alone (a pull request limit): pulls count as refused from
        now on (until the access's re-probe), and replays read by subject."""
        if refused is not None and self.pulls is not None and self.pulls.state != "refused":
            self.pulls.refused(refused)
        if not self.pull_state.renew():
            raise nats.errors.TimeoutError
        await self._drop_consumer()
        self.cut = None
        self.done = False
        return await self.next()

    async def _delete(self, name: str) -> bool:
        """Delete a pull consumer now (best effort, bounded): True when the server says it is gone
        (its slot is free at once; else past REPLAY_EDGE_CONSUMER_IDLE without a pull the server
        deletes it, and it is counted that long: REPLAY_PULL_SLOT_LINGER)."""
        if self.nc.is_closed:
            return False
        try:
            await asyncio.wait_for(self.nc.jetstream(prefix=self.api_prefix).delete_consumer(self.stream, name),
                                   self.timeout)
        except NotFoundError:
            return True
        except Exception:  # noqa: BLE001 - a lost answer, a closed connection: it may still exist
            return False
        return True

    async def _get(self, seq: int) -> StoredMessage | None:
        """The first stored message of the subject at or after ``seq``, if at most ``upto``; else
        None, and the replay is done."""
        gate = self.gate
        if gate is None:
            return self._answer(await self._ask_get(seq))
        charge = await gate.acquire(self._get_size(), self._get_size())
        # A task of its own, given back once it is answered, refused or timed out: also when this
        # reader is cancelled meanwhile (its client left), as nats-server sends the answer all the
        # same. Given back at the cancel, late attaches left at once had the server queue past the
        # budget (tests/test_edge_replay_budget.py).
        asked = asyncio.ensure_future(self._ask_get(seq))
        _LETTING_GO.add(asked)
        asked.add_done_callback(functools.partial(_answered, gate, charge))
        return self._answer(await asyncio.shield(asked))

    async def _ask_get(self, seq: int) -> bytes:
        access = self.access
        asked = self.nc.request(self.api_subject, self._request(seq), timeout=self.timeout)
        try:
            # Unguarded once MSG.GET answered (no task per open); until then a refusal, which only
            # the error callback reports, ends the wait at once (msg_get.py).
            reply = await (asked if access is None or access.confirmed else access.guard(asked))
        except nats.errors.NoRespondersError:
            raise self._no_responders() from None
        except nats.errors.TimeoutError:
            raise self._no_answer() from None
        return reply.data

    def _no_responders(self) -> Refused:
        return Refused(f"no responders on {self.api_subject}", denied=True)

    def _no_answer(self) -> Refused:
        return Refused(f"no answer on {self.api_subject} within {self.timeout:g} s", denied=False)

    def _request(self, seq: int) -> bytes:
        return msgspec.json.encode({"seq": seq, "next_by_subj": self.subject})

    def _answer(self, data: bytes) -> StoredMessage | None:
        """A MSG.GET answer read: the message, if at most ``upto``; else None, and the replay is done."""
        if self.access is not None:
            self.access.allowed()
        response = _decode(data)
        if response.error is not None:
            if response.error.err_code == NO_MESSAGE or response.error.code == 404:
                self._found(None)
                self.done = True
                return None
            raise APIError(code=response.error.code, err_code=response.error.err_code,
                           description=response.error.description)
        message = response.message
        self._found(message.seq if message is not None else None)
        if message is None or message.seq > self.upto:
            self.done = True
            return None
        return message

    def _found(self, seq: int | None) -> None:
        """The first stored result read is at ``seq`` (None: none is stored): one expected earlier
        is gone (``max_age``, ``max_msgs``, a deletion)."""
        if self.expect is not None:
            self.lost = seq is None or seq > self.expect
            self.expect = None

    async def overflowed(self, reply: str | None) -> bool:
        """nats-py dropped a message of the temporary consumer (``SlowConsumerError``; ``reply`` is
        its ``$JS.ACK`` subject): the reader is the bound behind. Pause: take nothing more in, keep
        what was queued before that message for :meth:`next`, which then goes on with a new
        consumer. (nats-py's ordered consumer counts a dropped message as delivered, so going on
        with this consumer would skip it.) True when this began a pause."""
        sub = self.sub
        if sub is None:
            return False
        seq = stream_seq(reply)
        if seq is None:
            seq = self.next_seq  # unreadable: hand out nothing queued past what was read
        if self.cut is not None:
            self.cut = min(self.cut, seq)
            return False
        self.cut = seq
        self.pauses += 1
        # Unsubscribed now, inside nats-py's read loop: the messages the server still sends for it
        # are ignored (no subscription), and those queued stay queued (Subscription.unsubscribe
        # leaves ``_pending_queue`` as it is).
        with contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()
        pending.wake(sub)  # a reader waiting for more: look again
        return True

    async def _stop_consumer(self) -> None:
        """End a pause: the consumer and what is queued past the cut go; the next :meth:`next`
        asks for the next stored result by subject and makes a new consumer from there."""
        await self._drop_consumer()
        self.cut = None
        self.done = False
        self.paused = True
        self.by_subject = self.by_subject or self.taken == 0

    async def _finish(self) -> None:
        self.done = True
        await self._drop_consumer()

    async def close(self) -> None:
        """Done for good, also when called while a consumer is being made (see :meth:`_subscribe`)."""
        self.close_now()
        await self._drop_consumer()

    def close_now(self) -> bool:
        """:meth:`close` without awaiting: True when that was all (no temporary consumer to drop)."""
        self.closed = self.done = True
        if self.asking:  # its answer is not wanted any more
            self.asking = False
            self._probe_given_back()
            if self._probes is not None:
                self._probes.forget(self._token)
            waiter = self._answer_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._outcome = None
        return self.sub is None

    async def _drop_consumer(self) -> None:
        sub, self.sub = self.sub, None
        name, self.consumer = self.consumer, None
        self.pull_state.over()
        if name is None:
            self._give_back()
        else:
            # What the pull out did not bring yet is given back once the consumer is deleted
            # (_let_go), not now: nats-server queued it towards the edge when the pull came, and
            # sends it all the same; its answer to the delete comes behind it. Given back at a
            # close, late attaches closed while their pulls were out had the server queue past
            # the budget (tests/test_edge_replay_budget.py).
            charged, self.charged = self.charged, 0
            if sub is not None:
                pending.wake(sub)  # a reader waiting in next() for this consumer returns at once
            # A task of its own, awaited shielded: the reader's task is cancelled when its client
            # leaves (Uvicorn), also during these round trips, and the slot was then never given
            # back (watch not called): --max-replay-consumers one lower for the edge's life.
            letting_go = asyncio.ensure_future(self._let_go(sub, name, charged))
            _LETTING_GO.add(letting_go)
            letting_go.add_done_callback(_LETTING_GO.discard)
            await asyncio.shield(letting_go)
            return
        charge, self.push_charge, self.window = self.push_charge, 0, 0
        if sub is not None:
            if charge:
                pending.wake(sub)  # a reader waiting in next() for this consumer returns at once
                # Deleted, and given back once the delete (or a flush) is answered behind the
                # unsubscribe: what the server sent before it is in by then. A task of its own,
                # awaited shielded (as _let_go).
                letting_go = asyncio.ensure_future(self._let_go_push(sub, charge))
                _LETTING_GO.add(letting_go)
                letting_go.add_done_callback(_LETTING_GO.discard)
                await asyncio.shield(letting_go)
                return
            if self.watch is not None:
                self.watch(sub, False)  # a push consumer: the server drops it after its inactive threshold
            pending.wake(sub)  # a reader waiting in next() for this consumer returns at once
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
            pending.drop(sub)  # what nobody will read (past a pause's cut, a closed feed's) goes now
        elif charge and self.gate is not None:
            self.gate.release(charge)

    async def _let_go_push(self, sub, charge: int) -> None:
        """Unsubscribe a budgeted push consumer and delete it (its slot is free at once: a consumer
        per window of results where acks are refused must not wait for each to linger), then give
        back its charge once the server has answered the delete, or a flush where that failed,
        both sent behind the unsubscribe (or the connection is gone)."""
        deleted = False
        try:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
            pending.drop(sub)
            name = getattr(sub, "_consumer", None)  # nats-py 2.x PushSubscription's consumer name
            if name:
                deleted = await self._delete(name)
            if not deleted and not self.nc.is_closed:
                with contextlib.suppress(nats.errors.Error, OSError, asyncio.TimeoutError):
                    await self.nc.flush(timeout=self.timeout)
        finally:
            assert self.gate is not None
            self.gate.release(charge)
            if self.watch is not None:  # deleted: its slot is free now; else it lingers as a push consumer's
                self.watch(sub, False, True if deleted else None)

    async def _let_go(self, sub, name: str, charged: int = 0) -> None:
        """Unsubscribe a pull consumer's inbox and delete the consumer (bounded: the timeout), then
        report it gone: its slot is free at once when deleted, else it lingers (REPLAY_PULL_SLOT_LINGER).
        ``charged``: what its pull out had not brought yet, given back then (read_budget.py)."""
        deleted = False
        try:
            if sub is not None:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()
                pending.drop(sub)  # what nobody will read (past a pause's cut, a closed feed's) goes now
            deleted = await self._delete(name)
        finally:
            if charged and self.gate is not None:
                self.gate.release(charged)
            if sub is not None and self.watch is not None:
                self.watch(sub, False, deleted)  # deleted: its slot is free now, it does not linger
