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

Usage: python benchmarks/edge_open.py [--mode core] [--opens 200] [--burst 1] [--load 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
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

    stamps: dict[str, dict[str, float]] = {}
    current: contextvars.ContextVar[str | None] = contextvars.ContextVar("rid", default=None)

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
        stamps_file.write_text(json.dumps(stamps))


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


async def client(port: int, opens: int, burst: int, gap: float, tag: str) -> list[dict]:
    runs: list[dict] = []
    for r in range(opens // burst):
        outs = [{"rid": f"{tag}{r}-{i}"} for i in range(burst)]
        await asyncio.gather(*(open_one("127.0.0.1", port, o["rid"], o) for o in outs))
        runs.extend(outs)
        await asyncio.sleep(gap)
    return runs


async def load(nats_url: str, prefix: str, port: int, rate: float, stop: asyncio.Event, tmp: Path) -> None:
    """RATE results/s to 50 streams held open by benchmarks/latency.py's SSE client process."""
    import nats

    from streamproc.wire import Role  # noqa: F401 - the same package the edge reads with
    out = tmp / "load.json"
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
                    await nc.publish(f"{prefix}.results.{rid}", b'{"text":"x","meta_info":{}}', headers=headers)
                    n += 1
            wave += 1
    finally:
        reader_proc.stdin.write(b"quit\n")
        await reader_proc.stdin.drain()
        await reader_proc.wait()
        await nc.close()


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


async def main_async(args) -> dict:
    from streamproc.sim.embedded import EmbeddedNats, free_port, stop_process

    report = {}
    config = None
    if args.deny_msg_get:
        config = ('authorization { users = [ { user: bench, password: bench, permissions: { publish: '
                  '{ allow: [">"], deny: ["$JS.API.STREAM.MSG.GET.>"] } } } ] }\nno_auth_user: bench\n')
    with EmbeddedNats(config=config) as server, tempfile.TemporaryDirectory(prefix="edge-open-") as tmp_dir:
        tmp = Path(tmp_dir)
        port = free_port()
        stamps_file = tmp / "stamps.json"
        prefix = "open"
        edge_argv = ["--nats-url", server.url, "--prefix", prefix, "--port", str(port), "--insecure-demo",
                     "--max-streams-per-client", "100000", "--log-level", "WARNING"]
        if args.mode == "jetstream":
            edge_argv.append("--ensure-results-stream")
        env = dict(os.environ)
        edge = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(stamps_file), "--",
                                 *edge_argv], env=env, stdin=subprocess.DEVNULL)
        try:
            from latency import wait_http
            wait_http(f"http://127.0.0.1:{port}/healthz", edge)
            if args.stored:
                await store(server.url, prefix, args.stored)
            await client(port, 20, 1, 0.01, "warm")
            if args.deny_msg_get:  # one stream held open until the edge found out (the others close at once)
                await fallen_back(port)
            stop = asyncio.Event()
            loader = (asyncio.create_task(load(server.url, prefix, port, args.load, stop, tmp))
                      if args.load else None)
            if loader:
                await asyncio.sleep(1.0)
            spy = (subprocess.Popen(["py-spy", "record", "-r", "1000", "-f", "raw", "-o", str(args.py_spy),
                                     "-p", str(edge.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   if args.py_spy else None)
            cpu0 = cpu_seconds(edge.pid), time.process_time()
            runs = await client(port, args.opens, args.burst, args.gap, "o")
            cpu1 = cpu_seconds(edge.pid)
            cpu = (cpu1[0] - cpu0[0][0], cpu1[1] - cpu0[0][1]), time.process_time() - cpu0[1]
            if spy:
                spy.send_signal(2)
                spy.wait(30)
            if loader:
                stop.set()
                await loader
        finally:
            stop_process(edge, 15)
        stamps = json.loads(stamps_file.read_text())
        label = (f"{args.mode}{' without MSG.GET' if args.deny_msg_get else ''}, bursts of {args.burst}, "
                 f"load {args.load:g} results/s")
        report = summarize(runs, stamps, label)
        report["cpu_us_per_open"] = {"edge": sum(cpu[0]) / len(runs) * 1e6, "client": cpu[1] / len(runs) * 1e6,
                                     "edge_user": cpu[0][0] / len(runs) * 1e6, "edge_sys": cpu[0][1] / len(runs) * 1e6}
        print(f"CPU per open: edge {report['cpu_us_per_open']['edge']:.0f} us "
              f"(user {report['cpu_us_per_open']['edge_user']:.0f}, sys {report['cpu_us_per_open']['edge_sys']:.0f})"
              + (" (with the load's events)" if args.load else "")
              + f", client {report['cpu_us_per_open']['client']:.0f} us")
    return report


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        sys.exit(serve(Path(sys.argv[2]), sys.argv[4:]))
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
    parser.add_argument("--py-spy", type=Path, help="record the edge with py-spy (raw format) meanwhile")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    report = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
