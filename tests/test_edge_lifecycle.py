"""One SSE stream's lifecycle behind Uvicorn's httptools protocol (the edge's server): what an open
holds while it waits, and what ends it. ``EventStreamResponse`` is served here by a bare ASGI app,
without NATS: the open and close paths are the response's own."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvicorn
from helpers import wait_until

from streamproc.edge.app import EventStreamResponse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Served:
    """``EventStreamResponse`` over ``frames()`` at a real Uvicorn (httptools) on a free port."""

    def __init__(self, frames, sync_close: bool = False) -> None:
        self.frames = frames
        self.sync_close = sync_close  # on_close a plain function that finishes at once (returns None)
        self.closed: list[bool] = []  # each stream's on_close(completed)
        self.errors: list[BaseException] = []  # what the response raised (Uvicorn would log it)
        self.server: uvicorn.Server | None = None
        self.port = 0

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return

        async def on_close(completed: bool) -> None:
            self.closed.append(completed)

        def on_close_now(completed: bool) -> None:
            self.closed.append(completed)

        try:
            await EventStreamResponse(self.frames(), on_close_now if self.sync_close else on_close, 10.0,
                                      lambda: None)(scope, receive, send)
        except Exception as exc:
            self.errors.append(exc)
            raise

    async def __aenter__(self) -> Served:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, http="httptools", lifespan="off", interface="asgi3",
                                log_config=None, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        config.load()
        self.server.lifespan = config.lifespan_class(config)
        await self.server.startup()
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.should_exit = True
        for listening in self.server.servers:
            listening.close()
        await self.server.shutdown()

    async def open(self, head_extra: str = "", body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(f"GET /v1/results/x HTTP/1.1\r\nHost: edge\r\n{head_extra}\r\n".encode() + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 "), head
        return reader, writer

    async def closed_count(self, n: int) -> list[bool]:
        """``closed`` once it holds ``n`` (or after 10 s): bounded by time, not by 200 turns."""
        deadline = time.monotonic() + 10
        while len(self.closed) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.closed


async def never():
    await asyncio.Event().wait()
    yield b""


async def test_an_open_stream_holds_one_task_and_its_clients_disconnect_ends_it():
    """Behind Uvicorn's httptools protocol the connection's loss cancels the stream itself
    (direct.watch_disconnect): before, each open stream held a second task, a watcher blocked in
    ``receive()`` until ``http.disconnect`` (a task, its steps and a future per open and close)."""
    async with Served(never) as served:
        await asyncio.sleep(0.05)
        before = len(asyncio.all_tasks())
        streams = [await served.open() for _ in range(5)]
        await asyncio.sleep(0.05)
        held = len(asyncio.all_tasks()) - before
        for _, writer in streams:
            writer.close()
        assert held == 5  # Uvicorn's run_asgi per stream, nothing more
        assert await served.closed_count(5) == [False] * 5  # each ended as a disconnect, at once
        # their tasks end in a later loop pass: polled, not one 50 ms sleep (which a descheduled
        # process can spend in a single pass)
        await wait_until(lambda: len(asyncio.all_tasks()) <= before, 10, "the streams' tasks ended")
        assert len(asyncio.all_tasks()) == before


async def test_a_stream_that_ends_itself_is_completed_not_disconnected():
    async def one():
        yield b"data: x\n\n"

    async with Served(one) as served:
        reader, writer = await served.open("Connection: close\r\n")
        body = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert b"data: x" in body and body.endswith(b"0\r\n\r\n")
        assert await served.closed_count(1) == [True]


async def test_a_stream_whose_request_body_is_still_coming_is_ended_by_its_disconnect_too():
    """A request body not yet read: a watcher task reads and drops it, and sees the disconnect."""
    async with Served(never) as served:
        reader, writer = await served.open("Content-Length: 100\r\n", b"abc")
        writer.write(b"def")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        assert await served.closed_count(1) == [False]


@pytest.mark.parametrize("sync_close", [False, True], ids=["awaited", "at-once"])
async def test_on_close_runs_once_per_stream_whether_it_returns_something_to_await_or_not(sync_close):
    """The edge's on_close finishes at once for a stream read from the fan-out (ResultFeed.close_now):
    it returns None and nothing is awaited, no shielded cancel scope entered; one that returns a
    coroutine (an unsubscribe left) is awaited, shielded, as every on_close was."""
    async def one():
        yield b"data: x\n\n"

    async with Served(never, sync_close) as served:
        _, writer = await served.open()
        writer.close()
        assert await served.closed_count(1) == [False]
        await asyncio.sleep(0.05)
        assert served.errors == []
    async with Served(one, sync_close) as served:
        reader, writer = await served.open("Connection: close\r\n")
        await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert await served.closed_count(1) == [True]
        await asyncio.sleep(0.05)
        assert served.errors == []
