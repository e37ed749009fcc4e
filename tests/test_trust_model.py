"""The shipped nats-server configuration (deploy/nats-server.conf) enforces the trust model.

A real nats-server runs that file (ports and storage overridden by the test's flags). Each
component's credentials may do exactly its job: a worker cannot publish a result (the forgery of
issue 11), an edge cannot publish on any application subject, and the whole pipeline (processor in
durable mode, edge replaying from JetStream, worker traffic) works with nothing but those rights.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.request

import anyio
import httpx
import nats
import nats.errors
import pytest

from conftest import processor_subprocess, run_cli_process
from edge_harness import (expected_sse, publish_result, publish_results, read_slowly, running_edge,
                          sent_to_connection, started_source)
from helpers import connection, rid, wait_until
from shipped_config import CONF, runnable, shipped_server, url
from streamproc.nats.streams import ensure_results_stream
from streamproc.sim.embedded import EmbeddedNats
from streamproc.wire import Subjects

pytestmark = pytest.mark.nats


# The edge user's permission added for edge/replay.py; deployments set up before it lack this line.
MSG_GET_GRANT = '            "$JS.API.STREAM.MSG.GET.STREAMPROC_RESULTS",\n'


@pytest.fixture(scope="module")
def server():
    with shipped_server(CONF.read_text()) as srv:
        yield srv


@pytest.fixture(scope="module")
def server_before_msg_get():
    """The shipped file as it was before the edge read stored results by subject."""
    with shipped_server(config_before_msg_get()) as srv:
        yield srv


def config_before_msg_get() -> str:
    config = CONF.read_text()
    assert config.count(MSG_GET_GRANT) == 1  # the edge's line (the processor's shares a line)
    return config.replace(MSG_GET_GRANT, "")


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
async def test_the_edges_permission_errors_are_logged_at_a_bounded_rate(server, caplog):
    """nats-server reports each refused request on the connection (``-ERR 'Permissions Violation'``),
    and a refused permission is hit once per request that needs it, which any client can make: the
    edge logged one ``nats_error`` line each, without bound. Here the edge's own connection (as the
    edge user) publishes 100 times where it may not."""
    caplog.set_level(logging.WARNING, logger="streamproc.edge")
    async with started_source(url(server, "edge"), Subjects("streamproc"), recent=0) as source:
        for i in range(100):
            await source.nc.publish(f"streamproc.results.forbidden-{i}", b"{}")
        await source.nc.flush()  # its PONG comes after every -ERR
        await anyio.sleep(0.5)  # the error callbacks have run
        for i in range(25):  # other errors (a lost connection's) are not hidden by a flood of refusals
            await source._on_error(ConnectionRefusedError(f"connect call failed {i}"))
    lines = [r.getMessage() for r in caplog.records if "event=nats_error" in r.getMessage()]
    refused = [line for line in lines if "permissions violation" in line.lower()]
    assert 1 <= len(refused) <= 20, len(refused)  # the limiter's burst; the rest counted in one line later
    assert len([line for line in lines if "connect call failed" in line]) == 25


def test_an_edge_refused_the_results_streams_info_stops_at_start_up_with_one_clear_line():
    """An edge user without ``$JS.API.STREAM.INFO.STREAMPROC_RESULTS`` (a hand-made permission list):
    nats-server drops the request and it times out. The edge exited 1 with a traceback ending in
    "nats: timeout"; now with one line naming the likely cause."""
    grant = '"$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.STREAMPROC_RESULTS",'
    config = CONF.read_text()
    assert config.count(grant) == 1  # the edge's line
    with shipped_server(config.replace(grant, '"$JS.API.STREAM.NAMES",')) as srv:
        async def results_stream() -> None:
            async with connection(url(srv, "processor")) as nc:
                await ensure_results_stream(nc.jetstream(), Subjects("streamproc"))

        anyio.run(results_stream)
        proc = run_cli_process("edge", "--nats-url", url(srv, "edge"), "--insecure-demo", "--port", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "streamproc edge: error: cannot read or create the JetStream results stream at start-up" in proc.stderr, \
        proc.stderr
    assert "docs/security.md" in proc.stderr


def test_an_edge_asked_to_ensure_a_results_stream_without_jetstream_says_jetstream_is_off():
    with EmbeddedNats(jetstream=False) as srv:
        proc = run_cli_process("edge", "--nats-url", srv.url, "--insecure-demo", "--port", "0",
                               "--ensure-results-stream")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "JetStream is not enabled on nats-server" in proc.stderr, proc.stderr


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_a_migration_works_with_the_frontend_and_workers_holding_only_their_own_rights(server):
    """The serving layer (frontend user) asks for the migrate and reads results; the workers (worker
    user) publish both attempts; the durable processor seals in its migrations bucket and reads
    stored results back, all within the shipped permissions."""
    from streamproc.catalog import worker_for
    from streamproc.client.migration import MigrationError, Migrator
    from streamproc.client.results import ResultCollector
    from streamproc.core.events import MigrateErrorCode
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
                # Never seen anywhere: the processor also looks in its chunk stream (MSG.GET) first.
                with pytest.raises(MigrationError) as unknown:
                    await Migrator(frontend, subjects, format="sglang", timeout=5).seal("trust-never-seen")
        finally:
            await workers.close()
            await frontend.close()
        log = processor_log.read_text()
    for m in migrations:
        assert verify_migration(m, results[m.request_id], worker) == [], (m.request_id, log)
    assert "Permissions Violation" not in log and "nats_error" not in log, log
    assert "seal_list_unreadable" not in log, log  # taking partitions lists the seal records
    assert unknown.value.code is MigrateErrorCode.UNKNOWN_REQUEST, unknown.value


@pytest.mark.anyio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spy_role", ["worker", "frontend"])
async def test_no_worker_reads_a_migrates_sealed_reply_and_no_frontend_reads_a_workers_puback(server, spy_role):
    """A sealed reply lists the token ids a client was sent: another user's answer. Until 2026-12-04
    the Migrator asked on its connection's inbox (``_INBOX.<nuid>``), and the shipped file let a
    worker subscribe to ``_INBOX.>`` (for its PubAcks): a worker spying there read every sealed
    reply, and a frontend spying there every worker's PubAck. The Migrator now asks on
    ``_INBOX.frontend.<token>``, denied to workers, and the frontend may subscribe to that alone.
    The same attack found the request ids of the seal records (a processor taking partitions lists
    them, delivered to its inbox with ``$KV.…`` subjects, which no deny named): a second processor
    starts while the spy listens, and the workers are denied ``$KV.>`` too."""
    from streamproc.catalog import worker_for
    from streamproc.client.results import ResultCollector
    from streamproc.sim.migration import plan_migrations, run_migration

    subjects, worker = Subjects("streamproc"), worker_for("sglang")
    seen: list[tuple[str, bytes]] = []

    async def note(msg) -> None:
        seen.append((msg.subject, msg.data))

    flags = ("--mode", "durable", "--format", "sglang", "--partitions", "2")
    spy, spy_errors = await connect(server, spy_role)
    try:
        await spy.subscribe("_INBOX.>", cb=note)
        await spy.flush()
        with processor_subprocess(url(server, "processor"), *flags):
            workers = await nats.connect(url(server, "worker"))
            frontend = await nats.connect(url(server, "frontend"))
            try:
                async with ResultCollector(frontend, subjects) as collector:
                    migrations = plan_migrations(seed=7, id_prefix=f"spied-{spy_role}")
                    for m in migrations:
                        await run_migration(workers, subjects, m, format="sglang", worker=worker,
                                            collector=collector, timeout=20, control=frontend)
                    await collector.wait_for([m.request_id for m in migrations], timeout=20)
            finally:
                await workers.close()
                await frontend.close()
        with processor_subprocess(url(server, "processor"), *flags) as (_, log):  # lists the seal records
            await wait_until(lambda: "lease_acquired" in log.read_text(),
                             20, "the second processor took its partitions")
            await anyio.sleep(0.5)
        await spy.flush()
    finally:
        await spy.close()
    sealed = [subject for subject, data in seen if b'"status":"sealed"' in data]
    pubacks = [subject for subject, data in seen if b'"stream":"STREAMPROC_CHUNKS"' in data]
    records = [subject for subject, _ in seen if subject.startswith("$KV.")]
    assert migrations and not sealed and not pubacks and not records, (
        f"a {spy_role} on _INBOX.> read {len(sealed)} sealed replies, {len(pubacks)} PubAcks and "
        f"{len(records)} seal records: {seen[:4]}")
    if spy_role == "frontend":  # refused outright, with a clear error, rather than filtered
        assert any("permissions violation" in e.lower() for e in spy_errors), spy_errors


async def sse_bytes(edge, request_id: str, publish) -> bytes:
    """Open the SSE stream, run ``publish`` once the headers came, return every byte received."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:
        async with client.stream("GET", f"/v1/results/{request_id}") as response:
            assert response.status_code == 200, await response.aread()
            await publish()
            return await response.aread()


