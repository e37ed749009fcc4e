"""SSE frames written from the fan-out straight to Uvicorn's transport, while the stream is idle.

At 2,000 events/s over 50 streams (40 per stream) no two events of one stream meet, so each went
through its own chain: the fan-out appended it to the stream's inbox and woke the stream's task
(a loop pass), ``ResultFeed.next`` took and reordered it, ``Edge.frames`` framed it, and
``EventStreamResponse`` handed it to Uvicorn's ``send`` (an ASGI message, its checks, chunked
framing), which wrote it to the socket. A py-spy profile put that chain at about half of the
edge's per-event CPU beside the socket write itself (docs/benchmarks.md, "Direct writes").

:meth:`DirectFrames.offer`, called by :meth:`.fanout.Fanout.dispatch` for each result, writes the
frame itself when that is exactly what the stream's task would do next and nothing can come
between: the task is parked in :meth:`.fanout.Inbox.wait` with nothing queued (so every earlier
frame is on the transport already, and no later one can pass it), the result is the next seq,
ends nothing (the final result and errors still go through the task, which ends the response),
the response's headers are out, the client is connected and the transport is not paused by flow
control. Anything else (a paused transport, a gap, a replay, tracing) takes the task's path as
before, so back-pressure, ``--write-timeout``, overruns and the reorder buffer are unchanged: a
direct write never waits, and once the transport's buffer passes its high-water mark Uvicorn's
flow control pauses it and the next results queue in the inbox for the task, whose ``send``
waits under the write watch.

The transport is reached through Uvicorn's ``RequestResponseCycle`` (httptools protocol), whose
``send`` is the bound method the ASGI app receives. Its fields are Uvicorn's internals (read
against 0.54's ``uvicorn/protocols/http/httptools_impl.py``): :func:`UvicornBody.of` answers None
(the ASGI path) for any other server, protocol, middleware-wrapped ``send`` or a cycle without
them.
"""

from __future__ import annotations

import asyncio
import time
from itertools import repeat
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..core.wire import ResultInfo
from .sse import RESULT_EVENT, result_event
from .stopping import RECANCEL_INTERVAL, RECANCEL_ROUNDS

if TYPE_CHECKING:
    from .feed import ResultFeed
    from .metrics import EdgeMetrics

_CYCLE_FIELDS = ("transport", "flow", "response_started", "response_complete", "disconnected", "chunked_encoding")


def _httptools_cycle() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:  # httptools or Uvicorn missing: nothing to write to directly
        return None
    return RequestResponseCycle


class _Ended:
    """A released :class:`DisconnectWatch`'s cycle: reads as disconnected."""

    disconnected = True


_ENDED = _Ended()


class DisconnectWatch(asyncio.Event):
    """Uvicorn's per-request ``message_event``, which also calls ``callback`` (once) when it is set
    with the cycle disconnected: ``HttpToolsProtocol.connection_lost`` marks the cycle
    ``disconnected`` and sets this event, which is all that a task blocked in ``receive()`` for
    ``http.disconnect`` (Starlette's ``listen_for_disconnect``) waits for. Installed by
    :func:`watch_disconnect` instead of such a task: a task per SSE stream, its first step, a
    future, and a wake-up plus a step at the disconnect (docs/benchmarks.md, "SSE lifecycle")."""

    def __init__(self, cycle: Any, callback: Callable[[], None] | None) -> None:
        super().__init__()
        self.cycle = cycle
        self.callback = callback

    def set(self) -> None:
        super().set()
        callback = self.callback
        if callback is not None and self.cycle.disconnected:
            self.callback = None
            callback()

    def release(self) -> None:
        """The response ended: no callback any more, and no reference back to the cycle, whose
        ``message_event`` this is (a reference cycle through the connection's transport and socket,
        left for the garbage collector; tests/test_edge_cycles.py)."""
        self.callback = None
        self.cycle = _ENDED


