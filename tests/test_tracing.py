"""OpenTelemetry (the ``otel`` extra): one request's spans form one trace from chunk to SSE frame.

The processor and the edge run in-process against a real nats-server with the SDK's in-memory
exporter; a client reads the SSE response over real HTTP (Uvicorn). Tests that need the SDK skip
with a reason where the extra is not installed; the ones that pin "off costs nothing, and a missing
extra breaks nothing" run either way.
"""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import httpx
import nats
import pytest
from edge_harness import demo_flag, expected_sse, running_edge
from helpers import free_port

from streamproc import config, tracing
from streamproc.client.publisher import ChunkPublisher
from streamproc.core.wire import Subjects
from streamproc.edge import sse
from streamproc.nats.processor import Processor
from streamproc.sim import traffic

pytestmark = [pytest.mark.anyio]

FORMAT = "sglang"
needs_otel = pytest.mark.skipif(
    not tracing.available(),
    reason=f"the otel extra is not installed ({tracing.EXTRA_HINT}); CI installs it with the test extra",
)


def in_memory() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@contextlib.asynccontextmanager
async def edge_in_process(nats_url: str, tracer: tracing.Tracing) -> AsyncIterator[str]:
    """The edge app under Uvicorn in this process; yields its base URL."""
    import uvicorn

    from streamproc.edge import settings as edge_settings
    from streamproc.edge.app import create_app

    port = free_port()
    settings = edge_settings.load(
        {}, {"nats_url": nats_url, "port": port, "format": FORMAT, "ensure_results_stream": True,
             "insecure_demo": True}
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, tracing=tracer),
            host="127.0.0.1",
            port=port,
            lifespan="on",
            log_config=None,
            timeout_graceful_shutdown=1,
        )
    )
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server.serve)
        with anyio.fail_after(20):
            while not server.started:
                await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


def chain(span: Any, by_id: dict[int, Any]) -> list[str]:
    """Span names from ``span`` up to its root, following parent links."""
    names = []
    while span is not None:
        names.append(span.name)
        span = by_id.get(span.parent.span_id) if span.parent is not None else None
    return names


class Traced:
    """One simulated P/D request under a router span of its own, with a worker span per leg."""

    def __init__(self, provider: Any, plan: traffic.PlannedRequest) -> None:
        tracer = provider.get_tracer("worker")
        self.plan = plan
        self.root = tracer.start_span("router.request")
        ctx = tracing.Tracing(provider)._child(self.root)
        self.prefill = tracer.start_span("worker.prefill", ctx)
        self.decode = tracer.start_span("worker.decode", ctx)

    def end(self) -> None:
        for span in (self.decode, self.prefill, self.root):
            span.end()


BODY_SIZE = "messaging.message.body.size"  # the issue's ``bytes`` attribute (OTel messaging semconv)


def sse_bodies(raw: bytes) -> dict[int, bytes]:
    """seq -> body of each ``id: N`` / ``data: ...`` event of an SSE response."""
    out = {}
    for block in raw.split(b"\n\n"):
        fields = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
        if b"id" in fields and b"data" in fields:
            out[int(fields[b"id"])] = fields[b"data"]
    return out


