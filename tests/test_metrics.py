"""The processor's status server, scraped from real `streamproc run` processes: /metrics (read
from the stats structs at scrape time), /healthz (connected to NATS) and /readyz (subscribed, or
owning partitions in durable mode)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import anyio
import pytest
from conftest import CLI
from edge_harness import free_port, running_edge
from durable_helpers import durable_settings
from helpers import rid, scrape

from streamproc.catalog import worker_for
from streamproc.client.publisher import ChunkPublisher
from streamproc.client.results import ResultCollector
from streamproc.nats.processor import Processor
from streamproc.sim.embedded import EmbeddedNats
from streamproc.simulation import make_truth
from streamproc.wire import Subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.timeout(60)]

SUBJECTS = Subjects("streamproc")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextlib.asynccontextmanager
async def ready_core_processor():
    """A core-mode ``streamproc run`` subprocess with its status server, on its own nats-server
    (the tests stop and restart it); yields (server, status port) once ``/readyz`` answers 200."""
    port = free_port()
    with EmbeddedNats(jetstream=False) as server:
        proc = subprocess.Popen(
            [*CLI, "run", "--nats-url", server.url, "--mode", "core", "--http-port", str(port),
             "--http-host", "127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        try:
            await wait_for(lambda: _status(port, "/readyz") == 200, timeout=15)
            yield server, port
        finally:
            proc.terminate()
            proc.wait(10)


async def wait_for(check, timeout: float = 10.0):
    with anyio.fail_after(timeout):
        while not (value := check()):
            await anyio.sleep(0.05)
    return value


async def test_core_processor_metrics_count_verdicts_error_kinds_latency_and_buffers(client, streamproc_run):
    port = free_port()
    worker = worker_for("sglang")
    publisher = ChunkPublisher(client, SUBJECTS)
    with streamproc_run("--mode", "core", "--format", "sglang", "--http-port", str(port),
                        "--http-host", "127.0.0.1"):
        assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        assert get(f"http://127.0.0.1:{port}/readyz") == (200, "ok\n")
        before = scrape(port)
        assert before['streamproc_results_total{verdict="passthrough"}'] == 0

        async with ResultCollector(client, SUBJECTS) as collector:
            # aggregated, unary: passthrough
            await publisher.publish_leg("m-agg", "agg", worker.agg(make_truth(1), stream=False))
            # aggregated, streaming, not finished: its published body is retained for a migration
            open_body = worker.agg(make_truth(2), stream=True)[0]
            await publisher.publish("m-open", "agg", 0, open_body)
            # an invalid chunk: an error result of kind invalid_chunk
            await client.publish(SUBJECTS.chunk("m-bad", "agg"), b"x", headers={"Streamproc-Seq": "nope"})
            # P/D with the decode leg first: it waits for the prefill leg
            truth = make_truth(3)
            decode = worker.decode(truth, stream=False)
            await publisher.publish_leg("m-pd", "decode", decode)
            await collector.wait_for(["m-agg", "m-bad"], timeout=10)
            waiting = await wait_for(lambda: (m := scrape(port))["streamproc_buffered_bytes"] > 0 and m)
            assert waiting["streamproc_buffered_bytes"] == sum(map(len, decode))
            assert waiting["streamproc_retained_bytes"] == len(open_body)
            assert waiting["streamproc_inflight_requests"] == 2  # m-open and m-pd
            await anyio.sleep(0.3)
            await publisher.publish_leg("m-pd", "prefill", worker.prefill(truth, stream=False))
            await collector.wait_for(["m-pd"], timeout=10)

        after = await wait_for(lambda: (m := scrape(port))['streamproc_results_total{verdict="joined"}'] == 1 and m)
        assert after['streamproc_results_total{verdict="passthrough"}'] == 2
        assert after['streamproc_results_total{verdict="error"}'] == 1
        assert after['streamproc_error_results_total{kind="invalid_chunk"}'] == 1
        assert after["streamproc_buffered_bytes"] == 0
        assert after["streamproc_inflight_requests"] == 1  # m-open is still streaming
        # the P/D result waited >= 0.3 s for its prefill leg
        assert after["streamproc_join_wait_seconds_count"] == 1
        assert after['streamproc_join_wait_seconds_bucket{le="0.25"}'] == 0
        assert after["streamproc_join_wait_seconds_sum"] >= 0.3
        # three messages made results ready (agg, open, bad chunk's error, prefill) -> four observations
        assert after["streamproc_result_latency_seconds_count"] == 4
        assert after['streamproc_result_latency_seconds_bucket{le="+Inf"}'] == 4
        assert after["streamproc_chunks_total"] >= 4
        assert after["streamproc_nats_connected"] == 1 and after["streamproc_ready"] == 1


async def test_omissions_are_counted_by_reason_so_a_format_mismatch_shows(client, streamproc_run):
    """A processor started with ``--format sglang-zstd`` reading plain SGLang workers (no
    ``Streamproc-Format`` header) omits every P/D request's routed experts as ``prefill_corrupt``
    (it reads raw rows as zstd). Only ``omitted=N`` in the stop summary showed it (a newcomer's walk
    through the README); ``streamproc_omissions_total{reason}`` names the reason, once per request
    (streams too, whose results are omitted chunk by chunk)."""
    port = free_port()
    worker = worker_for("sglang")
    publisher = ChunkPublisher(client, SUBJECTS)
    with streamproc_run("--mode", "core", "--format", "sglang-zstd", "--http-port", str(port),
                        "--http-host", "127.0.0.1"):
        assert "streamproc_omissions_total" not in str(scrape(port))
        ids = [rid("mismatch") for _ in range(3)]
        async with ResultCollector(client, SUBJECTS) as collector:
            for n, request_id in enumerate(ids):  # one at a time: a running join holds the byte budget
                truth = make_truth(40 + n, output_len=6, request_id=request_id)
                await publisher.publish_leg(request_id, "prefill", worker.prefill(truth, stream=False))
                await publisher.publish_leg(request_id, "decode", worker.decode(truth, stream=n == 2))
                await collector.wait_for([request_id], timeout=10)
            results = await collector.wait_for(ids, timeout=10)
        assert all(r[-1].verdict == "omitted" and r[-1].error is None for r in results.values()), results
        assert len(results[ids[2]]) > 1  # the stream: several results, omitted chunk by chunk or at its end
        after = await wait_for(lambda: (m := scrape(port)).get('streamproc_omissions_total{reason="prefill_corrupt"}')
                               == 3 and m)
        assert {k: v for k, v in after.items() if k.startswith("streamproc_omissions_total")} == {
            'streamproc_omissions_total{reason="prefill_corrupt"}': 3}


async def test_durable_processor_is_ready_once_it_owns_partitions(client, streamproc_run):
    port = free_port()
    with streamproc_run("--mode", "durable", "--partitions", "2", "--http-port", str(port),
                        "--http-host", "127.0.0.1"):
        metrics = await wait_for(lambda: (m := scrape(port))["streamproc_durable_partitions"] == 2 and m)
        assert get(f"http://127.0.0.1:{port}/readyz") == (200, "ok\n")
        assert metrics["streamproc_ready"] == 1
        assert "streamproc_durable_redelivered_total" in metrics
        assert "streamproc_reconnects_total" in metrics


async def test_every_durable_processor_metric_has_a_help_text_that_says_more_than_its_name(client, streamproc_run):
    """A HELP line that only repeated the field's name ("chunks", "late") told an operator nothing:
    each counter's text now lives on the stats field that counts it (``Meta(description=...)``)."""
    port = free_port()
    with streamproc_run("--mode", "durable", "--partitions", "1", "--http-port", str(port),
                        "--http-host", "127.0.0.1"):
        await wait_for(lambda: scrape(port)["streamproc_durable_partitions"] == 1)
        _, text = get(f"http://127.0.0.1:{port}/metrics")
    helps = dict(line.removeprefix("# HELP ").split(" ", 1) for line in text.splitlines()
                 if line.startswith("# HELP streamproc"))
    assert len(helps) > 60
    bare = {name: help_text for name, help_text in helps.items()
            if help_text.replace(" ", "_") in name or len(help_text.split()) < 3}
    assert bare == {}