class Departure:
    """Cancels a request's ``task`` when its client leaves (called by a :class:`DisconnectWatch`, or
    by the watcher task that reads ``receive()``), and again every ``RECANCEL_INTERVAL`` until
    :meth:`settle`, ``RECANCEL_ROUNDS`` times at most: a cancel can be lost. Python 3.11's
    ``asyncio.wait_for`` returns the awaited reply and drops a cancel that arrives in the same loop
    pass, without ``uncancel`` (stopping.py has the same remedy for the stop): the request would
    then hold its stream slot until its final result or ``--result-timeout``. :meth:`settle` stops
    it and takes back each cancel it sent (``uncancel``), so that ``cancelling()`` counts only the
    others' (the stop's)."""

    __slots__ = ("task", "left", "sent", "timer")

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.left = False  # the client left
        self.sent = 0  # cancels sent, not taken back yet
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if not self.left:
            self.left = True
            self._cancel()

    def _cancel(self) -> None:
        self.timer = None
        task = self.task
        if task.done() or self.sent > RECANCEL_ROUNDS:
            return
        self.sent += 1
        task.cancel()
        self.timer = asyncio.get_running_loop().call_later(RECANCEL_INTERVAL, self._cancel)

    def settle(self) -> None:
        """The task took the cancel, or ends anyway: no more of them, and none left counted."""
        timer = self.timer
        if timer is not None:
            self.timer = None
            timer.cancel()
        task = self.task
        while self.sent > 0:
            self.sent -= 1
            task.uncancel()


def watch_disconnect(receive: Callable[..., Any], callback: Callable[[], None]) -> DisconnectWatch | None:
    """Call ``callback`` when the client behind Uvicorn's ``receive`` disconnects (its
    :class:`DisconnectWatch`; ``.callback = None`` stops it), or None where a task reading
    ``receive()`` must watch instead: another server or protocol, a wrapped ``receive``, a request
    whose body is still coming (the task reads and drops it), a client already gone.
    Like the task's first ``receive()``, it resumes reading (Uvicorn pauses it for a pipelined request)."""
    if UvicornBody._cycle_type is False:
        UvicornBody._cycle_type = _httptools_cycle()
    cycle: Any = getattr(receive, "__self__", None)
    if UvicornBody._cycle_type is None or type(cycle) is not UvicornBody._cycle_type:
        return None
    event = getattr(cycle, "message_event", None)
    if (type(event) is not asyncio.Event or getattr(cycle, "more_body", True) is not False
            or getattr(cycle, "disconnected", True) is not False or not hasattr(cycle, "flow")):
        return None
    watch = DisconnectWatch(cycle, callback)
    if event.is_set():
        watch._value = True  # type: ignore[attr-defined]  # as Event.set() leaves it, without calling back (still connected)
    cycle.message_event = watch
    cycle.flow.resume_reading()
    return watch


class UvicornBody:
    """Uvicorn's cycle behind one response's ``send``, its transport and flow control: where
    :class:`DirectFrames` writes body chunks as ``send`` would, without the ASGI message (its checks
    and framing are read inline there, once per SSE event)."""

    __slots__ = ("cycle", "transport", "flow")

    _cycle_type: ClassVar[Any] = False  # resolved on first use

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        self.flow = cycle.flow

    @classmethod
    def of(cls, send: Callable[..., Any]) -> UvicornBody | None:
        """The body writer behind ``send``, or None where only ASGI messages will do."""
        if cls._cycle_type is False:
            cls._cycle_type = _httptools_cycle()
        cycle: Any = getattr(send, "__self__", None)
        if cls._cycle_type is None or type(cycle) is not cls._cycle_type:
            return None
        # all() over map(): the same checks as a generator expression, without its 7 Python frames per open
        if not all(map(hasattr, repeat(cycle), _CYCLE_FIELDS)) or not hasattr(cycle.flow, "write_paused"):
            return None
        return cls(cycle)


class WriteBatch:
    """The direct frames of one read from NATS, written at the end of that read (``FastClient``
    calls :meth:`flush` as ``read_done``): one write per stream, however many of its results the read
    held (as the task's path joins what waits). Before, the write waited for the next loop pass,
    behind a poll and whatever else was ready then (docs/benchmarks.md, "Where the SSE tail comes
    from"). With any other client (``hooked`` false: nats-py's stock parser) a ``call_soon`` flushes
    instead. Not scheduling it when hooked saves a loop pass per read: a ready callback makes the
    next poll a second ``epoll_wait`` (docs/benchmarks.md, "What a read costs at light load")."""

    __slots__ = ("streams", "hooked")

    def __init__(self, hooked: Callable[[], bool]) -> None:
        self.streams: list[DirectFrames] = []
        self.hooked = hooked  # whether flush() runs at the end of every read (ResultSource.after_read_hooked)

    def flush(self) -> None:
        """Write each stream's frames, stamping its ``sent_at`` with one clock read for the whole
        read (before: one per SSE event, in ``offer``): the frames leave now, and a stream's task
        reads ``sent_at`` only after this ran (it is woken through its inbox, after the read)."""
        streams, self.streams = self.streams, []
        if streams:
            now = time.monotonic()
            for direct in streams:
                direct.sent_at = now
                direct.flush()


