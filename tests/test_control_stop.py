"""Stopping the control plane (real nats-server, real ControlPlane): nothing is decided after it.

``stop`` answers the migrates already received for up to its timeout, then cancels the tasks still
answering. In durable mode a migrate awaits JetStream (the seal record) through nats-py, which awaits
each answer with ``asyncio.wait_for``: on Python 3.11 an answer that came in the cancel's loop pass
is returned and the cancel swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import AsyncIterator

import anyio
import anyio.abc
import nats
import pytest
from anyio.abc import SocketStream

from helpers import answered_with_the_cancel, wait_until
from streamproc.core.wire import MigrateError, MigrateErrorCode, MigrateRequest, Subjects, encode_control
from streamproc.nats.control import ControlPlane

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]


class RecordingTarget:
    """A target that owns and holds every request and records every migrate asked; ``waiting`` is set
    while the first one is held."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.waiting = asyncio.Event()

    def owns(self, request_id: str) -> bool:
        return True

    def holds(self, request_id: str) -> bool:
        return True

    @staticmethod
    def unknown(request_id: str) -> MigrateError:
        return MigrateError(request_id, MigrateErrorCode.UNKNOWN_REQUEST, "no chunk of this request has arrived")


class SlowFirstMigrate(RecordingTarget):
    """A target whose first migrate answers with the stop's cancel."""

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateError:
        self.asked.append(request.id or "")
        answer = self.unknown(request_id)
        if len(self.asked) == 1:
            return await answered_with_the_cancel(self.waiting, answer)
        return answer


async def test_a_migrate_waiting_behind_one_whose_answer_swallowed_the_stop_cancel_is_not_decided_after_the_stop(
        client: nats.aio.client.Client):
    """The serving task ran on into the request's next waiting migrate, sealing after the stop,
    against an input already stopping and a connection being closed (``migrate_failed`` errors)."""
    subjects = Subjects()
    target = SlowFirstMigrate()
    plane = ControlPlane(client, subjects, target)
    await plane.start()
    inbox = client.new_inbox()
    await client.subscribe(inbox + ".>")
    for n in ("first", "second"):
        await client.publish(subjects.migrate("r"), encode_control(MigrateRequest(id=n)), reply=f"{inbox}.{n}")
    await client.flush()
    await asyncio.wait_for(target.waiting.wait(), 10)
    await wait_until(lambda: len(plane._waiting.get("r", ())) == 1, 10, "the second migrate waiting its turn")
    serving = set(plane._tasks)
    assert len(serving) == 1
    await plane.stop(0.2)
    await asyncio.wait_for(asyncio.wait(serving), 5)
    await asyncio.sleep(0.1)
    assert target.asked == ["first"]


class HeldFirstMigrate(RecordingTarget):
    """A target whose first migrate waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateError:
        self.asked.append(request.id or "")
        if len(self.asked) == 1:
            self.waiting.set()
            await self.release.wait()
        return self.unknown(request_id)


async def test_a_migrate_waiting_behind_a_running_one_is_not_decided_after_a_stop_on_a_closed_connection(
        nats_url: str):
    """``stop`` returned at once when the connection was closed already (NATS lost, or closed
    before the stop) without marking the plane stopped or cancelling its tasks: the running migrate
    finished afterwards and the serving task went on to decide the request's next waiting one."""
    subjects = Subjects()
    target = HeldFirstMigrate()
    nc = await nats.connect(nats_url)
    asker = await nats.connect(nats_url)
    try:
        plane = ControlPlane(nc, subjects, target)
        await plane.start()
        for n in ("first", "second"):
            await asker.publish(subjects.migrate("r"), encode_control(MigrateRequest(id=n)),
                                reply=f"{asker.new_inbox()}.{n}")
        await asker.flush()
        await asyncio.wait_for(target.waiting.wait(), 10)
        await wait_until(lambda: len(plane._waiting.get("r", ())) == 1, 10, "the second migrate waiting its turn")
        serving = set(plane._tasks)
        await nc.close()
        await plane.stop(0.2)
        target.release.set()
        await asyncio.wait_for(asyncio.wait(serving), 5)
        await asyncio.sleep(0.1)
        assert target.asked == ["first"]
    finally:
        await asker.close()
        if not nc.is_closed:
            await nc.close()


_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError)
_SUB_LINE = re.compile(rb"(?:^|\r\n)(SUB )")
SUB_READ_LATE = 1.0  # seconds the proxy below holds a SUB (and, in order, all after it) back from the server


@contextlib.asynccontextmanager
async def sub_read_late(upstream_port: int) -> AsyncIterator[str]:
    """A TCP relay to a real nats-server that forwards a client's bytes in order but each ``SUB`` line
    ``SUB_READ_LATE`` s late (and the rest behind it): a server slow to read the connection's next
    segment, as a loaded 2-core machine can be. Its URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)

    async def relay(client: SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", upstream_port) as server:
            async def down() -> None:
                with contextlib.suppress(*_GONE):
                    async for data in server:
                        await client.send(data)

            async with anyio.create_task_group() as tg:
                tg.start_soon(down)
                with contextlib.suppress(*_GONE):
                    async for data in client:
                        while found := _SUB_LINE.search(data):
                            at = found.start(1)
                            if at:
                                await server.send(data[:at])
                            await anyio.sleep(SUB_READ_LATE)
                            end = data.find(b"\r\n", at)
                            end = len(data) if end < 0 else end + 2
                            await server.send(data[at:end])
                            data = data[end:]
                        if data:
                            await server.send(data)
                tg.cancel_scope.cancel()

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, relay, tg)
        try:
            yield f"nats://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        finally:
            tg.cancel_scope.cancel()


async def test_a_migrate_sent_from_another_connection_once_start_returned_is_heard_on_a_stock_client(
        nats_url: str):
    """``start`` flushed after subscribing so that a migrate sent once it returned is heard, but on a
    stock nats-py client (this file's other test hands it one) ``flush`` writes its PING ahead of the
    SUB still queued for the flusher (``Client._send_ping``: ``self._transport.write(PING_PROTO)``), so
    the PONG could come back before the server had the subscription, and a migrate published on
    another connection meanwhile went to nobody (that test's first migrate never reached ``waiting``
    within 10 s, once, in a full run). Here the server reads the SUB a second late."""
    subjects = Subjects()
    target = HeldFirstMigrate()
    async with sub_read_late(int(nats_url.rsplit(":", 1)[1])) as late_url:
        nc = await nats.connect(late_url, allow_reconnect=False)
        asker = await nats.connect(nats_url)
        try:
            plane = ControlPlane(nc, subjects, target)
            await plane.start()
            await asker.publish(subjects.migrate("r"), encode_control(MigrateRequest(id="first")),
                                reply=f"{asker.new_inbox()}.first")
            await asker.flush()
            await asyncio.wait_for(target.waiting.wait(), 2 * SUB_READ_LATE + 3)
            target.release.set()
            await plane.stop(1.0)
        finally:
            await asker.close()
            await nc.close()