async def test_durable_metrics_pubacks_end_to_end_latency_and_every_redelivery(client, streamproc_run):
    """PubAck and chunk -> stored-result latency histograms count each stored result; a chunk
    JetStream delivers twice is counted as redelivered also when its request is known (no lookup)."""
    port = free_port()
    worker = worker_for("sglang")
    publisher = ChunkPublisher(client, SUBJECTS, durable=True)
    with streamproc_run("--mode", "durable", "--partitions", "1", "--ack-wait", "1", "--format", "sglang",
                        "--http-port", str(port), "--http-host", "127.0.0.1") as (proc, _):
        await wait_for(lambda: scrape(port)["streamproc_durable_partitions"] == 1)
        async with ResultCollector(client, SUBJECTS) as collector:
            ids = [f"d-{i}" for i in range(3)]
            for i, rid in enumerate(ids):
                await publisher.publish_leg(rid, "agg", worker.agg(make_truth(10 + i), stream=False))
            await collector.wait_for(ids, timeout=10)
        stored = await wait_for(lambda: (m := scrape(port))["streamproc_durable_result_latency_seconds_count"] == 3
                                and m)
        assert stored["streamproc_durable_puback_latency_seconds_count"] == 3
        assert 0 < stored["streamproc_durable_puback_latency_seconds_sum"] <= stored[
            "streamproc_durable_result_latency_seconds_sum"]
        assert stored['streamproc_durable_result_latency_seconds_bucket{le="+Inf"}'] == 3
        assert stored["streamproc_durable_redelivered_total"] == 0
        recoveries = stored["streamproc_durable_recoveries_total"]

        # Frozen past --ack-wait, the processor gets the same chunk twice (delivery 1, then 2) when it
        # wakes: the second copy's request is known (finished) by then, so no recovery lookup runs.
        proc.send_signal(signal.SIGSTOP)
        try:
            await publisher.publish_leg("d-late", "agg", worker.agg(make_truth(20), stream=False))
            await anyio.sleep(2.5)
        finally:
            proc.send_signal(signal.SIGCONT)
        after = await wait_for(lambda: (m := scrape(port))["streamproc_durable_redelivered_total"] >= 1
                               and m["streamproc_durable_result_latency_seconds_count"] == 4 and m)
        assert after["streamproc_durable_recoveries_total"] == recoveries


