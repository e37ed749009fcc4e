"""What a hostile worker or frontend reads on every inbox it may subscribe to, while the whole
pipeline runs under the shipped configuration (deploy/nats-server.conf).

The processor's and the edge's inboxes carry more than API answers: pulled chunks, recovery lookups
and read-backs of stored results, KV gets and watches of the lease and migrations buckets (seal
records), ordered-consumer deliveries with their heartbeats and flow control, fast-batch flow acks
and PubAcks. nats-server filters a wildcard subscription's deliveries against a deny list by the
*message* subject, which for a JetStream delivery is the stored subject (nats-server ``client.go``
``deliverMsg``/``checkDenySub``), so each of those had to be denied by name while the worker shared
the processor's account; a frontend may subscribe to ``_INBOX.frontend.>`` only. Here a spy per role
subscribes to every inbox subject it may while a durable processor answers requests and migrates
(reading its history back), an edge serves a late reader from the stored results (STREAM.MSG.GET)
and follows the results with its ordered consumer, and a second processor takes partitions
(listing the seal records): the worker's spy must see nothing but PubAcks and stream lookups (its
own kind), the frontend's nothing but migrate replies.
"""

from __future__ import annotations

import json
import urllib.request

import anyio
import msgspec
import nats
import pytest
from conftest import processor_subprocess
from edge_harness import running_edge
from helpers import wait_until
from shipped_config import CONF, shipped_server, url

from streamproc.core.wire import chunk_headers, decode_migrate_reply
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server():
    with shipped_server(CONF.read_text()) as srv:
        yield srv


def foreign_to_a_worker(subject: str, data: bytes) -> bool:
    """Not an answer of the kind a worker gets for itself (a chunk PubAck, a stream lookup)."""
    return not (data.startswith(b'{"stream":"STREAMPROC_CHUNKS","seq":')
                or data.startswith(b'{"type":"io.nats.jetstream.api.v1.stream_names_response"'))


def foreign_to_a_frontend(subject: str, data: bytes) -> bool:
    """Not a migrate reply (what the frontend user asks for)."""
    try:
        decode_migrate_reply(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True
    return False


async def test_no_worker_or_frontend_spy_reads_anything_but_its_own_kind_of_reply(server):
    from streamproc.catalog import worker_for
    from streamproc.client.results import ResultCollector
    from streamproc.sim.migration import plan_migrations, run_migration

    subjects, worker = Subjects("streamproc"), worker_for("sglang")
    seen: dict[str, list[tuple[str, bytes]]] = {"worker": [], "frontend": []}
    spies = {"worker": (await nats.connect(url(server, "worker"), allow_reconnect=False), ["_INBOX.>"]),
             "frontend": (await nats.connect(url(server, "frontend"), allow_reconnect=False,
                                             inbox_prefix="_INBOX.frontend"), ["_INBOX.frontend.>"])}
    for role, (nc, patterns) in spies.items():
        for pattern in patterns:
            async def note(msg, role=role) -> None:
                seen[role].append((msg.subject, msg.data))

            await nc.subscribe(pattern, cb=note)
        await nc.flush()
    flags = ("--mode", "durable", "--format", "sglang", "--partitions", "2")
    try:
        with processor_subprocess(url(server, "processor"), *flags):
            with running_edge(url(server, "edge"), "--format", "sglang") as edge:
                workers = await nats.connect(url(server, "worker"))
                frontend = await nats.connect(url(server, "frontend"), inbox_prefix="_INBOX.frontend")
                try:
                    async with ResultCollector(frontend, subjects) as collector:
                        migrations = plan_migrations(seed=11, id_prefix="spies")
                        for m in migrations:
                            await run_migration(workers, subjects, m, format="sglang", worker=worker,
                                                collector=collector, timeout=20, control=frontend)
                        # A durable publish too: its PubAck is what the worker's spy may see (the control).
                        await workers.jetstream().publish(subjects.chunk("spies-durable", "agg"), b'{"text":"hi"}',
                                                          headers=chunk_headers("spies-durable", "agg", 0, final=True))
                        await collector.wait_for([m.request_id for m in migrations] + ["spies-durable"], timeout=20)
                finally:
                    await workers.close()
                    await frontend.close()
                for m in migrations:  # late readers: the edge reads the stored results (MSG.GET)
                    with urllib.request.urlopen(f"{edge.url}/v1/results/{m.request_id}?stream=false",
                                                timeout=10) as response:
                        assert response.status == 200 and response.read()
                with urllib.request.urlopen(f"{edge.url}/v1/recent", timeout=5) as response:
                    assert json.loads(response.read())  # the edge's ring followed the results
        with processor_subprocess(url(server, "processor"), *flags) as (_, log):  # lists the seal records
            await wait_until(lambda: "lease_acquired" in log.read_text(), 20, "the second processor took its partitions")
            await anyio.sleep(0.5)
        for nc, _ in spies.values():
            await nc.flush()
    finally:
        for nc, _ in spies.values():
            await nc.close()
    assert any(not foreign_to_a_worker(*m) for m in seen["worker"]), "the worker's spy saw no PubAck"
    assert any(not foreign_to_a_frontend(*m) for m in seen["frontend"]), "the frontend's spy saw no migrate reply"
    leaks = {role: [m for m in seen[role] if check(*m)]
             for role, check in (("worker", foreign_to_a_worker), ("frontend", foreign_to_a_frontend))}
    assert leaks == {"worker": [], "frontend": []}, {role: (len(found), found[:3]) for role, found in leaks.items()}