class DirectFrames:
    """One SSE stream's direct path: :meth:`offer` writes a result's frame when the task would."""

    __slots__ = ("feed", "encode", "metrics", "batch", "out", "pending", "sent_at")

    def __init__(self, feed: ResultFeed, encode: Callable[[ResultInfo], bytes], metrics: EdgeMetrics,
                 batch: WriteBatch) -> None:
        self.feed = feed
        self.encode = encode  # the result's frame, as Edge.frames makes it
        self.metrics = metrics
        self.batch = batch
        self.out: UvicornBody | None = None  # set once the headers are written, cleared before the end
        self.pending: list[bytes] = []  # frames taken since the last flush() (this NATS read's), written by it
        self.sent_at = 0.0  # time.monotonic() of the last direct write (Edge.frames' idle and keep-alive clocks): WriteBatch.flush

    def offer(self, result: ResultInfo) -> bool:
        """Take ``result``'s frame for this pass's write and count it as sent (True), or leave it to
        the task (False; then the frames taken before it are written first, so the task's follow).
        Runs once per SSE event, so what ``RequestResponseCycle.send`` needs to write a body chunk at
        once without waiting (the headers out, the body not ended, the client there, chunked framing,
        no flow-control pause, the transport open) and the batch's bookkeeping are written out here
        rather than called (docs/benchmarks.md, "Calls per SSE event"). So is ``SeqOrder.next_in_line``,
        last, on the order's public fields (one Python call per SSE event less: "Edge CPU per event,
        eighth pass"); tests/test_edge_direct_offer.py holds the two to the same answers."""
        out = self.out
        feed = self.feed
        inbox = feed.inbox
        order = feed.order
        if (out is None or inbox is None or not inbox.parked() or feed.overrun or feed.replay is not None
                or feed.ready or result.request_id != feed.request_id
                or not (cycle := out.cycle).response_started or cycle.response_complete or cycle.disconnected
                or cycle.chunked_encoding is not True or out.flow.write_paused or out.transport.is_closing()
                # SeqOrder.next_in_line(result), inline: the next seq, nothing waiting, ending nothing
                or order.done or order.pending or result.seq != order.next_seq or result.final
                or result.error is not None):
            if self.pending:
                self.flush()
            return False
        order.next_seq += 1  # next_in_line's True: the stream's next seq moves on (after every check above)
        pending = self.pending
        if not pending:  # the first frame of this read: the batch writes it at the read's end
            batch = self.batch
            if not batch.streams and not batch.hooked():
                asyncio.get_running_loop().call_soon(batch.flush)
            batch.streams.append(self)
        # sse.result_event(result), inline for a one-line body (a Python call per SSE event less: "Edge
        # CPU per event, eighth pass"); other bodies and other encodings (meta frames) are called
        encode = self.encode
        body = result.body
        if encode is result_event and 10 not in body and 13 not in body:  # int needles: LF, CR
            pending.append(RESULT_EVENT % (result.seq, body))
        else:
            pending.append(encode(result))
        # EdgeMetrics.sent(result), inline (a Python call per SSE event less): next_in_line passed no
        # error result, so only its verdict branch applies; tests/test_edge_direct_offer.py holds the two
        # to the same counts.
        metrics = self.metrics
        metrics.results_sent += 1
        verdict = result.verdict or "unknown"
        by_verdict = metrics.by_verdict
        by_verdict[verdict] = by_verdict.get(verdict, 0) + 1
        metrics.results_written_directly += 1
        return True  # sent_at: stamped by the batch's flush, one clock read per NATS read

    def flush(self) -> None:
        """Write the frames taken so far, unless the response ended or its client left meanwhile
        (bytes written while the transport is paused wait in its buffer). Runs before the stream's
        task can write again: the task is only woken through its inbox, and a wake-up comes after
        the flush that ends the read (``read_done``; the ``call_soon`` on the stock client), or after
        :meth:`offer`'s own flush. The write is ``send``'s for ``more_body=True``: one chunk of the
        chunked body, size, CRLF, bytes, CRLF."""
        pending = self.pending
        if not pending:
            return
        body = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        out = self.out
        if out is not None and not (cycle := out.cycle).response_complete and not cycle.disconnected:
            transport = out.transport
            if not transport.is_closing():
                transport.write(b"%x\r\n%b\r\n" % (len(body), body))
