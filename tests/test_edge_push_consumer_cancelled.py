"""A budgeted push consumer (STREAM.MSG.GET and pulls refused) whose subscription is cancelled
while being made (042511d: ``add_consumer`` + ``subscribe_bind`` instead of ``js.subscribe``).

The reader's task runs in an anyio cancel scope (Starlette's task group for an SSE response), whose
cancellation is level-triggered: every await after the first CancelledError is cancelled again. The
except path of ``Replay._push_consumer`` awaits ``_delete`` before it gives back ``push_charge``, so
that give-back is skipped; and with ``sub`` None, ``Feed.close_now`` drops the replay without
``Replay.close`` (``Replay.close_now`` says there is nothing to drop): the read budget stays charged.
``subscribe_bind`` is made to suspend (as nats-py's ``nc.subscribe`` does when its pending buffer
forces a flush). Real nats-server.
"""

from __future__ import annotations

import anyio
import nats.errors
import pytest
from edge_harness import publish_result, ring_read_all, started_source
from helpers import connection, rid, wait_until
from nats_auth import MSG_GET, PULLS, edge_user_denied
from nats.js.client import JetStreamContext

from streamproc.edge import replay as replay_module
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.nats]

NO_MSG_GET_NOR_PULLS = edge_user_denied(MSG_GET, PULLS)


async def unanswered(*args, **kwargs):
    raise nats.errors.TimeoutError


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_push_consumer_cancelled_while_subscribing_gives_back_its_charge(anyio_backend, monkeypatch):
    subjects = Subjects("pushcancel")
    with EmbeddedNats(config=NO_MSG_GET_NOR_PULLS) as server:
        url = server.url.replace("nats://", "nats://edge:edge@")
        async with connection(url) as nc, started_source(url, subjects, ensure_results_stream=True) as source:
            other = rid("other")
            for seq in range(4):
                await publish_result(nc, subjects, other, seq, b'{"n":%d}' % seq)
            await nc.flush()
            await ring_read_all(source, nc)
            source.msg_get.refused("denied by the test's configuration")
            source.pulls.refused("denied by the test's configuration")
            monkeypatch.setattr(replay_module, "subject_split", unanswered)
            real_bind = JetStreamContext.subscribe_bind
            binding = anyio.Event()

            async def slow_bind(self, *args, **kwargs):
                binding.set()
                await anyio.sleep(30)  # a suspension inside nc.subscribe (a forced flush)
                return await real_bind(self, *args, **kwargs)

            monkeypatch.setattr(JetStreamContext, "subscribe_bind", slow_bind)
            feed = await source.open(rid("empty"))
            assert feed.replay is not None and feed.replay.by_consumer
            with anyio.move_on_after(5) as scope:  # the client leaves while the consumer is made
                async with anyio.create_task_group() as tg:
                    async def read():
                        await feed.next(10.0)

                    tg.start_soon(read)
                    await binding.wait()
                    tg.cancel_scope.cancel()
            assert not scope.cancelled_caught
            await feed.close()
            await wait_until(lambda: source.read_gate.out == 0, 5, "every charge given back")