def config_before_pulls() -> str:
    """The shipped file as it was before the edge pulled a late attach's history: no
    CONSUMER.MSG.NEXT export, import or permission for the edge."""
    config = CONF.read_text()
    lines = [line for line in config.splitlines(keepends=True)
             if "MSG.NEXT.STREAMPROC_RESULTS.>\", accounts" not in line
             and "subject: \"$JS.API.CONSUMER.MSG.NEXT" not in line]
    before = "".join(lines).replace(', "$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.>"', "")
    assert before.count("MSG.NEXT") == 1 and before != config  # only a comment names it now
    return before


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", ["shipped", "before-pulls"])
async def test_a_slow_late_attach_through_the_shipped_config_is_sent_its_history_about_once(config):
    """The edge's account pulls a late attach's history (CONSUMER.MSG.NEXT, exported with
    response_type stream: one pull, several deliveries) sized by --stream-buffer-bytes, so a client
    slower than NATS is sent each result about once (1.64-1.94 x with the push consumers the pause
    stopped, at this 1 MiB bound). An edge user set up before it is refused the pull: the edge says
    so once and reads with push consumers, as before, and its client still gets every result."""
    subjects = Subjects("streamproc")
    request_id = rid(f"late-{config}")
    body = b'{"text":"' + b"x" * (64 * 1024 - 12) + b'"}'
    results = 400  # 25 MiB stored
    with shipped_server(CONF.read_text() if config == "shipped" else config_before_pulls()) as srv:
        processor = await nats.connect(url(srv, "processor"), allow_reconnect=False)
        try:
            await ensure_results_stream(processor.jetstream(), subjects)
            with running_edge(url(srv, "edge"), "--stream-buffer-bytes", str(1 << 20)) as edge:
                await publish_results(processor, subjects, request_id, [body] * results, flush_every=8)
                await wait_until(lambda: edge.metrics()["streamproc_edge_results_seen_total"] >= results, 15,
                                 "stored and seen")
                _, before = sent_to_connection(srv.monitor_url, "streamproc-edge")
                async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client, \
                        client.stream("GET", f"/v1/results/{request_id}") as response:
                    assert response.status_code == 200
                    received = await read_slowly(response)
                _, after = sent_to_connection(srv.monitor_url, "streamproc-edge")
                metrics, log = edge.metrics(), edge.log()
        finally:
            await processor.close()
    assert received == expected_sse([body] * results), received[-300:]
    assert metrics["streamproc_edge_streams_overrun_total"] == 0
    sent = (after - before) / (results * len(body))
    print(f"{config}: the server sent the edge {sent:.2f} x the history")
    if config == "shipped":
        assert sent < 1.1, sent
        assert metrics["streamproc_edge_replay_pauses_total"] == 0
        assert "replay_pulls_refused" not in log and "nats_error" not in log, log
    else:
        assert log.count("event=replay_pulls_refused") == 1, log
        assert "nats_error" not in log and "cannot read the results stream" not in log, log


