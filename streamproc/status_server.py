"""A very small HTTP/1.1 server for ``/metrics``, ``/healthz`` and ``/readyz`` of the processor.

The processor must not carry a web framework onto its hot path; scrapes are rare, tiny GETs.
Each connection gets one response and is closed. Requests are bounded (8 KiB of head, 5 s) so a
hostile client can hold nothing for long.
"""

from __future__ import annotations

import logging
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


class StatusServer:
    def __init__(self, host: str, port: int, routes: dict[str, Handler]) -> None:
        self.host = host
        self.port = port
        self.routes = routes

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen; ``task_status.started`` gets the bound port (useful with port 0)."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port, reuse_port=False)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        log_event(log, logging.INFO, "http_listening", host=self.host, port=port)
        task_status.started(port)
        async with listener:
            await listener.serve(self._handle)

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
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
