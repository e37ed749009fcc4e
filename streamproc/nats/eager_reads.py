"""NATS frames handed over as the socket delivers them, while nats-py's read loop waits for them.

nats-py reads its connection in a task (``Client._read_loop``): ``await transport.read()`` on an
``asyncio.StreamReader``, then ``await parser.parse(data)``. At light load every message arrives
alone, and each one costs the loop a wake-up of that task: the transport's ``data_received`` feeds
the reader, which resolves the task's waiter; the task's step is queued for the next loop pass (one
more ``epoll_wait`` with a zero timeout), and the resumed coroutine chain copies the reader's
buffer before the parser sees a byte. On this repository's 2-core machine that chain measured
20-40 µs of CPU per read beside a plain ``Protocol.data_received`` (docs/benchmarks.md, "Eager
reads"), more than everything streamproc does with the message.

:class:`EagerReads` sits in front of the connection's ``StreamReaderProtocol``. When a read
arrives while the read loop is parked in ``read()`` (so nothing is buffered), and the parser is
between frames, it hands the read's frames over itself (:meth:`FastParser.parse_now`: the same
``_msg_now`` calls, in the same order). It stops at the first frame that needs an await (a
JetStream control message, PING/PONG, INFO, ``-ERR``, anything malformed) and feeds the reader the
bytes from that frame on, so the read loop parses them, after everything before them: nats-py's
order is kept, because the read loop has nothing of its own in flight at that moment. A message
that must be reported (a slow consumer's drop) gets its error callback queued as a task, then the
rest of the read goes to the read loop, whose wake-up is queued after it (:meth:`EagerReads.report`). An exception from the
handover is set on the reader, so the read loop meets it where it would have met it in ``parse``.

Anything else is the stock path: every other event (EOF, a lost connection, write flow control) goes
to the ``StreamReaderProtocol`` unchanged, and a read that finds the loop busy, data buffered or a
frame half read is fed to the reader as before. Only the TCP transport nats-py makes
(``TcpTransport``: plain or TLS) with the reader fields this relies on (read against CPython
3.11-3.13 ``asyncio/streams.py``: ``StreamReader._waiter``, set only while ``read()`` waits on an
empty buffer) is taken over; WebSocket
connections and other versions keep the stock path (:func:`install` answers None).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AWAITING_CONTROL_LINE

from ..logs import error_text, log_event
from .buffered_reads import BufferedReads
from .fast_parser import FastParser

if TYPE_CHECKING:
    from .fast_client import FastClient

log = logging.getLogger("streamproc.nats")

# The connection states in which nats-py's ``is_closed`` or ``is_reconnecting`` is true: a read's
# test reads ``_status`` once against it instead of calling the two properties (fast_client's
# ``_states_agree`` checks they still say the same; a nats-py where they do not gets no FastClient).
_CLOSED_OR_RECONNECTING = frozenset(getattr(Client, name, None) for name in ("CLOSED", "RECONNECTING"))


class EagerReads(BufferedReads):
    """The NATS connection's protocol: a read's frames handed over at once when the read loop waits.
    Its reads land in one buffer kept for the connection (buffered_reads.py)."""

    def __init__(self, nc: FastClient, inner: asyncio.StreamReaderProtocol, reader: asyncio.StreamReader) -> None:
        self.nc = nc
        self.inner = inner  # nats-py's protocol: every event but the eager reads, and the rest of those
        self.reader = reader
        self.parser: FastParser = nc._ps  # type: ignore[assignment]
        self.active = True  # the read loop that installed this runs (FastClient._read_loop)
        self.reports: set[asyncio.Task] = set()
        self.eager = 0  # reads handed over here, for tests and benchmarks
        self.fed = 0  # reads (or their rest) fed to the reader for the read loop

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        parser = self.parser
        nc = self.nc
        # A waiter means the read loop is parked in read() with an empty buffer (feeding it wakes and
        # clears the waiter), so nothing of its own is in flight.
        if (self.active and reader._waiter is not None  # type: ignore[attr-defined]
                and not parser.buf and parser.state == AWAITING_CONTROL_LINE and parser is nc._ps
                and nc._status not in _CLOSED_OR_RECONNECTING):  # not is_closed, not is_reconnecting
            try:
                nc._in_read = True  # a write due meanwhile leaves at the read's end (FastClient._write_soon)
                try:
                    data = parser.parse_now(data, self.report)
                finally:
                    nc._in_read = False
                    nc.end_handover()  # every frame handed over so far (the edge writes their SSE frames)
            except Exception as exc:  # noqa: BLE001 - the read loop's to handle, as from parse
                reader.set_exception(exc)  # (raised here, asyncio would close the socket under nats-py)
                return
            self.eager += 1
            if not data:
                return
        self.fed += 1
        self.inner.data_received(data)

    def report(self, error: Any) -> None:
        """A message taken but dropped (``SlowConsumerError``): the error callback, in a task queued
        before the read loop's wake-up for the rest of the read. Its first step runs before the read
        loop reads on; a callback that then awaits no longer holds the read loop, as it does when
        ``parse`` awaits it (the processor's and the edge's callbacks end a feed or count the drop,
        which their first step does). An exception from it is logged, where in ``parse`` it would
        have stopped the read loop for good."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self.nc._error_cb(error))  # type: ignore[arg-type]
        self.reports.add(task)
        task.add_done_callback(self._reported)

    def _reported(self, task: asyncio.Task) -> None:
        self.reports.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(log, logging.ERROR, "nats_error_callback_failed", error=error_text(task.exception()))  # type: ignore[arg-type]

    # Everything else is nats-py's protocol's own.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # not called: installed after
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def install(nc: FastClient) -> EagerReads | None:
    """Put :class:`EagerReads` in front of ``nc``'s connection, or None (the stock path; logged at
    DEBUG) when the connection is not the kind described in the module doc."""
    transport = nc._transport
    why = None
    if type(transport) is not TcpTransport:
        why = f"transport {type(transport).__name__}"
    elif not isinstance(nc._ps, FastParser):
        why = "the stock parser"
    else:
        reader: Any = getattr(transport, "_io_reader", None)
        writer = getattr(transport, "_io_writer", None)
        socket_transport: Any = getattr(writer, "transport", None)
        inner: Any = socket_transport.get_protocol() if socket_transport is not None else None
        if type(inner) is not asyncio.StreamReaderProtocol or getattr(inner, "_stream_reader", None) is not reader:
            why = f"protocol {type(inner).__name__}"
        elif not hasattr(reader, "_waiter"):
            why = "StreamReader internals differ"
        else:
            eager = EagerReads(nc, inner, reader)  # type: ignore[arg-type]  # hasattr-checked above
            try:
                socket_transport.set_protocol(eager)
            except Exception as exc:  # noqa: BLE001 - a transport that cannot: the stock path
                why = f"set_protocol: {error_text(exc)}"
            else:
                return eager
    log_event(log, logging.DEBUG, "nats_eager_reads_off", reason=why)
    return None


__all__ = ["EagerReads", "install"]
