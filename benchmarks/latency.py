"""End-to-end latency: worker publish -> SSE client, beside publish -> result subscriber and the floor,
publish -> chunk subscriber, in core and durable mode (issue 14, target 5).

Everything is real and separate: one nats-server (JetStream on), ``streamproc run`` and
``streamproc edge`` subprocesses, and an SSE client process (this script with ``--sse-client``)
holding the HTTP streams. The load generator (this process) publishes aggregated streamed SGLang
chunks (one token each) and also subscribes, as plain NATS clients, to ``P.chunks.>`` (the floor:
what any NATS consumer of the worker's chunk sees) and ``P.results.>`` (the processor's output).
Every arrival is stamped with ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for every process
on the machine) and matched to its chunk's publish stamp by (request id, seq).

Requests come in waves of ``--streams`` concurrent SSE streams (50 by default) of ``--chunks``
chunks each. The SSE client opens wave n+1 while wave n is published, so no chunk is published to a
stream that is not open yet (in core mode the edge sees only results published after the open),
and it reports each open's time to response headers. ``--sse-clients 2`` gives the waves to two
client processes in turn, so the process reading wave n's events is not the one opening wave n+1
(a burst of 50 opens costs the Python client ~20 ms of CPU here, during which its own reads wait).
The SSE client is a few lines of raw asyncio HTTP/1.1 (chunked transfer) rather than httpx: a
client slower than the edge would measure itself.

Per mode: first the pipeline's peak (several waves opened, then published as fast as possible;
SSE events delivered / time from first publish to last event), then paced runs at 2,000 chunks/s
and at half of that peak, printing p50/p99/p99.9 per hop and the added latency over the floor.

``--baseline-tree DIR`` (e.g. the main checkout) adds a third contender to the interleaved rounds:
``streamproc edge`` run from that source tree (``PYTHONPATH``), on the same processor and results, so
a change to the edge is measured against its base in the same run (rows "vs base").
``--raw-server`` adds ``sse_floor.py``'s raw asyncio SSE server to the same rounds (rows "vs raw"): the
least SSE server, so the edge's SSE p99 / result p99 can be read beside what the harness allows.
``--count-calls`` runs the edge under ``call_hook.py`` and counts its Python and C calls over each
mode's 2,000 chunks/s run (opens, closes and events: this harness's lifecycle of one stream per
``--chunks`` events), printed per SSE event with the functions that differ between the modes (the
profiler slows the edge several times over: that run's CPU and latency figures mean nothing).
``--spread-run S`` adds, per mode, one more 2,000 chunks/s run whose waves open their streams evenly
over S seconds, as independent clients arrive: a burst of 50 opens at once costs the client alone
more than 5 ms, so the bursts measure the harness as much as the edge's open time.

Usage: python benchmarks/latency.py [--seconds 8] [--streams 50] [--chunks 40] [--modes core,durable]
                                    [--baseline-tree DIR] [--raw-server] [--spread-run 0.5] [--json out.json]
                                    [--count-calls]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from call_hook import collect  # benchmarks/, the script's directory

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
RATE = 2000.0
COUNT_DIR: Path | None = None  # --count-calls: where the edge under call_hook.py writes its counts
OPEN_SPREAD = 0.0  # --open-spread: seconds over which a paced run's wave opens its streams
BASELINE_TREE: Path | None = None  # --baseline-tree: an edge from this source tree, beside ours
TRACE_DIR: Path | None = None  # --trace-dir: each run's per-chunk stamps (publish, floor, result, SSE) as JSON
SSE_CLIENTS = 1  # --sse-clients: SSE client processes; wave n is opened and read by client n % SSE_CLIENTS
RAW_SERVER = False  # --raw-server: the least SSE server (sse_floor.py's raw asyncio one) joins the rounds


def python_path(tree: Path) -> str:
    """The tree's package and its built-in codecs (as benchmarks/durable_trees.py)."""
    return os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))
TARGETS_CORE = {"p50": 2.0, "p99": 10.0}  # added ms over the floor, core mode (issue 14, target 5)


# ----------------------------------------------------------------------------- the SSE client process

# Linux: the kernel's receive time of a read's data (struct timespec, CLOCK_REALTIME) as ancillary data.
SO_TIMESTAMPNS = 35
_STAMP_SPACE = socket.CMSG_SPACE(16)