@needs_otel
@pytest.mark.nats
@pytest.mark.parametrize("mode", ["core", "durable"])
async def test_one_request_forms_one_trace_from_worker_chunk_to_sse_frame(nats_url, mode):
    provider, exporter = in_memory()
    fmt = tracing.Tracing(provider)
    # Two requests at once: in core mode joins run off the loop one at a time, so the second
    # request's join is queued behind the first's and decided inside its finish.
    requests = [
        Traced(provider, p)
        for p in traffic.plan(FORMAT, requests=2, mode="pd", stream=True, seed=2, id_prefix=f"traced-{mode}")
    ]
    assert all(len(r.plan.decode) > 1 for r in requests)
    settings = config.load({}, {"nats_url": nats_url, "format": FORMAT, "mode": mode})
    raws: dict[str, bytes] = {}
    async with edge_in_process(nats_url, tracing.Tracing(provider)) as url:
        async with Processor(settings, tracing=tracing.Tracing(provider)):
            async with (
                httpx.AsyncClient(base_url=url, timeout=20) as client,
                contextlib.AsyncExitStack() as stack,
            ):
                responses = [
                    await stack.enter_async_context(client.stream("GET", f"/v1/results/{r.plan.request_id}"))
                    for r in requests
                ]
                async with await nats.connect(nats_url) as nc:
                    publisher = ChunkPublisher(nc, Subjects(), durable=mode == "durable")
                    # Decode legs first: their chunks wait for the prefill legs, whose arrival releases them.
                    for r in requests:
                        await publisher.publish_leg(
                            r.plan.request_id,
                            "decode",
                            r.plan.decode,
                            format=FORMAT,
                            traceparent=fmt.traceparent(r.decode),
                        )
                    for r in requests:
                        await publisher.publish_leg(
                            r.plan.request_id,
                            "prefill",
                            r.plan.prefill,
                            format=FORMAT,
                            traceparent=fmt.traceparent(r.prefill),
                        )
                with anyio.fail_after(20):
                    for r, response in zip(requests, responses):
                        assert response.status_code == 200
                        raws[r.plan.request_id] = await response.aread()
    for r in requests:
        r.end()

    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    for r in requests:
        plan = r.plan
        frames = [line for line in raws[plan.request_id].split(b"\n") if line.startswith(b"data: ")]
        assert len(frames) == len(plan.decode) + 1 and frames[-1] == b"data: [DONE]"
        trace_id = r.root.get_span_context().trace_id
        mine = [s for s in spans if s.context.trace_id == trace_id]
        assert {s.attributes.get("streamproc.request_id", plan.request_id) for s in mine} == {plan.request_id}
        names = [s.name for s in mine]
        # One correlate span per chunk, one join span per P/D result, a publish span per result
        # (durable: per publish attempt; each is a child of the same join span).
        assert names.count("streamproc.correlate") == len(plan.decode) + len(plan.prefill)
        assert names.count("streamproc.join") == len(plan.decode)
        assert names.count("streamproc.publish") >= len(plan.decode)
        frame_spans = sorted(
            (s for s in mine if s.name == "streamproc.edge.frame"),
            key=lambda s: s.attributes["streamproc.seq"],
        )
        assert [s.attributes["streamproc.seq"] for s in frame_spans] == list(range(len(plan.decode)))
        for frame in frame_spans:
            path = chain(frame, by_id)
            assert path[:4] == [
                "streamproc.edge.frame",
                "streamproc.publish",
                "streamproc.join",
                "streamproc.correlate",
            ], path
            assert path[4:] in (["worker.prefill", "router.request"], ["worker.decode", "router.request"]), (
                path
            )
            publish = by_id[frame.parent.span_id]
            join = by_id[publish.parent.span_id]
            assert publish.attributes["streamproc.seq"] == frame.attributes["streamproc.seq"]
            assert join.attributes["streamproc.verdict"] == frame.attributes["streamproc.verdict"] == "joined"
            # the join links to the decode chunk that carried the body, when another chunk released it
            correlate = by_id[join.parent.span_id]
            if correlate.attributes["streamproc.role"] == "prefill":
                assert [link.context.span_id for link in join.links] == [r.decode.get_span_context().span_id]
        correlates = [s for s in mine if s.name == "streamproc.correlate"]
        assert {s.attributes["streamproc.role"] for s in correlates} == {"prefill", "decode"}
        # ``bytes`` (messaging.message.body.size): the worker chunk's body on correlate, the result's
        # body on join and publish (the NATS payload), the whole SSE event on the edge's frame
        legs = {"prefill": plan.prefill, "decode": plan.decode}
        for correlate in correlates:
            body = legs[correlate.attributes["streamproc.role"]][correlate.attributes["streamproc.seq"]]
            assert correlate.attributes[BODY_SIZE] == len(body) > 0
        bodies = sse_bodies(raws[plan.request_id])
        for frame in frame_spans:
            seq = frame.attributes["streamproc.seq"]
            publish = by_id[frame.parent.span_id]
            join = by_id[publish.parent.span_id]
            assert join.attributes[BODY_SIZE] == publish.attributes[BODY_SIZE] == len(bodies[seq]) > 0
            assert frame.attributes[BODY_SIZE] == len(sse.event(bodies[seq], id=seq))
        [stream] = [s for s in mine if s.name == "streamproc.edge.stream"]
        assert stream.attributes["streamproc.edge.frames"] == len(plan.decode)
        assert stream.attributes["streamproc.edge.outcome"] == "completed"
        assert all(link.context.span_id == stream.context.span_id for f in frame_spans for link in f.links)
    assert len(spans) == sum(
        len([s for s in spans if s.context.trace_id == r.root.get_span_context().trace_id]) for r in requests
    ), "every span is in one of the two requests' traces"


