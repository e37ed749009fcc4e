"""A replay (``follow(replay=True)``) whose NATS user lacks a JetStream right it needs fails at once,
naming the subject and the permission: nats-server drops a refused publish and says so only on the
connection (``-ERR 'Permissions Violation ...'``), so without looking there the reader waited out a
request's timeout (the stream lookup: ``nats: timeout``) or its own (a refused pull: ``TimeoutError
... (0 results received)``). Real nats-server, users denied one right each.
"""

from __future__ import annotations

import time

import anyio
import pytest
from edge_harness import publish_results
from helpers import connection

import streamproc
from streamproc import ReplayRefused, Subjects, follow
from streamproc.nats.streams import ensure_results_stream
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

SUBJECTS = Subjects("streamproc")
USERS = """
authorization {
  users = [
    {user: admin, password: admin}
    {user: noapi, password: noapi, permissions: {publish: {deny: ["$JS.API.>"]}}}
    {user: nocreate, password: nocreate, permissions: {publish: {deny: ["$JS.API.CONSUMER.CREATE.>"]}}}
    {user: nonext, password: nonext, permissions: {publish: {deny: ["$JS.API.CONSUMER.MSG.NEXT.>"]}}}
  ]
}
"""
REFUSED = {
    "noapi": ("$JS.API.STREAM.NAMES", "$JS.API.STREAM.NAMES"),
    "nocreate": ("$JS.API.CONSUMER.CREATE.STREAMPROC_RESULTS.", "$JS.API.CONSUMER.CREATE.STREAMPROC_RESULTS.>"),
    "nonext": ("$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.", "$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.>"),
}


@pytest.fixture(scope="module")
def server():
    with EmbeddedNats(config=USERS) as srv:
        yield srv


def as_user(server: EmbeddedNats, user: str) -> str:
    return server.url.replace("nats://", f"nats://{user}:{user}@")


@pytest.mark.parametrize("user", sorted(REFUSED))
async def test_a_replay_refused_a_jetstream_right_raises_at_once_naming_subject_and_permission(server, user):
    rid = f"refused-{user}"
    async with connection(as_user(server, "admin")) as admin:
        await ensure_results_stream(admin.jetstream(), SUBJECTS)
        await publish_results(admin, SUBJECTS, rid, [b"a", b"b", b"c"])
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await streamproc.connect(as_user(server, user), error_cb=on_error, allow_reconnect=False)
    try:
        started = time.monotonic()
        with pytest.raises(ReplayRefused) as refused:
            async with follow(nc, SUBJECTS, rid, timeout=8, replay=True) as results:
                async for _ in results:
                    raise AssertionError("nothing can be read")
        took = time.monotonic() - started
        assert not nc.is_closed  # a refusal does not cost the connection
    finally:
        await nc.close()
    subject, permission = REFUSED[user]
    assert refused.value.subject.startswith(subject), refused.value.subject
    assert refused.value.permission == permission
    assert subject in str(refused.value) and permission in str(refused.value), refused.value
    assert took < 2.0, f"the refusal took {took:.1f} s"
    assert any("permissions violation" in e for e in errors), errors


async def test_a_refused_replay_leaves_no_consumer_and_the_allowed_reader_replays(server):
    """The refused pull's consumer is deleted; the same history replays for a user with the rights."""
    rid = "refused-then-allowed"
    async with connection(as_user(server, "admin")) as admin:
        js = admin.jetstream()
        await ensure_results_stream(js, SUBJECTS)
        await publish_results(admin, SUBJECTS, rid, [b"x"] * 5)
        nc = await streamproc.connect(as_user(server, "nonext"), allow_reconnect=False)
        try:
            with pytest.raises(ReplayRefused):
                await follow(nc, SUBJECTS, rid, timeout=8, replay=True).collect()
        finally:
            await nc.close()
        with anyio.fail_after(10):
            while await js.consumers_info("STREAMPROC_RESULTS"):
                await anyio.sleep(0.1)
        got = await follow(admin, SUBJECTS, rid, timeout=8, replay=True).collect()
    assert [r.seq for r in got] == list(range(5))
