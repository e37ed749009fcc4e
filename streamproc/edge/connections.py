"""Bounded HTTP connections: a cap on open connections, and a deadline and a size for each request head.

Uvicorn (0.54, httptools protocol) accepts every connection and keeps it until the client closes:
a connection that never sends a request, or sends half a request head and stops, holds its file
descriptor and its protocol object forever, and an endless header line grows in the parser without
limit (httptools accumulates it). ``--limit-concurrency`` does not help: it only answers a *complete*
head with a plain-text 503 and a WARNING line each. So a flood of connections could exhaust the
edge's descriptors (then asyncio stops accepting for a second at a time, legitimate clients
included) and its memory, and every request it did parse waited in the open pacer's queue
(``pacer.py``), which grows with the connections.

:func:`protocol_class` subclasses Uvicorn's ``HttpToolsProtocol`` (read against 0.54's
``uvicorn/protocols/http/httptools_impl.py``) with three bounds, all settings:

- ``--max-connections``: a connection accepted while that many are open is answered at once, before
  anything is read, with ``503`` and a JSON ``overloaded`` error naming the limit, then closed. It
  never reaches the app. Up to :data:`REFUSED_LINGERING` refused connections wait for their client's
  EOF (at most :data:`REFUSED_LINGER` s), so the answer is not lost to the reset that closing a
  socket with an unread request sends; in a flood the others are closed at once (the answer is on
  the wire before the reset, which a client reading it on Linux still gets). Every open, the
  pacer's waiting ones included, holds a connection, so this bounds them too.
- ``--head-timeout``: a request head (the request line and headers) must be complete this many
  seconds after the connection was made, or after the previous request's response and body both
  ended, or after its first byte if it began while a response was in progress (pipelined); checked
  every :data:`SWEEP_INTERVAL` s at most; else ``408`` and close. A request Uvicorn starts from its
  pipeline has its head already; a body is not a head, also one still arriving after an early answer.
  Such a body (a request answered before it was read: a 401, 404 or ``/healthz`` does not read it)
  must end within the same deadline, counted from the answer's end, and within :data:`DISCARD_BYTES`
  received after the answer (:data:`UPLOAD_DISCARD_BYTES` for a POST, PUT or PATCH), else the
  connection is closed (no answer: the client has its own), by a lingering close (below).
  Uvicorn bounds it by nothing: httptools parses the rest of the body and ``on_body`` drops it
  (after ``response_complete``) for as long as it comes, and each read cancels its keep-alive timer,
  armed only at a response's end; so a ``Content-Length: 1000000000`` trickled a byte at a time, or
  one byte and then silence, held the connection, and a ``--max-connections`` slot, for good, and
  one sent at full speed was parsed and dropped at ~1 GB/s (64 MiB in 0.07 s on loopback). Its end
  re-arms the deadline for the next head, so keep-alive still works after it. (A body the app reads,
  ``POST /v1/experts``, has its deadline in the handler: ``app.py``.)
- ``--max-head-bytes``: a request head longer than that gets ``431`` and close, whatever the
  response state (httptools would keep concatenating an endless header line of a head pipelined
  behind a stream). Exact for a head whose first byte starts a read; one that begins inside a read,
  after the end of a body or of another request, may have up to that many bytes more (reads longer
  than the room left are fed to the parser a piece at a time, :meth:`feed_bounded`).

With a response in progress the ``408``/``431`` is not written, only the connection closed:
responses go out in order, and an answer written then would land inside that response's body.

Writes: a response whose client takes nothing of it for ``--write-timeout`` (the transport's buffer
past its high-water mark and, with the kernel's send queue, not shrinking) has its connection aborted
(``connections_stalled``); an SSE stream in progress is left to its own bounds, then checked alike.
Uvicorn waits for such a client for good, and only the SSE route bounded its writes (``app.WriteWatch``,
which still ends a stream first): a unary answer is written after its request gave back its stream
slot, so a client that asked for a 7 MiB answer and read nothing held its connection, ~4 MiB of kernel
buffer and the rest of the body in the edge for good, as many times as it asked. A client that takes
some within each period is sent everything, however long it takes. A closing connection alike: asyncio's
``close`` waits for the transport's buffer to drain, and the check is armed only past the high-water
mark (``pause_writing``), so a client that read nothing held a connection closed with less than that
left (Uvicorn's keep-alive timeout, ``Connection: close``, the stop; the edge's ``408``/``431``) for
good. Every close of a plain connection goes through the transport's ``close``, replaced per connection
(an instance attribute, ``close_watched``: nothing added per write) by one that arms the check.

Pipelining: Uvicorn parses every head a read holds and queues a request (its scope, headers and
ASGI cycle, ~2 KB with a short head) for each behind the response in progress, and reads on at
every answer's end. A client that pipelined 2 MiB of ``GET /healthz`` heads and read none of the
answers had ~60,000 requests queued, ~150 MiB of the edge's memory per connection, for as long as
it kept the connection (a head that arrived complete is not timed). A connection whose requests
waiting behind the one in progress would pass :data:`MAX_PIPELINED` is closed at once, unanswered
(``abort``: a client that reads nothing would hold a ``close`` forever), and no more are queued.

Lingering close (:meth:`linger_close`, as nginx's ``lingering_close`` and Apache's
``ap_lingering_close``): a connection the edge ends while its client may still be sending a body it
answered (the discard bounds above, and the ``408`` of a ``POST /v1/experts`` body late for its
deadline, which the handler marks with :data:`.app.CLOSE_AFTER_RESPONSE`) is not closed at once.
Closing a socket with unread bytes in its receive buffer makes the kernel send a reset, and the
client's next write fails: httpx (httpcore over anyio) reads an answer only once it sent the whole
body, and anyio pauses reading between receives, so the answer still sits unread in its kernel
buffer when the failed write makes asyncio force-close the transport: ``httpx.ReadError`` instead of
the ``408``/``429``/``413`` (seen under load in ``test_edge_memory.py``'s 16 concurrent 32 MiB
posts). So the edge half-closes (``write_eof``: the FIN follows the answer, and a client that reads
while it sends stops there), then reads and drops whatever comes, unparsed, for at most
:data:`LINGER_TIME` s and :data:`LINGER_BYTES` bytes (or the request's declared length, within its
discard cap), and closes at the client's EOF or at either bound (``abort``). A client that finishes
its body within them reads its answer; one that trickles on is cut off at the bound. A lingering
connection keeps its ``--max-connections`` slot, so their number is bounded by it. Over TLS (no
half-close) the connection is closed at once, as before.

TLS (``--tls-cert-file``): with ``create_server(ssl=...)`` asyncio puts its TLS layer
(``asyncio.sslproto.SSLProtocol``, read against CPython 3.11) under each connection at its accept,
and tells Uvicorn's protocol only once the handshake is done. So a connection that never finished
its handshake was not counted against ``--max-connections`` and had no ``--head-timeout``: asyncio
held it for its own 60 s handshake timeout (``SSL_HANDSHAKE_TIMEOUT``), with the layer's 256 KiB
receive buffer, allocated and zeroed at the accept (2,000 idle connects raised an edge's RSS from
64 to 686 MB for a minute). The edge's server therefore listens on plain TCP and makes the layer
itself (:class:`BoundedTLS`, ``BoundedProtocol.over_tls``): a connection in its handshake counts
against ``--max-connections``, one accepted past it is closed at once (a ``503`` would need the
handshake first; ``connections_refused``), the handshake must end within ``--head-timeout``
(``tls_handshakes_unfinished`` counts the ones that did not), and the receive buffer is
:data:`TLS_READ_BYTES`. A closing connection's TLS shutdown (asyncio sends what is left, then
waits for the client's ``close_notify``) is force-closed, dropping what is still unsent, after
``--write-timeout`` in which the client took nothing, as a plain connection's blocked write; asyncio
force-closed at 30 s whatever was left, so a slow client lost the end of a long stream. What the
client has not taken counts the kernel's send queue too (``unsent_bytes``), as over plain HTTP: a
unary answer leaves the TLS layer at once, and the socket's buffer alone stood still for seconds
while a client read 0.5 MB/s, which lost the end of a 7.2 MB answer at the cut. A shutdown the
client ends (its EOF or ``close_notify``) closes the socket transport with what is left in its buffer,
which asyncio waits for with no bound: that wait has the same watch. At the stop
the connections still in their handshake, which Uvicorn does not know of, are ended
(``end_handshakes``). A connection refused, or never handshaken, is never told of its loss by
Uvicorn, so its parser and TLS layer are let go of here (otherwise a reference cycle each, kept
until a garbage collection).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import socket
import ssl
import struct
import termios
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .app import CLOSE_AFTER_RESPONSE, SSE_STREAM, error_response
from ..logs import LogLimiter
from .experts import MAX_BODY_BYTES
from .stopping import FINAL_WRITE_TIMEOUT

if TYPE_CHECKING:
    from .metrics import EdgeMetrics
    from .settings import EdgeSettings

_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on a TCP socket (Linux): unacknowledged bytes
REFUSED_LINGER = 1.0  # seconds a refused connection may wait for its client's EOF before it is closed
SWEEP_INTERVAL = 1.0  # seconds between checks for overdue request heads (a head may get up to this much more)
REFUSED_LINGERING = 64  # refused connections that may linger at once; past it the next ones close at once
# Bytes of a request's body received after its answer (dropped unread) before the connection is closed.
# The edge's GET routes read no body and no client sends one: 1 MiB. An upload may be answered before
# it was read (a 401, or the 413 of a body over experts.MAX_BODY_BYTES), and HTTP clients such as
# httpx read the answer only once they sent the whole body: closed before that, they get a reset, not
# the answer. Twice the largest body the edge reads.
DISCARD_BYTES = 1 << 20
UPLOAD_DISCARD_BYTES = 2 * MAX_BODY_BYTES
UPLOAD_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
# Requests a connection may have waiting behind the one in progress (pipelined); past it the
# connection is closed (module docstring, "Pipelining"). Browsers, EventSource and httpx never
# pipeline; each waiting request holds its head (up to --max-head-bytes) and an ASGI cycle.
MAX_PIPELINED = 8
# Lingering close (module docstring): after the half-close, what the client may still send is read and
# dropped, unparsed, for at most LINGER_TIME s, and at most LINGER_BYTES bytes, or the request's
# declared Content-Length where that is within its discard cap (DISCARD_BYTES, UPLOAD_DISCARD_BYTES):
# a client may finish the body it declared (an experts 408 or 429 declared at most 32 MiB), never
# more than the discard phase would have taken. 2 s is Apache's lingering wait per read
# (MAX_SECS_TO_LINGER bounds its total at 30 s; nginx's lingering_time is 30 s, its lingering_timeout
# 5 s): a client ending a body it was sending steadily gets there, a trickler is held 2 s more at
# most. Dropping costs the kernel's copy only (no parsing): 32 MiB is ~0.03 s of loopback.
LINGER_TIME = 2.0
LINGER_BYTES = 4 << 20
# asyncio's SSLProtocol allocates (and zeroes) a receive buffer of its ``max_size``, 256 KiB, for
# every connection from its accept: 2,000 idle connects to an HTTPS edge took 620 MB. A request head
# is at most --max-head-bytes and a TLS record 16 KiB of plaintext; larger reads only save loop passes
# on bulk uploads, which the edge does not take.
TLS_READ_BYTES = 32 * 1024
INVALID_REQUEST = "Invalid HTTP request received."  # Uvicorn 0.54's warning and 400 body for a head llhttp refuses
# What Uvicorn's cycle is told remains of an unframed HTTP/1.0 body (close_delimited): it counts the
# bytes down and refuses to write past 0, and a stream has no length.
UNFRAMED_LENGTH = 1 << 62
DESCRIPTOR_RESERVE = 256  # descriptors beyond --max-connections: NATS, logs, refused connections lingering


class ParserLog:
    """Uvicorn's protocol logger (``uvicorn.error``) without its ``Invalid HTTP request received.``
    warning, which the protocol's ``send_400_response`` writes instead as ``invalid_http_request``
    through the LogLimiter, with the peer (Uvicorn wrote one WARNING line per head llhttp refuses:
    any client reaching the port, no token needed, wrote ~1,200 a second). Every other call is the
    logger's own. One for all connections: it holds none of them."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg != INVALID_REQUEST or args:
            self._logger.warning(msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def close_delimited(app: Any, cycle: Any) -> Callable[..., Awaitable[None]]:
    """``app`` for an HTTP/1.0 request (``cycle``: Uvicorn 0.54's httptools ``RequestResponseCycle``),
    its body of no stated length (an SSE stream) sent unframed and ended by the close (RFC 9112
    section 6.3) instead of chunked. Uvicorn chunked it whatever the request's version, and RFC 9112
    section 6.1 forbids ``Transfer-Encoding`` to a request that does not indicate HTTP/1.1: an HTTP/1.0
    client read the chunk sizes as part of the events. Uvicorn keeps no HTTP/1.0 connection alive, so
    the close comes with the body's end. The wrapped ``send`` names the cycle as its ``__self__``
    (``direct.UvicornBody.of``: the stop's cut of a client that stopped reading); such a stream stays
    off the fan-out's direct writes all the same, which frame chunks (``DirectFrames.offer`` takes
    only a body whose ``chunked_encoding`` is True). Wrapping the app, not
    replacing ``cycle.send``, stores no closure on the cycle (a reference cycle: tests/test_edge_cycles.py)."""

    async def unframed(scope: Any, receive: Any, send: Callable[[Any], Awaitable[None]]) -> None:
        length_unstated = False

        async def sending(message: Any) -> None:
            nonlocal length_unstated
            if message["type"] == "http.response.start" and not cycle.response_started:
                names = {name.lower() for name, _ in message.get("headers", ())}
                if (b"content-length" not in names and b"transfer-encoding" not in names
                        and scope["method"] != "HEAD" and message["status"] not in (204, 304)):
                    length_unstated = True
                    cycle.keep_alive = False
                    cycle.chunked_encoding = False  # Uvicorn adds no Transfer-Encoding, writes the body as is
                    cycle.expected_content_length = UNFRAMED_LENGTH
            elif (length_unstated and message["type"] == "http.response.body"
                  and not message.get("more_body", False)):
                cycle.expected_content_length = len(message.get("body", b""))  # Uvicorn checks it ends at 0
            await send(message)

        sending.__self__ = cycle  # type: ignore[attr-defined]  # found by end_for_stop (the docstring)
        await app(scope, receive, sending)

    return unframed


def answer(status: int, reason: str, message: str, kind: str) -> bytes:
    """A complete ``Connection: close`` response with the edge's JSON error body (``error_response``'s)."""
    body = error_response(message, kind, status).body
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def protocol_class(settings: EdgeSettings, metrics: EdgeMetrics, limited: LogLimiter | None = None) -> type:
    """Uvicorn's httptools protocol with the bounds of ``settings``, counted in ``metrics``; lines one
    client can cause per connection go through ``limited`` (the edge's, else one of its own)."""
    from asyncio.sslproto import SSLProtocol

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if limited is None:
        limited = LogLimiter(logging.getLogger("streamproc.edge"))
    parser_log = ParserLog(logging.getLogger("uvicorn.error"))  # the logger Uvicorn's protocol takes

    limit = settings.max_connections
    head_timeout = settings.head_timeout
    write_timeout = settings.write_timeout
    max_head_bytes = settings.max_head_bytes
    refusal = answer(503, "Service Unavailable",
                     f"too many open connections (limit {limit}, --max-connections); retry later", "overloaded")
    timed_out = answer(408, "Request Timeout",
                       f"the request head did not arrive within {head_timeout:g}s (--head-timeout)", "invalid_request")
    too_large = answer(431, "Request Header Fields Too Large",
                       f"the request head is over {max_head_bytes} bytes (--max-head-bytes)", "invalid_request")
    lingering = [0]  # refused connections waiting for their client's EOF now
    # Connections whose request head is due, with their deadline; one sweep per interval closes the
    # late ones (a timer per connection, armed and cancelled, was ~1.6% of the edge's CPU in bursts).
    due: dict[BoundedProtocol, float] = {}
    interval = min(SWEEP_INTERVAL, head_timeout / 4)
    sweeping = [False]

    def sweep(loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for protocol, deadline in list(due.items()):
            if deadline <= now:
                protocol.head_overdue()
        if due:
            loop.call_later(interval, sweep, loop)
        else:
            sweeping[0] = False

    class BoundedProtocol(HttpToolsProtocol):
        """One HTTP connection, bounded (module docstring); in ``due`` while its request head is."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = parser_log
            self.linger: asyncio.TimerHandle | None = None
            # Bytes of the head in progress, or of a body being discarded after its answer, counted
            # from the read it was in at its start (at the answer's end for a body: see ``room``).
            self.head_bytes = 0
            self.heading = True  # the parser's next bytes are a request head (False inside a request body)
            self.discard_limit = DISCARD_BYTES  # of the body of the request in progress, after its answer
            self.refused = False
            self.lingering = False  # half-closed: what comes is dropped unparsed until EOF or a bound (linger_close)
            self.lingered = 0  # bytes dropped while lingering
            self.linger_bytes = LINGER_BYTES  # the most it may drop (linger_close)
            self.tls: Any = None  # its BoundedTLS layer under --tls-cert-file
            self.running: Any = None  # the request whose ASGI task runs (Uvicorn's cycle), pipelined ones aside
            self.stall: asyncio.TimerHandle | None = None  # while writing is paused: the next progress check
            self.unsent = 0  # bytes waiting in the transport at the last progress check
            self.stopping = False  # the stop asked it to close (shutdown)
            self.cut: asyncio.TimerHandle | None = None  # closing in the stop: its abort (watch_closing)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            tls = self.tls
            if tls is not None:  # its handshake is done: counted as open from here on
                tls.handshaken()
            if len(self.connections) >= limit:
                self.refuse(transport)
                return
            super().connection_made(transport)
            metrics.connections_open = len(self.connections)
            if tls is None:  # (under TLS the shutdown has its own bound: BoundedTLS)
                try:
                    # Every close of this connection, the edge's and Uvicorn's (keep-alive timeout,
                    # Connection: close, the stop, an app error, close_delimited's end), goes through
                    # the transport's close(): an instance attribute, so writes cost nothing more.
                    transport.close = self.close_watched  # type: ignore[method-assign]
                except AttributeError:  # a transport without a __dict__ (uvloop): the edge's own closes only
                    pass
            self.await_head()

        def refuse(self, transport: asyncio.Transport) -> None:
            """Answer 503 without reading, half-close, and drop the connection at the client's EOF."""
            metrics.connections_refused += 1
            self.refused = True
            self.transport = transport
            transport.write(refusal)
            if lingering[0] >= REFUSED_LINGERING or not transport.can_write_eof():
                transport.close()
                return
            lingering[0] += 1
            transport.write_eof()
            self.linger = self.loop.call_later(REFUSED_LINGER, transport.abort)

        def await_head(self) -> None:
            due[self] = self.loop.time() + head_timeout
            if not sweeping[0]:
                sweeping[0] = True
                self.loop.call_later(interval, sweep, self.loop)

        def head_overdue(self) -> None:
            due.pop(self, None)
            if not self.heading:  # the body of a request answered before it was read: no answer is due
                metrics.bodies_timed_out += 1
                self.linger_close()
                return
            metrics.head_timeouts += 1
            self.close_with(timed_out)

        def linger_close(self) -> None:
            """End a connection whose client may still be sending a body the edge answered: half-close
            (the FIN follows the answer), drop what comes for at most LINGER_TIME s and LINGER_BYTES,
            then close (module docstring, "Lingering close"). Closed at once, the unread bytes made the
            kernel reset the connection, and an HTTP client still sending (httpx) lost the answer."""
            due.pop(self, None)
            transport = self.transport
            if self.lingering or transport.is_closing():
                return
            if not transport.can_write_eof():  # TLS: no half-close
                transport.close()
                return
            self.lingering = True
            self.linger_bytes = LINGER_BYTES
            cycle = self.cycle
            for name, value in cycle.scope["headers"] if cycle is not None else ():
                if name == b"content-length" and value.isdigit() and int(value) <= self.discard_limit:
                    self.linger_bytes = max(LINGER_BYTES, int(value))  # its whole declared body may still come
            transport.write_eof()
            self.flow.resume_reading()  # Uvicorn pauses reading a body nothing reads past 64 KiB
            self.linger = self.loop.call_later(LINGER_TIME, transport.abort)

        def close_with(self, response: bytes) -> None:
            """Answer and close; with a response in progress (a head pipelined behind it) only close:
            responses go out in order, and an answer written now would land inside that one's body."""
            if not self.transport.is_closing():
                if self.cycle is None or self.cycle.response_complete:
                    self.transport.write(response)
                self.transport.close()
                self.watch_closing()  # (done by close_watched already where the transport takes it)

        def room(self) -> tuple[int, bool]:
            """Bytes the parser may get before the next check, and whether they count (``head_bytes``):
            a head's up to --max-head-bytes; a body dropped after its answer's up to ``discard_limit``;
            else (a body the app reads, or one a response in progress did not read: Uvicorn
            buffers 64 KiB of it, then pauses reading) the head limit, so that a head beginning
            inside the piece, after that body, is bounded too."""
            if self.heading:
                return max_head_bytes - self.head_bytes, True
            cycle = self.cycle
            if cycle is not None and cycle.response_complete:
                return self.discard_limit - self.head_bytes, True
            return max_head_bytes, False

        def data_received(self, data: bytes) -> None:
            if self.refused:
                return  # the request of a refused connection is not read
            if self.lingering:
                self.drop(len(data))
                return
            room, counted = self.room()
            if len(data) <= room:  # neither a head nor a dropped body can outgrow its limit in it
                if counted:  # back to 0 when the head or the body completes
                    self.head_bytes += len(data)
                super().data_received(data)
                return
            self.feed_bounded(memoryview(data))

        def feed_bounded(self, data: memoryview) -> None:
            """A read longer than the room left: the parser gets at most that much at a time, so a head
            (or a dropped body) in progress at a piece's start is cut exactly at its limit, and a head
            that began inside a piece (after a body or another request) had less than the limit in it."""
            while data:
                room, counted = self.room()
                if room == 0:  # the head (or dropped body) in progress has its limit already and is incomplete
                    due.pop(self, None)
                    if self.heading:
                        metrics.heads_too_large += 1
                        self.close_with(too_large)
                    else:  # the client has its answer: only close (lingering: the rest is dropped)
                        metrics.bodies_too_large += 1
                        self.linger_close()
                        if self.lingering:
                            self.drop(len(data))
                    return
                piece, data = data[:room], data[room:]
                if counted:
                    self.head_bytes += len(piece)
                super().data_received(piece)
                if self.transport.is_closing() or self.transport.get_protocol() is not self:
                    return  # answered and closed (400, 431), or upgraded to a WebSocket

        def drop(self, size: int) -> None:
            """``size`` bytes read while lingering: dropped; past LINGER_BYTES the connection is closed."""
            self.lingered += size
            if self.lingered > self.linger_bytes:
                self.transport.abort()

        def send_400_response(self, msg: str) -> None:
            # Uvicorn's answer to a head llhttp refuses, after its warning (ParserLog leaves it out)
            if msg == INVALID_REQUEST:
                metrics.invalid_http_requests += 1  # the log line is limited; the count is whole
                client = self.client
                limited.log(logging.WARNING, "invalid_http_request",
                            client=f"{client[0]}:{client[1]}" if client else None)
            running = self.running
            if running is not None and not running.response_complete and (
                    running.response_started or running is not self.cycle or self.heading):
                # A response in progress (an SSE stream), or one due before any answer to these bytes (a
                # request pipelined behind it, or these bytes a head behind its whole request; only bytes
                # of its own body are its answer's): Uvicorn's 400 went into that body, or was read as
                # that request's answer (the client read HTTP inside its event stream). End
                # the connection instead: that request is told its client is gone, as connection_lost
                # would (the stream stops writing), and what it wrote is flushed before the close.
                running.disconnected = True
                running.message_event.set()
                if not self.transport.is_closing():
                    self.transport.close()
                    self.watch_closing()
                return
            super().send_400_response(msg)

        def close_watched(self) -> None:
            """The transport's ``close`` (set in ``connection_made``): asyncio's, then ``watch_closing``."""
            transport = self.transport
            type(transport).close(transport)
            self.watch_closing()

        def watch_closing(self) -> None:
            """A closed transport waits for its buffer to drain: one below the high-water mark has no
            progress check armed (``pause_writing`` arms it), so a client reading nothing held the
            connection for good. Its client must take some within every --write-timeout, as while open."""
            if self.stall is None and self.transport.get_write_buffer_size():
                self.unsent = self.waiting()
                self.stall = self.loop.call_later(write_timeout, self.check_progress)
            if self.stopping and self.cut is None and self.transport.get_write_buffer_size():
                # In the stop --write-timeout (30 s) comes after Uvicorn's graceful timeout (1 s), which
                # waits for every connection and logs an error: cut as a stream's last frame is.
                self.cut = self.loop.call_later(FINAL_WRITE_TIMEOUT, self.transport.abort)

        def shutdown(self) -> None:
            """Uvicorn's, at the stop: close now, or at the end of the response in progress; either
            close is watched as the stop's (``watch_closing``)."""
            self.stopping = True
            super().shutdown()
            if self.transport.is_closing():  # (close_watched did, unless the transport took no close_watched)
                self.watch_closing()

        def eof_received(self) -> bool | None:
            if self.refused or self.lingering:
                return False  # the transport closes itself
            return super().eof_received()

        def _unsupported_upgrade_warning(self) -> None:
            """Uvicorn's warning for each request with an ``Upgrade`` it does not take (every one: the
            edge takes none, server.py), which also told the operator to install a WebSocket library:
            a line a client chose per request. Such a request is answered as the plain request it also
            is (RFC 9110 section 7.8 lets a server ignore Upgrade), and logged as one."""

        def on_message_begin(self) -> None:
            if self not in due:  # a head begun while a response is in progress has its own deadline
                self.await_head()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            due.pop(self, None)
            self.heading = False
            self.head_bytes = 0
            self.discard_limit = UPLOAD_DISCARD_BYTES if self.parser.get_method() in UPLOAD_METHODS else DISCARD_BYTES
            if len(self.pipeline) >= MAX_PIPELINED:  # a response in progress and that many waiting behind it
                if not self.transport.is_closing():
                    metrics.pipelines_too_deep += 1
                    self.transport.abort()
                return  # not queued; the rest of this read is parsed into nothing (Uvicorn's per-head scope)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self.heading = True
            self.head_bytes = 0  # of a body dropped after its answer; the next head counts from the next read
            cycle = self.cycle  # None after a WebSocket upgrade's head
            if cycle is not None and cycle.response_complete and not self.transport.is_closing():
                self.await_head()  # answered before its body was read (e.g. 413): the next head is due now
            super().on_message_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            if (cycle is not None and cycle.response_complete and cycle.scope.get(CLOSE_AFTER_RESPONSE)
                    and not self.transport.is_closing()):
                # The app answered and wants the connection ended, its request's body maybe still coming
                # (a 408 of POST /v1/experts): linger instead of Uvicorn's close at "Connection: close".
                self.server_state.total_requests += 1
                self.linger_close()
                return
            started = bool(self.pipeline)  # Uvicorn starts a request whose head it already parsed
            super().on_response_complete()
            if not started and not self.transport.is_closing() and self not in due:
                # The next request's head on this keep-alive connection is due; or, answered before
                # its body was read (not heading), that body's end (on_message_complete re-arms).
                self.await_head()

        def pause_writing(self) -> None:
            # The transport's buffer passed its high-water mark (the client takes less than is written):
            # from now on the client must take some within every --write-timeout (module docstring, "Writes").
            super().pause_writing()
            if self.stall is None:
                self.unsent = self.waiting()
                self.stall = self.loop.call_later(write_timeout, self.check_progress)

        def waiting(self) -> int:
            """Bytes of responses the client has not taken: the transport's buffer and, plain, the
            kernel's send queue (``unsent_bytes``); over HTTPS also the TLS layer's socket buffer and
            queue (``BoundedTLS.unsent_bytes``), else a slow client's progress went unseen."""
            tls = self.tls
            if tls is not None:
                return self.transport.get_write_buffer_size() + tls.unsent_bytes()
            return unsent_bytes(self.transport)

        def resume_writing(self) -> None:
            if self.stall is not None:
                self.stall.cancel()
                self.stall = None
            super().resume_writing()
            if self.transport.is_closing():  # what is left, under the low-water mark, is still bounded
                self.watch_closing()

        def check_progress(self) -> None:
            """--write-timeout after writing paused, or after the last progress: the client took some of
            what waits (checked again later), or nothing (the connection is aborted)."""
            self.stall = None
            transport = self.transport
            unsent = self.waiting()
            if transport.get_write_buffer_size() == 0:  # drained (resume_writing comes with it)
                return
            running = self.running
            if unsent < self.unsent or (running is not None and running.scope.get(SSE_STREAM)
                                        and not running.response_complete and not transport.is_closing()):
                # progress, or an SSE stream in progress: its own bounds end it (app.WriteWatch,
                # --stream-buffer-bytes); a stream they ended and Uvicorn closes is checked as any other
                self.unsent = unsent
                self.stall = self.loop.call_later(write_timeout, self.check_progress)
                return
            metrics.connections_stalled += 1
            transport.abort()  # a close would wait for the client to take what waits

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            # Uvicorn's (0.54), for a request whose head completed with none in progress, and for the next
            # pipelined one at a response's end: the one connection_lost must tell (below)
            self.running = cycle
            if cycle.scope["http_version"] == "1.0":
                app = close_delimited(app, cycle)
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc: Exception | None) -> None:
            running, self.running = self.running, None
            if self.stall is not None:
                self.stall.cancel()
                self.stall = None
            if self.cut is not None:
                self.cut.cancel()
                self.cut = None
            if running is not None and running is not self.cycle and not running.response_complete:
                # Uvicorn tells only ``self.cycle``, the newest request: with a complete head pipelined
                # behind a stream that is the waiting one, and the stream never heard its client leave
                # (it wrote keep-alives into the lost connection until --result-timeout). Told as Uvicorn
                # tells its cycle; its message_event may be the stream's disconnect watch (direct.py).
                running.disconnected = True
                running.message_event.set()
            forget_read_callback(self.transport)  # (under TLS that transport is BoundedTLS's: cleared there)
            if self.refused:
                if self.linger is not None:
                    self.linger.cancel()
                    lingering[0] -= 1
                self.parser = None  # it holds the protocol (a cycle); Uvicorn's connection_lost drops it
                return
            if self.linger is not None:  # lingering_close's bound
                self.linger.cancel()
            due.pop(self, None)
            super().connection_lost(exc)  # (it closes the transport: close_watched arms nothing once lost)
            # close_watched held the protocol from its transport: a reference cycle
            getattr(self.transport, "__dict__", {}).pop("close", None)
            metrics.connections_open = len(self.connections)

        @classmethod
        def over_tls(cls, context: ssl.SSLContext) -> Callable[..., asyncio.BaseProtocol]:
            """Uvicorn's protocol factory for HTTPS: each connection a :class:`BoundedProtocol`
            under its own :class:`BoundedTLS` (the server itself then listens without ``ssl``)."""
            connections = None

            def make(**kwargs: Any) -> asyncio.BaseProtocol:
                nonlocal connections
                if connections is not None and len(connections) + len(handshaking) >= limit:
                    return Refused()  # before Uvicorn's protocol and the TLS layer are made
                http = cls(**kwargs)
                connections = http.connections  # Uvicorn's open connections (handshaken), one set per server
                http.tls = BoundedTLS(http, context)
                return http.tls
            return make

        @staticmethod
        def end_handshakes() -> None:
            """At the stop: end the connections still in their TLS handshake, which Uvicorn does
            not know of (nothing else would close them before the loop does, with a warning each)."""
            for tls in list(handshaking):
                if tls.socket_transport is not None:
                    tls.socket_transport.abort()

    handshaking: set[BoundedTLS] = set()  # TLS connections accepted whose handshake has not ended

    class BoundedTLS(SSLProtocol):
        """asyncio's TLS layer (``asyncio.sslproto.SSLProtocol``, what ``create_server(ssl=...)``
        puts under each connection) with the plain connections' bounds (module docstring, "TLS"):
        a handshake counts against ``--max-connections`` and must end within ``--head-timeout``;
        a closing connection's TLS shutdown ends after ``--write-timeout`` without progress;
        reads of at most :data:`TLS_READ_BYTES`."""

        max_size = TLS_READ_BYTES  # SSLProtocol: its receive buffer (allocated and zeroed per connection) and read size

        def __init__(self, http: BoundedProtocol, context: ssl.SSLContext) -> None:
            super().__init__(http.loop, http, context, None, server_side=True,
                             ssl_handshake_timeout=head_timeout, ssl_shutdown_timeout=write_timeout)
            self.http: BoundedProtocol | None = http
            self.connections = http.connections  # Uvicorn's open connections (handshaken)
            self.socket_transport: asyncio.Transport | None = None
            self.told = False  # the HTTP protocol was made (so Uvicorn tells it of the loss)
            self.unsent = -1  # bytes still to send when the shutdown began, then at its last timeout check

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.socket_transport = transport
            if len(self.connections) + len(handshaking) >= limit:  # others were accepted in the same pass
                metrics.connections_refused += 1
                transport.abort()
                return
            handshaking.add(self)
            super().connection_made(transport)

        def handshaken(self) -> None:
            """The handshake is done: the HTTP protocol's ``connection_made``."""
            self.told = True
            handshaking.discard(self)

        def _check_shutdown_timeout(self) -> None:
            # SSLProtocol's (CPython 3.11-3.13), at ssl_shutdown_timeout after the app closed the
            # connection: it force-closes, dropping what is still unsent. A slow reader still
            # taking a response's end (a stream ended with Connection: close, or the 408 of the
            # next head's deadline on a keep-alive one) gets another --write-timeout while it
            # takes some, as a write to a plain connection waits for it (a reviewer's finding:
            # tied to --head-timeout, the end of an HTTPS stream was cut, ~0.4 of 7 MB).
            unsent = self.unsent_bytes()
            if 0 < unsent < self.unsent:
                self.unsent = unsent
                self._shutdown_timeout_handle = self._loop.call_later(write_timeout, self._check_shutdown_timeout)
                return
            super()._check_shutdown_timeout()

        def _start_shutdown(self) -> None:
            # SSLProtocol's, when the app closes the connection: what is left to send then
            self.unsent = self.unsent_bytes()
            super()._start_shutdown()

        def _on_shutdown_complete(self, shutdown_exc: BaseException | None) -> None:
            # SSLProtocol's, at the client's EOF or close_notify (or its answer to ours): it cancels the
            # shutdown's timeout and closes the socket transport, which then waits for its buffer to
            # drain, with no bound. A client that half-closed after its request and read nothing held
            # its connection, its --max-connections slot and the answer's unsent MiBs for good. What is
            # left gets the same watch: --write-timeout without progress and it is force-closed.
            super()._on_shutdown_complete(shutdown_exc)
            if shutdown_exc is None and self.socket_transport is not None:
                self.unsent = self.unsent_bytes()
                self._shutdown_timeout_handle = self._loop.call_later(write_timeout, self._check_shutdown_timeout)

        def unsent_bytes(self) -> int:
            """What waits below the HTTP protocol: the encrypted bytes not yet in the socket transport,
            its buffer and the kernel's send queue (``unsent_bytes``). The queue counts: a unary answer
            leaves this layer at once, and with MiBs queued the socket's buffer stood still for
            seconds under a client taking 0.5 MB/s, which lost the answer's end at the shutdown's cut."""
            transport = self.socket_transport
            if transport is None:  # (closing, its buffer and socket still hold what the client has not taken)
                return 0
            return unsent_bytes(transport) + self._outgoing.pending

        def connection_lost(self, exc: Exception | None) -> None:
            http, self.http = self.http, None
            if self in handshaking:
                metrics.tls_handshakes_unfinished += 1
                handshaking.discard(self)
            if http is not None:
                http.tls = None
                if not self.told:  # refused or never handshaken: Uvicorn's connection_lost, which drops
                    http.parser = None  # the parser (it holds the protocol: a cycle), never comes
            transport, self.socket_transport = self.socket_transport, None
            forget_read_callback(transport)
            # Also for a refused one (never started: its HTTP protocol is not told): SSLProtocol lets go of
            # its app transport and protocol here, two reference cycles (each with its buffer) otherwise
            super().connection_lost(exc)

    class Refused(asyncio.Protocol):
        """An HTTPS connection accepted while --max-connections are open or handshaking: closed at
        once (a 503 would need its handshake first), so a flood of connections costs no more."""

        transport: asyncio.BaseTransport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            metrics.connections_refused += 1
            self.transport = transport
            transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            transport, self.transport = self.transport, None
            forget_read_callback(transport)

    return BoundedProtocol


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to ``transport`` its client has not acknowledged: the transport's buffer and the
    kernel's send queue (Linux ``SIOCOUTQ``; elsewhere the buffer alone). The queue is what shows a
    slow client's progress: with a few MiB queued the kernel reports the socket writable only once
    much of it is gone, so the buffer alone stood still for seconds while the client read steadily."""
    size = transport.get_write_buffer_size()  # type: ignore[attr-defined]
    sock = transport.get_extra_info("socket")
    if sock is not None and _OUTQ is not None:
        try:
            size += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return size


def forget_read_callback(transport: asyncio.BaseTransport | None) -> None:
    """Break the reference cycle of a lost connection's asyncio socket transport: CPython 3.11-3.13
    ``_SelectorSocketTransport.set_protocol`` keeps a bound method of the transport itself
    (``_read_ready_cb``), which held each closed connection's transport and socket until a garbage
    collection (tests/test_edge_cycles.py). It reads no more once its connection is lost."""
    if transport is not None and getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None  # type: ignore[attr-defined]


def raise_descriptor_limit(connections: int) -> str | None:
    """Raise the soft RLIMIT_NOFILE to what ``connections`` need (up to the hard limit); a warning
    when even that is too low, since the edge would then fail to accept before refusing."""
    needed = connections + DESCRIPTOR_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        return (f"the open-file limit is {soft}, below --max-connections {connections} + {DESCRIPTOR_RESERVE}: "
                "past it the edge fails to accept instead of refusing with 503; raise `ulimit -n` or lower "
                "--max-connections")
    return None


# Connections asyncio accepts per loop pass, and the kernel's listen queue behind them. asyncio's
# ``BaseSelectorEventLoop._accept_connection`` (3.11) calls ``accept()`` up to ``backlog`` times each
# pass the listening socket is readable, and ``Server._start_serving`` passes the same number to
# ``listen()``. With Uvicorn's ``backlog`` (2048) every connection of a burst was accepted in one pass
# and all their transports made in the next, a pass of several ms (hundreds in a flood) in which the
# open streams' events waited ("Accept pacing", docs/benchmarks.md). A small ``backlog`` alone would
# shorten the kernel's queue too, and a burst past it would wait for SYN retries (1 s and more); so
# the server starts with :data:`ACCEPTS_PER_PASS` and its sockets are listened on again with
# :data:`LISTEN_BACKLOG` (Linux ``listen()`` on a listening socket only changes the queue's length,
# capped by ``net.core.somaxconn``, 4096 by default since Linux 5.4): the rest of a burst waits in the
# kernel's queue, readable again at the next poll, and is accepted over the next passes. uvloop
# (``STREAMPROC_EDGE_LOOP=uvloop``) accepts as libuv does, not 8 per pass; the queue is the same.
ACCEPTS_PER_PASS = 8
LISTEN_BACKLOG = 4096
# Loop passes from a connection's accept() to its protocol's connection_made: the transport is made
# by a task (``_accept_connection2``) and calls ``connection_made`` with ``call_soon``.
ACCEPT_PASSES = 3


def relisten(servers: list[asyncio.base_events.Server]) -> None:
    """Give each started server's sockets the full listen queue, :data:`LISTEN_BACKLOG` (they were
    listened on with :data:`ACCEPTS_PER_PASS`, which asyncio also takes as its accepts per pass)."""
    for server in servers:
        for sock in server.sockets:  # asyncio's TransportSocket has no listen(): a duplicate of its descriptor
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as same:  # the same socket
                same.listen(LISTEN_BACKLOG)


async def stop_accepting(servers: list[asyncio.base_events.Server]) -> None:
    """Stop calling ``accept()``, then let the connections already accepted be made, before
    Uvicorn's ``shutdown`` closes the servers and asks every connection it knows to close. Made after
    that (accepted in the pass before the stop: up to :data:`ACCEPTS_PER_PASS`), one was never asked
    and held the stop for the whole graceful timeout, with an error line; and one whose transport is
    made after ``Server.close`` fails asyncio's ``Server._attach`` assertion. The listening sockets
    stay open meanwhile (closing them is Uvicorn's part)."""
    loop = asyncio.get_running_loop()
    for server in servers:
        for sock in server.sockets:
            try:
                loop.remove_reader(sock.fileno())
            except (NotImplementedError, RuntimeError, ValueError):  # another loop (uvloop): Uvicorn's stop as it is
                pass
    for _ in range(ACCEPT_PASSES):
        await asyncio.sleep(0)
