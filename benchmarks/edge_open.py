"""Where the time of one SSE open goes (issue 14, target 2: open p50 <= 5 ms).

Starts one nats-server and a ``streamproc edge`` whose steps are stamped (this script with
``--serve``: the real edge with wrappers around its open path), then opens SSE streams with a raw
asyncio HTTP/1.1 client (as benchmarks/latency.py's) and prints the median time of each step,
client and edge stamps on one clock (``time.perf_counter``: CLOCK_MONOTONIC, shared by processes):

  connect      client: TCP connect (``asyncio.open_connection``) returned
  parsed       edge: request line and headers parsed (Uvicorn's ``on_headers_complete``)
  handler      edge: ``Edge.results`` entered (task start, Starlette routing)
  auth         edge: capability checked (``Edge.authenticate``)
  lookup       edge: results stream known (``StreamLookup.find``)
  subscribe    edge: SUB queued (core); main's JetStream path: the ordered consumer created (a round trip)
  flush        edge: PING/PONG round trip done (core: the subscription is live on the server)
  consumer     edge, this branch's JetStream path: the ordered consumer created, after the headers
  written      edge: response headers handed to the transport
  headers      client: response headers read

``--mode core`` (no results stream) or ``jetstream`` (the edge creates one with
``--ensure-results-stream``); ``--deny-msg-get`` runs nats-server with a user (every connection's,
``no_auth_user``) that may not publish ``$JS.API.STREAM.MSG.GET.>``, as the edge user of a
deployment set up before edge/replay.py: JetStream opens fall back to a consumer each (msg_get.py).
An open reads the stream by subject only when something is stored (else there is nothing to
replay); ``--stored N`` stores N results of another request first, so each open asks. ``--burst N`` opens N streams at once per round, as latency.py's
waves do; ``--load RATE`` meanwhile publishes results at RATE/s to 50 other open streams read by
a second client process, the benchmark's 2,000 events/s load without its processor.

Baselines in the same run, in interleaved rounds (``--rounds``; each contender goes first in turn):

  floor        ``--floor``: the same client bursts against a minimal raw-asyncio HTTP server (this
               script with ``--floor-serve``, no NATS, no Uvicorn) that answers the SSE response
               head as soon as it has read the request head: what the client and the machine cost
               with no edge at all. Under ``--load`` the load still goes to the edge (idle between
               its own rounds), so the machine is as busy as in the edge's rounds.
  base         ``--baseline-tree DIR``: the same stamped edge imported from that source tree
               (``PYTHONPATH``; e.g. the main checkout), on the same nats-server.

With ``--load``, each SSE event's delay (the load's publish to its arrival at the SSE reader) is split
into events that arrived while a burst was opening (from its first connect to its last response
head, the client's clock) and the others; and the stamped edge records each event-loop pass longer
than 1 ms (``asyncio``'s ``_run_once``), printed as the passes' p50/p99/max during bursts and outside.

Usage: python benchmarks/edge_open.py [--mode core] [--opens 200] [--burst 1] [--load 0] [--rounds 1]
                                      [--floor] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("connect", "parsed", "handler", "auth", "lookup", "subscribe", "flush", "written", "headers")


# ----------------------------------------------------------------------------- the stamped edge

def serve(stamps_file: Path, edge_argv: list[str]) -> int:
    """``streamproc edge`` with stamps on its open path; writes them as JSON when it stops."""
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext
    from uvicorn.protocols.http import httptools_impl

    from streamproc.edge import app as edge_app
    from streamproc.edge import lookup, source
    from streamproc.edge.command import main as edge_main

    if os.environ.get("EDGE_OPEN_PER_PASS"):  # --per-pass: the opens let through per loop pass (edge/pacer.py)
        try:
            from streamproc.edge import pacer
        except ImportError:
            pass
        else:
            pacer.OPENS_PER_PASS = int(os.environ["EDGE_OPEN_PER_PASS"])
    stamps: dict[str, dict[str, float]] = {}
    current: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)
    passes = probe_loop_passes()

    def mark(rid: str | None, step: str) -> None:
        if rid is not None:
            seen = stamps.setdefault(rid, {})
            if step in STEPS and "written" in seen:  # work after the headers (a consumer being created)
                return
            seen.setdefault(step, time.perf_counter())

    def rid_of(path: str) -> str | None:
        return path.rsplit("/", 1)[1] if path.startswith("/v1/results/") else None

    headers_complete = httptools_impl.HttpToolsProtocol.on_headers_complete

    def on_headers_complete(self) -> None:
        mark(rid_of(self.url.decode("latin-1").split("?")[0]), "parsed")
        headers_complete(self)

    httptools_impl.HttpToolsProtocol.on_headers_complete = on_headers_complete

    cycle_send = httptools_impl.RequestResponseCycle.send

    async def send(self, message) -> None:
        await cycle_send(self, message)
        if message["type"] == "http.response.start":
            mark(rid_of(self.scope["path"]), "written")

    httptools_impl.RequestResponseCycle.send = send

    def around(cls, name: str, before: str | None, after: str | None) -> None:
        original = getattr(cls, name)

        async def wrapped(self, *args, **kwargs):
            rid = current.get()
            mark(rid, before) if before else None
            try:
                return await original(self, *args, **kwargs)
            finally:
                mark(rid, after) if after else None

        setattr(cls, name, wrapped)

    results = edge_app.Edge.results

    async def results_wrapped(self, request):
        rid = request.path_params["request_id"]
        current.set(rid)
        mark(rid, "handler")
        return await results(self, request)

    edge_app.Edge.results = results_wrapped
    authenticate = edge_app.Edge.authenticate

    def authenticate_wrapped(self, request):
        try:
            return authenticate(self, request)
        finally:
            mark(current.get(), "auth")

    edge_app.Edge.authenticate = authenticate_wrapped
    around(lookup.StreamLookup, "find", None, "lookup")
    around(Client, "subscribe", None, "subscribe")
    around(JetStreamContext, "subscribe", None, "consumer")  # this branch: after the headers
    around(Client, "flush", None, "flush")
    try:
        from streamproc.edge.barrier import PongBarrier  # this branch: one PING per loop pass of opens
    except ImportError:
        pass
    else:
        around(PongBarrier, "wait", None, "flush")
    del source  # imported so that the wrappers are in place before the edge starts
    try:
        return edge_main(edge_argv)
    finally:
        stamps_file.write_text(json.dumps({"stamps": stamps, "passes": passes}))


def probe_loop_passes(longer_than: float = 0.001) -> list[list]:
    """[start, seconds, CPU seconds] of every event-loop pass longer than ``longer_than``: the time
    from one ``select`` returning to the next call, i.e. the callbacks and task steps of one
    ``_run_once`` (an event that arrives meanwhile waits for the rest of the pass), and the thread's
    CPU time in it (less than the wall time when the process was preempted). Wraps the selector class.
    With ``EDGE_OPEN_HANDLES=1`` each pass also gets the seconds of its callbacks by name (a task
    step: its coroutine's), which costs the edge a timer per callback."""
    import collections
    import selectors

    passes: list[list] = []
    cls = type(selectors.DefaultSelector())
    select = cls.select
    clock = time.perf_counter
    returned = [None]
    spent: collections.Counter = collections.Counter()
    by_handle = os.environ.get("EDGE_OPEN_HANDLES") == "1"

    cpu_clock = time.thread_time
    cpu_returned = [0.0]

    def timed_select(self, timeout=None):
        now = clock()
        since = returned[0]
        if since is not None and now - since > longer_than:
            passes.append([since, now - since, cpu_clock() - cpu_returned[0]]
                          + ([dict(spent.most_common(8))] if by_handle else []))
        spent.clear()
        try:
            return select(self, timeout)
        finally:
            returned[0] = clock()
            cpu_returned[0] = cpu_clock()

    cls.select = timed_select
    if by_handle:
        run = asyncio.events.Handle._run

        def name_of(callback) -> str:
            owner = getattr(callback, "__self__", None)
            if isinstance(owner, asyncio.Task):
                return "task " + getattr(owner.get_coro(), "__qualname__", "?")
            return getattr(callback, "__qualname__", type(callback).__name__)

        def timed_run(self):
            began = clock()
            try:
                return run(self)
            finally:
                spent[name_of(self._callback)] += clock() - began

        asyncio.events.Handle._run = timed_run
    return passes


# ----------------------------------------------------------------------------- the floor server

def floor_serve(port: int) -> int:
    """The least an SSE open can cost here: raw asyncio, the response head written as soon as the
    request head is read, the connection held until the client closes it."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"x-accel-buffering: no\r\ntransfer-encoding: chunked\r\n\r\n")

    class Open(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            if self.buf is None:
                return
            self.buf += data
            if b"\r\n\r\n" in self.buf:
                self.buf = None
                self.transport.write(head)

    async def main() -> None:
        import signal
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Open, "127.0.0.1", port, backlog=2048)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        await stop.wait()
        server.close()

    asyncio.run(main())
    return 0


# ----------------------------------------------------------------------------- the client

async def open_one(host: str, port: int, rid: str, out: dict) -> None:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    out["start"] = t0
    out["connect"] = time.perf_counter()
    writer.write(f"GET /v1/results/{rid} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n"
                 "Connection: close\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    out["headers"] = time.perf_counter()
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"{rid}: {head[:200]!r}")
    writer.close()


async def store(nats_url: str, prefix: str, n: int) -> None:
    """``n`` results of a request nobody opens, stored in the results stream."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for seq in range(n):
            await js.publish(f"{prefix}.results.stored", b'{"text":"x","meta_info":{}}',
                             headers={"Streamproc-Seq": str(seq)})
    finally:
        await nc.close()


async def fallen_back(port: int) -> None:
    """Hold one stream open until /healthz says the edge reads with a consumer per stream."""
    import urllib.request

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/results/detect HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
                health = json.loads(response.read())
            if "stored_results" in health:
                print(f"edge: {health['stored_results']}")
                return
        raise RuntimeError(f"the edge did not fall back: {health}")
    finally:
        writer.close()


async def client(port: int, opens: int, burst: int, gap: float, tag: str,
                 windows: list | None = None) -> list[dict]:
    """``opens`` opens in bursts of ``burst``; ``windows`` gets each burst's (first start, last head)."""
    runs: list[dict] = []
    for r in range(opens // burst):
        outs = [{"rid": f"{tag}{r}-{i}"} for i in range(burst)]
        begun = time.perf_counter()
        await asyncio.gather(*(open_one("127.0.0.1", port, o["rid"], o) for o in outs))
        if windows is not None:
            windows.append((begun, max(o["headers"] for o in outs)))
        runs.extend(outs)
        await asyncio.sleep(gap)
    return runs


async def load(nats_url: str, prefix: str, port: int, rate: float, stop: asyncio.Event, tmp: Path,
               delays: list | None = None) -> None:
    """RATE results/s to 50 streams held open by benchmarks/latency.py's SSE client process;
    ``delays`` gets (arrival, publish -> arrival seconds) of every event read."""
    import nats

    out = tmp / f"load-{port}-{time.monotonic_ns()}.json"
    published: dict[tuple[str, int], float] = {}
    reader_proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "latency.py"), "--sse-client", f"http://127.0.0.1:{port}", "--out", str(out),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    nc = await nats.connect(nats_url)
    wave = 0
    n = 0
    started = time.perf_counter()
    try:
        while not stop.is_set():
            rids = [f"load{wave}-{i}" for i in range(50)]
            reader_proc.stdin.write(f"open {wave} {' '.join(rids)}\n".encode())
            await reader_proc.stdin.drain()
            await reader_proc.stdout.readline()
            for seq in range(40):
                for rid in rids:
                    due = started + n / rate
                    now = time.perf_counter()
                    if due > now + 0.001:
                        await nc.flush()
                        await asyncio.sleep(due - now)
                    headers = {"Streamproc-Seq": str(seq)}
                    if seq == 39:
                        headers["Streamproc-Final"] = "true"
                    published[(rid, seq)] = time.perf_counter()
                    await nc.publish(f"{prefix}.results.{rid}", b'{"text":"x","meta_info":{}}', headers=headers)
                    n += 1
            wave += 1
    finally:
        reader_proc.stdin.write(b"quit\n")
        await reader_proc.stdin.drain()
        await reader_proc.wait()
        await nc.close()
    if delays is not None and out.exists():
        for rid, seq, at in json.loads(out.read_text())["arrivals"]:
            sent = published.get((rid, seq))
            if sent is not None:
                delays.append((at, at - sent))


async def load_run(nats_url: str, prefix: str, port: str, rate: str, out: str) -> int:
    """``load`` until stdin closes; writes the events' (arrival, delay) to ``out``."""
    stop = asyncio.Event()
    delays: list[tuple[float, float]] = []
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    async def until_eof() -> None:
        await stdin.read()
        stop.set()

    watcher = asyncio.create_task(until_eof())
    with tempfile.TemporaryDirectory(prefix="edge-open-load-") as tmp:
        await load(nats_url, prefix, int(port), float(rate), stop, Path(tmp), delays)
    watcher.cancel()
    Path(out).write_text(json.dumps(delays))
    return 0


def summarize(runs: list[dict], stamps: dict, label: str) -> dict:
    """Per step: the median time since the previous step and since the client's start (ms)."""
    rows = []
    for run in runs:
        s = {**stamps.get(run["rid"], {}), **{k: run[k] for k in ("start", "connect", "headers")}}
        for prev, step in zip(STEPS, STEPS[1:]):  # a step the open did not take: no time
            if step not in s and prev in s:  # (JetStream: no PING; the consumer is created after the headers)
                s[step] = s[prev]
        if all(k in s for k in STEPS):
            rows.append(s)
    print(f"\n{label}: {len(rows)} opens (of {len(runs)} with every stamp); median ms")
    print(f"{'step':12}{'step ms':>10}{'since start':>13}")
    out = {}
    prev = "start"
    for step in STEPS:
        delta = statistics.median(r[step] - r[prev] for r in rows) * 1e3
        since = statistics.median(r[step] - r["start"] for r in rows) * 1e3
        out[step] = {"step_ms": delta, "since_start_ms": since}
        print(f"{step:12}{delta:10.3f}{since:13.3f}")
        prev = step
    consumer = [r["consumer"] - r["start"] for r in rows if "consumer" in r]
    if consumer:
        out["consumer_since_start_ms"] = statistics.median(consumer) * 1e3
        print(f"{'consumer':12}{'':10}{out['consumer_since_start_ms']:13.3f}   (JetStream: ordered consumer created)")
    total = sorted((r["headers"] - r["start"]) * 1e3 for r in rows)
    out["open_ms"] = {"p50": total[len(total) // 2], "p90": total[int(len(total) * 0.9)], "n": len(total)}
    print(f"open: p50 {out['open_ms']['p50']:.3f} ms, p90 {out['open_ms']['p90']:.3f} ms")
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def split_delays(delays: list[tuple[float, float]], windows: list[tuple[float, float]]) -> dict:
    """Event delays (ms) of arrivals while a burst was opening, and of the others."""
    during = [d * 1e3 for at, d in delays if inside(at, windows)]
    other = [d * 1e3 for at, d in delays if not inside(at, windows)]
    return {name: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": max(v, default=float("nan")), "n": len(v)}
            for name, v in (("during", during), ("other", other), ("all", during + other))}


class Contender:
    """One server the client bursts open streams on: the stamped edge (ours or a baseline tree's) or the floor."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None, stamps_file: Path | None) -> None:
        self.name, self.port, self.stamps_file = name, port, stamps_file
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.runs: list[dict] = []
        self.windows: list[tuple[float, float]] = []
        self.rounds: list[dict] = []
        self.delays: list[tuple[float, float]] = []

    @property
    def edge(self) -> bool:
        return self.stamps_file is not None


async def main_async(args) -> dict:
    from streamproc.sim.embedded import EmbeddedNats, free_port, stop_process

    report: dict = {}
    config = None
    if args.deny_msg_get:
        config = ('authorization { users = [ { user: bench, password: bench, permissions: { publish: '
                  '{ allow: [">"], deny: ["$JS.API.STREAM.MSG.GET.>"] } } } ] }\nno_auth_user: bench\n')
    with EmbeddedNats(config=config) as server, tempfile.TemporaryDirectory(prefix="edge-open-") as tmp_dir:
        tmp = Path(tmp_dir)
        prefix = "open"
        script = str(Path(__file__).resolve())
        contenders: list[Contender] = []

        def stamped_edge(name: str, env: dict, per_pass: int | None = None) -> Contender:
            port = free_port()
            edge_argv = ["--nats-url", server.url, "--prefix", prefix, "--port", str(port), "--insecure-demo",
                         "--max-streams-per-client", "100000", "--log-level", "WARNING"]
            if args.mode == "jetstream":
                edge_argv.append("--ensure-results-stream")
            stamps_file = tmp / f"stamps-{name}.json"
            if args.probe_handles:
                env = {**env, "EDGE_OPEN_HANDLES": "1"}
            if per_pass is not None:
                env = {**env, "EDGE_OPEN_PER_PASS": str(per_pass)}
            return Contender(name, [sys.executable, script, "--serve", str(stamps_file), "--", *edge_argv],
                             port, env, stamps_file)

        try:
            contenders.append(stamped_edge("edge", dict(os.environ)))
            for n in args.per_pass:  # this tree's edge with another number of opens per loop pass
                contenders.append(stamped_edge(f"pp{n}", dict(os.environ), n))
            if args.baseline_tree:
                from latency import python_path
                contenders.append(stamped_edge("base", {**os.environ,
                                                        "PYTHONPATH": python_path(args.baseline_tree.resolve())}))
            if args.floor:
                port = free_port()
                contenders.append(Contender("floor", [sys.executable, script, "--floor-serve", str(port)], port,
                                            None, None))
            from latency import wait_http
            for c in contenders:
                if c.edge:
                    wait_http(f"http://127.0.0.1:{c.port}/healthz", c.proc)
            for _ in range(100):
                try:
                    for c in contenders:
                        (await asyncio.open_connection("127.0.0.1", c.port))[1].close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            if args.stored:
                await store(server.url, prefix, args.stored)
            for c in contenders:
                await client(c.port, 20, 1, 0.01, f"warm{c.name}")
            if args.deny_msg_get:  # one stream held open until the edge found out (the others close at once)
                for c in contenders:
                    if c.edge:
                        await fallen_back(c.port)
            for r in range(args.rounds):
                for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
                    await one_round(c, r, args, server.url, prefix, tmp, contenders[0])
        finally:
            for c in contenders:
                stop_process(c.proc, 15)
        load_note = f"load {args.load:g} results/s"
        print(f"\n{args.mode}{' without MSG.GET' if args.deny_msg_get else ''}, bursts of {args.burst}, "
              f"{load_note}, {args.rounds} interleaved round(s) of {args.opens} opens per contender")
        for c in contenders:
            entry: dict = {"rounds": c.rounds}
            if c.edge:
                recorded = json.loads(c.stamps_file.read_text())
                entry.update(summarize(c.runs, recorded["stamps"], f"{c.name}: {args.mode}, {load_note}"))
                passes = recorded["passes"]
                named = [x[3] for x in passes if len(x) > 3 and inside(x[0], c.windows)]
                if named:  # --probe-handles: what ran in the long passes during bursts
                    total: dict[str, float] = {}
                    for top in named:
                        for k, v in top.items():
                            total[k] = total.get(k, 0.0) + v
                    spent = sum(x[1] for x in passes if len(x) > 3 and inside(x[0], c.windows))
                    entry["long_pass_callbacks_ms"] = {k: v * 1e3 for k, v in total.items()}
                    print(f"{c.name}: callbacks in the passes > 1 ms during bursts ({spent * 1e3:.0f} ms in all)")
                    for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:12]:
                        print(f"  {v * 1e3:8.1f} ms  {k}")
                entry["loop_passes_ms"] = {
                    name: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": max(v, default=0.0),
                           "sum": sum(v)}
                    for name, v in (
                        ("during", [x[1] * 1e3 for x in passes if inside(x[0], c.windows)]),
                        ("other", [x[1] * 1e3 for x in passes if not inside(x[0], c.windows)]),
                        ("during_cpu", [x[2] * 1e3 for x in passes if inside(x[0], c.windows)]))}
            if args.load and c.delays:
                entry["event_delay_ms"] = split_delays(c.delays, c.windows)
            report[c.name] = entry
        print(f"\n{'round':6}" + "".join(f"{c.name + ' p50':>12}{c.name + ' cpu':>11}" for c in contenders)
              + "   (open p50 ms at the client; server CPU us per open" + (", with the load's events)" if args.load
                                                                           else ")"))
        for r in range(args.rounds):
            print(f"{r:<6}" + "".join(f"{c.rounds[r]['open_p50']:12.2f}{c.rounds[r]['cpu_us']:11.0f}"
                                      for c in contenders))
        print(f"{'median':6}" + "".join(
            f"{statistics.median(x['open_p50'] for x in c.rounds):12.2f}"
            f"{statistics.median(x['cpu_us'] for x in c.rounds):11.0f}" for c in contenders))
        print("client CPU us per open, median of the rounds: " + ", ".join(
            f"{c.name} {statistics.median(x['client_cpu_us'] for x in c.rounds):.0f}" for c in contenders)
              + f"; load average {min(x['loadavg'] for c in contenders for x in c.rounds):.1f}-"
              f"{max(x['loadavg'] for c in contenders for x in c.rounds):.1f}")
        names = [c.name for c in contenders]
        pairs = [("edge", b) for b in names[1:]] + [(a, "floor") for a in names[1:-1] if "floor" in names]
        for a, b in pairs:
            ca, cb = contenders[names.index(a)], contenders[names.index(b)]
            ratios = [x["open_p50"] / y["open_p50"] for x, y in zip(ca.rounds, cb.rounds)]
            diffs = [x["open_p50"] - y["open_p50"] for x, y in zip(ca.rounds, cb.rounds)]
            report[f"{a}/{b}"] = {"open_p50_ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)],
                                  "open_p50_minus_ms": statistics.median(diffs)}
            print(f"open p50 {a}/{b}: paired median x{statistics.median(ratios):.2f} "
                  f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); {a} - {b}: {statistics.median(diffs):+.2f} ms")
        if args.load:
            print(f"\n{'round':6}" + "".join(f"{c.name + ' ev p50d':>16}{'p99d':>8}{'p99':>8}" for c in contenders)
                  + "   (event delay ms: p50 and p99 while a burst opens, p99 of all)")
            for r in range(args.rounds):
                print(f"{r:<6}" + "".join(f"{c.rounds[r]['event_p50_during']:16.2f}{c.rounds[r]['event_p99_during']:8.2f}"
                                          f"{c.rounds[r]['event_p99_all']:8.2f}" for c in contenders))
            print(f"{'median':6}" + "".join(
                f"{statistics.median(x['event_p50_during'] for x in c.rounds):16.2f}"
                f"{statistics.median(x['event_p99_during'] for x in c.rounds):8.2f}"
                f"{statistics.median(x['event_p99_all'] for x in c.rounds):8.2f}" for c in contenders))
            print("\nevent delay, publish -> SSE reader (ms), while a burst opens / otherwise; loop passes > 1 ms")
            for c in contenders:
                e = report[c.name].get("event_delay_ms")
                if e is None:
                    continue
                d, o, a = e["during"], e["other"], e["all"]
                line = (f"{c.name:8} events p50 {d['p50']:6.2f} / {o['p50']:6.2f}  p99 {d['p99']:7.2f} / "
                        f"{o['p99']:7.2f}  max {d['max']:7.1f} / {o['max']:7.1f}  n {d['n']} / {o['n']}; "
                        f"all p99 {a['p99']:.2f}")
                print(line)
        print("\nedge loop passes > 1 ms: while a burst opens (wall ms; CPU ms) / otherwise (wall ms)")
        for c in contenders:
            lp = report[c.name].get("loop_passes_ms")
            if lp:
                d, u, o = lp["during"], lp["during_cpu"], lp["other"]
                print(f"{c.name:8} during: n {d['n']:4} p50 {d['p50']:6.2f} p99 {d['p99']:7.2f} max {d['max']:7.1f}; "
                      f"CPU p50 {u['p50']:6.2f} p99 {u['p99']:6.2f} max {u['max']:6.1f}  "
                      f"other: n {o['n']:4} p50 {o['p50']:6.2f} p99 {o['p99']:7.2f}")
    return report


async def one_round(c: Contender, r: int, args, nats_url: str, prefix: str, tmp: Path, edge: Contender) -> None:
    """One contender's bursts (with the load meanwhile, on the contender or, for the floor, on the edge)."""
    target = c if c.edge else edge
    delays_file = tmp / f"delays-{c.name}-{r}.json"
    loader = (await asyncio.create_subprocess_exec(  # its own process: not delayed by the client's bursts
        sys.executable, str(Path(__file__).resolve()), "--load-run", nats_url, prefix, str(target.port),
        str(args.load), str(delays_file), stdin=asyncio.subprocess.PIPE) if args.load else None)
    if loader:
        await asyncio.sleep(1.0)
    spy = (subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record", "-r", "1000", "-f", "raw", "-o", str(args.py_spy),
                             "-p", str(c.proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
           if args.py_spy and c.name == "edge" and r == 0 else None)
    windows: list[tuple[float, float]] = []
    cpu0 = cpu_seconds(c.proc.pid), time.process_time()
    runs = await client(c.port, args.opens, args.burst, args.gap, f"{c.name}{r}-", windows)
    cpu1 = cpu_seconds(c.proc.pid)
    cpu = (cpu1[0] - cpu0[0][0], cpu1[1] - cpu0[0][1]), time.process_time() - cpu0[1]
    if spy:
        spy.send_signal(2)
        spy.wait(30)
    if loader:
        loader.stdin.close()
        await loader.wait()
        delays = json.loads(delays_file.read_text())
        c.delays.extend(delays)
        split = split_delays(delays, windows)
        extra = {"event_p99_during": split["during"]["p99"], "event_p50_during": split["during"]["p50"],
                 "event_p99_all": split["all"]["p99"]}
    else:
        extra = {}
    c.runs.extend(runs)
    c.windows.extend(windows)
    opens = sorted((x["headers"] - x["start"]) * 1e3 for x in runs)
    c.rounds.append({"open_p50": opens[len(opens) // 2], "open_p90": opens[int(len(opens) * 0.9)],
                     "cpu_us": sum(cpu[0]) / len(runs) * 1e6, "cpu_user_us": cpu[0][0] / len(runs) * 1e6,
                     "cpu_sys_us": cpu[0][1] / len(runs) * 1e6, "client_cpu_us": cpu[1] / len(runs) * 1e6,
                     "loadavg": os.getloadavg()[0], **extra})


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(Path(sys.argv[2]), sys.argv[4:]))
    if len(sys.argv) > 2 and sys.argv[1] == "--floor-serve":
        sys.exit(floor_serve(int(sys.argv[2])))
    if len(sys.argv) > 2 and sys.argv[1] == "--load-run":
        sys.exit(asyncio.run(load_run(*sys.argv[2:7])))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("core", "jetstream"), default="core")
    parser.add_argument("--opens", type=int, default=200)
    parser.add_argument("--burst", type=int, default=1, help="streams opened at once per round")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between rounds")
    parser.add_argument("--load", type=float, default=0.0, help="results/s to 50 other streams meanwhile")
    parser.add_argument("--stored", type=int, default=0,
                        help="results stored before the opens (jetstream: each open then asks MSG.GET)")
    parser.add_argument("--deny-msg-get", action="store_true",
                        help="the NATS user may not publish $JS.API.STREAM.MSG.GET.> (the edge's fallback)")
    parser.add_argument("--py-spy", type=Path, help="record the edge with py-spy (raw format) in its first round")
    parser.add_argument("--probe-handles", action="store_true",
                        help="time the edge's loop callbacks and print what ran in its long passes during bursts")
    parser.add_argument("--per-pass", type=int, action="append", default=[], metavar="N",
                        help="also run this tree's edge letting N opens through per loop pass (edge/pacer.py; "
                             "repeatable; 100000: unbounded)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of --opens opens per contender")
    parser.add_argument("--floor", action="store_true",
                        help="also burst the same opens at a raw-asyncio server that answers the head at once")
    parser.add_argument("--baseline-tree", type=Path,
                        help="also run the stamped edge from this source tree (e.g. the main checkout)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    report = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