async def test_durable_processor_records_join_wait_and_result_latency_as_core_mode_does(client, nats_url,
                                                                                       streamproc_run):
    """The same P/D traffic as the core-mode test: the join wait and the chunk -> results handed to
    NATS latency (one observation per chunk that made results) are counted in durable mode too, and
    the edge's /v1/stats, which the live page charts, reads them from the processor's /metrics."""
    port = free_port()
    worker = worker_for("sglang")
    publisher = ChunkPublisher(client, SUBJECTS, durable=True)
    with streamproc_run("--mode", "durable", "--partitions", "1", "--format", "sglang",
                        "--http-port", str(port), "--http-host", "127.0.0.1"):
        await wait_for(lambda: scrape(port)["streamproc_durable_partitions"] == 1)
        async with ResultCollector(client, SUBJECTS) as collector:
            await publisher.publish_leg("dl-agg", "agg", worker.agg(make_truth(31), stream=False))
            truth = make_truth(32)
            await publisher.publish_leg("dl-pd", "decode", worker.decode(truth, stream=False))
            await wait_for(lambda: scrape(port)["streamproc_buffered_bytes"] > 0)  # the decode leg waits
            await anyio.sleep(0.3)
            await publisher.publish_leg("dl-pd", "prefill", worker.prefill(truth, stream=False))
            await collector.wait_for(["dl-agg", "dl-pd"], timeout=10)
        assert [r.verdict.value for r in collector.results["dl-pd"]] == ["joined"]
        stored = await wait_for(lambda: (m := scrape(port))["streamproc_durable_result_latency_seconds_count"] == 2
                                and m)
        assert stored["streamproc_join_wait_seconds_count"] == 1
        assert stored['streamproc_join_wait_seconds_bucket{le="0.25"}'] == 0
        assert stored["streamproc_join_wait_seconds_sum"] >= 0.3
        # two chunks made results (the aggregated one, the prefill leg that released the join)
        assert stored["streamproc_result_latency_seconds_count"] == 2
        assert stored['streamproc_result_latency_seconds_bucket{le="+Inf"}'] == 2
        assert 0 < stored["streamproc_result_latency_seconds_sum"] <= stored[
            "streamproc_durable_result_latency_seconds_sum"]  # handed to NATS before stored

        with running_edge(nats_url, "--processor-metrics-url", f"http://127.0.0.1:{port}/metrics") as edge:
            status, text = get(f"{edge.url}/v1/stats")
        assert status == 200, text
        stats = json.loads(text)
        assert stats["processors"] == [{"url": f"http://127.0.0.1:{port}/metrics", "ok": True, "error": None}]
        assert stats["join_wait"]["count"] == 1 and stats["join_wait"]["sum"] >= 0.3
        assert stats["result_latency"]["count"] == 2
        assert stats["processor_results"] == 2


