"""A replay whose every pull is refused as asked (a ``409 Exceeded MaxRequest...`` status, even for one
result alone): the client's makes its consumer again a bounded number of times, then fails (a refusal
is no answer, so it must not reset the count of consumers made again in a row: ``PullState.renew``);
the edge's reads on by subject (``STREAM.MSG.GET``), as where pulls are not permitted. Real
nats-server; the account maps ``CONSUMER.MSG.NEXT`` to a responder that refuses every pull, as
nats-server's ``processNextMsgRequest`` does past a consumer's request limits."""

from __future__ import annotations

import anyio
import pytest
import httpx
from edge_harness import expected_sse, publish_results, running_edge
from helpers import connection

import streamproc
from streamproc import Subjects, follow
from streamproc.nats.replay_pull import REPLAY_RENEWALS_MAX
from streamproc.nats.streams import ensure_results_stream
from streamproc.sim.embedded import EmbeddedNats

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

SUBJECTS = Subjects("streamproc")
# Every pull reaches the refusing responder below instead of JetStream.
MAPPED = 'mappings = { "$JS.API.CONSUMER.MSG.NEXT.>": "refusing.next.>" }\n'
REFUSAL = {"Status": "409", "Description": "Exceeded MaxRequestExpires of 1s"}


@pytest.fixture(scope="module")
def server():
    with EmbeddedNats(config=MAPPED) as srv:
        yield srv


async def test_a_replay_whose_every_pull_is_refused_fails_after_a_bounded_number_of_consumers(server):
    rid = "every-pull-refused"
    pulls: list[str] = []
    async with connection(server.url) as admin:
        await ensure_results_stream(admin.jetstream(), SUBJECTS)
        await publish_results(admin, SUBJECTS, rid, [b"a", b"b", b"c"])

        async def refuse(msg) -> None:
            pulls.append(msg.subject)
            await admin.publish(msg.reply, b"", headers=REFUSAL)

        await admin.subscribe("refusing.next.>", cb=refuse)
        await admin.flush()
        nc = await streamproc.connect(server.url, allow_reconnect=False)
        try:
            with anyio.move_on_after(20) as waited:
                with pytest.raises(TimeoutError) as failed:
                    await follow(nc, SUBJECTS, rid, timeout=30, replay=True).collect()
        finally:
            await nc.close()
    assert not waited.cancelled_caught, f"still making consumers after 20 s: {len(pulls)} pulls refused"
    assert "Exceeded MaxRequestExpires" in str(failed.value), failed.value
    # two pulls per consumer (as asked, then one result alone), the first consumer and its renewals
    assert len(pulls) <= 2 * (REPLAY_RENEWALS_MAX + 1), len(pulls)


async def test_the_edge_reads_a_history_by_subject_when_every_pull_is_refused_even_alone(server):
    """A pull request limit every consumer meets (the account's ``max_request_batch`` below the edge's
    batch, say) refuses each pull even for one result: the edge's replay made its consumer again
    ``REPLAY_RENEWALS_MAX`` times and ended the stream with a timeout. Now it counts pulls as refused
    (``replay_pulls_refused``, with the limit's description) and reads the history by subject."""
    subjects = SUBJECTS  # (one results stream per server: STREAMPROC_RESULTS)
    rid = "edge-every-pull-refused"
    bodies = [b'{"text":"%d"}' % i for i in range(8)]
    pulls: list[str] = []
    async with connection(server.url) as admin:
        await ensure_results_stream(admin.jetstream(), subjects)
        await publish_results(admin, subjects, rid, bodies)

        async def refuse(msg) -> None:
            pulls.append(msg.subject)
            await admin.publish(msg.reply, b"", headers=REFUSAL)

        await admin.subscribe("refusing.next.>", cb=refuse)
        await admin.flush()
        with running_edge(server.url, "--prefix", subjects.prefix) as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
                response = await client.get(f"/v1/results/{rid}")
                assert response.status_code == 200
                assert response.content == expected_sse(bodies), (response.content[-300:], edge.log()[-2000:])
                # and a later replay reads by subject from the start: no more pulls
                asked = len(pulls)
                again = await client.get(f"/v1/results/{rid}")
                assert again.content == expected_sse(bodies)
                assert len(pulls) == asked
            log = edge.log()
    assert "event=replay_pulls_refused" in log and "Exceeded MaxRequestExpires" in log, log[-2000:]
    assert "max_request_batch" in log  # the hint names the limits, not the permission
    assert 0 < asked <= 2, asked  # as asked, then one result alone: refused even so