@pytest.mark.anyio
@pytest.mark.timeout(90)
async def test_an_edge_without_the_msg_get_permission_serves_whole_streams_with_a_consumer_each(
        server_before_msg_get):
    """An edge user of the earlier permission set may not publish $JS.API.STREAM.MSG.GET: the edge
    says so once, reads each JetStream stream's history before the open with consumers in the read
    budget, then live from the ring (since 2026-12-06; before, an ordered consumer of its own from
    the stream's start), and a core-mode edge never asks for it."""
    srv, subjects = server_before_msg_get, Subjects("streamproc")
    processor = await nats.connect(url(srv, "processor"))
    try:
        # Core mode first (no results stream yet): live results, nothing to read by subject.
        with running_edge(url(srv, "edge")) as edge:
            live = rid("core")

            async def publish_live() -> None:
                for seq in range(3):
                    await publish_result(processor, subjects, live, seq, b'{"n":%d}' % seq, final=seq == 2)
                await processor.flush()

            body = await sse_bytes(edge, live, publish_live)
            assert body == expected_sse([b'{"n":%d}' % seq for seq in range(3)])
            assert "stored_results_unreadable" not in edge.log() and "nats_error" not in edge.log(), edge.log()

        await ensure_results_stream(processor.jetstream(), subjects)
        before, during = rid("before"), rid("during")
        for seq in range(2):  # stored before the edge starts
            await publish_result(processor, subjects, before, seq, b'{"b":%d}' % seq)
        await processor.flush()
        with running_edge(url(srv, "edge")) as edge:
            await publish_result(processor, subjects, before, 2, b'{"b":2}')  # read by the ring, no stream open
            await processor.flush()
            for seq in range(2):
                await publish_result(processor, subjects, during, seq, b'{"d":%d}' % seq)
            await processor.flush()

            async def publish_rest(request_id: str, key: bytes, seqs: range):
                async def publish() -> None:
                    for seq in seqs:
                        await publish_result(processor, subjects, request_id, seq, b'{"%s":%d}' % (key, seq),
                                             final=seq == seqs[-1])
                    await processor.flush()
                return publish

            started = time.monotonic()
            body = await sse_bytes(edge, before, await publish_rest(before, b"b", range(3, 5)))
            assert body == expected_sse([b'{"b":%d}' % seq for seq in range(5)])
            # The refusal is read from the server's -ERR, not from the request's 5 s timeout.
            assert time.monotonic() - started < 4.0
            body = await sse_bytes(edge, during, await publish_rest(during, b"d", range(2, 4)))
            assert body == expected_sse([b'{"d":%d}' % seq for seq in range(4)])
            async with httpx.AsyncClient(base_url=edge.url, timeout=15) as client:  # unary: the whole answer
                response = await client.get(f"/v1/results/{before}?stream=false")
                assert response.status_code == 200 and b'{"b":4}' in response.content, response.content
                health = (await client.get("/healthz")).json()
            assert "STREAM.MSG.GET.STREAMPROC_RESULTS" in health.get("stored_results", ""), health
            metrics = edge.metrics()
            log = edge.log()
        assert metrics["streamproc_edge_stored_reads_refused"] == 1
        assert metrics["streamproc_edge_streams_fallback_total"] == 3
        assert log.count("event=stored_results_unreadable") == 1, log
        assert "$JS.API.STREAM.MSG.GET.STREAMPROC_RESULTS" in log and "docs/security.md" in log, log
        assert "nats_error" not in log and "cannot read the results stream" not in log, log
    finally:
        await processor.close()


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_edge_reads_by_subject_again_once_the_permission_is_granted_without_a_restart():
    """After a refusal the edge tries MSG.GET again every re-probe interval; once nats-server
    reloads the shipped file with the grant, the next open past the interval replays by subject."""
    subjects = Subjects("streamproc")
    with shipped_server(config_before_msg_get()) as srv:
        processor = await nats.connect(url(srv, "processor"))
        try:
            await ensure_results_stream(processor.jetstream(), subjects)
            ids = [rid("reprobe") for _ in range(3)]
            for request_id in ids:
                await publish_result(processor, subjects, request_id, 0, b'{"n":0}', final=True)
            await processor.flush()
            async with started_source(url(srv, "edge"), subjects) as source:
                access = source.msg_get
                assert access is not None
                access.reprobe = 0.5
                refused = await source.open(ids[0])
                assert (await refused.next(5.0)).body == b'{"n":0}'  # read with a consumer, in the budget
                assert refused.inbox is not None and access.state == "refused"  # dispatched: no own consumer
                assert source.metrics.stored_reads_refused == 1 and source.metrics.streams_fallback == 1
                await refused.close()
                conf = srv.log_path.parent / "server.conf"  # EmbeddedNats runs this file: the shipped one now
                conf.write_text(runnable(CONF.read_text()))
                os.kill(srv.pid, signal.SIGHUP)  # nats-server reloads its configuration file
                await wait_until(lambda: "Reloaded server configuration" in srv.log_path.read_text(), 10,
                                 "nats-server reloads its configuration")
                await anyio.sleep(access.reprobe)
                allowed = await source.open(ids[1])
                assert allowed.replay is not None  # the re-probe: read by subject
                assert (await allowed.next(5.0)).body == b'{"n":0}'
                assert access.state == "allowed" and source.metrics.stored_reads_refused == 0
                later = await source.open(ids[2])
                assert later.replay is not None and (await later.next(5.0)).body == b'{"n":0}'
                assert source.metrics.streams_fallback == 1
                for feed in (allowed, later):
                    await feed.close()
        finally:
            await processor.close()


