"""The self-contained demo: embedded NATS, the processor, simulated SGLang workers, a verified summary.

Nothing is trusted: every aggregated result is compared byte for byte with what the simulated
worker published, and every P/D result's expert rows with the ground truth.
"""

from __future__ import annotations

import contextlib

import sys
import time
from typing import AsyncIterator, Callable, Iterator, TextIO

import anyio
import msgspec
import nats

from .. import catalog, config

from . import traffic
from .embedded import EmbeddedNats, free_port
from .migration import MigratingRequest, plan_migrations, run_migration, verify_migration
from ..nats.processor import Processor
from ..client.results import ResultCollector
from .simulation import SimulatedWorker
from ..core.wire import ResultInfo
from .verification import Verifier

PREFERRED_FORMATS = ("sglang-zstd", "sglang")


def default_format() -> str:
    """sglang-zstd when its distribution (codec and simulated worker) is installed, else the built-in sglang."""
    installed = set(catalog.codec_names())
    for name in PREFERRED_FORMATS:
        if name in installed:
            try:
                catalog.worker_for(name)
            except Exception:
                continue
            return name
    return PREFERRED_FORMATS[-1]


class DemoReport(msgspec.Struct):
    format: str
    nats_url: str
    messages: int
    seconds: float
    rows: dict[str, traffic.Tally]
    problems: dict[str, list[str]]
    processor: dict[str, int] | None  # counters of the in-process processor (None when it runs elsewhere)
    timed_out: str | None = None
    title: str = "streamproc demo"
    faults: dict[str, list[int]] = {}  # planned fault -> [requests, ended as they must] (the demo's)

    @property
    def total(self) -> traffic.Tally:
        total = traffic.Tally()
        for tally in self.rows.values():
            for field in total.__struct_fields__:
                setattr(total, field, getattr(total, field) + getattr(tally, field))
        return total

    @property
    def ok(self) -> bool:
        total = self.total
        return self.timed_out is None and total.requests > 0 and total.failed == 0 and total.verified == total.requests


# Short enough that the demo's missing prefill legs end in omissions within seconds.
DEMO_PREFILL_TIMEOUT = 1.0
# From this many requests on, two of them (one aggregated, one P/D) migrate mid-decode.
MIGRATIONS_FROM = 10


def summarize_migrations(migrations: list[MigratingRequest], results: dict[str, list[ResultInfo]],
                         worker: SimulatedWorker, rows: dict[str, traffic.Tally],
                         problems: dict[str, list[str]]) -> None:
    """Verify every migrated request into its own summary row (e.g. ``P/D stream, migrated``)."""
    for m in migrations:
        got = results.get(m.request_id, [])
        found = verify_migration(m, got, worker)
        name = f"{'aggregated' if m.kind == 'agg' else 'P/D'} stream, migrated"
        rows.setdefault(name, traffic.Tally()).add(m.kind, got, found)
        if found:
            problems[m.request_id] = found