class StampedSocket:
    """The socket under an asyncio transport, read with ``recvmsg_into`` so that each read also
    carries the kernel's receive stamp (``SO_TIMESTAMPNS``): when the edge's bytes reached this
    client's socket, whatever this process was doing then. For TCP the stamp is that of the read's
    last segment, so an event in an earlier segment of the same read is stamped late, never early.
    ``reads`` holds (bytes received so far, stamp as ``time.perf_counter()``) per read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.received = 0
        self.reads: list[tuple[int, float]] = []
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

    def recv_into(self, buf, nbytes: int = 0) -> int:
        n, ancdata, _, _ = self._sock.recvmsg_into([memoryview(buf)[:nbytes] if nbytes else buf], _STAMP_SPACE)
        if n:
            self.received += n
            stamp = None
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
                    sec, nsec = struct.unpack("qq", data[:16])
                    # CLOCK_REALTIME -> CLOCK_MONOTONIC (perf_counter), the offset read now
                    stamp = sec + nsec * 1e-9 - (time.clock_gettime(time.CLOCK_REALTIME) - time.perf_counter())
            self.reads.append((self.received, stamp if stamp is not None else time.perf_counter()))
        return n

    def recv(self, bufsize: int) -> bytes:  # what the transport calls for a plain (not buffered) protocol
        buf = bytearray(bufsize)
        return bytes(buf[:self.recv_into(buf)])

    def stamp_of(self, offset: int) -> float:
        """The receive stamp of the read that brought the stream's byte at ``offset`` (exclusive end)."""
        i = bisect.bisect_left(self.reads, (offset, -1.0))
        return self.reads[min(i, len(self.reads) - 1)][1]

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def stamp_transport(writer: asyncio.StreamWriter) -> StampedSocket | None:
    """Swap the transport's socket for a :class:`StampedSocket` (asyncio's selector transport reads
    with ``self._sock.recv``, or ``recv_into`` for a buffered protocol); None where that is not how
    it reads."""
    transport = writer.transport
    sock = getattr(transport, "_sock", None)
    if not isinstance(sock, socket.socket) or not hasattr(transport, "_read_ready__data_received"):
        return None
    try:
        stamped = StampedSocket(sock)
    except OSError:
        return None
    transport._sock = stamped
    return stamped


