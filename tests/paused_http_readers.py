"""SSE clients that ask for their streams, read nothing until told, then read them slowly: run as
a subprocess, so their reads load their own process and event loop, not the test's. A test that
timed the edge from the loop running 50 such readers measured that loop's stalls (up to 234 ms
beside two CPU burners) along with the edge's.

``python paused_http_readers.py URL ID...``: prints ``connected`` once every request is sent,
starts reading on a line on stdin, then prints one JSON line: each stream's body's SHA-256, in
the order of the IDs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys

import h11


async def paused_body(url: str, request_id: str, connected: asyncio.Queue[None], go: asyncio.Event) -> str:
    """A stream's body's SHA-256, read by a client that reads nothing until ``go`` is set."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, f"GET /v1/results/{request_id} HTTP/1.1\r\nHost: edge\r\n\r\n".encode())
        connected.put_nowait(None)
        await go.wait()
        parser, body = h11.Connection(h11.CLIENT), hashlib.sha256()
        parser.send(h11.Request(method="GET", target=f"/v1/results/{request_id}", headers=[("Host", "edge")]))
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                parser.receive_data(await loop.sock_recv(sock, 64 * 1024))
                await asyncio.sleep(0.002)
            elif isinstance(event, h11.Response):
                if event.status_code != 200:
                    return f"status {event.status_code}"
            elif isinstance(event, h11.Data):
                body.update(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return body.hexdigest()


async def main(url: str, ids: list[str]) -> None:
    loop = asyncio.get_running_loop()
    connected: asyncio.Queue[None] = asyncio.Queue()
    go = asyncio.Event()
    readers = [asyncio.ensure_future(paused_body(url, i, connected, go)) for i in ids]
    for _ in ids:
        await connected.get()
    print("connected", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    go.set()
    print(json.dumps(await asyncio.gather(*readers)), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