async def run_demo(*, requests: int = 200, format: str | None = None, seed: int = 1,
                   timeout: float = 60.0, progress: TextIO | None = None,
                   serve_port: int | None = None, out: TextIO = sys.stdout,
                   work: anyio.CancelScope | None = None) -> DemoReport | None:
    """``progress`` (e.g. stderr) gets a line about every second while results come in.

    With ``serve_port`` the summary is printed to ``out``, then NATS and the processor stay up
    behind a live edge on that port (0: any free one) until ``work`` is cancelled (``streamproc
    demo`` cancels it on SIGINT or SIGTERM). Cancelled before the summary, it returns None."""
    work = work or anyio.CancelScope()
    report: DemoReport | None = None
    format = format or default_format()
    worker = catalog.worker_for(format)
    started = time.perf_counter()
    async with EmbeddedNats() as server:
        overrides = {"nats_url": server.url, "format": format, "log_level": "WARNING",
                     "prefill_timeout": DEMO_PREFILL_TIMEOUT}
        if serve_port is not None:  # the page's join-wait chart reads the processor's /metrics
            overrides |= {"http_host": "127.0.0.1", "http_port": free_port()}
        settings = config.load({}, overrides)
        async with Processor(settings) as processor:
            with work:  # cancelled by the caller (a signal): the processor and NATS still stop as usual
                async with contextlib.AsyncExitStack() as serving:  # the edge, when serving
                    edge: tuple[int, anyio.Event] | None = None
                    if serve_port is not None:  # up before the traffic: the page lists the demo's requests
                        edge = await serving.enter_async_context(edge_server(
                            server.url, format, serve_port,
                            processor_metrics_url=f"http://127.0.0.1:{processor.http_port}/metrics"))
                    nc = await nats.connect(server.url)
                    try:
                        migrations = plan_migrations(seed=seed, id_prefix="demo") if requests >= MIGRATIONS_FROM else []
                        examples: dict[str | None, str] = {}  # the first request of each fault (None: healthy)

                        def noted(plans: Iterator[traffic.PlannedRequest]) -> Iterator[traffic.PlannedRequest]:
                            for p in plans:
                                examples.setdefault(p.fault, p.request_id)
                                yield p

                        # planned a window at a time as it is published: memory does not grow with --requests
                        windows = traffic.windows(noted(traffic.planned(
                            format, requests=requests - len(migrations), mode="mixed", seed=seed, id_prefix="demo",
                            worker=worker, faults=True)), seed=seed)
                        collectors: list[ResultCollector] = []
                        results: dict[str, list[ResultInfo]] = {}

                        def finished() -> int:
                            return verifier.finished + sum(c.finished(m.request_id) for c in collectors for m in migrations)

                        async with Verifier(nc, settings.subjects, worker) as verifier, anyio.create_task_group() as tg:
                            if progress is not None:
                                tg.start_soon(_report_progress, progress, finished, requests, processor)
                            # Against JetStream (mode auto chose durable), each chunk waits for its PubAck, as
                            # simulate does: a chunk the stream refuses raises instead of vanishing.
                            published = await verifier.publish(windows, format=format, timeout=timeout,
                                                               durable=processor.mode == "durable")
                            timed_out = published.timed_out
                            # Opened only now, so it holds no more than the requests still open (it keeps
                            # every result it sees); the migrations' own results are what it is for.
                            async with ResultCollector(nc, settings.subjects) as collector:
                                collectors.append(collector)
                                try:
                                    if timed_out is None:
                                        with anyio.fail_after(timeout):
                                            # While the traffic flows: a worker dies mid-decode, its request migrates.
                                            for m in migrations:
                                                await run_migration(nc, settings.subjects, m, format=format,
                                                                    worker=worker, collector=collector, timeout=timeout)
                                        await collector.wait_for([m.request_id for m in migrations], timeout=timeout)
                                        await verifier.drain(timeout)
                                except TimeoutError as exc:
                                    timed_out = str(exc) or f"the migrations did not finish within {timeout}s"
                                results = {m.request_id: list(collector.results.get(m.request_id, []))
                                           for m in migrations}
                                collectors.clear()
                            verifier.close()
                            tg.cancel_scope.cancel()
                    finally:
                        with anyio.CancelScope(shield=True), anyio.move_on_after(2):  # closed even when cancelled
                            await nc.close()
                    rows, problems = verifier.summary(), verifier.problems
                    summarize_migrations(migrations, results, worker, rows, problems)
                    stats = processor.snapshot()
                    report = DemoReport(format, server.url, published.messages, time.perf_counter() - started, rows,
                                        problems, stats, timed_out, faults=verifier.faults)
                    if edge is not None:
                        print_report(report, out)
                        faulted = examples.get("corrupt_prefill") or next(iter(examples.values()))
                        print_live_page(edge[0], faulted, out)
                        await edge[1].wait()
    return report


