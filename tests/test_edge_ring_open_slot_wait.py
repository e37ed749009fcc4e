"""With the ring and ``STREAM.MSG.GET`` refused, a late attach reads its history with consumers alone
(since 2026-12-06): past ``--max-replay-consumers`` it waits for one, and gets it when one is freed."""

from __future__ import annotations

import pytest
from edge_harness import publish_result, started_source
from helpers import connection, rid, wait_until
from nats_auth import MSG_GET, edge_user_denied

from streamproc.core.wire import ResultInfo
from streamproc.edge.feed import Ended
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

NO_STORED_READS = edge_user_denied(MSG_GET)


async def test_a_ring_late_attach_waiting_for_a_replay_consumer_gets_the_one_freed_and_its_whole_history():
    subjects = Subjects("slotwait")
    with EmbeddedNats(config=NO_STORED_READS) as server:
        url = server.url.replace("nats://", "nats://edge:edge@")
        async with connection(url) as nc, started_source(url, subjects, ensure_results_stream=True,
                                                         max_replay_consumers=1) as source:
            ids = [rid("holder"), rid("waiter")]
            for request_id in ids:
                for seq in range(3):
                    await publish_result(nc, subjects, request_id, seq, b'{"n":%d}' % seq, final=seq == 2,
                                         acked=True)
            await wait_until(lambda: source.fanout.delivered() >= 6, 10, "the ring read the histories")
            holder = await source.open(ids[0])
            first = await holder.next(10.0)
            assert isinstance(first, ResultInfo) and first.seq == 0  # the MSG.GET refusal found, a consumer made
            assert source.msg_get.state == "refused"
            waiter = await source.open(ids[1])
            assert await waiter.next(1.0) is None  # no consumer free: it waits
            assert source.metrics.replay_consumer_waits >= 1
            seqs = []
            while isinstance(item := await holder.next(5.0), ResultInfo):
                seqs.append(item.seq)
            assert isinstance(item, Ended) and seqs == [1, 2], (seqs, item)
            await holder.close()
            seqs = []
            while isinstance(item := await waiter.next(15.0), ResultInfo):
                seqs.append(item.seq)
            assert isinstance(item, Ended) and seqs == [0, 1, 2], (seqs, item)
            await waiter.close()
            await wait_until(lambda: source._replay_consumers_held() == 0 and not source._slot_waiters, 15,
                             "every replay consumer slot free")
            assert source.read_gate.out == 0