@pytest.mark.anyio
async def test_a_reader_as_the_edge_user_replays_a_stored_request_and_the_frontend_is_refused_at_once(server):
    """``follow(replay=True)`` pulls from a consumer (``$JS.API.CONSUMER.MSG.NEXT``): the edge user
    (the role that reads stored results) may, through the EDGE account's import of the pulls; the
    frontend (no JetStream API right: in STREAMPROC a JetStream request of its own would be answered
    wherever it named, results included) gets ReplayRefused naming the stream lookup, not a timeout."""
    import streamproc
    from edge_harness import publish_results
    from streamproc import ReplayRefused, follow

    subjects, rid = Subjects("streamproc"), "trust-replay"
    async with connection(url(server, "processor")) as processor:
        await ensure_results_stream(processor.jetstream(), subjects)
        await publish_results(processor, subjects, rid, [b"r%d" % i for i in range(50)])
    edge = await streamproc.connect(url(server, "edge"), inbox_prefix="_INBOX.streamproc.edge", allow_reconnect=False)
    try:
        got = await follow(edge, subjects, rid, timeout=8, replay=True, max_buffered_bytes=64).collect()
    finally:
        await edge.close()
    assert [r.body for r in got] == [b"r%d" % i for i in range(50)]
    frontend = await streamproc.connect(url(server, "frontend"), inbox_prefix="_INBOX.frontend", allow_reconnect=False)
    try:
        started = time.monotonic()
        with pytest.raises(ReplayRefused) as refused:
            await follow(frontend, subjects, rid, timeout=8, replay=True).collect()
    finally:
        await frontend.close()
    assert refused.value.subject == "$JS.API.STREAM.NAMES", refused.value
    assert time.monotonic() - started < 2.0


