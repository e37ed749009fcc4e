"""``streamproc edge``: results over HTTP as the SGLang server and Dynamo frame them.

Routes:

- ``GET /v1/results/{request_id}``: server-sent events, one ``data:`` frame per result body
  (``id:`` = the result's seq), ``data: [DONE]`` at the end; ``Last-Event-ID`` resumes after a
  seq. ``Accept: application/json`` or ``?stream=false`` waits for the final result and answers
  with one JSON body instead. ``?verdicts=1`` adds ``event: meta`` frames (seq, join verdict,
  error) before each result; the ``data`` of ordinary frames stays exactly the worker's bytes.
- ``GET /v1/recent``: request ids recently seen on ``P.results.>`` (for the page; operators only).
- ``POST /v1/experts``: the routed-experts matrix of one result body, decoded by the codec
  (``experts.py``; ``?verdict=`` the request's strongest verdict, so the rows can be attributed to
  legs); any valid capability (it costs CPU), or ``--insecure-demo``.
- ``GET /v1/stats``: results seen and the processors' join wait and result latency, for the page's charts
  (``stats.py``; operators only).
- ``GET /v1/info``: how the edge authenticates (``{"auth": "jwt"|"insecure-demo", ...}``), unauthenticated.
- ``GET /``: the live page (its scripts: ``PAGE_SCRIPTS``). ``GET /healthz``, ``GET /metrics`` (open: counters only, no request ids).

Results need a capability for their request id (:mod:`streamproc.edge.auth`): 401 with
``WWW-Authenticate: Bearer`` without a valid one, 403 for a valid one naming other ids. Each
client (the capability's ``sub``; its address with ``--insecure-demo``) holds at most
``--max-streams-per-client`` streams; a stream's buffer, a unary answer's size and one write's
duration are bounded, so slow or greedy clients cannot exhaust the edge (docs/edge.md).

Built on Starlette and served by Uvicorn; the stream response is the only custom piece, because
a client that goes away must free its NATS subscription at once, whatever the ASGI server's
disconnect semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..catalog import Catalog
from ..core.codec import ERROR_STATUS as CORE_ERROR_STATUS
from ..core.codec import (ANSWER_MEDIA_TYPE, Codec, ErrorKind, answer_media_type_of, answer_status_of,
                          fold_added_markers, shown_kind)
from ..core.defaults import RESULT_HELD_OVERHEAD
from ..core.errors import InvalidCapability, StreamprocError, cut_error_text
from ..core.reorder import stale_final_text
from ..logs import carries_access_token, error_text, log_event
from ..core.wire import ResultInfo, Verdict, check_request_id
from . import sse
from ..metrics import CONTENT_TYPE, exposition, registry_for
from .auth import AUDIENCE, Capability, Verifier, load_key, presented_token
from .heap import HeapTrimmer
from .metrics import EdgeCollector, EdgeMetrics
from . import pacer
from .direct import Departure, DirectFrames, UvicornBody, WriteBatch, watch_disconnect
from .experts import MAX_BODIES_BYTES, MAX_BODY_BYTES, MAX_CLIENT_BODIES_BYTES, BodyBudget, build_view
from .feed import Ended, Gap, Lost, Overrun, ResultFeed, StaleFinal, StreamGone
from .settings import EdgeSettings
from .sse import result_event
from .source import ResultSource
from . import stopping as stop
from .stats import StatsSource

if TYPE_CHECKING:
    from ..tracing import StreamTrace, Tracing

log = logging.getLogger("streamproc.edge")

FROM_ENVIRONMENT: Any = object()  # create_app(tracing=...): configured by the OTEL_* variables

PAGE_DIR = Path(__file__).parent / "page"
# Results already waiting go out as one chunk up to this many bytes (Edge.frames). Unbounded, a
# stream replaying a stored history (a late attach, a resume: ``feed.next(0.0)`` reads the stored
# results) gathered all of it before its first write, whether or not its client read: 4 such
# streams of a 48 MiB history took the edge's RSS up by 250-280 MiB past --stream-buffer-bytes.
BATCH_BYTES = 64 * 1024
PAGE_SCRIPTS = ("edge.js", "access.js", "experts.js", "charts.js")
# Unary answers' bytes a client may have waiting in the edge, not yet taken, in --max-unary-bytes. An
# answer gives back its stream slot once built, so without it one client asking again and again and
# reading nothing held as many answers as --max-connections allows, each for --write-timeout.
UNARY_ANSWERS_PER_CLIENT = 4

# HTTP status of a unary answer whose final result is an error (the Streamproc-Error header); the
# kinds the edge adds itself (a client's bad request) beside the processor's ErrorKind table.
ERROR_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "unauthorized": 401,  # no capability, or one that is invalid or expired
    "forbidden": 403,  # a valid capability that does not name this request id
    "too_many_streams": 429,  # this client holds --max-streams-per-client streams
    "too_many_uploads": 429,  # this client's POST /v1/experts bodies hold its share (experts.BodyBudget)
    "too_large": 413,  # a unary answer past --max-unary-bytes (read it as a stream instead)
    **CORE_ERROR_STATUS,
}
_VERDICT_RANK = {Verdict.PASSTHROUGH: 0, Verdict.JOINED: 1, Verdict.STITCHED: 2, Verdict.OMITTED: 3}

# On every /v1 answer that is results, operator data or an answer to a capability: no cache (a proxy,
# the browser's disk) may keep it. RFC 6750 section 2.3 asks for it where the token came as
# ?access_token= (EventSource cannot send headers, so the page does), and a result read with a
# header is no less private. And no browser may sniff a worker's body into a type it renders (HTML in
# a body answered as JSON or plain text). Set per response, not by a middleware: a wrapped ASGI
# ``send`` would turn the fan-out's direct writes off (direct.UvicornBody.of).
PRIVATE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
# The live page and its scripts: they load nothing but the edge's own scripts and API, and are
# framed by no one (clickjacking); an injected inline script or foreign source would not run, and
# no URL leaves in a Referer. The <style> block and style="" attributes are the page's own.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
# Scope key of a request whose connection is to end after its answer while its body may still be
# coming: ``connections.py`` then half-closes and lingers (bounded) instead of closing at once, which
# reset the connection under a client still sending and lost it the answer. Not "Connection: close":
# Uvicorn closes at once on that header.
CLOSE_AFTER_RESPONSE = "streamproc.close_after_response"
# Scope key of a request whose answer is an SSE stream: its writes have the stream's own bounds
# (WriteWatch, --stream-buffer-bytes), so ``connections.py`` leaves a stream in progress to them.
SSE_STREAM = "streamproc.sse_stream"


def error_response(message: str, kind: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """The edge's own refusals (bad id, too many streams, NATS down), before any result is read.
    ``message`` is cut (``cut_error_text``: at most ``MAX_ERROR_TEXT`` bytes as JSON): some carry an
    exception's text, a hostile body's parse error or NATS's, whose length nothing else bounds."""
    return JSONResponse({"error": {"message": cut_error_text(message), "type": kind, "code": status}},
                        status_code=status,
                        headers={**PRIVATE, **headers} if headers else PRIVATE)


