"""The shipped nats-server configuration (deploy/nats-server.conf) enforces the trust model.

A real nats-server runs that file (ports and storage overridden by the test's flags). Each
component's credentials may do exactly its job: a worker cannot publish a result (the forgery of
issue 11), an edge cannot publish on any application subject, and the whole pipeline (processor in
durable mode, edge replaying from JetStream, worker traffic) works with nothing but those rights.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest

from conftest import processor_subprocess, run_cli_process
from edge_harness import running_edge
from streamproc.sim.embedded import EmbeddedNats

pytestmark = pytest.mark.nats

CONF = Path(__file__).parent.parent / "deploy" / "nats-server.conf"
PASSWORDS = {role: f"{role}-pw-{i}e7c" for i, role in enumerate(["worker", "processor", "edge", "frontend"])}


@pytest.fixture(scope="module")
def server():
    mp = pytest.MonkeyPatch()
    for role, password in PASSWORDS.items():
        mp.setenv(f"STREAMPROC_{role.upper()}_PASSWORD", password)  # nats-server reads them from its env
    try:
        # The test's flags choose ports and storage; everything else is the shipped file.
        config = CONF.read_text().replace("jetstream { store_dir: /data/jetstream }", "")
        assert config != CONF.read_text()
        with EmbeddedNats(config=config) as srv:
            yield srv
    finally:
        mp.undo()


def url(server: EmbeddedNats, role: str) -> str:
    return server.url.replace("nats://", f"nats://{role}:{PASSWORDS[role]}@")


async def connect(server: EmbeddedNats, role: str):
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url(server, role), error_cb=on_error, allow_reconnect=False)
    return nc, errors


async def attempt_publishes(server: EmbeddedNats, role: str, subjects: list[str]) -> tuple[list[str], list[str]]:
    """Publish once on each subject as ``role``; return what a processor-side observer received and
    the permission errors ``role`` got."""
    received: list[str] = []

    async def note(msg) -> None:
        received.append(msg.subject)

    observers = []
    for observer_role, subject in (("frontend", "streamproc.results.>"), ("processor", "streamproc.chunks.>")):
        observer, _ = await connect(server, observer_role)
        await observer.subscribe(subject, cb=note)
        await observer.flush()
        observers.append(observer)
    nc, errors = await connect(server, role)
    for subject in subjects:
        await nc.publish(subject, b"{}", headers={"Nats-Msg-Id": "forged.0", "Streamproc-Seq": "0"})
    await nc.flush()
    await anyio.sleep(0.3)
    await nc.close()
    for observer in observers:
        await observer.close()
    return received, errors


@pytest.mark.anyio
async def test_a_worker_can_publish_chunks_and_cannot_publish_a_result(server):
    received, errors = await attempt_publishes(server, "worker", ["streamproc.chunks.r1.agg",
                                                                  "streamproc.results.r1"])
    assert received == ["streamproc.chunks.r1.agg"]
    assert any("permissions violation" in e.lower() and "streamproc.results.r1" in e for e in errors), errors


@pytest.mark.anyio
async def test_a_worker_cannot_read_results_or_chunks(server):
    nc, errors = await connect(server, "worker")
    await nc.subscribe("streamproc.results.>")
    await nc.subscribe("streamproc.chunks.>")
    await nc.flush()
    await anyio.sleep(0.2)
    await nc.close()
    for subject in ("streamproc.results.>", "streamproc.chunks.>"):
        assert any("permissions violation for subscription" in e.lower() and subject in e for e in errors), errors


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["edge", "frontend"])
async def test_an_edge_or_frontend_cannot_publish_results_chunks_or_stream_changes(server, role):
    subjects = ["streamproc.results.r2", "streamproc.chunks.r2.agg", "$JS.API.STREAM.DELETE.STREAMPROC_RESULTS",
                "$JS.API.STREAM.PURGE.STREAMPROC_RESULTS"]
    if role == "edge":
        subjects.append("streamproc.control.r2.migrate")
    received, errors = await attempt_publishes(server, role, subjects)
    assert received == []
    for subject in subjects:
        assert any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in errors), \
            (subject, errors)


def test_the_pipeline_works_with_each_component_holding_only_its_own_rights(server):
    with processor_subprocess(url(server, "processor"), "--mode", "durable", "--format", "sglang",
                              "--partitions", "2") as (_, processor_log):
        with running_edge(url(server, "edge"), "--format", "sglang") as edge:
            proc = run_cli_process("simulate", "--nats-url", url(server, "worker"), "--format", "sglang",
                                   "--requests", "4", "--mode", "mixed")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            deadline = time.monotonic() + 20
            while True:
                with urllib.request.urlopen(f"{edge.url}/v1/recent", timeout=5) as response:
                    recent = json.loads(response.read())
                entries = recent.get("requests", recent) if isinstance(recent, dict) else recent
                finished = [e for e in entries if e.get("final")]
                if len(finished) >= 4 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert len(finished) == 4, entries
            assert not any(e.get("error") for e in finished), finished
            # A late reader: the edge replays the request from the processor's results stream.
            rid = finished[0]["request_id"]
            with urllib.request.urlopen(f"{edge.url}/v1/results/{rid}?stream=false", timeout=10) as response:
                assert response.status == 200
                assert response.read()
            assert "nats_error" not in edge.log(), edge.log()
            assert "mode=durable" in processor_log.read_text()
            assert "nats_error" not in processor_log.read_text(), processor_log.read_text()


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_a_migration_works_with_the_frontend_and_workers_holding_only_their_own_rights(server):
    """The serving layer (frontend user) asks for the migrate and reads results; the workers (worker
    user) publish both attempts; the durable processor seals in its migrations bucket and reads
    stored results back, all within the shipped permissions."""
    from streamproc.catalog import worker_for
    from streamproc.client.results import ResultCollector
    from streamproc.core.wire import Subjects
    from streamproc.sim.migration import plan_migrations, run_migration, verify_migration

    subjects, worker = Subjects("streamproc"), worker_for("sglang")
    with processor_subprocess(url(server, "processor"), "--mode", "durable", "--format", "sglang",
                              "--partitions", "2") as (_, processor_log):
        workers = await nats.connect(url(server, "worker"))
        frontend = await nats.connect(url(server, "frontend"))
        try:
            async with ResultCollector(frontend, subjects) as collector:
                migrations = plan_migrations(seed=5, id_prefix="trust")
                for m in migrations:
                    await run_migration(workers, subjects, m, format="sglang", worker=worker, collector=collector,
                                        timeout=20, control=frontend)
                await collector.wait_for([m.request_id for m in migrations], timeout=20)
                results = dict(collector.results)
        finally:
            await workers.close()
            await frontend.close()
        log = processor_log.read_text()
    for m in migrations:
        assert verify_migration(m, results[m.request_id], worker) == [], (m.request_id, log)
    assert "Permissions Violation" not in log and "nats_error" not in log, log
    assert "seal_list_unreadable" not in log, log  # taking partitions lists the seal records
