"""A TCP proxy in front of a real nats-server that can hold one client publish back: a slow request.

:class:`HoldingProxy` relays a client's connection to the server byte for byte, except that, once
armed, the next ``PUB``/``HPUB`` whose subject its predicate picks (``every``: each one) is kept back
until the test releases it (or ``hold_at_most`` passes); every later frame overtakes it. To the client this is a
request the server is slow to answer (a JetStream store taking its time): its reply comes when the
held frame reaches the server. ``rewrite`` (:class:`PullAnswered`) changes a client frame
before it is relayed. The server's side is relayed untouched, unless ``stall_after`` picks the subject
of a message it delivers (``MSG``/``HMSG``): that one is relayed, then nothing more of the server's side
for ``stall_for`` seconds (a server that goes quiet mid-read), then the rest.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Callable

import anyio
from anyio.abc import SocketStream


class HoldingProxy:
    def __init__(self, upstream_port: int, hold: Callable[[bytes], bool], *, hold_at_most: float = 5.0,
                 every: bool = False, rewrite: Callable[[bytes], bytes] | None = None,
                 stall_after: Callable[[bytes], bool] | None = None, stall_for: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self._stall_after = stall_after  # the first server message it picks stalls the server's side
        self.stall_for = stall_for
        self.stalled = anyio.Event()  # set when the server's side stalls
        self._rewrite = rewrite  # each complete client frame passes through it first
        self._hold = hold
        self.hold_at_most = hold_at_most
        # Armed for good: every publish the predicate picks is held (a request nobody answers within
        # ``hold_at_most``), not the next one only.
        self.every = every
        self.port = 0
        self._armed = False
        self.held = anyio.Event()  # set when a frame is being held
        self._release = anyio.Event()
        self.held_subject = b""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def arm(self) -> None:
        """Hold the next publish the predicate picks."""
        self._armed = True

    def release(self) -> None:
        self._release.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator["HoldingProxy"]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, self._relay, tg)
                try:
                    yield self
                finally:
                    self._release.set()
                    tg.cancel_scope.cancel()

    async def _relay(self, client: SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", self.upstream_port) as server:
            lock = anyio.Lock()  # one frame at a time towards the server (a held one goes out later)

            async def down() -> None:
                buffer = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for data in server:
                        if self._stall_after is None or self.stalled.is_set():
                            await client.send(data)
                            continue
                        buffer += data
                        while (frame := _next_frame(buffer))[0] is not None:
                            whole, subject = frame
                            buffer = buffer[len(whole):]
                            await client.send(whole)
                            if subject is not None and self._stall_after(subject):
                                self.stalled.set()
                                await anyio.sleep(self.stall_for)
                                if buffer:
                                    await client.send(buffer)
                                break
                tg.cancel_scope.cancel()

            async def send(frame: bytes) -> None:
                async with lock:
                    await server.send(frame)

            async def later(frame: bytes) -> None:
                with anyio.move_on_after(self.hold_at_most):
                    await self._release.wait()
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await send(frame)

            async def up() -> None:
                buffer = b""
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for data in client:
                        buffer += data
                        while True:
                            frame, subject = _next_frame(buffer)
                            if frame is None:
                                break
                            buffer = buffer[len(frame):]
                            if self._rewrite is not None:
                                frame = self._rewrite(frame)
                            if self._armed and subject is not None and self._hold(subject):
                                self._armed = self.every
                                self.held_subject = subject
                                self.held.set()
                                tg.start_soon(later, frame)
                            else:
                                await send(frame)
                tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(down)
                tg.start_soon(up)


def _next_frame(buffer: bytes) -> tuple[bytes | None, bytes | None]:
    """The first complete protocol frame in ``buffer`` and, for one with a payload (a client's PUB/HPUB,
    the server's MSG/HMSG: its last word is the payload's size), its subject."""
    end = buffer.find(b"\r\n")
    if end < 0:
        return None, None
    line = buffer[:end]
    words = line.split()
    op = words[0].upper() if words else b""
    if op not in (b"PUB", b"HPUB", b"MSG", b"HMSG"):
        return buffer[:end + 2], None
    total = end + 2 + int(words[-1]) + 2
    if len(buffer) < total:
        return None, None
    return buffer[:total], words[1]


class PullAnswered:
    """A :class:`HoldingProxy` ``rewrite``: the next ``times`` pulls (``PUB $JS.API.CONSUMER.MSG.NEXT.
    <stream>.<consumer> <reply>``; None: every one) are not relayed; each becomes a publish of a
    status message (``status``, e.g. ``b"409 Exceeded MaxWaiting"``) to the pull's reply subject, which
    the real server delivers to the client's inbox as it delivers its own statuses. What nats-server
    sends when its consumer's waiting queue is full, its leader changes or it shuts down, which a
    test cannot make it do at a chosen pull."""

    def __init__(self, status: bytes, times: int | None = None) -> None:
        self.header = b"NATS/1.0 " + status + b"\r\n\r\n"
        self.left = times
        self.answered = 0  # pulls answered so far with the status

    def __call__(self, frame: bytes) -> bytes:
        words = frame[:frame.find(b"\r\n")].split()
        if (self.left == 0 or len(words) != 4 or words[0].upper() != b"PUB"
                or not words[1].startswith(b"$JS.API.CONSUMER.MSG.NEXT.")):
            return frame
        if self.left is not None:
            self.left -= 1
        self.answered += 1
        size = len(self.header)
        return b"HPUB %s %d %d\r\n%s\r\n" % (words[2], size, size, self.header)