def router_refusal(request: Request, exc: Exception) -> Response:
    """Starlette's own answer to its router's ``HTTPException`` (404: no route, 405: a method the route
    does not take, its ``Allow`` kept), saying :data:`PRIVATE` too. A 404 or 405 is cacheable without
    being told (RFC 9110 section 15.1), with its URL: the path of a request that missed every route may
    carry ``?access_token=<jwt>`` (an id sent with a literal ``/``, a trailing slash), and said nothing."""
    assert isinstance(exc, HTTPException)
    headers = {**exc.headers, **PRIVATE} if exc.headers else PRIVATE
    return Response(exc.detail, status_code=exc.status_code, media_type="text/plain", headers=headers)


def unauthorized(message: str) -> JSONResponse:
    """401 with the challenge RFC 6750 section 3 asks for (``error="invalid_token"`` when one was sent)."""
    challenge = f'Bearer realm="{AUDIENCE}"'
    if not message.startswith("no capability"):
        challenge += ', error="invalid_token"'
    return error_response(message, "unauthorized", 401, {"WWW-Authenticate": challenge})


def sse_head() -> list[tuple[bytes, bytes]]:
    """The SSE response's header list, as ``StreamingResponse(frames, media_type=sse.MEDIA_TYPE,
    headers={**PRIVATE, "X-Accel-Buffering": "no"})`` builds it (its ``init_headers``)."""
    head = StreamingResponse.__new__(StreamingResponse)
    head.status_code = 200
    head.media_type = sse.MEDIA_TYPE
    head.init_headers({**PRIVATE, "X-Accel-Buffering": "no"})
    return head.raw_headers


SSE_HEAD = sse_head()  # built once per process; EventStreamResponse copies it per open