class StampedNatsReader:
    """A minimal NATS subscriber on a raw socket that stamps each message with the kernel's receive
    time of the read holding its last byte (as :class:`StampedSocket`), so the floor and result hops
    can be compared with the SSE client's socket stamps, without the load generator's own delays.
    ``seen[name]`` maps (request id, seq) to the stamp, ``name`` being the subscription's."""

    def __init__(self, url: str, subjects: dict[str, str]) -> None:
        self.url, self.subjects = url, subjects  # name -> subject
        self.seen: dict[str, dict[tuple[str, int], float]] = {name: {} for name in subjects}
        self.cuts: dict[int, tuple[str, int, bool]] = {}
        self.buf = bytearray()
        self.base = 0  # stream offset of buf[0]
        self.received = 0
        self.reads: list[tuple[int, float]] = []
        self.sock: socket.socket | None = None

    async def start(self, cuts: dict[str, tuple[int, bool]]) -> None:
        """``cuts[name]``: (characters of the subject before the request id, whether a role token follows)."""
        host, port = self.url.removeprefix("nats://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        lines = [b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n']
        for sid, (name, subject) in enumerate(self.subjects.items(), 1):
            lines.append(f"SUB {subject} {sid}\r\n".encode())
            self.cuts[sid] = (name, *cuts[name])
        sock.sendall(b"".join(lines) + b"PING\r\n")
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self.ponged = loop.create_future()
        loop.add_reader(sock.fileno(), self._readable)
        await asyncio.wait_for(self.ponged, 10)

    def close(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _readable(self) -> None:
        sock = self.sock
        while sock is not None:
            try:
                data, ancdata, _, _ = sock.recvmsg(1 << 18, _STAMP_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                self.close()
                return
            stamp = None
            for level, kind, raw in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    stamp = sec + nsec * 1e-9 - (time.clock_gettime(time.CLOCK_REALTIME) - time.perf_counter())
            self.received += len(data)
            self.reads.append((self.received, stamp if stamp is not None else time.perf_counter()))
            self.buf += data
        self._parse()

    def _parse(self) -> None:
        buf, pos = self.buf, 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = bytes(buf[pos:eol])
            if line.startswith((b"MSG ", b"HMSG ")):
                parts = line.split(b" ")
                hsize = int(parts[-2]) if parts[0] == b"HMSG" else 0
                size = int(parts[-1])
                end = eol + 2 + size + 2
                if len(buf) < end:
                    break
                name, cut, role = self.cuts[int(parts[2])]
                frame = bytes(buf[eol + 2:eol + 2 + hsize])
                at = frame.find(b"Streamproc-Seq:")
                if at >= 0:
                    seq = int(frame[at + 15:frame.index(b"\r\n", at)])
                    rid = parts[1][cut:].decode()
                    if role:
                        rid = rid.rsplit(".", 1)[0]
                    offset = self.base + eol + 2 + size  # the frame's last payload byte (exclusive end)
                    i = bisect.bisect_left(self.reads, (offset, -1.0))
                    self.seen[name][(rid, seq)] = self.reads[min(i, len(self.reads) - 1)][1]
                pos = end
            else:
                if line == b"PING" and self.sock is not None:
                    self.sock.send(b"PONG\r\n")
                elif line == b"PONG" and not self.ponged.done():
                    self.ponged.set_result(None)
                pos = eol + 2
        del buf[:pos]
        self.base += pos
        if len(self.reads) > 64:  # keep the reads that may still hold an unparsed frame's end
            keep = bisect.bisect_left(self.reads, (self.base, -1.0))
            del self.reads[:max(0, keep - 1)]


async def sse_stream(host: str, port: int, rid: str, arrivals: list, opened: list, wave: list) -> None:
    """One ``GET /v1/results/<rid>``: each event's (rid, seq, arrival, kernel receive stamp) until
    ``data: [DONE]``. The arrival is when this client's loop got the event (what a client sees),
    the receive stamp when its bytes reached this client's socket (what the edge did, without this
    process's own delays: the opens of the next wave, its GC, waiting for a core)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    stamped = stamp_transport(writer)
    writer.write(f"GET /v1/results/{rid} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n"
                 "Connection: close\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    opened.append(time.perf_counter() - t0)
    wave.append(rid)
    if status != 200:
        body = await reader.read(2000)
        raise RuntimeError(f"{rid}: HTTP {status} {body[:200]!r}")
    chunked = b"transfer-encoding: chunked" in head.lower()
    buf = b""
    offset = len(head)  # bytes of the response taken from the reader so far
    try:
        while True:
            if chunked:
                line = await reader.readline()
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    return
                data = (await reader.readexactly(size + 2))[:-2]
                offset += len(line) + size + 2
            else:
                data = await reader.read(1 << 16)
                if not data:
                    return
                offset += len(data)
            now = time.perf_counter()
            received = stamped.stamp_of(offset) if stamped is not None and stamped.reads else now
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                seq = None
                for line in event.split(b"\n"):
                    if line.startswith(b"id: "):
                        seq = int(line[4:])
                    elif line == b"data: [DONE]":
                        return
                if seq is not None:
                    arrivals.append((rid, seq, now, received))
    finally:
        writer.close()


async def sse_client(url: str, out: Path, spread: float = 0.0) -> None:
    """Reads ``open <wave> <rid> ...`` lines; answers ``opened <wave>`` once every stream has its
    headers; on ``quit`` waits for open streams to end and writes arrivals and open times as JSON.
    ``spread`` > 0: a wave's opens are spaced evenly over that many seconds instead of all at once,
    as independent clients arrive."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    arrivals: list = []
    opened: list[float] = []
    tasks: list[asyncio.Task] = []
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    errors: list[str] = []

    async def open_wave(wave: str, rids: list[str]) -> None:
        wave_opened: list[str] = []  # per wave: waves opened together may finish in any order
        for i, rid in enumerate(rids):
            if spread > 0 and i:
                await asyncio.sleep(spread / len(rids))
            task = asyncio.create_task(sse_stream(host, int(port), rid, arrivals, opened, wave_opened))
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or errors.append(repr(t.exception())))
            tasks.append(task)
        while len(wave_opened) < len(rids) and not errors:
            await asyncio.sleep(0.002)
        print(f"opened {wave}" if not errors else f"error {errors[0]}", flush=True)

    while True:
        line = (await reader.readline()).decode().split()
        if not line or line[0] == "quit":
            break
        if line[0] == "open":
            asyncio.create_task(open_wave(line[1], line[2:]))
    done, pending = await asyncio.wait(tasks, timeout=60) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    out.write_text(json.dumps({"arrivals": arrivals, "opened": opened, "errors": errors,
                               "unfinished": len(pending)}))


# ----------------------------------------------------------------------------- the load generator

CDF_QUANTILES = [i / 100 for i in range(100)] + [0.995, 0.999, 1.0]


def percentiles(values: list[float], *, cdf: bool = False) -> dict:
    """p50/p99/p99.9 (and the quantiles a CDF plot needs) of ``values``."""
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "p99.9": float("nan"), "n": 0}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    out = {"p50": pick(0.5), "p99": pick(0.99), "p99.9": pick(0.999), "n": len(v)}
    if cdf:
        out["cdf"] = [[q, pick(q)] for q in CDF_QUANTILES]
    return out


def cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def voluntary_switches(pid: int) -> int:
    """Voluntary context switches of a process (Linux /proc): about one per wake-up of an event loop
    that sleeps in epoll_wait between reads (docs/benchmarks.md, results per NATS read)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def edge_flags() -> list[str]:
    """``--insecure-demo`` (no capabilities: the SSE client is one address), and per-client stream
    limits above the benchmark's open streams, or every wave past 32 streams would get 429."""
    text = subprocess.run([str(BIN / "streamproc"), "edge", "--help"], capture_output=True, text=True).stdout
    flags = ["--insecure-demo"] if "--insecure-demo" in text else []
    if "--max-streams-per-client" in text:
        flags += ["--max-streams-per-client", "100000"]
    return flags


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def wait_results_stream(nats_url: str, prefix: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Until the durable processor has created the JetStream stream that stores ``prefix``'s results."""
    import nats

    async def find() -> bool:
        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().find_stream_name_by_subject(f"{prefix}.results.x")
            return True
        except nats.js.errors.NotFoundError:
            return False
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamproc run exited with {proc.returncode}")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside the run's event loop
            if pool.submit(asyncio.run, find()).result():
                return
        time.sleep(0.1)
    raise RuntimeError(f"no results stream for {prefix} after {timeout} s")


class Mode:
    """One mode's processor and edge on a shared nats-server, with its own subject prefix."""

    def __init__(self, nats_url: str, mode: str, logdir: Path) -> None:
        from streamproc.sim.embedded import free_port
        self.mode, self.nats_url, self.prefix = mode, nats_url, f"lat{mode}"
        self.port = free_port()
        self.counts = (COUNT_DIR or Path()) / f"{mode}-edge.json"  # --count-calls
        self.edge_url = f"http://127.0.0.1:{self.port}"
        common = ["--nats-url", nats_url, "--prefix", self.prefix, "--log-level", "WARNING"]
        run = [str(BIN / "streamproc"), "run", *common, "--format", "sglang", "--mode", mode]
        edge = [str(BIN / "streamproc"), "edge", *common, "--port", str(self.port), *edge_flags()]
        # The baseline of target 2: a bare Starlette SSE relay on the same results (sse_relay.py).
        self.relay_port = free_port()
        self.relay_url = f"http://127.0.0.1:{self.relay_port}"
        relay = [sys.executable, str(HERE / "sse_relay.py"), "--nats-url", nats_url, "--prefix", self.prefix,
                 "--port", str(self.relay_port)]
        argvs, names, envs = [run, edge, relay], ["run", "edge", "relay"], [None, None, None]
        if COUNT_DIR is not None:  # the same command line, in-process under the call counter
            argvs[1] = [sys.executable, str(HERE / "call_hook.py"), "streamproc", *edge[1:]]
            envs[1] = {**os.environ, "CALL_HOOK_OUTPUT": str(self.counts)}
        self.base_url = self.raw_url = None
        if BASELINE_TREE is not None:  # the same edge command, imported from the baseline's tree
            base_port = free_port()
            self.base_url = f"http://127.0.0.1:{base_port}"
            argvs.append([str(BIN / "streamproc"), "edge", *common, "--port", str(base_port), *edge_flags()])
            names.append("base")
            envs.append({**os.environ, "PYTHONPATH": python_path(BASELINE_TREE)})
        if RAW_SERVER:  # what the harness allows any SSE server: no HTTP framework, no nats-py, no bounds
            raw_port = free_port()
            self.raw_url = f"http://127.0.0.1:{raw_port}"
            argvs.append([sys.executable, str(HERE / "sse_floor.py"), "--serve", "floor", "--nats-url", nats_url,
                          "--prefix", self.prefix, "--port", str(raw_port)])
            names.append("raw")
            envs.append(None)
        self.names = names
        self.logs = [open(logdir / f"{mode}-{name}.log", "wb") for name in names]
        self.procs = []
        for i, (argv, log, env) in enumerate(zip(argvs, self.logs, envs)):
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env))
            if i == 0 and mode == "durable":
                # An edge decides at start how it reads (the results stream through its recent ring's
                # consumer, or core NATS), as in a deployment where the processor runs first.
                wait_results_stream(nats_url, self.prefix, self.procs[0])
        wait_http(f"{self.edge_url}/healthz", self.procs[1])
        wait_http(f"{self.relay_url}/healthz", self.procs[2])
        for name in names[3:]:
            wait_http(f"{self.url(name)}/healthz", self.procs[names.index(name)])

    def url(self, target: str) -> str:
        return {"edge": self.edge_url, "relay": self.relay_url, "base": self.base_url, "raw": self.raw_url}[target]

    def close(self) -> None:
        from streamproc.sim.embedded import stop_process
        for proc in self.procs:
            stop_process(proc, 15)
        for log in self.logs:
            log.close()


