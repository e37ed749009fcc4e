"""Found by an attack on the shipped trust model (2026-12-04): nats-server answers a JetStream
request on whatever reply subject the requester names, and publishes that answer with JetStream's
own rights, not the requester's (nats-server ``client.go`` ``processInboundClientMsg`` checks the
publish subject against the user's permissions and the reply only against the reserved prefixes of
``isReservedReply``: ``_R_.``, ``$JS.ACK.``, ``$GNR.``). A worker may publish two subjects JetStream
answers, a chunk (its PubAck) and ``$JS.API.STREAM.NAMES``; naming ``streamproc.results.<id>``,
``$KV.STREAMPROC_CHUNKS_MIGRATIONS.r.<id>`` or ``$KV.STREAMPROC_CHUNKS_LEASES.m.<x>`` as the reply
had the results stream or a bucket store that answer: a worker wrote results, seal records and
lease members, none of which its user may publish. With fake lease members the processors shrink
their fair share and give up partitions: every request of those partitions goes unanswered.

The shipped file now puts the worker in an account of its own (``WORKERS``) that imports its two
subjects from ``STREAMPROC`` as services: nats-server replaces a request's reply with a ``_R_.``
subject that leads back into ``WORKERS``, so whatever reply a worker names stays in its account.
The edge's JetStream API requests (stream and consumer info, ``STREAM.MSG.GET``: an answer carrying
a stored result) were answered the same way; it is in an account ``EDGE`` of its own, importing its
API subjects as services and the results and its ordered consumers' deliveries as streams.
"""

from __future__ import annotations

import anyio
import nats
import nats.js.errors
import pytest
from conftest import processor_subprocess
from shipped_config import CONF, requests_unanswered_under_fake_lease_members, shipped_server, url

from streamproc.core.partitions import partition_of
from streamproc.core.wire import chunk_headers
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]
SUBJECTS = Subjects("streamproc")
LEASES, MIGRATIONS = "KV_STREAMPROC_CHUNKS_LEASES", "KV_STREAMPROC_CHUNKS_MIGRATIONS"


@pytest.fixture(scope="module")
def server():
    """The shipped configuration with every stream and bucket a durable processor creates."""
    with shipped_server(CONF.read_text()) as srv:
        with processor_subprocess(url(srv, "processor"), "--mode", "durable", "--partitions", "8",
                                  "--lease-ttl", "3"):
            pass
        yield srv


def targets(victim: str) -> dict[str, tuple[str, str]]:
    """Reply subjects a worker may not publish on, each with the stream that would store it."""
    return {
        SUBJECTS.result(victim): ("STREAMPROC_RESULTS", "a result"),
        f"$KV.STREAMPROC_CHUNKS_MIGRATIONS.r.{victim}": (MIGRATIONS, "a seal record"),
        f"$KV.STREAMPROC_CHUNKS_LEASES.m.fake-{victim}": (LEASES, "a lease member"),
    }


async def stored(nc, stream: str, subject: str) -> bytes | None:
    try:
        return (await nc.jetstream().get_last_msg(stream, subject)).data
    except nats.js.errors.NotFoundError:
        return None


# What each role may publish that JetStream answers: (subject, payload, headers).
ANSWERED = {
    "worker": [("$JS.API.STREAM.NAMES", b"", None),  # the JetStream API
               (SUBJECTS.chunk("reply-victim", "agg"), b'{"text":"x"}', chunk_headers("reply-victim", "agg", 0))],  # a PubAck
    "edge": [("$JS.API.INFO", b"", None), ("$JS.API.STREAM.NAMES", b"", None),
             ("$JS.API.STREAM.INFO.STREAMPROC_RESULTS", b"", None),
             ("$JS.API.STREAM.MSG.GET.STREAMPROC_RESULTS", b'{"last_by_subj":"streamproc.results.nothing"}', None),
             ("$JS.API.CONSUMER.INFO.STREAMPROC_RESULTS.nothing", b"", None)],
}


@pytest.mark.parametrize("role", sorted(ANSWERED))
async def test_no_worker_or_edge_gets_jetstream_to_store_its_answers_where_it_may_not_publish(server, role):
    victim = f"reply-victim-{role}"
    attacker = await nats.connect(url(server, role), allow_reconnect=False,
                                  inbox_prefix="_INBOX.streamproc.edge" if role == "edge" else "_INBOX")
    processor = await nats.connect(url(server, "processor"), allow_reconnect=False)
    try:
        for reply in targets(victim):
            for subject, payload, headers in ANSWERED[role]:
                await attacker.publish(subject, payload, reply=reply, headers=headers)
        await attacker.flush()
        await anyio.sleep(0.5)
        written = {what: data for reply, (stream, what) in targets(victim).items()
                   if (data := await stored(processor, stream, reply)) is not None}
        # The attacker's own requests still get their answers on its inbox.
        assert (await attacker.request("$JS.API.STREAM.NAMES", b"", timeout=5)).data.startswith(b'{"type"')
    finally:
        await attacker.close()
        await processor.close()
    assert written == {}, f"the {role} had JetStream write {sorted(written)}: {written}"


async def test_no_worker_stalls_partitions_by_having_jetstream_write_fake_lease_members(server):
    """Fake members in the lease bucket shrink the processor's fair share: with 8 partitions and 7
    fake members it serves one partition, and requests of the other seven wait in the chunk stream
    (the attack of tests/test_control_reply.py, by a worker through JetStream's answers instead of a
    frontend through the processor's)."""
    worker = await nats.connect(url(server, "worker"), allow_reconnect=False)

    async def fake_member(i: int) -> None:
        await worker.publish("$JS.API.STREAM.NAMES", b"", reply=f"$KV.STREAMPROC_CHUNKS_LEASES.m.fake-{i}")
        await worker.flush()

    try:
        missing, lease_log = await requests_unanswered_under_fake_lease_members(server, fake_member)
    finally:
        await worker.close()
    stalled = sorted({partition_of(rid, 8) for rid in missing})
    assert not missing, (f"{len(missing)} of 40 requests unanswered after 10 s (partitions {stalled}); "
                         f"the processor's lease log:\n{lease_log}")