class EventStreamResponse(StreamingResponse):
    """An SSE response that races the client: on ``http.disconnect`` the frames stop at once.

    ``on_close(completed)`` runs after the stream; what it returns to await (a coroutine, as an
    ``async def`` returns) is awaited shielded from cancellation, so the NATS subscription is
    always released, also when the client vanished mid-wait. None: it finished at once.
    """

    media_type = sse.MEDIA_TYPE

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None] | None],
                 write_timeout: float, on_stall: Callable[[], None], direct: DirectFrames | None = None,
                 stopping: stop.Stopping | None = None, stop_frame: bytes = b"") -> None:
        # What StreamingResponse.__init__ sets, without its per-open ``isinstance(content,
        # AsyncIterable)`` (an ABC check: ``frames`` is always an async iterator) and
        # ``init_headers`` (the same head every time): SSE_HEAD is built once, by Starlette's own
        # ``init_headers``; each response gets a copy, as ``Response.headers`` may change it.
        self.body_iterator = frames
        self.status_code = 200
        self.background = None
        self.raw_headers = SSE_HEAD.copy()
        self.on_close = on_close
        self.on_stall = on_stall
        self.write_timeout = write_timeout
        self.direct = direct  # the fan-out writes idle-time frames itself once the headers are out (direct.py)
        self.stopping = stopping  # the edge's stop ends this stream itself, with stop_frame (stopping.py)
        self.stop_frame = stop_frame
        self.completed = False

    async def stream_response(self, send: Send) -> bool:
        """Starlette's loop, with each write bounded: Uvicorn's ``send`` waits while the socket's
        buffer is full (flow control), so a client that stopped reading would hold the stream, its
        slot and its subscription forever. After ``write_timeout`` the stream is dropped instead."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        direct = self.direct
        task = asyncio.current_task()
        assert task is not None
        if self.stopping is not None:
            self.stopping.enter(task)  # from now on a stop ends the body with stop_frame (__call__)
        watch = WriteWatch(self.write_timeout, task)
        try:
            if direct is not None:
                direct.out = UvicornBody.of(send)
            async for chunk in self.body_iterator:
                watch.writing()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                watch.written()
        except asyncio.CancelledError:
            # The watch's cancel arrives at the blocked send (it fires only between writing() and
            # written()); any other cancel (the client left, the server stops) is not ours.
            if not watch.stalled or task.uncancel() > 0:
                raise
        finally:
            watch.close()  # a timer left armed would cancel whatever the task does next
            if direct is not None:
                direct.out = None  # nothing may follow the body's end
        if watch.stalled:
            self.on_stall()
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The frames are written by this task, which is cancelled when the client disconnects:
        behind Uvicorn's httptools protocol by the connection's loss itself (direct.watch_disconnect),
        elsewhere by a watcher task that reads ``receive()`` until ``http.disconnect``. (An anyio
        task group of a writer and a listener did the same with a task, four cancel scopes and an
        Event more per open: ~10% of the edge's CPU in a burst of opens; the watcher task itself was
        ~7% of an open and close: docs/benchmarks.md, "SSE lifecycle".)"""
        task = asyncio.current_task()
        assert task is not None
        scope[SSE_STREAM] = True
        gone = Departure(task)

        async def watch() -> None:
            await self.listen_for_disconnect(receive)
            gone()

        hook = watch_disconnect(receive, gone)
        watcher = asyncio.get_running_loop().create_task(watch()) if hook is None else None
        stopping = self.stopping
        try:
            with contextlib.suppress(OSError):
                self.completed = await self.stream_response(send)
        except asyncio.CancelledError:
            if gone.left:
                gone.settle()
            elif stopping is not None and stopping.claims(task):
                if hook is not None:  # the stop ends it now, aborting a client that does not read
                    hook.callback = None  # (end_for_stop): that disconnect must not cancel the end
                with contextlib.suppress(OSError):
                    await self.end_for_stop(send)
            else:  # cancelled from outside (the server's own timeout): not ours to swallow
                raise
        finally:
            gone.settle()  # a cancel the task never saw is taken back, none comes later
            if watcher is not None:
                watcher.cancel()
            else:
                hook.release()  # type: ignore[union-attr]  # on_close is not cancelled by a late disconnect
            if stopping is not None:
                stopping.leave(task)
            rest = self.on_close(self.completed)
            if rest is not None:  # a round trip left (an unsubscribe, a replay's consumer)
                with anyio.CancelScope(shield=True):
                    await rest

    async def end_for_stop(self, send: Send) -> None:
        """The edge stops: the stop's error event and ``[DONE]``, then the body's end. Every frame
        the fan-out took for this stream is on the transport already (a direct write's flush runs at
        the end of the read that took it, before the cancel can wake this task, and none is taken
        once it is woken: direct.py).
        A client that does not read gets its connection closed after ``FINAL_WRITE_TIMEOUT``: when the
        frame cannot be handed over by then, or when it was but still waits in the transport's buffer
        then (Uvicorn waits for every connection to close, and logs an error when one outlasts its
        graceful timeout)."""
        body = UvicornBody.of(send)
        try:
            async with asyncio.timeout(stop.FINAL_WRITE_TIMEOUT):
                await send({"type": "http.response.body", "body": self.stop_frame, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            if body is not None:
                body.transport.abort()  # the cycle is marked disconnected in the next loop pass
                await asyncio.sleep(0)
            return
        if body is not None and body.transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(stop.FINAL_WRITE_TIMEOUT, body.transport.abort)


class UnaryAnswer:
    """An ASGI answer sent as ``answer`` would be, then an empty last body part: Uvicorn writes that
    only once the transport drained (or the connection is lost, e.g. cut by --write-timeout), and
    ``taken`` runs then, so what a client has not read counts against it (Edge.charged)."""

    def __init__(self, answer: Response, taken: Callable[[], None]) -> None:
        self.answer: Response | None = answer
        self.taken = taken

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Nothing here keeps the body while the last part waits for the drain: what the kernel did not
        # take is already a copy in the transport (asyncio's _SelectorSocketTransport.write, 3.11:
        # "data = data[n:]" then "self._buffer.extend(data)"), so holding it too doubled each answer
        # a client left unread (+42 MiB for six 7.2 MB answers, test_edge_memory.py).
        answer, self.answer = self.answer, None
        if answer is None:
            raise RuntimeError("a UnaryAnswer is sent once")
        start = {"type": "http.response.start", "status": answer.status_code, "headers": answer.raw_headers}
        part = {"type": "http.response.body", "body": answer.body, "more_body": True}
        del answer
        try:
            await send(start)
            await send(part)
            del part
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.taken()


class EventStreamHead(Response):
    """``HEAD /v1/results/{id}`` of a stream: the head GET's stream starts with (``SSE_HEAD``) and
    no body. Everything after an SSE head is content (RFC 9110 section 9.3.2: HEAD gets GET's header
    fields, not its content), so no stream is opened for it: run as GET's stream, a HEAD held a stream
    slot, a NATS subscription and its connection until the stream ended, long after the head was sent."""

    def __init__(self) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = SSE_HEAD.copy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class WriteWatch:
    """Cancels ``task`` (its blocked write) once one write has been blocked for ``timeout`` seconds.

    ``anyio.move_on_after`` around every write made a cancel scope and a timer per SSE event (about
    5 µs of the edge's per-event CPU, docs/benchmarks.md); almost every write returns at once. This
    arms one timer at most per ``timeout`` period: when it fires during a write it re-arms for that
    write's own deadline (``started + timeout``), so a write is still cut exactly ``timeout`` after
    it began; between writes it lapses until the next one. It cancels the task itself, not an anyio
    cancel scope (one per open was ~5% of the edge's CPU in a burst of opens): ``stalled`` tells
    the writer that the cancel was the watch's."""

    __slots__ = ("timeout", "task", "loop", "since", "handle", "stalled")

    def __init__(self, timeout: float, task: asyncio.Task) -> None:
        self.timeout, self.task = timeout, task
        self.loop = asyncio.get_running_loop()
        self.since: float | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.stalled = False

    def writing(self) -> None:
        self.since = now = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(now + self.timeout, self._check)

    def written(self) -> None:
        self.since = None

    def _check(self) -> None:
        self.handle = None
        if self.since is None:
            return
        due = self.since + self.timeout
        if self.loop.time() >= due:
            self.stalled = True
            self.task.cancel()
        else:
            self.handle = self.loop.call_at(due, self._check)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Edge:
    """What the routes share: settings, counters, the NATS source and the folding codec."""

    def __init__(self, settings: EdgeSettings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing  # None: off (streamproc.tracing)
        self.metrics = EdgeMetrics()
        self.source = ResultSource(settings, self.metrics)
        self.registry = registry_for(EdgeCollector(self.metrics, self.source.read_gate.budget))
        self.codec: Codec = Catalog()(settings.format)  # an unknown format fails here, at start-up
        self.stopping = stop.Stopping()  # the streams a stop ends cleanly (stopping.py)
        self.stop_frame = sse.event(self.codec.error_body(stop.MESSAGE, ErrorKind.OVERLOADED)) + sse.DONE
        self.verifier = (Verifier(load_key(settings.auth_key_file, settings.auth_algorithm),
                                  settings.auth_algorithm, settings.auth_leeway)
                         if settings.auth_key_file else None)  # else --insecure-demo (EdgeSettings checks)
        self.client_streams: dict[str, int] = {}
        self.client_unsent: dict[str, int] = {}  # bytes of unary answers a client has not taken (UnaryAnswer)
        # the fan-out's direct frames of one NATS read (direct.py)
        self.write_batch = WriteBatch(lambda: self.source.after_read_hooked)
        self.source.after_read = self.write_batch.flush
        self.pacer = pacer.OpenPacer(pacer.OPENS_PER_PASS)  # a burst of opens leaves room for events (pacer.py)
        self.heap = HeapTrimmer()
        self.stats = StatsSource(self.metrics, settings.processor_metrics_urls(), sees_all_results=settings.recent > 0)
        # One expert view decodes at a time: a few open pages cannot multiply the decode memory.
        self.view_limiter = anyio.CapacityLimiter(1)
        self.bodies = BodyBudget()  # POST /v1/experts bodies held at once

    # ------------------------------------------------------------------ access

    def authenticate(self, request: Request, authorization: list[str] | None = None
                     ) -> tuple[str, Capability | None] | Response:
        """The client's identity and capability, or the 401 to answer. With ``--insecure-demo`` the
        client is its address and has no capability (everything is allowed). ``authorization``: the
        request's Authorization values when the caller has read them already (open_headers)."""
        if self.verifier is None:
            return f"addr:{request.client.host if request.client else '?'}", None
        try:
            if authorization is None:
                authorization = request.headers.getlist("authorization")
            token = presented_token(authorization, query_values(request, "access_token"))
            if token is None:
                raise InvalidCapability("no capability: send 'Authorization: Bearer <token>' or ?access_token=")
            capability = self.verifier.verify(token)
        except InvalidCapability as exc:
            self.metrics.unauthorized += 1
            return unauthorized(str(exc))
        if capability.sub:
            return f"sub:{capability.sub}", capability
        # No sub: the token is its own client, as a minted token's random sub makes it. Before, every
        # such token counted as one client "sub:", so one holder's --max-streams-per-client streams
        # left every other holder 429. Told apart by what was signed, not by the signature: an ECDSA
        # signature (r, s) is also valid as (r, n - s), so the holder of one ES256 token has two.
        return f"token:{hashlib.sha256(token.rpartition('.')[0].encode()).hexdigest()}", capability

    def authorize_operator(self, request: Request) -> Response | None:
        """None when the request may see operator data (``/v1/recent``), else the 401/403."""
        who = self.authenticate(request)
        if isinstance(who, Response):
            return who
        capability = who[1]
        if capability is not None and not capability.operator:
            self.metrics.forbidden += 1
            return error_response("this needs an operator capability (scope: operator)", "forbidden", 403)
        return None

    # ------------------------------------------------------------------ routes

    async def results(self, request: Request) -> Response | UnaryAnswer:
        pacer = self.pacer
        await pacer.turn()
        self.metrics.opens_paced = pacer.paced
        request_id = request.path_params["request_id"]
        authorization, last_event_id, accept = open_headers(request.scope)
        try:
            check_request_id(request_id)
            after = sse.parse_last_event_id(last_event_id)
        except ValueError as exc:
            return error_response(str(exc), "invalid_request", 400)
        who = self.authenticate(request, authorization)
        if isinstance(who, Response):
            return who
        client, capability = who
        if capability is not None and not capability.allows(request_id):
            self.metrics.forbidden += 1
            return error_response(f"this capability does not cover request {request_id}", "forbidden", 403)
        unary = wants_unary(request, accept)
        if self.stopping.active:
            return error_response(stop.MESSAGE, "unavailable", 503)
        if not self.source.connected:
            return error_response("the edge is not connected to NATS", "unavailable", 503)
        if self.metrics.streams_active >= self.settings.max_streams:
            self.metrics.streams_rejected += 1
            return error_response(
                f"too many concurrent result streams (limit {self.settings.max_streams}); retry later",
                "overloaded",
                503,
            )
        if self.client_streams.get(client, 0) >= self.settings.max_streams_per_client:
            self.metrics.streams_rejected_client += 1
            return error_response(
                f"this client has {self.settings.max_streams_per_client} result streams open "
                "(--max-streams-per-client); close one or retry later",
                "too_many_streams",
                429,
            )
        if unary and (self.client_unsent.get(client, 0) + self.settings.max_unary_bytes
                      > UNARY_ANSWERS_PER_CLIENT * self.settings.max_unary_bytes):
            return self.unsent_refusal(client)  # before the answer is collected, which costs as much again
        if not unary and request.scope["method"] == "HEAD":
            return EventStreamHead()  # GET's head, answered without opening the stream it would start
        self.metrics.streams_active += 1
        self.metrics.streams_opened += 1
        self.client_streams[client] = self.client_streams.get(client, 0) + 1
        try:
            feed = await self.source.open(request_id, after=None if unary else after)
        except Exception as exc:  # noqa: BLE001 - NATS refused the subscription: a clean 503, not a 500 page
            self.metrics.streams_active -= 1
            self.client_left(client)
            self.source.limited.log(logging.WARNING, "subscribe_failed", request_id=request_id,
                                    error=error_text(exc))
            return error_response(f"cannot subscribe to results: {exc}", "unavailable", 503)
        if unary:
            self.metrics.unary_requests += 1
            task = asyncio.current_task()
            assert task is not None
            self.stopping.enter(task)
            try:
                return self.charged(client, await self.unary_until_disconnect(request, feed))
            except asyncio.CancelledError:
                if not self.stopping.claims(task):
                    raise
                return error_response(stop.MESSAGE, "unavailable", 503)
            finally:
                self.stopping.leave(task)
                with anyio.CancelScope(shield=True):
                    self.client_left(client)
                    await self.release(feed)
        verdicts = query_values(request, "verdicts")[-1:] in (["1"], ["true"], ["yes"])
        trace = self.tracing.stream(request_id) if self.tracing is not None else None

        def on_close(completed: bool) -> Awaitable[None] | None:
            if completed:
                self.metrics.streams_completed += 1
            else:
                self.metrics.client_disconnects += 1
            if trace is not None:
                trace.close("completed" if completed else "disconnected")
            self.client_left(client)
            feed.direct = None  # feed and DirectFrames refer to each other: a cycle left to the GC otherwise
            return self.release_now(feed)

        def on_stall() -> None:
            self.metrics.streams_stalled += 1
            self.source.limited.log(logging.INFO, "stream_stalled", request_id=request_id,
                                    write_timeout=self.settings.write_timeout)

        # Tracing has a span per frame, sent by the task: no direct writes then.
        direct = (DirectFrames(feed, meta_and_event if verdicts else result_event, self.metrics, self.write_batch)
                  if trace is None and feed.inbox is not None else None)
        feed.direct = direct
        return EventStreamResponse(self.frames(feed, verdicts=verdicts, trace=trace, direct=direct), on_close,
                                   self.settings.write_timeout, on_stall, direct, self.stopping, self.stop_frame)

    def stop_streams(self) -> None:
        """The edge stops: every open stream and waiting unary request ends itself now (stopping.py),
        and opens still to come get 503."""
        if self.stopping.active:
            return
        ended = self.stopping.stop()
        log_event(log, logging.INFO, "stopping", streams=ended)

    def charged(self, client: str, answer: Response) -> Response | UnaryAnswer:
        """``answer``, its bytes counted against ``client`` until they left the edge; or a 429 when
        its answers not yet taken would pass UNARY_ANSWERS_PER_CLIENT x --max-unary-bytes."""
        size = len(answer.body)
        unsent = self.client_unsent.get(client, 0)
        if unsent and unsent + size > UNARY_ANSWERS_PER_CLIENT * self.settings.max_unary_bytes:
            return self.unsent_refusal(client)  # others were collected meanwhile
        self.client_unsent[client] = unsent + size

        def taken() -> None:
            left = self.client_unsent.get(client, 0) - size
            if left > 0:
                self.client_unsent[client] = left
            else:
                self.client_unsent.pop(client, None)
        return UnaryAnswer(answer, taken)

    def unsent_refusal(self, client: str) -> Response:
        self.metrics.streams_rejected_client += 1
        return error_response(
            f"this client's unary answers not yet read hold {self.client_unsent.get(client, 0)} bytes in the edge "
            f"(at most {UNARY_ANSWERS_PER_CLIENT} x --max-unary-bytes); read them, or retry later",
            "too_many_streams", 429)

    def client_left(self, client: str) -> None:
        left = self.client_streams.get(client, 0) - 1
        if left > 0:
            self.client_streams[client] = left
        else:
            self.client_streams.pop(client, None)

    async def recent(self, request: Request) -> Response:
        refused = self.authorize_operator(request)
        if refused is not None:
            return refused
        return Response(msgspec.json.encode(self.source.recent.newest_first()), media_type="application/json",
                        headers=PRIVATE)

    async def info(self, request: Request) -> Response:
        """What the page needs before it has a token: whether it needs one, and must show a banner."""
        s = self.settings
        return JSONResponse({
            "auth": "jwt" if self.verifier is not None else "insecure-demo",
            "audience": AUDIENCE if self.verifier is not None else None,
            "algorithm": s.auth_algorithm if self.verifier is not None else None,
            "tls": bool(s.tls_cert_file),
            "max_streams_per_client": s.max_streams_per_client,
            # The format's field names the page needs (it names none itself): generated text, and
            # the routed-experts value it posts to /v1/experts.
            "text_field": self.codec.text_field,
            "experts_field": self.codec.experts_field,
        }, headers=PRIVATE)  # not private, but one rule for /v1 is one a reviewer can check

    async def experts(self, request: Request) -> Response:
        """The routed-experts view of the result body in the request (the page posts what it received).
        It reveals nothing the client did not send, but decoding costs CPU: any valid capability."""
        who = self.authenticate(request)
        if isinstance(who, Response):
            return who
        client = who[0]
        try:
            offset = int(request.query_params.get("offset", "0"))
            rows = request.query_params.get("rows")
            rows_wanted = int(rows) if rows is not None else None
        except ValueError:
            return error_response("offset and rows must be integers", "invalid_request", 400)
        verdict_text = request.query_params.get("verdict")  # the request's strongest: which legs made the rows
        if verdict_text is not None and verdict_text not in {v.value for v in Verdict}:
            return error_response(f"verdict must be one of {', '.join(Verdict)}", "invalid_request", 400)
        verdict = Verdict(verdict_text) if verdict_text is not None else None
        declared = request.headers.get("content-length")
        if declared is not None and not (declared.isascii() and declared.isdigit()):
            declared = None  # '²'.isdigit(): never int()-ed (HTTP parsers refuse such a header anyway)
        if declared is not None and int(declared) > MAX_BODY_BYTES:
            return error_response(f"body over {MAX_BODY_BYTES} bytes", "invalid_request", 413)
        # The client's share is claimed by the declared length before the body is read (a chunked
        # body's as it comes); the edge-wide bound counts bytes as they are read. Both are given back
        # once the view is answered: a body waiting for the one decode at a time is held too. A post
        # past either is refused at once (connections.py discards the rest of its body).
        budget, claimed, held = self.bodies, 0, 0
        try:
            if declared is not None:
                if not budget.claim(client, int(declared)):
                    return self.bodies_refused("client")
                claimed = int(declared)
            # The body is due --head-timeout after the head, like the next head: without a deadline
            # one trickled, or stopped short, held the connection, its --max-connections slot and up
            # to 32 MiB of chunks for as long as its client liked (connections.py bounds only the
            # bodies nothing reads). 10 s: a 32 MiB body needs 3.4 MB/s, a 3 MB one 0.3 MB/s.
            chunks, size = [], 0
            with anyio.move_on_after(self.settings.head_timeout) as deadline:
                try:
                    async for chunk in request.stream():
                        size += len(chunk)
                        if size > MAX_BODY_BYTES:
                            return error_response(f"body over {MAX_BODY_BYTES} bytes", "invalid_request", 413)
                        if size > claimed:  # no Content-Length (chunked): claimed as it comes
                            if not budget.claim(client, size - claimed):
                                return self.bodies_refused("client")
                            claimed = size
                        if not budget.hold(len(chunk)):
                            return self.bodies_refused("edge")
                        held += len(chunk)
                        chunks.append(chunk)
                except ClientDisconnect:
                    # The poster left before its body ended: nothing to decode, no one to answer (Uvicorn
                    # sends nothing once its client is gone). Let out, it was a traceback per such post.
                    chunks.clear()
                    self.metrics.experts_bodies_abandoned += 1
                    return error_response(f"the client left before its body ended ({size} bytes came)",
                                          "invalid_request", 400)
            if deadline.cancelled_caught:
                self.metrics.experts_bodies_timed_out += 1
                chunks.clear()
                request.scope[CLOSE_AFTER_RESPONSE] = True  # ended after the answer, lingering (connections.py)
                return error_response(f"the request body did not arrive within {self.settings.head_timeout:g}s "
                                      f"(--head-timeout; {size} bytes came)", "invalid_request", 408)
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()  # one copy of the body from here on
            try:
                view = await anyio.to_thread.run_sync(
                    lambda: build_view(self.codec, body, offset=offset, rows=rows_wanted, verdict=verdict),
                    limiter=self.view_limiter,
                )
            except ValueError as exc:  # msgspec.DecodeError is a ValueError too
                return error_response(f"not a result body: {exc}", "invalid_request", 400)
            except RecursionError:  # parsers recurse per nesting level: deep JSON is bad input, not an edge bug
                return error_response("not a result body: nested too deeply to parse", "invalid_request", 400)
            return Response(msgspec.json.encode(view), media_type="application/json", headers=PRIVATE)
        finally:
            budget.give(client, claimed, held)

    def bodies_refused(self, bound: str) -> Response:
        """The answer to an experts post past a bound of :class:`.experts.BodyBudget`."""
        self.metrics.experts_bodies_refused += 1
        if bound == "client":
            return error_response(f"this client's posted bodies already hold {MAX_CLIENT_BODIES_BYTES} bytes "
                                  "of the edge; retry once one is answered", "too_many_uploads", 429,
                                  {"Retry-After": "1"})
        return error_response(f"posted bodies already hold {MAX_BODIES_BYTES} bytes of the edge; retry later",
                              "overloaded", 503, {"Retry-After": "1"})

    async def stats_json(self, request: Request) -> Response:
        """Results seen and the processors' join wait and result latency: operator data, like ``/v1/recent``."""
        refused = self.authorize_operator(request)
        if refused is not None:
            return refused
        return Response(msgspec.json.encode(await self.stats.snapshot()), media_type="application/json",
                        headers=PRIVATE)

    async def healthz(self, request: Request) -> Response:
        if self.source.connected:
            missing, others = self.source.results_stream_missing, self.source.own_streams_missing
            if missing is not None or others:  # 200: restarting the edge would not bring a stream back
                body: dict[str, Any] = {"status": "degraded", "nats": "connected"}
                if missing is not None:  # the one the recent ring reads
                    body["results_stream"] = missing
                if others:  # read by streams with an ordered consumer of their own (--recent 0, ...)
                    body["results_streams_missing"] = dict(sorted(others.items()))
                return JSONResponse(body)
            access = self.source.msg_get
            if access is not None and access.state == "refused":  # still serving, at a cost (msg_get.py)
                return JSONResponse({"status": "ok", "nats": "connected",
                                     "stored_results": f"read with consumers, in the read budget: publish to "
                                                       f"{access.subject} refused (docs/security.md)"})
            return JSONResponse({"status": "ok", "nats": "connected"})
        return JSONResponse({"status": "unavailable", "nats": "disconnected"}, status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(exposition(self.registry), headers={"Content-Type": CONTENT_TYPE})

    # --------------------------------------------------------------- streaming

    async def frames(self, feed: ResultFeed, *, verdicts: bool, trace: StreamTrace | None = None,
                     direct: DirectFrames | None = None) -> AsyncIterator[bytes]:
        """SSE frames for one request: results in seq order, then ``[DONE]``; keep-alives meanwhile.
        ``trace`` (tracing on) gets a span per result frame, ended once the frame was sent.
        Without tracing, the results already waiting in the feed go out as one chunk (one ASGI send,
        one socket write), the same bytes as one chunk per result. ``direct``: results the fan-out
        wrote itself while this waited (direct.py) count for the result timeout and the keep-alive."""
        settings, metrics = self.settings, self.metrics
        idle_since = last = time.monotonic()  # the last result; the last write
        limit = min(settings.idle_stream_timeout, settings.result_timeout)  # until the first result
        carried: Any = None  # a non-result item found while collecting a batch: handled next
        wrote = True
        while True:
            if carried is not None:
                item, carried = carried, None
            else:
                now = time.monotonic()
                if wrote:
                    last = now
                wrote = True
                if direct is not None and direct.sent_at > last:
                    idle_since = last = direct.sent_at
                    limit = settings.result_timeout
                wait = min(last + settings.keepalive, idle_since + limit) - now
                item = await feed.next(max(wait, 0.0))
            if type(item) is ResultInfo and trace is None:
                idle_since = time.monotonic()
                limit = settings.result_timeout
                batch, size = [], 0
                while True:
                    if verdicts:
                        batch.append(meta_frame(item))
                    batch.append(frame := sse.event(item.body, id=item.seq))
                    size += len(frame)
                    metrics.sent(item)
                    if item.final or item.error is not None:
                        if event_id(feed, item) is None:
                            batch[-1] = sse.event(item.body)
                        batch.append(sse.DONE)
                        yield b"".join(batch)
                        return
                    if size >= BATCH_BYTES:
                        break
                    item = await feed.next(0.0)
                    if type(item) is not ResultInfo:
                        carried = item
                        break
                yield b"".join(batch) if len(batch) > 1 else batch[0]
                continue
            if item is None:
                if direct is not None and direct.sent_at > last:  # results went out meanwhile
                    wrote = False
                    continue
                if time.monotonic() - idle_since >= limit:
                    metrics.result_timeouts += 1
                    yield sse.event(self.timeout_body(feed, limit)) + sse.DONE
                    return
                metrics.keepalives_sent += 1
                yield sse.KEEPALIVE
                continue
            if isinstance(item, Ended):
                yield sse.DONE
                return
            if isinstance(item, Gap):
                metrics.gaps += 1
                yield sse.event(self.gap_body(feed, item)) + sse.DONE
                return
            if isinstance(item, StaleFinal):
                metrics.stale_finals += 1
                yield sse.event(self.stale_final_body(feed, item)) + sse.DONE
                return
            if isinstance(item, Lost):
                yield sse.event(self.lost_body(feed, item)) + sse.DONE
                return
            if isinstance(item, Overrun):
                yield sse.event(self.overrun_body(feed, item)) + sse.DONE
                return
            if isinstance(item, StreamGone):
                yield sse.event(self.gone_body(feed, item)) + sse.DONE
                return
            idle_since = time.monotonic()
            limit = settings.result_timeout
            frame = meta_frame(item) if verdicts else b""
            frame += sse.event(item.body, id=event_id(feed, item))
            metrics.sent(item)
            if trace is not None:
                trace.frame(item, len(frame))
            if item.final or item.error is not None:
                yield frame + sse.DONE
                if trace is not None:
                    trace.sent()
                return
            yield frame
            if trace is not None:
                trace.sent()

    async def unary_until_disconnect(self, request: Request, feed: ResultFeed) -> Response:
        """The unary answer, unless the client leaves first: then its stream slot is freed at once.
        Behind Uvicorn's httptools protocol the connection's loss cancels this task itself
        (direct.watch_disconnect), as an SSE stream's does; elsewhere a watcher task reads
        ``receive()``. (The task group of a responder and a watcher left each request's objects, its
        connection's socket included, in a reference cycle through the watcher's CancelledError,
        until a garbage collection: tests/test_edge_cycles.py.)"""
        task = asyncio.current_task()
        assert task is not None
        gone = Departure(task)
        hook = watch_disconnect(request.receive, gone)
        if hook is None:
            return await self.unary_watched(request, feed)
        try:
            return await self.unary(feed)
        except asyncio.CancelledError:
            if not gone.left:  # the edge stops (Edge.results answers), or the server's own cancel
                raise
            self.metrics.client_disconnects += 1
            return Response(status_code=499)  # nobody is listening
        finally:
            gone.settle()
            hook.release()

    async def unary_watched(self, request: Request, feed: ResultFeed) -> Response:
        """:meth:`unary_until_disconnect` where the disconnect must be read from ``receive()``."""
        answer: Response | None = None
        async with anyio.create_task_group() as tg:

            async def respond() -> None:
                nonlocal answer
                answer = await self.unary(feed)
                tg.cancel_scope.cancel()

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                self.metrics.client_disconnects += 1
                tg.cancel_scope.cancel()

            tg.start_soon(respond)
            tg.start_soon(watch)
        return answer if answer is not None else Response(status_code=499)  # nobody is listening

    async def unary(self, feed: ResultFeed) -> Response:
        """Wait for the final result; answer with the single result, or the codec's fold of the stream, with
        the status and Content-Type the engine answers that body with (:meth:`answer_status`,
        :meth:`answer_media_type`)."""
        results: list[ResultInfo] = []
        size = 0
        idle_since = time.monotonic()
        limit = min(self.settings.idle_stream_timeout, self.settings.result_timeout)  # until the first result
        while True:
            left = limit - (time.monotonic() - idle_since)
            item = await feed.next(max(left, 0.0)) if left > 0 else None
            if item is None:
                self.metrics.result_timeouts += 1
                return Response(self.timeout_body(feed, limit), status_code=504, media_type="application/json",
                                headers=PRIVATE)
            if isinstance(item, Overrun):  # not reachable while unary reads as fast as NATS delivers
                return Response(self.overrun_body(feed, item), status_code=503, media_type="application/json",
                                headers=PRIVATE)
            if isinstance(item, Gap):
                self.metrics.gaps += 1
                return Response(self.gap_body(feed, item), status_code=500, media_type="application/json",
                                headers=PRIVATE)
            if isinstance(item, StaleFinal):  # not reachable without a result handed out; answer anyway
                self.metrics.stale_finals += 1
                return Response(self.stale_final_body(feed, item), status_code=500,
                                media_type="application/json", headers=PRIVATE)
            if isinstance(item, Lost):
                return Response(self.lost_body(feed, item), status_code=503, media_type="application/json",
                                headers=PRIVATE)
            if isinstance(item, StreamGone):
                return Response(self.gone_body(feed, item), status_code=ErrorKind.UNAVAILABLE.http_status,
                                media_type="application/json", headers=PRIVATE)
            if isinstance(item, Ended):  # not reachable without a resume point; answer honestly anyway
                break
            idle_since = time.monotonic()
            self.metrics.sent(item)
            if item.error is not None:
                return Response(
                    item.body,
                    status_code=ERROR_STATUS.get(item.error, 500),
                    media_type="application/json",
                    headers={**PRIVATE, "Streamproc-Error": shown_kind(item.error)},
                )
            # What it holds, not its body alone (empty bodies with long traceparents were held unseen).
            # One call per result of a unary answer: the rule's home, not fanout.py's per-event inline copy.
            size += item.held_bytes
            if size > self.settings.max_unary_bytes:  # never hold a whole huge stream for one client
                self.metrics.unary_too_large += 1
                return error_response(
                    f"the results of request {feed.request_id} exceed --max-unary-bytes "
                    f"({self.settings.max_unary_bytes} bytes, counting each result's body, request id, "
                    f"traceparent and {RESULT_HELD_OVERHEAD} bytes); read them as a stream (Accept: text/event-stream)",
                    "too_large", 413)
            results.append(item)
            limit = self.settings.result_timeout
            if item.final:
                break
        verdict = max(
            (r.verdict for r in results if r.verdict is not None), key=_VERDICT_RANK.__getitem__, default=None
        )
        headers = {**PRIVATE, "Streamproc-Results": str(len(results))}
        if len(results) == 1 and not self.codec.folds_alone(results[0].body):
            body = results[0].body
        else:
            try:
                body, added = await anyio.to_thread.run_sync(self.fold, [r.body for r in results])
            except Exception as exc:  # noqa: BLE001 - a codec bug must not take the edge down
                self.source.limited.log(logging.ERROR, "fold_failed", request_id=feed.request_id, exc_info=True)
                # Cut: a codec plugin's exception chooses its text's length (a 10 MB message was a 10 MB
                # 500 body, held and sent whole); the traceback above keeps its start (bounded_traceback).
                body = self.codec.error_body(cut_error_text(f"cannot fold {len(results)} results: {exc}"),
                                             ErrorKind.INTERNAL)
                return Response(body, status_code=500, media_type=ANSWER_MEDIA_TYPE, headers=PRIVATE)
            if added:  # a field the fold could not say, marked: not the results' bytes (docs/protocol.md)
                verdict = Verdict.OMITTED
        if verdict is not None:
            headers["Streamproc-Join"] = verdict.value
        return Response(body, status_code=self.answer_status(feed, body),
                        media_type=self.answer_media_type(feed, body), headers=headers)

    def fold(self, bodies: list[bytes]) -> tuple[bytes, bool]:
        """The codec's fold of a unary answer's results, and whether it added an omission marker none of
        them carries (:func:`~streamproc.core.codec.fold_added_markers`, a byte search in the same worker
        thread): such an answer is ``omitted``, whatever its results' verdicts."""
        folded = self.codec.fold(bodies)
        return folded, fold_added_markers(bodies, folded)

    def answer_status(self, feed: ResultFeed, body: bytes) -> int:
        """The status the aggregated engine answers ``body`` with as its unary answer: an error body's
        own status (``Codec.answer_status``, a bounded look at the bytes), else 200. A codec that
        raises answers 200, the body as a result like any other."""
        try:
            return answer_status_of(self.codec, body)
        except Exception:  # noqa: BLE001 - a codec bug must not take the answer down
            self.source.limited.log(logging.ERROR, "answer_status_failed", request_id=feed.request_id,
                                    exc_info=True)
            return 200

    def answer_media_type(self, feed: ResultFeed, body: bytes) -> str:
        """The Content-Type the aggregated engine answers ``body`` with (``Codec.answer_media_type``: a
        plain-text 500 is not JSON), else ``application/json``. A codec that raises answers JSON."""
        try:
            return answer_media_type_of(self.codec, body)
        except Exception:  # noqa: BLE001 - a codec bug must not take the answer down
            self.source.limited.log(logging.ERROR, "answer_media_type_failed", request_id=feed.request_id,
                                    exc_info=True)
            return ANSWER_MEDIA_TYPE

    def timeout_body(self, feed: ResultFeed, limit: float) -> bytes:
        return self.codec.error_body(f"no result for request {feed.request_id} within {limit}s", ErrorKind.TIMEOUT)

    def overrun_body(self, feed: ResultFeed, overrun: Overrun) -> bytes:
        return self.codec.error_body(
            f"more than {overrun.limit} bytes of results of request {feed.request_id} waited in the edge "
            "(--stream-buffer-bytes): the client fell behind, or a seq never arrived while later ones did; "
            "reconnect with Last-Event-ID to resume",
            ErrorKind.OVERLOADED,
        )

    def gap_body(self, feed: ResultFeed, gap: Gap) -> bytes:
        hint = (
            ""
            if feed.mode == "jetstream"
            else " (attached late? without a JetStream results stream only live results are seen)"
        )
        return self.codec.error_body(
            f"result seq {gap.missing} of request {feed.request_id} never arrived while {gap.waiting} later "
            f"ones did{hint}",
            ErrorKind.INTERNAL,
        )

    def stale_final_body(self, feed: ResultFeed, stale: StaleFinal) -> bytes:
        return self.codec.error_body(
            stale_final_text(feed.request_id, stale.seq, stale.next_seq - 1)
            + "; the results stream may hold another writer's",
            ErrorKind.INTERNAL,
        )

    def lost_body(self, feed: ResultFeed, lost: Lost) -> bytes:
        return self.codec.error_body(
            cut_error_text(f"the edge lost its subscription to request {feed.request_id}: {lost.reason}"),
            ErrorKind.INTERNAL
        )

    def gone_body(self, feed: ResultFeed, gone: StreamGone) -> bytes:
        return self.codec.error_body(
            cut_error_text(f"no more results of request {feed.request_id}: {gone.reason}"), ErrorKind.UNAVAILABLE)

    async def release(self, feed: ResultFeed) -> None:
        rest = self.release_now(feed)
        if rest is not None:
            await rest

    def release_now(self, feed: ResultFeed) -> Awaitable[None] | None:
        """:meth:`release`; None when the feed closed at once, else the rest to await (ResultFeed.close_now)."""
        self.metrics.streams_active -= 1
        self.heap.released()
        return feed.close_now()


def event_id(feed: ResultFeed, result: ResultInfo) -> int | None:
    """A result frame's SSE id: its seq, except the error result ``SeqOrder.push`` handed out below a
    seq already handed out or seen (``error_below``: a restarted core-mode processor's error at its own
    seq 0): none, so the client's Last-Event-ID never goes back and a resume from it does not read the
    results again. Told by the order's flag, set when it was handed out, not by its ``next_seq`` now:
    results handed out together wait in the feed, and the traced path frames each on its own."""
    return None if result.error is not None and feed.order.error_below else result.seq


def meta_and_event(result: ResultInfo) -> bytes:
    return meta_frame(result) + sse.event(result.body, id=result.seq)


def meta_frame(result: ResultInfo) -> bytes:
    meta = {
        "seq": result.seq,
        "verdict": result.verdict.value if result.verdict else None,
        "error": shown_kind(result.error) if result.error is not None else None,
    }
    return sse.event(msgspec.json.encode(meta), event="meta")


def query_values(request: Request, name: str) -> list[str]:
    """``request.query_params.getlist(name)`` (``get`` is its last value), without parsing a query
    string the request does not have (a plain SSE open: building the empty QueryParams was ~1.5% of
    the edge's CPU in bursts)."""
    return request.query_params.getlist(name) if request.scope["query_string"] else []


def open_headers(scope: Scope) -> tuple[list[str], str | None, str]:
    """The headers an SSE open reads, in one pass over ``scope["headers"]``: every Authorization
    value, the Last-Event-ID (None without one; repeated lines joined with ", " as RFC 9110 section
    5.3 lets a recipient join them, which is no seq: a 400, where the first line was taken before
    2026-12-06 and a proxy reading the last saw another resume point) and the first Accept ("" without one), decoded
    as Starlette's ``Headers.getlist`` and ``get`` decode them (latin-1, names compared as they are
    in the scope, which ASGI servers give lower-cased). Starlette's ``Headers`` and three lookups
    were ~9 Python calls per open (docs/benchmarks.md, "SSE lifecycle")."""
    authorization: list[str] = []
    last_event_id: str | None = None
    accept: str | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization.append(value.decode("latin-1"))
        elif name == b"last-event-id":
            if last_event_id is None:
                last_event_id = value.decode("latin-1")
            else:
                last_event_id += ", " + value.decode("latin-1")
        elif name == b"accept":
            if accept is None:
                accept = value.decode("latin-1")
    return authorization, last_event_id, "" if accept is None else accept


def wants_unary(request: Request, accept: str | None = None) -> bool:
    """``?stream=false``, or an Accept header that asks for JSON and not for an event stream
    (``accept``: the request's, when the caller has read it already)."""
    stream = query_values(request, "stream")
    if stream:
        return stream[-1].lower() in ("false", "0", "no")
    if accept is None:
        accept = request.headers.get("accept", "")
    return "application/json" in accept and sse.MEDIA_TYPE not in accept


def cors_middleware(settings: EdgeSettings) -> list[Middleware]:
    """CORS for the ``--cors-origin`` pages only; none by default, so no ``Access-Control-*`` header is
    sent and another origin's page cannot read results through a visitor's browser (docs/security.md).
    Capabilities travel in ``Authorization`` (not cookies): credentials mode stays off."""
    origins = settings.cors_origins()
    if not origins:
        return []
    return [Middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Last-Event-ID", "Content-Type", "Accept"],
        expose_headers=["Streamproc-Results", "Streamproc-Join", "Streamproc-Error", "WWW-Authenticate"],
        max_age=600,
    )]


def create_app(settings: EdgeSettings, *, tracing: Tracing | None = FROM_ENVIRONMENT) -> Starlette:
    """The ASGI app. Raises :class:`UnknownFormat` for an unknown ``--format``, ``ConfigError`` for
    ``OTEL_*`` variables that name no installed exporter. ``tracing`` None turns tracing off."""
    if tracing is FROM_ENVIRONMENT:
        from ..tracing import from_environment

        tracing = from_environment("streamproc-edge")
    edge = Edge(settings, tracing)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if edge.source.nc is None:  # `streamproc edge` connects before serving; other ASGI servers here
            try:
                await edge.source.start()
            except StreamprocError as exc:  # NATS unreachable or refusing us, a mismatched stream
                app.state.startup_error = exc  # `streamproc edge` reports it in one line and exits 1
                await edge.source.stop()
                raise
        if edge.verifier is None:  # said at every start, not only on the page: it may not be a demo
            log_event(log, logging.WARNING, "insecure_demo", host=settings.host, port=settings.port,
                      problem="--insecure-demo: every request's results, /v1/recent and /v1/stats are "
                              "served to anyone who reaches this address, without a capability; "
                              "for local trials only")
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(edge.heap.run)
                yield
                edge.stop_streams()  # `streamproc edge` did this when the stop began (command.py)
                tasks.cancel_scope.cancel()
        finally:
            await edge.source.stop()
            if edge.tracing is not None:
                edge.tracing.shutdown()  # flush batched spans

    async def page(request: Request) -> Response:
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    async def script(request: Request) -> Response:
        name = request.path_params["name"] + ".js"
        if name not in PAGE_SCRIPTS:
            return Response("not found\n", status_code=404, media_type="text/plain")
        return FileResponse(PAGE_DIR / name, media_type="text/javascript", headers=PAGE_HEADERS)

    app = EdgeApp(
        middleware=cors_middleware(settings),
        routes=[
            Route("/", page),
            Route("/{name}.js", script),
            Route("/v1/results/{request_id}", edge.results),
            Route("/v1/recent", edge.recent),
            Route("/v1/info", edge.info),
            Route("/v1/experts", edge.experts, methods=["POST"]),
            Route("/v1/stats", edge.stats_json),
            Route("/healthz", edge.healthz),
            Route("/metrics", edge.metrics_text),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: router_refusal},
    )
    # No slash redirect: its Location is built from the Host header and repeats the query, so
    # /v1/recent/?access_token=<jwt> sent the token towards whatever host the request named.
    app.router.redirect_slashes = False
    app.state.edge = edge
    app.state.startup_error = None
    app.results_route = results_route(edge, settings)
    return app


RESULTS_PREFIX = "/v1/results/"
# HEAD takes GET's route (RFC 9110 section 9.3.2): through Starlette's router, which matches the
# decoded path, an id holding "/" (sent as %2F) was 404 on HEAD while GET served it.
_READS = ("GET", "HEAD")


class EdgeApp(Starlette):
    """Starlette, with ``GET /v1/results/{request_id}`` (and HEAD) answered before its middleware and router.

    Every SSE open went through ServerErrorMiddleware, ExceptionMiddleware, the router's match of
    each route's regex and ``request_response``'s exception wrapper, and every event's ASGI send
    through two ``send`` wrappers (docs/benchmarks.md, "SSE open"). This route is what the edge
    exists for, so it is dispatched here; the same ``Edge.results`` answers it, behind the same
    CORS middleware when ``--cors-origin`` is set. HEAD takes the same route (RFC 9110 section
    9.3.2; Uvicorn sends no body for it), so it answers what GET answers, an id holding ``/`` included.
    Any other path, method or shape (a slash in the path after the prefix) goes through Starlette as
    before. A request id may hold ``/`` (the
    wire rule allows it): sent as ``%2F`` (``encodeURIComponent``, ``quote(id, safe="")``) it is one
    path segment, read from ``raw_path`` (Uvicorn decodes ``scope["path"]``, where it looked like two
    segments and got 404). An exception still reaches Uvicorn, which answers 500 and logs it, as
    ServerErrorMiddleware re-raising did."""

    results_route: Callable[[Scope, Receive, Send], Awaitable[None]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.results_route is not None and scope["type"] == "http" and scope["method"] in _READS:
            path = route_path(scope)
            if path.startswith(RESULTS_PREFIX):
                request_id = path[len(RESULTS_PREFIX):]
                if request_id and ("/" not in request_id or _one_raw_segment(scope, request_id)):
                    scope["app"] = self
                    scope["path_params"] = {"request_id": request_id}
                    await self.results_route(scope, receive, send)
                    return
        if scope["type"] == "http" and carries_access_token(scope.get("query_string", b"").decode("latin-1")):
            send = no_store(send)
        await super().__call__(scope, receive, send)


def no_store(send: Send) -> Send:
    """``send`` with every answer saying ``Cache-Control: no-store`` (any other ``Cache-Control`` out).
    For the routes Starlette answers to a URL carrying ``?access_token=``: the page, its scripts,
    ``/healthz`` and ``/metrics`` are open and cacheable, but a pasted ``/?access_token=<jwt>`` (the docs
    say ``#access_token=``) was cached with its URL, token included (RFC 6750 section 2.3). The results
    route is not wrapped (its answers say :data:`PRIVATE` themselves; a wrapped ``send`` would turn the
    fan-out's direct writes off)."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = [(name, value) for name, value in message.get("headers", ())
                       if name.lower() != b"cache-control"]
            message = {**message, "headers": [*headers, (b"cache-control", b"no-store")]}
        await send(message)

    return sending


def _one_raw_segment(scope: Scope, request_id: str) -> bool:
    """Whether the id's slashes were sent encoded (``%2F``): the raw path ends in one segment after
    the prefix that decodes to ``request_id``."""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes):
        return False
    segment = raw.rpartition(b"/")[2].decode("latin-1")
    return unquote(segment) == request_id


def route_path(scope: Scope) -> str:
    """The path the router matches: without ``root_path`` when it is a prefix of the path (what
    Starlette 1.x's private ``starlette._utils.get_route_path`` does, kept here, not imported)."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def results_route(edge: Edge, settings: EdgeSettings) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``Edge.results`` as a bare ASGI app (what ``starlette.routing.request_response`` makes of it,
    without its exception wrapper: the edge raises no HTTPException), behind the CORS middleware."""

    async def results(scope: Scope, receive: Receive, send: Send) -> None:
        response = await edge.results(Request(scope, receive, send))
        await response(scope, receive, send)

    app: Callable[[Scope, Receive, Send], Awaitable[None]] = results
    for middleware in reversed(cors_middleware(settings)):
        cls, args, kwargs = middleware
        app = cls(app, *args, **kwargs)
    return app