@needs_otel
@pytest.mark.nats
async def test_results_of_a_chunk_without_traceparent_start_a_trace_the_edge_continues(nats_url):
    provider, exporter = in_memory()
    [plan] = traffic.plan(FORMAT, requests=1, mode="agg", stream=False, seed=4, id_prefix="untraced")
    settings = config.load({}, {"nats_url": nats_url, "format": FORMAT, "mode": "core"})
    async with edge_in_process(nats_url, tracing.Tracing(provider)) as url:
        async with Processor(settings, tracing=tracing.Tracing(provider)):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                async with client.stream("GET", f"/v1/results/{plan.request_id}") as response:
                    async with await nats.connect(nats_url) as nc:
                        await ChunkPublisher(nc).publish_leg(plan.request_id, "agg", plan.agg, format=FORMAT)
                    with anyio.fail_after(20):
                        raw = await response.aread()
    assert raw == expected_sse(plan.agg)  # the body is untouched by tracing
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    [frame] = [s for s in spans if s.name == "streamproc.edge.frame"]
    assert chain(frame, by_id) == ["streamproc.edge.frame", "streamproc.publish", "streamproc.correlate"]
    assert len({s.context.trace_id for s in spans}) == 1
    assert by_id[frame.parent.span_id].attributes["streamproc.verdict"] == "passthrough"


@needs_otel
@pytest.mark.nats
async def test_a_worker_trace_that_is_not_sampled_stays_unsampled_and_results_still_flow(nats_url):
    provider, exporter = in_memory()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    unsampled = f"00-{trace_id}-00f067aa0ba902b7-00"  # flags 00: the worker decided not to sample
    [plan] = traffic.plan(FORMAT, requests=1, mode="pd", stream=True, seed=2, id_prefix="unsampled")
    settings = config.load({}, {"nats_url": nats_url, "format": FORMAT, "mode": "core"})
    async with Processor(settings, tracing=tracing.Tracing(provider)) as p:
        async with await nats.connect(nats_url) as nc:
            sub = await nc.subscribe(p.subjects.result(plan.request_id))
            publisher = ChunkPublisher(nc)
            await publisher.publish_leg(
                plan.request_id, "decode", plan.decode, format=FORMAT, traceparent=unsampled
            )
            await publisher.publish_leg(
                plan.request_id, "prefill", plan.prefill, format=FORMAT, traceparent=unsampled
            )
            with anyio.fail_after(20):
                results = [await sub.next_msg(timeout=20) for _ in plan.decode]
    assert [r.headers["Streamproc-Join"] for r in results] == ["joined"] * len(plan.decode)
    # The default sampler is parent-based: the processor records nothing and passes the worker's
    # traceparent on as it came (the same trace, still unsampled).
    assert [r.headers["traceparent"] for r in results] == [unsampled] * len(plan.decode)
    assert exporter.get_finished_spans() == ()