def config_without_pull_import() -> str:
    """The shipped file with the edge user still allowed to publish CONSUMER.MSG.NEXT but its
    account without the import of it (a hand edit that dropped one line)."""
    config = CONF.read_text()
    lines = [line for line in config.splitlines(keepends=True) if "subject: \"$JS.API.CONSUMER.MSG.NEXT" not in line]
    without = "".join(lines)
    assert without != config and '"$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.>"' in without  # the grant stays
    return without


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_replay_whose_account_lacks_the_pull_import_is_refused_at_once_naming_the_import():
    """With the publish permission but without the import, nats-server answers a pull "no
    responders" (503). The reader took that for a consumer gone and made one again, pulled, got 503,
    without end (``timeout=None``: for ever; the first 503 also counted as a pull answered, which
    turned the refusal check off). Now a 503 before the consumer ever answered is the refusal it is."""
    from edge_harness import publish_results

    import streamproc
    from streamproc import ReplayRefused, follow

    subjects, rid = Subjects("streamproc"), "trust-no-import"
    with shipped_server(config_without_pull_import()) as server:
        async with connection(url(server, "processor")) as processor:
            js = processor.jetstream()
            await ensure_results_stream(js, subjects)
            await publish_results(processor, subjects, rid, [b"r%d" % i for i in range(5)])
            edge = await streamproc.connect(url(server, "edge"), inbox_prefix="_INBOX.streamproc.edge",
                                            allow_reconnect=False)
            try:
                started = time.monotonic()
                with anyio.fail_after(10), pytest.raises(ReplayRefused) as refused:
                    await follow(edge, subjects, rid, timeout=None, replay=True).collect()
                took = time.monotonic() - started
                assert not edge.is_closed
            finally:
                await edge.close()
            permission = "$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS.>"
            assert refused.value.permission == permission, refused.value
            assert refused.value.subject.startswith("$JS.API.CONSUMER.MSG.NEXT.STREAMPROC_RESULTS."), refused.value
            assert "no responders" in str(refused.value) and "import" in str(refused.value), refused.value
            assert took < 2.0, f"the refusal took {took:.1f} s"
            with anyio.fail_after(10):  # its consumer was deleted
                while await js.consumers_info("STREAMPROC_RESULTS"):
                    await anyio.sleep(0.1)