def build_wave(tag: str, streams: int, chunks: int):
    """``streams`` requests of ``chunks`` one-token chunks, interleaved request by request."""
    from streamproc.catalog import worker_for
    from streamproc.simulation import make_truth
    from streamproc.wire import Role, chunk_headers
    worker = worker_for("sglang")
    per_request = []
    for i in range(streams):
        rid = f"{tag}-{i}"
        truth = make_truth(i, request_id=rid, prompt_len=16, output_len=chunks, num_layers=2, top_k=2,
                           chunk_sizes=[1] * chunks, return_logprob=False)
        bodies = worker.agg(truth, stream=True)
        per_request.append([(rid, seq, body, chunk_headers(rid, Role.AGG, seq, final=seq == len(bodies) - 1))
                            for seq, body in enumerate(bodies)])
    rids = [r[0][0] for r in per_request]
    return rids, [msg for step in zip(*per_request) for msg in step]


async def one_run(mode: Mode, label: str, waves: int, streams: int, chunks: int, rate: float | None,
                  tmp: Path, target: str = "edge", spread: float | None = None, count: bool = False) -> dict:
    """Publish ``waves`` waves at ``rate`` chunks/s (None: as fast as possible, all waves opened
    first) with the SSE client reading from ``target`` ("edge" or "relay", the bare Starlette
    relay); returns per-hop latencies and the SSE delivery rate. ``spread``: this run's opens of a
    wave are spaced over that many seconds (default ``--open-spread``; a peak run opens at once).
    ``count`` (``--count-calls``): the edge's calls from the first publish until the clients are done."""
    import nats
    open_spread = spread if spread is not None else (OPEN_SPREAD if rate is not None else 0.0)
    outs = [tmp / f"{mode.mode}-{label}-{target}-{k}.json" for k in range(SSE_CLIENTS)]
    clients = [await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "--sse-client", mode.url(target), "--out", str(out),
        "--open-spread", str(open_spread),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for out in outs]
    nc = await nats.connect(mode.nats_url)
    published: dict[tuple[str, int], float] = {}
    floor: dict[tuple[str, int], float] = {}
    result: dict[tuple[str, int], float] = {}
    ccut, rcut = len(f"{mode.prefix}.chunks."), len(f"{mode.prefix}.results.")

    async def on_chunk(msg) -> None:
        floor[(msg.subject[ccut:].rsplit(".", 1)[0], int(msg.headers["Streamproc-Seq"]))] = time.perf_counter()

    async def on_result(msg) -> None:
        result[(msg.subject[rcut:], int(msg.headers["Streamproc-Seq"]))] = time.perf_counter()

    await nc.subscribe(f"{mode.prefix}.chunks.>", cb=on_chunk, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.subscribe(f"{mode.prefix}.results.>", cb=on_result, pending_msgs_limit=-1, pending_bytes_limit=-1)
    # The same two hops stamped by the kernel at a subscriber's socket (beside the SSE client's)
    stamped = StampedNatsReader(mode.nats_url, {"floor": f"{mode.prefix}.chunks.>",
                                                "result": f"{mode.prefix}.results.>"})
    await stamped.start({"floor": (ccut, True), "result": (rcut, False)})
    await nc.flush()
    built = [build_wave(f"{label}{w}", streams, chunks) for w in range(waves)]

    async def request_open(w: int) -> None:  # wave w is opened and read by client w % SSE_CLIENTS
        client = clients[w % len(clients)]
        client.stdin.write(f"open {w} {' '.join(built[w][0])}\n".encode())
        await client.stdin.drain()

    opened_waves: set[str] = set()

    async def wait_opened(w: int) -> None:
        # Waves opened together (the peak run opens them all first) may finish opening in any order.
        client = clients[w % len(clients)]
        while str(w) not in opened_waves:
            line = (await asyncio.wait_for(client.stdout.readline(), 120)).decode().strip()
            if not line.startswith("opened "):
                raise RuntimeError(f"SSE client: {line!r}")
            opened_waves.add(line.split()[1])

    try:
        ahead = waves if rate is None else 1
        for w in range(ahead):
            await request_open(w)
        for w in range(ahead):
            await wait_opened(w)
        await nc.flush()
        await asyncio.sleep(0.05)
        subject = f"{mode.prefix}.chunks.%s.agg"
        cpu0 = [cpu_seconds(p.pid) for p in mode.procs]
        switches0 = voluntary_switches(mode.procs[mode.names.index(target)].pid)
        if count:
            mode.procs[1].send_signal(signal.SIGUSR1)
        started = time.perf_counter()
        n = 0
        for w in range(waves):
            if rate is not None and w + 1 < waves:
                await request_open(w + 1)  # opened while this wave is published
            for rid, seq, body, headers in built[w][1]:
                if rate is not None:
                    due = started + n / rate
                    now = time.perf_counter()
                    if due > now + 0.001:
                        await nc.flush()
                        await asyncio.sleep(due - now)
                published[(rid, seq)] = time.perf_counter()
                await nc.publish(subject % rid, body, headers=headers)
                n += 1
            await nc.flush()
            if rate is not None and w + 1 < waves:
                await wait_opened(w + 1)
        for client in clients:
            client.stdin.write(b"quit\n")
            await client.stdin.drain()
        for client in clients:
            await asyncio.wait_for(client.wait(), 180)
        cpu = [cpu_seconds(p.pid) - c for p, c in zip(mode.procs, cpu0)]
        switches = voluntary_switches(mode.procs[mode.names.index(target)].pid) - switches0
        calls = await collect(mode.procs[1], mode.counts, "edge") if count else None
        data: dict = {"arrivals": [], "opened": [], "errors": []}
        for out in outs:
            for key, value in json.loads(out.read_text()).items():
                if key in data:
                    data[key] += value
    finally:
        await nc.close()
        stamped.close()
        for client in clients:
            if client.returncode is None:
                client.kill()
    if data["errors"]:
        raise RuntimeError(f"SSE client errors: {data['errors'][:3]}")
    sse = {(rid, seq): t for rid, seq, t, _ in data["arrivals"]}
    socket_in = {(rid, seq): t for rid, seq, _, t in data["arrivals"]}  # the kernel's receive stamps
    if TRACE_DIR is not None:  # for offline analysis of where a tail comes from (docs/benchmarks.md)
        rows = [[rid, seq, t, floor.get((rid, seq)), result.get((rid, seq)), sse.get((rid, seq)),
                 socket_in.get((rid, seq)), stamped.seen["floor"].get((rid, seq)),
                 stamped.seen["result"].get((rid, seq))]
                for (rid, seq), t in published.items()]
        (TRACE_DIR / f"{mode.mode}-{label}-{target}.json").write_text(json.dumps(
            {"mode": mode.mode, "label": label, "target": target, "rate": rate, "rows": rows,
             "pids": {name: p.pid for name, p in zip(mode.names, mode.procs)}}))
    hops = {}
    for name, seen in (("floor", floor), ("result", result), ("sse", sse), ("socket", socket_in),
                       ("floor_socket", stamped.seen["floor"]), ("result_socket", stamped.seen["result"])):
        hops[name] = percentiles([(seen[k] - t) * 1e3 for k, t in published.items() if k in seen], cdf=True)
    last = max(sse.values()) if sse else started
    return {"label": label, "rate": rate, "target": target, "open_spread": open_spread, "offered": n / (time.perf_counter() - started) if rate is None else rate,
            "published": n, "sse_rate": len(sse) / max(1e-9, last - started), "hops": hops,
            "missing_sse": n - len(sse), "open_ms": percentiles([x * 1e3 for x in data["opened"]]),
            # CPU per chunk over the run (stream opens and their teardown included)
            "processor_cpu_us": cpu[0] / n * 1e6, "edge_cpu_us": cpu[1] / n * 1e6,
            "relay_cpu_us": cpu[2] / n * 1e6, "server_cpu_us": cpu[mode.names.index(target)] / n * 1e6,
            "server_switches_per_event": switches / max(1, len(sse)),
            **({"calls": calls, "events": max(1, len(sse))} if calls is not None else {})}


def show_calls(counted: dict[str, dict]) -> None:
    """--count-calls: the edge's calls per SSE event in each mode's 2,000 chunks/s run, its most called
    functions, and (both modes) the functions whose calls per event differ (durable - core)."""
    from edge_calls import diff, per_event
    tables = {m: per_event(r["calls"], r["events"]) for m, r in counted.items()}
    for m, (python, c) in tables.items():
        r = counted[m]
        print(f"\n{m}: the edge's calls per SSE event at {RATE:,.0f} chunks/s ({r['events']} events, their streams' "
              f"opens and closes included): {sum(python.values()):.1f} Python + {sum(c.values()):.1f} C")
        for name, n in sorted(python.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {n:7.2f}  {name}")
    if "core" in tables and "durable" in tables:
        print("\nthe edge, durable - core, calls per SSE event:")
        for i, kind in ((0, "Python"), (1, "C")):
            diff(kind, tables["core"][i], tables["durable"][i], 0.05, 40)


def show(mode: str, run: dict) -> None:
    h = run["hops"]
    label = "peak" if run["rate"] is None else f"{run['rate']:,.0f}/s"
    for name in ("floor", "result", "sse", "floor_socket", "result_socket", "socket"):
        if name not in h:  # a --json report of an older run
            continue
        p = h[name]
        print(f"{mode:8}{label:>10}  {name.replace('_socket', '@k'):7}{p['p50']:9.2f}{p['p99']:9.2f}{p['p99.9']:9.2f}{p['n']:8}", end="")
        if name == "sse":
            print(f"   +{p['p50'] - h['floor']['p50']:.2f} / +{p['p99'] - h['floor']['p99']:.2f} ms over floor; "
                  f"open p50 {run['open_ms']['p50']:.1f} ms; SSE {run['sse_rate']:,.0f} ev/s; cpu us/chunk "
                  f"processor {run['processor_cpu_us']:.0f} edge {run['edge_cpu_us']:.0f}; "
                  f"{run['target']} wake-ups/event {run.get('server_switches_per_event', float('nan')):.3f}"
                  + (f"; {run['missing_sse']} missing" if run["missing_sse"] else ""))
        else:
            print()


VERSUS = (  # (key, label, unit, higher is better) of the edge-vs-relay comparison
    ("peak_rate", "peak SSE events/s", "ev/s", True),
    ("cpu_us", "CPU us/event @2k/s", "us", False),
    ("open_p50", "SSE open p50 @2k/s", "ms", False),
    ("sse_p99", "SSE p99 @2k/s", "ms", False),
)


def median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


async def versus_relay(mode: Mode, args, tmp: Path) -> dict:
    """Target 2's baseline in the same run: interleaved rounds (edge first in even rounds, relay
    first in odd ones) of a peak run and a 2,000 chunks/s run per contender; medians per contender
    and the paired median of the per-round ratios (edge / relay)."""
    per_wave = args.streams * args.chunks
    waves = max(1, round(RATE * args.relay_seconds / per_wave))
    rounds: list[dict] = []
    targets = ["edge", "relay"] + [name for name in ("base", "raw") if mode.url(name) is not None]
    for r in range(args.relay_rounds):
        figures = {}
        for target in targets[r % len(targets):] + targets[:r % len(targets)]:  # each goes first in turn
            tag = f"v{r}{target}"
            peak = await one_run(mode, f"{tag}p", args.peak_waves, args.streams, args.chunks, None, tmp, target)
            paced = await one_run(mode, f"{tag}r", waves, args.streams, args.chunks, RATE, tmp, target)
            figures[target] = {"peak_rate": peak["sse_rate"], "cpu_us": paced["server_cpu_us"],
                               "open_p50": paced["open_ms"]["p50"], "sse_p99": paced["hops"]["sse"]["p99"],
                               "sse_p50": paced["hops"]["sse"]["p50"], "result_p50": paced["hops"]["result"]["p50"],
                               "switches": paced["server_switches_per_event"],
                               "socket_p99": paced["hops"]["socket"]["p99"],
                               "result_socket_p99": paced["hops"]["result_socket"]["p99"],
                               "result_p99": paced["hops"]["result"]["p99"]}
        rounds.append(figures)
    out: dict = {"rounds": rounds, "median": {}}
    extra = (("switches", "wake-ups/event @2k/s", "", False),  # voluntary context switches per SSE event
             ("sse_p50", "SSE p50 @2k/s", "ms", False), ("result_p99", "result p99 @2k/s", "ms", False))
    for key, label, unit, _ in VERSUS + extra:
        ours, base = (median([f[t][key] for f in rounds]) for t in ("edge", "relay"))
        ratio = median([f["edge"][key] / f["relay"][key] for f in rounds if f["relay"][key]])
        out["median"][key] = {"edge": ours, "relay": base, "ratio": ratio}
        print(f"{mode.mode:8}  vs relay  {label:22}{ours:10,.2f}{base:10,.2f}  x{ratio:.3f}  {unit}")
    for other in targets[2:]:  # the baseline tree's edge, the raw asyncio server: the same comparison
        out[other] = {}
        for key, label, unit, _ in VERSUS + extra:
            ours, base = (median([f[t][key] for f in rounds]) for t in ("edge", other))
            ratio = median([f["edge"][key] / f[other][key] for f in rounds if f[other][key]])
            out[other][key] = {"edge": ours, other: base, "ratio": ratio}
            print(f"{mode.mode:8}  vs {other:7}{label:22}{ours:10,.2f}{base:10,.2f}  x{ratio:.3f}  {unit}")
    for t in targets:  # target 2: SSE p99 <= 2x the result subscriber's p99, per contender
        x = median([f[t]["sse_p99"] / f[t]["result_p99"] for f in rounds if f[t]["result_p99"]])
        out["median"][f"sse_p99_over_result_{t}"] = x
        k = median([f[t]["socket_p99"] / f[t]["result_socket_p99"] for f in rounds if f[t]["result_socket_p99"]])
        out["median"][f"socket_p99_over_result_{t}"] = k
        print(f"{mode.mode:8}  {t:6}  SSE p99 / result p99, paired median  x{x:.2f}   "
              f"(both stamped by the kernel at the subscriber's socket: x{k:.2f})")
    return out


async def run(args) -> dict:
    from streamproc.sim.embedded import EmbeddedNats
    report: dict = {"modes": {}, "relay": {}, "streams": args.streams, "chunks": args.chunks,
                    "seconds": args.seconds}
    per_wave = args.streams * args.chunks
    with EmbeddedNats() as server, tempfile.TemporaryDirectory(prefix="streamproc-latency-") as tmp:
        tmp_path = Path(tmp)
        print(f"{os.cpu_count()} cores; {args.streams} concurrent SSE streams x {args.chunks} one-token chunks "
              f"per wave; paced runs of ~{args.seconds:g} s; latencies in ms from the worker's publish")
        print(f"{'mode':8}{'load':>10}  {'hop':7}{'p50':>9}{'p99':>9}{'p99.9':>9}{'n':>8}")
        for mode_name in args.modes.split(","):
            mode = Mode(server.url, mode_name, tmp_path)
            runs = []
            try:
                await one_run(mode, "warm", 1, args.streams, args.chunks, 500.0, tmp_path)
                peak = await one_run(mode, "peak", args.peak_waves, args.streams, args.chunks, None, tmp_path)
                show(mode_name, peak)
                runs.append(peak)
                for rate in (RATE, peak["sse_rate"] / 2):
                    waves = max(1, round(rate * args.seconds / per_wave))
                    r = await one_run(mode, f"r{int(rate)}", waves, args.streams, args.chunks, rate, tmp_path,
                                      count=COUNT_DIR is not None and rate == RATE)
                    show(mode_name, r)
                    runs.append(r)
                if args.spread_run > 0:  # the same 2,000 chunks/s with each wave's opens spread out
                    waves = max(1, round(RATE * args.seconds / per_wave))
                    r = await one_run(mode, "s", waves, args.streams, args.chunks, RATE, tmp_path,
                                      spread=args.spread_run)
                    r["spread_run"] = True
                    print(f"{mode_name:8}  the same with each wave's {args.streams} opens spread over "
                          f"{args.spread_run:g} s, as independent clients arrive:")
                    show(mode_name, r)
                    runs.append(r)
                if args.relay_rounds:
                    print(f"{mode_name:8}  edge against a bare Starlette SSE relay, {args.relay_rounds} interleaved "
                          f"rounds (ours, relay, paired median ratio)")
                    report["relay"][mode_name] = await versus_relay(mode, args, tmp_path)
            except Exception:
                for log in sorted(tmp_path.glob(f"{mode_name}-*.log")):
                    print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
                raise
            finally:
                mode.close()
            report["modes"][mode_name] = runs
    if COUNT_DIR is not None:
        show_calls({m: next(r for r in runs if "calls" in r) for m, runs in report["modes"].items()})
        for runs in report["modes"].values():
            for r in runs:
                r.pop("calls", None)  # not in --json: large, and an edge's counts are read here
    core = [r for r in report["modes"].get("core", []) if r["rate"] == RATE and not r.get("spread_run")]
    if core:
        h = core[0]["hops"]
        added = {q: h["sse"][q] - h["floor"][q] for q in ("p50", "p99")}
        report["core_added_ms"] = added
        at_socket = {q: h["socket"][q] - h["floor_socket"][q] for q in ("p50", "p99")}
        report["core_added_at_socket_ms"] = at_socket
        print(f"target (core, {RATE:,.0f} chunks/s): added p50 {added['p50']:.2f} ms (<= {TARGETS_CORE['p50']}), "
              f"p99 {added['p99']:.2f} ms (<= {TARGETS_CORE['p99']}); stamped by the kernel at the "
              f"subscribers' sockets p50 {at_socket['p50']:.2f}, p99 {at_socket['p99']:.2f} ms")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each paced run")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--chunks", type=int, default=40, help="chunks per request")
    parser.add_argument("--peak-waves", type=int, default=4,
                        help="waves of the peak run (at least 1: half of its rate paces the second run)")
    parser.add_argument("--modes", default="core,durable")
    parser.add_argument("--relay-rounds", type=int, default=3,
                        help="interleaved rounds against the bare Starlette SSE relay (0: none)")
    parser.add_argument("--relay-seconds", type=float, default=4.0, help="length of each paced relay round")
    parser.add_argument("--open-spread", type=float, default=0.0,
                        help="paced runs: open each wave's streams evenly over this many seconds (default 0: "
                             "all at once); keep it under a wave's publish time (streams x chunks / rate)")
    parser.add_argument("--spread-run", type=float, default=0.0, metavar="SECONDS",
                        help="per mode, one more run at 2,000 chunks/s whose waves open their streams evenly "
                             "over this many seconds (the open time and tail of independent arrivals, beside "
                             "the bursts of the main run); 0: none")
    parser.add_argument("--sse-clients", type=int, default=1,
                        help="SSE client processes, taking waves in turn (2: the next wave's opens are not made "
                             "by the process reading this wave's events, whose reads would wait for them)")
    parser.add_argument("--baseline-tree", type=Path,
                        help="source tree whose edge joins the interleaved rounds (e.g. a checkout of main)")
    parser.add_argument("--raw-server", action="store_true",
                        help="add the least SSE server any Python edge could be (sse_floor.py's raw asyncio one: "
                             "no HTTP framework, no nats-py, one wildcard subscription) to the interleaved rounds, "
                             "so its SSE p99 / result p99 shows what the harness allows on this machine")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--count-calls", action="store_true",
                        help="count the edge's Python and C calls per SSE event in each mode's 2,000 chunks/s run "
                             "(call_hook.py; that run's CPU and latency figures then mean nothing)")
    parser.add_argument("--trace-dir", type=Path,
                        help="write each run's per-chunk stamps (publish, floor, result, SSE arrival) there")
    parser.add_argument("--sse-client", metavar="EDGE_URL", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_waves < 1:
        parser.error("--peak-waves must be at least 1: the half-peak run is paced at half of the peak run's rate")
    # The harness's own processes collect rarely too (as streamproc run and edge): the SSE client's
    # collections (28 in 6 s, up to 18 ms on a loaded run) delayed its reads, the load generator's
    # its publishes after their stamps.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    if args.sse_client:
        asyncio.run(sse_client(args.sse_client, args.out, args.open_spread))
        return
    global OPEN_SPREAD, BASELINE_TREE, SSE_CLIENTS, TRACE_DIR, RAW_SERVER, COUNT_DIR
    RAW_SERVER = args.raw_server
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        TRACE_DIR = args.trace_dir
    OPEN_SPREAD = args.open_spread
    SSE_CLIENTS = max(1, args.sse_clients)
    BASELINE_TREE = args.baseline_tree.resolve() if args.baseline_tree else None
    with tempfile.TemporaryDirectory(prefix="streamproc-calls-") as counts:
        COUNT_DIR = Path(counts) if args.count_calls else None
        report = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