@needs_otel
@pytest.mark.nats
async def test_unsampled_aggregated_chunks_take_the_fused_path_beside_sampled_ones_that_are_recorded(nats_url):
    """With the default parent-based sampler, chunks of unsampled worker traces record nothing on any
    path, so the fused passthrough path takes them (benchmarks/tracing.py: the general path cost them
    ~5 µs per message); a sampled request beside them still gets its spans, and a chunk without a
    traceparent still starts a trace."""
    provider, exporter = in_memory()
    unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plans = traffic.plan(FORMAT, requests=3, mode="agg", stream=True, seed=11, id_prefix="mixed")
    settings = config.load({}, {"nats_url": nats_url, "format": FORMAT, "mode": "core"})
    async with Processor(settings, tracing=tracing.Tracing(provider)) as p:
        assert p.input._fused is not None  # the fused path is on with tracing on
        async with await nats.connect(nats_url) as nc:
            subs = [await nc.subscribe(p.subjects.result(plan.request_id)) for plan in plans]
            publisher = ChunkPublisher(nc)
            for plan, traceparent in zip(plans, [unsampled, sampled, None]):
                await publisher.publish_leg(plan.request_id, "agg", plan.agg, format=None, traceparent=traceparent)
            with anyio.fail_after(20):
                results = [[await sub.next_msg(timeout=20) for _ in plan.agg] for sub, plan in zip(subs, plans)]
    assert [[r.data for r in rs] for rs in results] == [list(plan.agg) for plan in plans]
    assert [r.headers["traceparent"] for r in results[0]] == [unsampled] * len(plans[0].agg)
    spans = exporter.get_finished_spans()
    by_trace: dict[int, int] = {}
    for s in spans:
        by_trace[s.context.trace_id] = by_trace.get(s.context.trace_id, 0) + 1
    assert int(unsampled.split("-")[1], 16) not in by_trace  # nothing recorded for the unsampled request
    assert by_trace.get(int(sampled.split("-")[1], 16), 0) == 2 * len(plans[1].agg)  # correlate + publish each
    assert len(by_trace) == 1 + len(plans[2].agg)  # each chunk without traceparent starts a trace
    assert all(int(r.headers["traceparent"][-2:], 16) & 1 for r in results[1] + results[2])  # sampled flag


