"""A very small HTTP/1.1 server for ``/metrics``, ``/healthz`` and ``/readyz`` of the processor.

The processor must not carry a web framework onto its hot path; scrapes are rare, tiny GETs.
Each connection gets one response and is closed. Requests are bounded (8 KiB of head, 5 s) so a
hostile client can hold nothing for long, and so are connections: at most :data:`MAX_CONNECTIONS`
are open at once, and a new one closes the oldest (answers are immediate, so the oldest is one that
has not sent its request: idle sockets cannot keep a health probe out), and a failed accept (no
descriptors left: EMFILE) backs off instead of ending the server, and with it the processor. Before,
400 idle connects to a processor limited to 256 descriptors made ``anyio``'s ``serve`` raise out of
the task group.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import anyio
import anyio.abc

from .logs import error_text, log_event

log = logging.getLogger("streamproc.http")

Handler = Callable[[], tuple[int, bytes, str]]  # -> status, body, content type
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 503: "Service Unavailable",
            500: "Internal Server Error"}
MAX_HEAD = 8192
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 64  # scrapes and probes are a few at a time
ACCEPT_BACKOFF = 0.1  # seconds to wait after a failed accept (asyncio's own servers wait 1 s)


class StatusServer:
    def __init__(self, host: str, port: int, routes: dict[str, Handler]) -> None:
        self.host = host
        self.port = port
        self.routes = routes
        self._open: OrderedDict[anyio.CancelScope, None] = OrderedDict()  # connections served, oldest first
        self.evicted = 0  # connections closed to make room for a new one (MAX_CONNECTIONS were open)
        self.accept_errors = 0

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen; ``task_status.started`` gets the bound port (useful with port 0)."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        log_event(log, logging.INFO, "http_listening", host=self.host, port=port)
        task_status.started(port)
        async with listener, anyio.create_task_group() as tg:
            for one in listener.listeners:  # one per address the host resolved to
                tg.start_soon(self._accept, one, tg)

    async def _accept(self, listener: anyio.abc.Listener[anyio.abc.SocketStream], tg: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ECONNABORTED: the next accept may work
                self.accept_errors += 1
                if self.accept_errors == 1 or self.accept_errors % 1000 == 0:
                    log_event(log, logging.WARNING, "http_accept_failed", error=error_text(exc),
                              failures=self.accept_errors)
                await anyio.sleep(ACCEPT_BACKOFF)
                continue
            if len(self._open) >= MAX_CONNECTIONS:
                self.evicted += 1
                self._open.popitem(last=False)[0].cancel()  # closed unanswered (_respond's async with)
            scope = anyio.CancelScope()
            self._open[scope] = None
            tg.start_soon(self._handle, stream, scope)

    async def _handle(self, stream: anyio.abc.SocketStream, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                await self._respond(stream)
        finally:
            self._open.pop(scope, None)

    async def _respond(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(READ_TIMEOUT):
                    head = b""
                    while b"\r\n\r\n" not in head and b"\n\n" not in head:
                        if len(head) > MAX_HEAD:
                            await self._send(stream, 400, b"request head too large\n", "text/plain")
                            return
                        head += await stream.receive(4096)
                    method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
                    path = target.split("?", 1)[0]
                    handler = self.routes.get(path)
                    if handler is None:
                        await self._send(stream, 404, b"not found\n", "text/plain")
                    elif method not in ("GET", "HEAD"):
                        await self._send(stream, 405, b"only GET\n", "text/plain")
                    else:
                        status, body, ctype = handler()
                        await self._send(stream, status, b"" if method == "HEAD" else body, ctype)
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    ConnectionError):
                return
            except Exception as exc:  # a bug in a handler must not take the processor down
                log_event(log, logging.ERROR, "http_handler_failed", error=error_text(exc), exc_info=True)
                await self._send(stream, 500, b"internal error\n", "text/plain")

    @staticmethod
    async def _send(stream: anyio.abc.SocketStream, status: int, body: bytes, ctype: str) -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
        await stream.send(head + body)