@contextlib.asynccontextmanager
async def edge_server(nats_url: str, format: str, port: int, *,
                      processor_metrics_url: str = "") -> AsyncIterator[tuple[int, anyio.Event]]:
    """The reference edge on the demo's NATS while the context is open: its bound port, and an event
    set if it stops on its own. Opened before the traffic, so the live page's list of recent
    requests holds the demo's (the edge's ring reads new results only). Uvicorn's own signal capture
    is off: two handlers of one signal would cancel Uvicorn in the middle of its shutdown
    (``streamproc demo`` cancels on SIGINT/SIGTERM: cli.until_signal owns the signals)."""
    from ..core.errors import StartupError
    from ..edge.app import create_app
    from ..edge.connections import raise_descriptor_limit
    from ..edge.server import server_class, server_config
    from ..edge.settings import load as load_edge_settings

    settings = load_edge_settings({}, {"nats_url": nats_url, "format": format, "host": "127.0.0.1",
                                       "port": port, "log_level": "ERROR",
                                       "processor_metrics_url": processor_metrics_url,
                                       "insecure_demo": True})  # a local demo: the page says so on screen
    app = create_app(settings)
    # the open-file limit `streamproc edge` raises (one helper): under a soft limit of 1024 the edge would
    # fail to accept before it refused past --max-connections
    problem = raise_descriptor_limit(settings.max_connections)
    if problem is not None:
        print(f"streamproc demo: warning: the live page's edge: {problem}", file=sys.stderr)
    # the edge's own server, bounds and all (edge/server.py); the caller owns the signals
    server = server_class(app.state.edge.stop_streams, signals=False)(
        server_config(app, settings, access_log=False))
    failed: list[BaseException] = []
    done = anyio.Event()

    async def run() -> None:
        with anyio.CancelScope(shield=True):  # stopped gracefully by should_exit (below), never cut short
            try:
                await server.serve()
            except SystemExit as exc:  # Uvicorn's way of saying it could not start (a busy port)
                failed.append(exc)
            finally:
                done.set()

    served = False
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            while not server.started and not done.is_set():
                await anyio.sleep(0.05)
            if not failed and server.started:
                served = True
                try:
                    yield server.servers[0].sockets[0].getsockname()[1], done
                except Exception as exc:  # noqa: BLE001 - re-raised outside the task group (no ExceptionGroup)
                    error = exc
        finally:
            server.should_exit = True
    if error is not None:
        raise error
    if not served:  # raised outside the task group: one line from the CLI, not an ExceptionGroup traceback
        raise StartupError(f"cannot serve the live page on 127.0.0.1:{port}")


def print_live_page(bound: int, example: str, out: TextIO) -> None:
    print(f"live page: http://127.0.0.1:{bound}/?id={example}  (results: "
          f"http://127.0.0.1:{bound}/v1/results/<id>; Ctrl-C stops)", file=out, flush=True)


async def _report_progress(out: TextIO, finished: Callable[[], int], requests: int, processor: Processor) -> None:
    while True:
        await anyio.sleep(1.0)
        stats = processor.stats
        print(f"progress: {finished()}/{requests} requests finished, {stats.results} results "
              f"(joined {stats.joined}, omitted {stats.omitted}, errors {stats.errors}), "
              f"{processor.correlator.inflight} in flight", file=out, flush=True)


COLUMNS = ("requests", "results", "passthrough", "joined", "stitched", "omitted", "errors", "verified")


def print_report(report: DemoReport, out: TextIO = sys.stdout) -> None:
    width = max(len(name) for name in [*report.rows, "total"]) + 2
    head = "".join(f"{c:>12}" for c in COLUMNS)
    print(f"{report.title}: format={report.format}  nats={report.nats_url}  "
          f"{report.messages} chunks published, {report.seconds:.2f}s", file=out)
    print(f"{'':<{width}}{head}", file=out)
    for name, tally in [*report.rows.items(), ("total", report.total)]:
        cells = "".join(f"{getattr(tally, c):>12}" for c in COLUMNS)
        print(f"{name:<{width}}{cells}", file=out)
    stats = report.processor
    if stats is not None:
        print(f"processor: chunks={stats['chunks']} results={stats['results']} duplicates={stats['duplicates']} "
              f"errors={stats['errors']} prefill_timeouts={stats['prefill_timeouts']} inflight={stats['inflight']}",
              file=out)
    if report.faults:  # the omissions and errors above are these, so none reads as a failure
        planned = sum(n for n, _ in report.faults.values())
        as_expected = sum(ok for _, ok in report.faults.values())
        order = [*traffic.FAULT_OUTCOMES, *sorted(report.faults.keys() - traffic.FAULT_OUTCOMES.keys())]
        kinds = "; ".join(f"{report.faults[fault][0]} {traffic.FAULT_OUTCOMES.get(fault, fault)}"
                          for fault in order if fault in report.faults)
        print(f"planned faults, {as_expected} of {planned} as expected: {kinds}", file=out)
    if report.timed_out:
        print(f"TIMEOUT: {report.timed_out}", file=out)
    for rid, found in list(report.problems.items())[:10]:
        print(f"FAIL {rid}: {'; '.join(found[:3])}", file=out)
    total = report.total
    if report.ok:
        print(f"verified OK: all {total.requests} requests ({total.results} results) match the simulated workers "
              "and the ground truth", file=out)
    else:
        print(f"verified FAIL: {total.requests - total.verified} of {total.requests} requests wrong or missing",
              file=out)