@needs_otel
@pytest.mark.nats
@pytest.mark.parametrize("format_header", [FORMAT, None], ids=["format-header", "fused-path-shape"])
async def test_a_sampler_that_records_unsampled_parents_still_gets_the_processors_spans(nats_url, format_header):
    """Without a format header, a unary aggregated chunk has the shape of the fused passthrough path
    (core/passthrough.py), which records no span: with tracing on every chunk takes the general path."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced = tracing.Tracing(provider)
    assert not traced.skips_unsampled
    unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    [plan] = traffic.plan(FORMAT, requests=1, mode="agg", stream=False, seed=7, id_prefix="recorded")
    settings = config.load({}, {"nats_url": nats_url, "format": FORMAT, "mode": "core"})
    async with Processor(settings, tracing=traced) as p:
        async with await nats.connect(nats_url) as nc:
            sub = await nc.subscribe(p.subjects.result(plan.request_id))
            await ChunkPublisher(nc).publish_leg(
                plan.request_id, "agg", plan.agg, format=format_header, traceparent=unsampled
            )
            result = await sub.next_msg(timeout=20)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"streamproc.correlate", "streamproc.publish"}
    assert result.headers["traceparent"] == tracing.Tracing(provider).traceparent(spans["streamproc.publish"])


def test_tracing_is_off_without_otel_variables_and_the_hot_path_binds_the_correlators_own_methods():
    settings = config.load({}, {"nats_url": "nats://127.0.0.1:1", "format": FORMAT})
    assert tracing.exporter_names({}) == []
    assert tracing.exporter_names({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == ["otlp"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) == []
    p = Processor(settings, tracing=None)
    pipeline = p.pipeline
    assert pipeline.receive == p.correlator.receive and pipeline.finish == p.correlator.finish

    async def publish(*args: object) -> None:
        pass

    assert pipeline.publisher(publish) is publish


@needs_otel
@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "no-such-exporter"}, "OTEL_TRACES_EXPORTER='no-such-exporter'"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
         "OTEL_EXPORTER_OTLP_PROTOCOL='carrier-pigeon'"),
    ],
)
def test_otel_variables_that_name_nothing_installed_are_bad_configuration_for_every_command(variables, named):
    from conftest import run_cli_process

    dead = f"nats://127.0.0.1:{free_port()}"
    for command in (["run", "--mode", "core"], ["edge"]):
        proc = run_cli_process(*command, "--nats-url", dead, *demo_flag(command[0]), env=variables)
        assert proc.returncode == 2, proc.stderr
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"streamproc {command[0]}: error: {named}"), line


def shadow_opentelemetry(tmp: Path) -> str:
    """A PYTHONPATH entry on which ``import opentelemetry`` fails, as without the extra."""
    package = tmp / "opentelemetry"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent("""\
        raise ImportError("opentelemetry is not installed (shadowed by the test)")
    """)
    )
    return str(tmp)


@pytest.mark.nats
async def test_without_the_extra_otel_variables_only_warn_and_results_still_flow(nats_url, tmp_path):
    import os

    shadow = shadow_opentelemetry(tmp_path)
    env = {
        "PYTHONPATH": shadow + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
    }
    [plan] = traffic.plan(FORMAT, requests=1, mode="agg", stream=True, seed=6, id_prefix="no-extra")
    from conftest import processor_subprocess

    with processor_subprocess(nats_url, "--format", FORMAT, "--mode", "core", env=env) as (proc, log_path):
        with running_edge(nats_url, "--format", FORMAT, env=env) as edge:
            async with httpx.AsyncClient(base_url=edge.url, timeout=20) as client:
                async with client.stream("GET", f"/v1/results/{plan.request_id}") as response:
                    async with await nats.connect(nats_url) as nc:
                        await ChunkPublisher(nc).publish_leg(plan.request_id, "agg", plan.agg, format=FORMAT)
                    with anyio.fail_after(20):
                        raw = await response.aread()
            edge_log = edge.log()
        processor_log = log_path.read_text()
    assert raw == expected_sse(plan.agg)
    for log in (processor_log, edge_log):
        assert "tracing_unavailable" in log and "streamproc[otel]" in log, log


class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) on a free port."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.bodies: list[bytes] = []
        received = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    received.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, Any]]:
        """``(service.name, span)`` for every span received so far."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for body in self.bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                out.extend((service, span) for scope in rs.scope_spans for span in scope.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@needs_otel