@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_join_seconds_counts_every_join_and_the_page_stats_show_it(client, nats_url, streamproc_run, mode):
    """``streamproc_join_seconds`` (the codec join's own CPU time, on the loop or in the join thread)
    has one observation per P/D result, as ``streamproc_join_wait_seconds`` does; /v1/stats carries
    it beside the join wait for the page's chart."""
    port = free_port()
    worker = worker_for("sglang")
    publisher = ChunkPublisher(client, SUBJECTS, durable=mode == "durable")
    partitions = ["--partitions", "1"] if mode == "durable" else []
    with streamproc_run("--mode", mode, *partitions, "--format", "sglang", "--http-port", str(port),
                        "--http-host", "127.0.0.1"):
        await wait_for(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 200, timeout=15)
        ids = [f"js-{mode}-{i}" for i in range(4)]
        async with ResultCollector(client, SUBJECTS) as collector:
            for i, rid in enumerate(ids):
                truth = make_truth(40 + i)
                legs = [("prefill", worker.prefill(truth, stream=i < 2)), ("decode", worker.decode(truth, stream=i < 2))]
                for role, bodies in (legs if i % 2 else legs[::-1]):  # decode leg first: it waits, then joins
                    await publisher.publish_leg(rid, role, bodies)
            await collector.wait_for(ids, timeout=15)
        joins = sum(len(collector.results[rid]) for rid in ids)
        assert joins > len(ids)  # the streaming requests joined more than one result each
        assert all(r.verdict.value == "joined" for rid in ids for r in collector.results[rid])
        metrics = await wait_for(lambda: (m := scrape(port)).get("streamproc_join_seconds_count") == joins and m)
        assert metrics["streamproc_join_wait_seconds_count"] == joins
        assert metrics['streamproc_join_seconds_bucket{le="+Inf"}'] == joins
        assert 0 < metrics["streamproc_join_seconds_sum"] < 5 * joins
        assert metrics['streamproc_results_total{verdict="joined"}'] == joins

        with running_edge(nats_url, "--processor-metrics-url", f"http://127.0.0.1:{port}/metrics") as edge:
            status, text = get(f"{edge.url}/v1/stats")
        assert status == 200, text
        stats = json.loads(text)
        assert stats["join"]["count"] == stats["join_wait"]["count"] == joins
        assert stats["join"]["sum"] == pytest.approx(metrics["streamproc_join_seconds_sum"])
        assert stats["join"]["buckets"][-1][1] == joins  # the +Inf bucket (JSON null)


