"""The baseline for the edge (issue 14, target 2): a bare Starlette SSE relay.

``GET /v1/results/<request_id>`` subscribes to ``P.results.<request_id>`` (one core NATS
subscription per client, stock nats-py, flushed so it is live before the headers go out, as the
edge's core mode does) and yields each result as ``id: <seq>`` + ``data: <body>`` as it comes, then
``data: [DONE]`` after the final one: the least an SSE edge could do. No ordering, gap handling,
capabilities, buffer bounds, write timeouts, keep-alives or metrics. Served by Uvicorn with the
same settings as ``streamproc edge`` (httptools, access log through logging at WARNING).

Usage: python benchmarks/sse_relay.py --nats-url URL --prefix P --port N
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import nats
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


def build(nats_url: str, prefix: str) -> Starlette:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["nc"] = await nats.connect(nats_url)
        yield
        await state["nc"].close()

    async def results(request: Request) -> StreamingResponse:
        nc = state["nc"]
        sub = await nc.subscribe(f"{prefix}.results.{request.path_params['request_id']}")
        await nc.flush()

        async def frames():
            try:
                async for msg in sub.messages:
                    h = msg.headers or {}
                    yield b"id: " + h.get("Streamproc-Seq", "").encode() + b"\ndata: " + msg.data + b"\n\n"
                    if h.get("Streamproc-Final") == "true" or "Streamproc-Error" in h:
                        yield b"data: [DONE]\n\n"
                        return
            finally:
                await sub.unsubscribe()

        return StreamingResponse(frames(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return Starlette(routes=[Route("/v1/results/{request_id}", results),
                             Route("/healthz", lambda request: StreamingResponse(iter([b"ok"])))],
                     lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--prefix", default="streamproc")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config = uvicorn.Config(build(args.nats_url, args.prefix), host="127.0.0.1", port=args.port, lifespan="on",
                            http="httptools", access_log=True, log_config=None, log_level="warning",
                            timeout_graceful_shutdown=1)
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