@pytest.mark.nats
async def test_processor_and_edge_export_over_otlp_as_the_standard_variables_say(nats_url):
    """`streamproc run` and `streamproc edge` as subprocesses, configured only by OTEL_* variables,
    export their spans of one request over OTLP/HTTP; flushed on a graceful stop."""
    from conftest import processor_subprocess

    receiver = OtlpReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    worker = f"00-{trace_id}-b7ad6b7169203331-01"
    [plan] = traffic.plan(FORMAT, requests=1, mode="agg", stream=True, seed=6, id_prefix="otlp")
    try:
        with processor_subprocess(nats_url, "--format", FORMAT, "--mode", "core", env=env) as (
            proc,
            log_path,
        ):
            with running_edge(nats_url, "--format", FORMAT, env=env) as edge:
                async with httpx.AsyncClient(base_url=edge.url, timeout=20) as client:
                    async with client.stream("GET", f"/v1/results/{plan.request_id}") as response:
                        async with await nats.connect(nats_url) as nc:
                            await ChunkPublisher(nc).publish_leg(
                                plan.request_id, "agg", plan.agg, format=FORMAT, traceparent=worker
                            )
                        with anyio.fail_after(20):
                            raw = await response.aread()
                assert edge.stop() == 0
            processor_log = log_path.read_text()
        assert raw == expected_sse(plan.agg)
        assert "event=tracing_enabled" in processor_log and "exporters=otlp" in processor_log
        spans = receiver.spans()
    finally:
        receiver.close()
    assert {span.trace_id.hex() for _, span in spans} == {trace_id}
    by_service: dict[str, list[str]] = {}
    for service, span in spans:
        by_service.setdefault(service, []).append(span.name)
    n = len(plan.agg)
    assert sorted(by_service["streamproc"]) == sorted(
        ["streamproc.correlate"] * n + ["streamproc.publish"] * n
    )
    assert sorted(by_service["streamproc-edge"]) == sorted(
        ["streamproc.edge.frame"] * n + ["streamproc.edge.stream"]
    )
    worker_span_id = worker.split("-")[2]
    assert all(s.parent_span_id.hex() == worker_span_id for _, s in spans if s.name == "streamproc.correlate")


@needs_otel
@pytest.mark.nats
async def test_results_handed_out_together_keep_their_sse_ids_with_tracing_on(nats_url):
    """With tracing on, each result is framed on its own (the traced path of ``Edge.frames``). Results
    that came out of order (seqs 1 and 2 before 0) are handed out together when the missing one comes,
    so several wait in the feed at once: each still goes out with its seq as its SSE id, as without
    tracing. 5f0b9b9's ``event_id`` read the order's next seq when the frame was made, past the ones
    still waiting, and sent those without an id (a resume would then start before them)."""
    from streamproc.core.events import Result
    from streamproc.core.wire import result_headers

    provider, _ = in_memory()
    subjects = Subjects()
    request_id = "traced-ids-1"
    bodies = [b'{"text":"%d"}' % seq for seq in range(5)]
    async with edge_in_process(nats_url, tracing.Tracing(provider)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client, await nats.connect(nats_url) as nc:
            async with client.stream("GET", f"/v1/results/{request_id}") as response:
                await anyio.sleep(0.5)  # the stream's subscription is in place
                for seq in (1, 2, 0, 3, 4):
                    await nc.publish(subjects.result(request_id), bodies[seq],
                                     headers=result_headers(Result(request_id, seq, bodies[seq], seq == 4)))
                await nc.flush()
                with anyio.fail_after(20):
                    raw = await response.aread()
    assert raw == expected_sse(bodies), raw


@needs_otel
@pytest.mark.nats
async def test_an_error_result_s_publish_span_names_its_request_and_seq(nats_url):
    """The ``streamproc.publish`` span reads the request id and seq from ``Nats-Msg-Id``. An error result's
    is ``<request_id>.<seq>.error`` since 8ac2350: split at its last dot, the span named ``<rid>.0`` as the
    request and had no seq."""
    from streamproc.core.events import Result
    from streamproc.core.wire import result_headers

    provider, exporter = in_memory()
    request_id = "traced-error-1"
    error_body = b'{"error":{"message":"no chunk for 30 s","type":"timeout"}}'
    async with await nats.connect(nats_url) as nc:
        publish = tracing.Tracing(provider).publisher(nc.publish)
        for result in (Result(request_id, 0, error_body, True, error="timeout"),
                       Result(request_id, 3, b"{}", False)):
            await publish(Subjects().result(request_id), result.body, headers=result_headers(result))
        await nc.flush()
    spans = [s for s in exporter.get_finished_spans() if s.name == "streamproc.publish"]
    assert [(s.attributes["streamproc.request_id"], s.attributes.get("streamproc.seq")) for s in spans] == [
        (request_id, 0), (request_id, 3)]