async def test_reconnects_are_counted_when_nats_comes_back():
    async with ready_core_processor() as (server, port):
        assert scrape(port)["streamproc_reconnects_total"] == 0
        server.restart()
        metrics = await wait_for(lambda: (m := scrape(port))["streamproc_reconnects_total"] == 1 and m,
                                 timeout=15)
        assert metrics["streamproc_disconnects_total"] == 1
        assert metrics["streamproc_nats_connected"] == 1


async def test_messages_forged_into_the_processors_jetstream_inbox_are_dropped_and_counted(client, nats_url):
    """The processor reads stored results back (and seal records) through push consumers; a message
    published into such an inbox that JetStream did not send is dropped (nats/robust.py) and counted
    in ``streamproc_foreign_messages_total``, and the processor's consumer reads on."""
    port = free_port()
    settings = durable_settings(nats_url, http_port=port, http_host="127.0.0.1")
    publisher = ChunkPublisher(client, settings.subjects)
    async def scraped() -> dict[str, float]:  # off the loop: the status server is on it (in-process)
        return await anyio.to_thread.run_sync(scrape, port)

    async with Processor(settings) as p:
        assert (await scraped())["streamproc_foreign_messages_total"] == 0
        await publisher.publish_leg(rid("first"), "agg", [b"one"])
        # what the processor's own read-back opens: an ordered consumer on the results stream
        sub = await p.nc.jetstream().subscribe(settings.subjects.result("*"), ordered_consumer=True)
        assert (await sub.next_msg(timeout=10)).data == b"one"
        for _ in range(3):
            await client.publish(sub.subject, b"forged", reply="_INBOX.not.a.jetstream.ack")
        await client.flush()
        await publisher.publish_leg(rid("second"), "agg", [b"two"])
        assert (await sub.next_msg(timeout=10)).data == b"two"  # its read loop went on
        metrics = await scraped()
        assert metrics["streamproc_foreign_messages_total"] == 3  # each dropped before "two" was read
        assert metrics["streamproc_nats_connected"] == 1
        await sub.unsubscribe()


def test_status_server_answers_unhealthy_while_nats_is_unreachable(tmp_path):
    port, dead = free_port(), free_port()
    proc = subprocess.Popen(
        [*CLI, "run", "--nats-url", f"nats://127.0.0.1:{dead}", "--http-port", str(port),
         "--http-host", "127.0.0.1", "--connect-timeout", "30"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                status = get(f"http://127.0.0.1:{port}/healthz")
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert status == (503, "not connected to NATS\n")
        assert get(f"http://127.0.0.1:{port}/readyz") == (503, "not ready\n")
        assert scrape(port)["streamproc_nats_connected"] == 0
    finally:
        proc.terminate()
        proc.wait(10)


async def test_health_turns_503_when_nats_goes_away():
    async with ready_core_processor() as (server, port):
        server.stop()
        await wait_for(lambda: _status(port, "/healthz") == 503)
        assert _status(port, "/readyz") == 503
        assert scrape(port)["streamproc_disconnects_total"] == 1


def _status(port: int, path: str) -> int | None:
    try:
        return get(f"http://127.0.0.1:{port}{path}")[0]
    except urllib.error.URLError:
        return None


async def test_status_server_refuses_unknown_paths_methods_and_oversized_heads(streamproc_run):
    port = free_port()
    with streamproc_run("--mode", "core", "--http-port", str(port), "--http-host", "127.0.0.1"):
        assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 405
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Junk: " + b"a" * 20_000)
            assert sock.recv(100).startswith(b"HTTP/1.1 400 ")
        # a client that sends nothing is dropped; the server still answers others meanwhile
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200


def test_latency_histogram_buckets_are_upper_bounds_inclusive_and_cumulative():
    from streamproc.core.latency import LatencyHistogram

    hist = LatencyHistogram((0.1, 1.0))
    for seconds in (0.0, 0.1, 0.10001, 1.0, 7.0):
        hist.observe(seconds)
    assert hist.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]
    assert hist.count == 5 and hist.total == pytest.approx(8.20001)
    with pytest.raises(ValueError):
        LatencyHistogram((1.0, 0.1))
