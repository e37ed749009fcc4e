"""Stopping the control plane (real nats-server, real ControlPlane): nothing is decided after it.

``stop`` answers the migrates already received for up to its timeout, then cancels the tasks still
answering. In durable mode a migrate awaits JetStream (the seal record) through nats-py, which awaits
each answer with ``asyncio.wait_for``: on Python 3.11 an answer that came in the cancel's loop pass
is returned and the cancel swallowed.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

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
