"""How little CPU can any Python SSE edge spend per event on this machine? (issue 14, target 2)

Target 2 asks for <= 40 us of edge CPU per SSE event at 2,000 events/s over 50 streams. This script
puts that figure beside floors measured in the same harness and rounds, so a miss can be read as
"the edge's own work" or "the machine":

- ``floor``: the least a Python edge can do. One asyncio ``BufferedProtocol`` on a raw NATS connection (one
  wildcard SUB, a minimal HMSG parser) and a raw asyncio HTTP server; each result is written to its
  client's transport as ``id: <seq>`` + ``data: <body>`` straight from ``data_received``. No HTTP
  framework, no nats-py, no queues, no tasks per event, no bounds of any kind.
- ``natspy``: the same raw HTTP server, fed by stock nats-py (one wildcard subscription, callback).
- ``relay``: ``benchmarks/sse_relay.py``, the bare Starlette SSE relay (target 2's throughput baseline).
- ``edge``: ``streamproc edge`` (core mode, ``--insecure-demo``), from this tree or ``--tree``.
  ``--jetstream``: a JetStream stream captures the results (as the durable processor's results
  stream does), so each edge reads them through its recent ring's ordered consumer; the other
  contenders subscribe as before.

The harness (this process) opens 50 SSE streams to the contender, then publishes results (the
processor's result headers: seq, message id, join verdict) straight to ``P.results.<id>`` at a
paced rate, round robin over the streams, ``--batch`` of them per flush, and reads every stream. Each contender's CPU (utime +
stime from /proc) over the paced window is divided by the events its clients received. Rounds are
interleaved; the figure is the median over rounds, the range beside it.

``--count-calls``: each contender runs under ``call_hook.py`` (counting from the first paced
publish until every event was read), and the table gives its Python function calls and C calls
per event instead of CPU (the profiler slows it several times over: the CPU figures of such a run
mean nothing). As ``call_counts.py`` does for the durable processor: a change to the per-event
path shows exactly in its counts, where its CPU change would be lost in the noise.

Usage: python benchmarks/sse_floor.py [--rate 2000] [--seconds 4] [--rounds 5] [--batch 10] [--tree NAME=PATH] [--jetstream]
                                     [--only edge,main] [--count-calls]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from call_hook import OUTPUT_ENV, collect  # noqa: E402
from streamproc.core.wire import JOIN, MSG_ID, SEQ  # noqa: E402
from streamproc.nats.buffered_reads import BufferedReads  # noqa: E402  (no nats-py: a raw floor)
from streamproc.sim.embedded import EmbeddedNats, free_port, stop_process  # noqa: E402

PREFIX = "floor"
STREAMS = 50
BODY = b'{"text":" token","meta_info":{"completion_tokens":1}}'
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"connection: close\r\n\r\n")
HEALTHZ = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
DONE = b"data: [DONE]\n\n"
LAST = (b"Streamproc-Final: true", b"Streamproc-Error:")  # a request's last result (streamproc.core.wire)


# ------------------------------------------------------------------ the floor contenders (subprocesses)

class RawHttp:
    """A raw asyncio HTTP server: ``GET /v1/results/<id>`` registers the connection's transport.

    With ``nats`` (the floor), the wildcard subscription exists only while a stream is open: an idle
    floor parsing every result would load the machine under the other contenders' rounds
    (latency.py --raw-server). An open waits for the SUB's PONG before its head, as the edge's do."""

    def __init__(self) -> None:
        self.clients: dict[str, asyncio.Transport] = {}
        self.nats: RawNats | None = None
        self.waiting: list[tuple[str, asyncio.Transport]] = []
        self.live = False

    def admit(self, rid: str, transport: asyncio.Transport) -> None:
        if self.nats is None or self.live:
            transport.write(SSE_HEAD)
            self.clients[rid] = transport
            return
        if not self.waiting:
            self.nats.subscribe(self.on_live)
        self.waiting.append((rid, transport))

    def on_live(self) -> None:
        self.live = True
        for rid, transport in self.waiting:
            if not transport.is_closing():
                self.admit(rid, transport)
        self.waiting.clear()
        self.leave(None, None)  # every one of them may have left meanwhile

    def leave(self, rid: str | None, transport: asyncio.Transport | None) -> None:
        if rid is not None and self.clients.get(rid) is transport:
            del self.clients[rid]
        if self.nats is not None and self.live and not self.clients:
            self.nats.unsubscribe()
            self.live = False

    def factory(self) -> asyncio.Protocol:
        server = self

        class Conn(asyncio.Protocol):
            def connection_made(self, transport):  # type: ignore[override]
                self.transport, self.buf, self.rid = transport, b"", None

            def data_received(self, data: bytes) -> None:
                self.buf += data
                if self.rid is None and b"\r\n\r\n" in self.buf:
                    path = self.buf.split(b"\r\n", 1)[0].decode().split()[1]
                    if path == "/healthz":  # latency.py waits for it before its rounds
                        self.transport.write(HEALTHZ)
                        self.transport.close()
                        return
                    self.rid = path.rsplit("/", 1)[1]
                    server.admit(self.rid, self.transport)

            def connection_lost(self, exc):  # type: ignore[override]
                if self.rid is not None:
                    server.leave(self.rid, self.transport)

        return Conn()


def frame(seq: bytes, body: bytes) -> bytes:
    return b"id: " + seq + b"\ndata: " + body + b"\n\n"


class RawNats(BufferedReads):
    """One wildcard SUB while streams are open; a minimal parser of MSG/HMSG/PING frames (no
    validation: a floor)."""

    SEQ = re.compile(rb"Streamproc-Seq: (\d+)")

    def __init__(self, http: RawHttp, ready: asyncio.Future, prefix: str = PREFIX) -> None:
        self.http, self.buf, self.prefix = http, b"", prefix
        self.offset = len(prefix) + len(".results.")
        self.sid = 0
        self.pongs: collections.deque = collections.deque([lambda: ready.set_result(None)])
        http.nats = self

    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport
        transport.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\nPING\r\n')

    def subscribe(self, on_live) -> None:
        """SUB, then PING: its PONG proves the subscription live."""
        self.sid += 1
        self.pongs.append(on_live)
        self.transport.write(f"SUB {self.prefix}.results.* {self.sid}\r\nPING\r\n".encode())

    def unsubscribe(self) -> None:
        self.transport.write(f"UNSUB {self.sid}\r\n".encode())

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        clients = self.http.clients
        while pos < end:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            if buf.startswith(b"HMSG ", pos):
                parts = buf[pos + 5:eol].split()
                hlen, tlen = int(parts[-2]), int(parts[-1])
                start = eol + 2
                if start + tlen + 2 > end:
                    break
                headers = buf[start:start + hlen]
                body = buf[start + hlen:start + tlen]
                transport = clients.get(parts[0][self.offset:].decode())
                if transport is not None:
                    transport.write(frame(self.SEQ.search(headers).group(1), body))
                    if LAST[0] in headers or LAST[1] in headers:  # then [DONE], as an SSE edge ends a stream
                        transport.write(DONE)
                        transport.close()
                pos = start + tlen + 2
                continue
            line = buf[pos:eol]
            if line == b"PING":
                self.transport.write(b"PONG\r\n")
            elif line == b"PONG" and self.pongs:
                self.pongs.popleft()()
            pos = eol + 2
        self.buf = buf[pos:]


async def serve(kind: str, nats_url: str, port: int, prefix: str = PREFIX) -> None:
    loop = asyncio.get_running_loop()
    http = RawHttp()
    if kind == "floor":
        ready = loop.create_future()
        host, nats_port = nats_url.rsplit("//", 1)[1].rsplit(":", 1)
        await loop.create_connection(lambda: RawNats(http, ready, prefix), host, int(nats_port))
        await ready
    else:
        import nats
        nc = await nats.connect(nats_url)
        offset = len(prefix) + len(".results.")

        async def on_result(msg) -> None:
            transport = http.clients.get(msg.subject[offset:])
            if transport is not None:
                transport.write(frame(msg.headers["Streamproc-Seq"].encode(), msg.data))
                if msg.headers.get("Streamproc-Final") == "true" or "Streamproc-Error" in msg.headers:
                    transport.write(DONE)
                    transport.close()

        await nc.subscribe(f"{prefix}.results.*", cb=on_result)
        await nc.flush()
    await loop.create_server(http.factory, "127.0.0.1", port)
    await asyncio.Event().wait()


# ------------------------------------------------------------------ the harness

def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


COUNT_DIR: Path | None = None  # --count-calls: where each contender's call_hook.py writes its counts
HOOK = str(HERE / "call_hook.py")


def counts_path(kind: str) -> Path:
    assert COUNT_DIR is not None
    return COUNT_DIR / f"{kind}.json"


def start(kind: str, nats_url: str, port: int, trees: dict[str, Path]) -> subprocess.Popen:
    hook = [sys.executable, HOOK] if COUNT_DIR is not None else [sys.executable]
    env = dict(os.environ, **({OUTPUT_ENV: str(counts_path(kind))} if COUNT_DIR is not None else {}))
    if kind in ("floor", "natspy"):
        argv = [*hook, __file__, "--serve", kind, "--nats-url", nats_url, "--port", str(port)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    if kind == "relay":
        argv = [*hook, str(HERE / "sse_relay.py"), "--nats-url", nats_url, "--prefix", PREFIX, "--port", str(port)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    tree = trees[kind]
    if kind.endswith("+uvloop"):  # --uvloop: the same tree's edge on uvloop (STREAMPROC_EDGE_LOOP)
        env["STREAMPROC_EDGE_LOOP"] = "uvloop"
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))
    command = ["streamproc"] if COUNT_DIR is not None else ["-m", "streamproc.cli"]
    argv = [*hook, *command, "edge", "--nats-url", nats_url, "--prefix", PREFIX,
            "--port", str(port), "--insecure-demo", "--max-streams-per-client", "100000"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tree)


async def open_stream(port: int, rid: str, counts: dict[str, int]) -> asyncio.StreamWriter:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /v1/results/{rid} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"open {rid}: {head[:80]!r}")

    async def read() -> None:
        tail = b""  # the last 5 bytes: "data: " split across two reads is counted once
        while chunk := await reader.read(65536):
            data = tail + chunk
            counts[rid] += data.count(b"data: ")
            tail = data[-5:]
    asyncio.get_running_loop().create_task(read())
    return writer


async def one_round(kind: str, server: EmbeddedNats, trees: dict[str, Path], rate: float,
                    seconds: float, batch: int) -> dict:
    import nats
    port = free_port()
    proc = start(kind, server.url, port, trees)
    writers: list[asyncio.StreamWriter] = []
    try:
        for _ in range(300):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        tag = f"{kind}{time.monotonic_ns()}"
        rids = [f"{tag}-{i}" for i in range(STREAMS)]
        counts = dict.fromkeys(rids, 0)
        for rid in rids:
            writers.append(await open_stream(port, rid, counts))
        await asyncio.sleep(0.5)  # every stream's subscription is live (the edge flushes before headers)
        nc = await nats.connect(server.url)
        total = int(rate * seconds)
        headers = [{SEQ: str(i // STREAMS), MSG_ID: f"{rids[i % STREAMS]}.{i // STREAMS}", JOIN: "passthrough"}
                   for i in range(total)]
        subjects = [f"{PREFIX}.results.{rids[i % STREAMS]}" for i in range(total)]
        if COUNT_DIR is not None:
            proc.send_signal(signal.SIGUSR1)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        for i in range(total):
            await nc.publish(subjects[i], BODY, headers=headers[i])
            if i % batch == batch - 1:
                delay = t0 + (i + 1) / rate - time.monotonic()
                await (asyncio.sleep(delay) if delay > 0 else nc.flush())
        await nc.flush()
        deadline = time.monotonic() + 5
        while sum(counts.values()) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        cpu = cpu_seconds(proc.pid) - cpu0
        delivered = sum(counts.values())
        calls = await collect(proc, counts_path(kind), kind) if COUNT_DIR is not None else None
        await nc.close()
        out = {"cpu_us": cpu / max(delivered, 1) * 1e6, "delivered": delivered / total,
               "rate": total / (time.monotonic() - t0)}
        if calls is not None:
            per = max(delivered, 1)
            out["python_calls"] = sum(row[3] for row in calls["python"]) / per
            out["c_calls"] = sum(row[1] for row in calls["c"]) / per
            out["top"] = [(n / per, f"{name} ({Path(file).name}:{line})") for file, line, name, n in calls["python"][:30]]
            out["top_c"] = [(n / per, name) for name, n in calls["c"][:30]]
            out["calls"], out["events"] = calls, per  # all of them (edge_calls.py compares runs by function)
        return out
    finally:
        for w in writers:
            w.close()
        stop_process(proc, 5)


async def run(args) -> None:
    trees = {"edge": ROOT, **{name: Path(path).resolve() for name, _, path in
                              (spec.partition("=") for spec in args.tree)}}
    kinds = ["floor", "natspy", "relay", *trees]
    if args.only:
        kinds = [k for k in kinds if k in args.only.split(",")]
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    print(f"{os.cpu_count()} cores; {'JetStream results stream; ' if args.jetstream else ''}{STREAMS} SSE streams; {args.rate:,.0f} events/s for {args.seconds:g} s per "
          f"round; {args.rounds} rounds, order rotated; edge CPU us per event received", flush=True)
    with EmbeddedNats(jetstream=args.jetstream) as server:
        if args.jetstream:  # the durable processor's results stream (streamproc.nats.streams)
            import nats
            from streamproc.core.wire import Subjects
            from streamproc.nats.streams import ensure_results_stream
            nc = await nats.connect(server.url)
            await ensure_results_stream(nc.jetstream(), Subjects(PREFIX))
            await nc.close()
        for r in range(args.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                results[kind].append(await one_round(kind, server, trees, args.rate, args.seconds, args.batch))
            print(f"round {r + 1}: " + ", ".join(f"{k} {results[k][-1]['cpu_us']:.0f}" for k in kinds), flush=True)
    if COUNT_DIR is not None:
        print(f"\n{'contender':10}{'Python calls/event':>20}{'C calls/event':>15}{'delivered':>11}   (medians of the rounds)")
        for kind in kinds:
            xs = results[kind]
            print(f"{kind:10}{statistics.median(x['python_calls'] for x in xs):20.1f}"
                  f"{statistics.median(x['c_calls'] for x in xs):15.1f}{min(x['delivered'] for x in xs):11.3f}")
        for kind in kinds:
            print(f"\n{kind}, Python functions called most, per event (last round):")
            for n, name in results[kind][-1]["top"]:
                print(f"  {n:7.2f}  {name}")
            print(f"{kind}, C functions called most, per event (last round):")
            for n, name in results[kind][-1]["top_c"]:
                print(f"  {n:7.2f}  {name}")
        return
    print(f"\n{'contender':10}{'cpu us/event':>14}{'(range)':>14}{'x floor':>9}{'delivered':>11}")
    floor = statistics.median(x["cpu_us"] for x in results["floor"]) if "floor" in results else float("nan")
    for kind in kinds:
        cpu = [x["cpu_us"] for x in results[kind]]
        print(f"{kind:10}{statistics.median(cpu):14.1f}{f'({min(cpu):.0f}-{max(cpu):.0f})':>14}"
              f"{statistics.median(cpu) / floor:9.2f}{min(x['delivered'] for x in results[kind]):11.3f}")
    for name in trees:
        if name != "edge" and name in results and "edge" in results:
            pairs = [a["cpu_us"] / b["cpu_us"] for a, b in zip(results["edge"], results[name])]
            print(f"paired edge/{name} per round: {' '.join(f'{x:.2f}' for x in pairs)}; "
                  f"median {statistics.median(pairs):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--batch", type=int, default=10, metavar="N",
                        help="results published per flush: 10 (default) reach the edge ten to a read; "
                             "1 one to a read, as a processor's results at 2,000/s mostly do")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="also run `streamproc edge` from this source tree (e.g. main=../main); a NAME "
                             "ending in +uvloop runs that edge on uvloop (STREAMPROC_EDGE_LOOP=uvloop)")
    parser.add_argument("--only", metavar="NAMES", help="run only these contenders (e.g. edge,main: a quicker A/B)")
    parser.add_argument("--jetstream", action="store_true",
                        help="a JetStream stream captures the results: the edges read them with an ordered consumer")
    parser.add_argument("--count-calls", action="store_true",
                        help="count each contender's Python and C calls per event (call_hook.py) instead of its CPU")
    parser.add_argument("--serve", choices=["floor", "natspy"], help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default=PREFIX, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if args.serve:
        asyncio.run(serve(args.serve, args.nats_url, args.port, args.prefix))
    elif args.count_calls:
        global COUNT_DIR
        with tempfile.TemporaryDirectory() as tmp:
            COUNT_DIR = Path(tmp)
            asyncio.run(run(args))
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
