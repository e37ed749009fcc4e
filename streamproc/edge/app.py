"""``streamproc edge``: results over HTTP as the SGLang server and Dynamo frame them.

Routes:

- ``GET /v1/results/{request_id}``: server-sent events, one ``data:`` frame per result body
  (``id:`` = the result's seq), ``data: [DONE]`` at the end; ``Last-Event-ID`` resumes after a
  seq. ``Accept: application/json`` or ``?stream=false`` waits for the final result and answers
  with one JSON body instead. ``?verdicts=1`` adds ``event: meta`` frames (seq, join verdict,
  error) before each result; the ``data`` of ordinary frames stays exactly the worker's bytes.
- ``GET /v1/recent``: request ids recently seen on ``P.results.>`` (for the page).
- ``POST /v1/experts``: the routed-experts matrix of one result body, decoded (``experts.py``).
- ``GET /v1/stats``: results seen and the processors' join latency, for the page's charts (``stats.py``).
- ``GET /``: the live page (its scripts: ``PAGE_SCRIPTS``). ``GET /healthz``, ``GET /metrics``.

Built on Starlette and served by Uvicorn; the stream response is the only custom piece, because
a client that goes away must free its NATS subscription at once, whatever the ASGI server's
disconnect semantics.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..catalog import Catalog
from ..core.codec import ERROR_STATUS as CORE_ERROR_STATUS
from ..core.codec import Codec, ErrorKind
from ..core.errors import StreamprocError
from ..logs import error_text, log_event
from ..core.wire import ResultInfo, Verdict, check_request_id
from . import sse
from ..metrics import CONTENT_TYPE, exposition, registry_for
from .metrics import EdgeCollector, EdgeMetrics
from .experts import MAX_BODY_BYTES, build_view
from .settings import EdgeSettings
from .source import Ended, Gap, Lost, ResultFeed, ResultSource
from .stats import StatsSource

log = logging.getLogger("streamproc.edge")

PAGE_DIR = Path(__file__).parent / "page"
PAGE_SCRIPTS = ("edge.js", "experts.js", "charts.js")

# HTTP status of a unary answer whose final result is an error (the Streamproc-Error header); the
# kinds the edge adds itself (a client's bad request) beside the processor's ErrorKind table.
ERROR_STATUS: dict[str, int] = {"invalid_request": 400, **CORE_ERROR_STATUS}
_VERDICT_RANK = {Verdict.PASSTHROUGH: 0, Verdict.JOINED: 1, Verdict.STITCHED: 2, Verdict.OMITTED: 3}


def error_response(message: str, kind: str, status: int) -> JSONResponse:
    """The edge's own refusals (bad id, too many streams, NATS down), before any result is read."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class EventStreamResponse(StreamingResponse):
    """An SSE response that races the client: on ``http.disconnect`` the frames stop at once.

    ``on_close(completed)`` runs after the stream, shielded from cancellation, so the NATS
    subscription is always released, also when the client vanished mid-wait.
    """

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]]) -> None:
        super().__init__(
            frames,
            media_type=sse.MEDIA_TYPE,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close
        self.completed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                        self.completed = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close(self.completed)


class Edge:
    """What the routes share: settings, counters, the NATS source and the folding codec."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.settings = settings
        self.metrics = EdgeMetrics()
        self.registry = registry_for(EdgeCollector(self.metrics))
        self.source = ResultSource(settings, self.metrics)
        self.codec: Codec = Catalog()(settings.format)  # an unknown format fails here, at start-up
        self.stats = StatsSource(self.metrics, settings.processor_metrics_urls(), sees_all_results=settings.recent > 0)
        # One expert view decodes at a time: a few open pages cannot multiply the decode memory.
        self.view_limiter = anyio.CapacityLimiter(1)

    # ------------------------------------------------------------------ routes

    async def results(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        try:
            check_request_id(request_id)
            after = sse.parse_last_event_id(request.headers.get("last-event-id"))
        except ValueError as exc:
            return error_response(str(exc), "invalid_request", 400)
        unary = wants_unary(request)
        if not self.source.connected:
            return error_response("the edge is not connected to NATS", "unavailable", 503)
        if self.metrics.streams_active >= self.settings.max_streams:
            self.metrics.streams_rejected += 1
            return error_response(
                f"too many concurrent result streams (limit {self.settings.max_streams}); retry later",
                "overloaded",
                503,
            )
        self.metrics.streams_active += 1
        self.metrics.streams_opened += 1
        try:
            feed = await self.source.open(request_id, after=None if unary else after)
        except Exception as exc:  # noqa: BLE001 - NATS refused the subscription: a clean 503, not a 500 page
            self.metrics.streams_active -= 1
            log_event(log, logging.WARNING, "subscribe_failed", request_id=request_id, error=error_text(exc))
            return error_response(f"cannot subscribe to results: {exc}", "unavailable", 503)
        if unary:
            self.metrics.unary_requests += 1
            try:
                return await self.unary_until_disconnect(request, feed)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.release(feed)
        verdicts = request.query_params.get("verdicts", "") in ("1", "true", "yes")

        async def on_close(completed: bool) -> None:
            if completed:
                self.metrics.streams_completed += 1
            else:
                self.metrics.client_disconnects += 1
            await self.release(feed)

        return EventStreamResponse(self.frames(feed, verdicts=verdicts), on_close)

    async def recent(self, request: Request) -> Response:
        return Response(msgspec.json.encode(self.source.recent.newest_first()), media_type="application/json")

    async def experts(self, request: Request) -> Response:
        """The routed-experts view of the result body in the request (the page posts what it received)."""
        try:
            offset = int(request.query_params.get("offset", "0"))
            rows = request.query_params.get("rows")
            rows_wanted = int(rows) if rows is not None else None
        except ValueError:
            return error_response("offset and rows must be integers", "invalid_request", 400)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return error_response(f"body over {MAX_BODY_BYTES} bytes", "invalid_request", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return error_response(f"body over {MAX_BODY_BYTES} bytes", "invalid_request", 413)
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            view = await anyio.to_thread.run_sync(
                lambda: build_view(self.codec, body, offset=offset, rows=rows_wanted), limiter=self.view_limiter
            )
        except ValueError as exc:  # msgspec.DecodeError is a ValueError too
            return error_response(f"not a result body: {exc}", "invalid_request", 400)
        return Response(msgspec.json.encode(view), media_type="application/json")

    async def stats_json(self, request: Request) -> Response:
        return Response(msgspec.json.encode(await self.stats.snapshot()), media_type="application/json")

    async def healthz(self, request: Request) -> Response:
        if self.source.connected:
            return JSONResponse({"status": "ok", "nats": "connected"})
        return JSONResponse({"status": "unavailable", "nats": "disconnected"}, status_code=503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(exposition(self.registry), headers={"Content-Type": CONTENT_TYPE})

    # --------------------------------------------------------------- streaming

    async def frames(self, feed: ResultFeed, *, verdicts: bool) -> AsyncIterator[bytes]:
        """SSE frames for one request: results in seq order, then ``[DONE]``; keep-alives meanwhile."""
        settings, metrics = self.settings, self.metrics
        idle_since = time.monotonic()
        while True:
            left = settings.result_timeout - (time.monotonic() - idle_since)
            item = await feed.next(min(settings.keepalive, max(left, 0.0)))
            if item is None:
                if time.monotonic() - idle_since >= settings.result_timeout:
                    metrics.result_timeouts += 1
                    yield sse.event(self.timeout_body(feed)) + sse.DONE
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
            if isinstance(item, Lost):
                yield sse.event(self.lost_body(feed, item)) + sse.DONE
                return
            idle_since = time.monotonic()
            frame = meta_frame(item) if verdicts else b""
            frame += sse.event(item.body, id=item.seq)
            metrics.sent(item)
            if item.final or item.error is not None:
                yield frame + sse.DONE
                return
            yield frame

    async def unary_until_disconnect(self, request: Request, feed: ResultFeed) -> Response:
        """The unary answer, unless the client leaves first: then its stream slot is freed at once."""
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
        """Wait for the final result; answer with the single result, or the codec's fold of the stream."""
        results: list[ResultInfo] = []
        idle_since = time.monotonic()
        while True:
            left = self.settings.result_timeout - (time.monotonic() - idle_since)
            item = await feed.next(max(left, 0.0)) if left > 0 else None
            if item is None:
                self.metrics.result_timeouts += 1
                return Response(self.timeout_body(feed), status_code=504, media_type="application/json")
            if isinstance(item, Gap):
                self.metrics.gaps += 1
                return Response(self.gap_body(feed, item), status_code=500, media_type="application/json")
            if isinstance(item, Lost):
                return Response(self.lost_body(feed, item), status_code=503, media_type="application/json")
            if isinstance(item, Ended):  # not reachable without a resume point; answer honestly anyway
                break
            idle_since = time.monotonic()
            self.metrics.sent(item)
            if item.error is not None:
                return Response(
                    item.body,
                    status_code=ERROR_STATUS.get(item.error, 500),
                    media_type="application/json",
                    headers={"Streamproc-Error": item.error},
                )
            results.append(item)
            if item.final:
                break
        verdict = max(
            (r.verdict for r in results if r.verdict is not None), key=_VERDICT_RANK.__getitem__, default=None
        )
        headers = {"Streamproc-Results": str(len(results))}
        if verdict is not None:
            headers["Streamproc-Join"] = verdict.value
        if len(results) == 1:
            return Response(results[0].body, media_type="application/json", headers=headers)
        try:
            body = await anyio.to_thread.run_sync(self.codec.fold, [r.body for r in results])
        except Exception as exc:  # noqa: BLE001 - a codec bug must not take the edge down
            log_event(log, logging.ERROR, "fold_failed", request_id=feed.request_id, exc_info=True)
            body = self.codec.error_body(f"cannot fold {len(results)} results: {exc}", ErrorKind.INTERNAL)
            return Response(body, status_code=500, media_type="application/json")
        return Response(body, media_type="application/json", headers=headers)

    def timeout_body(self, feed: ResultFeed) -> bytes:
        return self.codec.error_body(
            f"no result for request {feed.request_id} within {self.settings.result_timeout}s",
            ErrorKind.TIMEOUT,
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

    def lost_body(self, feed: ResultFeed, lost: Lost) -> bytes:
        return self.codec.error_body(
            f"the edge lost its subscription to request {feed.request_id}: {lost.reason}", ErrorKind.INTERNAL
        )

    async def release(self, feed: ResultFeed) -> None:
        self.metrics.streams_active -= 1
        await feed.close()


def meta_frame(result: ResultInfo) -> bytes:
    meta = {
        "seq": result.seq,
        "verdict": result.verdict.value if result.verdict else None,
        "error": result.error,
    }
    return sse.event(msgspec.json.encode(meta), event="meta")


def wants_unary(request: Request) -> bool:
    """``?stream=false``, or an Accept header that asks for JSON and not for an event stream."""
    stream = request.query_params.get("stream")
    if stream is not None:
        return stream.lower() in ("false", "0", "no")
    accept = request.headers.get("accept", "")
    return "application/json" in accept and sse.MEDIA_TYPE not in accept


def create_app(settings: EdgeSettings) -> Starlette:
    """The ASGI app. Raises :class:`UnknownFormat` for an unknown ``--format``."""
    edge = Edge(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if edge.source.nc is None:  # `streamproc edge` connects before serving; other ASGI servers here
            try:
                await edge.source.start()
            except StreamprocError as exc:  # NATS unreachable or refusing us, a mismatched stream
                app.state.startup_error = exc  # `streamproc edge` reports it in one line and exits 1
                await edge.source.stop()
                raise
        try:
            yield
        finally:
            await edge.source.stop()

    async def page(request: Request) -> Response:
        return FileResponse(PAGE_DIR / "index.html", media_type="text/html")

    async def script(request: Request) -> Response:
        name = request.path_params["name"] + ".js"
        if name not in PAGE_SCRIPTS:
            return Response("not found\n", status_code=404, media_type="text/plain")
        return FileResponse(PAGE_DIR / name, media_type="text/javascript")

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/{name}.js", script),
            Route("/v1/results/{request_id}", edge.results),
            Route("/v1/recent", edge.recent),
            Route("/v1/experts", edge.experts, methods=["POST"]),
            Route("/v1/stats", edge.stats_json),
            Route("/healthz", edge.healthz),
            Route("/metrics", edge.metrics_text),
        ],
        lifespan=lifespan,
    )
    app.state.edge = edge
    app.state.startup_error = None
    return app
