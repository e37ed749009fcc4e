"""What the HTTP server alone costs an SSE open (issue 14, target 2: open p50 <= 5 ms in bursts of 50).

Target 2 asks to "fix what the profile shows (server choice ... included)". This script prices the
server choice on its own: no NATS, no edge, no Starlette, no checks. Each contender answers
``GET /v1/results/<id>`` with the SSE response head and one comment frame as soon as it has the
request, then holds the stream until the client leaves:

  raw           a raw asyncio ``Protocol`` (this script with ``--serve raw``): writes the head in
                ``data_received`` once the request head is complete. No HTTP framework at all.
  uvicorn       Uvicorn with httptools on asyncio (the edge's server) running a three-message ASGI
                app (``http.response.start``, one body part, wait for ``http.disconnect``).
  granian-asgi  Granian (a Rust HTTP server, hyper/tokio) running the same ASGI app;
                ``--workers 1 --runtime-threads 1``.
  granian-rsgi  Granian's own interface (RSGI): ``response_stream``, one ``send_bytes``, wait for
                ``client_disconnect``.

Granian is in the ``[bench]`` extra; without it the granian contenders are skipped with a note.

The client is benchmarks/latency.py's kind (asyncio streams): per burst, N connections opened at
once, each writes the request and reads the response head; the open time is connect to head. After
the burst every connection is closed. Rounds are interleaved (each contender goes first in turn);
per round and contender ``--bursts`` bursts. Prints each contender's median of its rounds' open
p50 (with the range of the rounds) and the server's CPU per open + close (the process CPU clocks of
the server and its child processes, ``clock_getcpuclockid``), and the paired ratio of each
contender's open p50 to the raw server's in the same round.

Usage: ``python benchmarks/server_open.py [--rounds 7] [--bursts 20] [--burst 50] [--json FILE]``
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
HEAD = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]
FIRST_FRAME = b": open\n\n"
RAW_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-store\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(FIRST_FRAME), FIRST_FRAME))


async def asgi_app(scope, receive, send):
    """The least ASGI SSE answer: head, one frame, then wait for the client to leave."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": FIRST_FRAME, "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


class RsgiApp:
    """The same answer through Granian's RSGI interface."""

    async def __rsgi__(self, scope, protocol):
        transport = protocol.response_stream(200, [(k.decode(), v.decode()) for k, v in HEAD])
        await transport.send_bytes(FIRST_FRAME)
        await protocol.client_disconnect()


rsgi_app = RsgiApp()


class RawSSE(asyncio.Protocol):
    """Writes the SSE head once the request head is in; nothing else."""

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data):
        self.buffer += data
        if b"\r\n\r\n" in self.buffer:
            self.buffer = b""
            self.transport.write(RAW_RESPONSE)


def serve_raw(port: int) -> None:
    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(RawSSE, "127.0.0.1", port, backlog=1024))
    loop.run_forever()


def has_granian() -> bool:
    return importlib.util.find_spec("granian") is not None


def command(kind: str, port: int) -> list[str]:
    py = sys.executable
    if kind == "raw":
        return [py, str(SCRIPT), "--serve", "raw", "--port", str(port)]
    if kind == "uvicorn":
        return [py, "-m", "uvicorn", "server_open:asgi_app", "--port", str(port), "--http", "httptools",
                "--loop", "asyncio", "--lifespan", "off", "--log-level", "warning", "--backlog", "1024"]
    interface, app = {"granian-asgi": ("asgi", "server_open:asgi_app"),
                      "granian-rsgi": ("rsgi", "server_open:rsgi_app")}[kind]
    return [py, "-m", "granian", "--interface", interface, "--port", str(port), "--workers", "1",
            "--runtime-threads", "1", "--no-ws", "--log-level", "warning", app]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    found = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                found += process_tree(int(child))
    except OSError:
        pass
    return found


def cpu_seconds(pids: list[int]) -> float:
    """The CPU time of these processes (all their threads), to the nanosecond."""
    libc = ctypes.CDLL(None, use_errno=True)
    total = 0.0
    for pid in pids:
        clock = ctypes.c_int()
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
            try:
                total += time.clock_gettime(clock.value)
            except OSError:
                pass
    return total


REQUEST = b"GET /v1/results/r%d HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"


async def open_one(port: int, i: int) -> tuple[float, asyncio.StreamWriter]:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST % i)
    head = await reader.readuntil(b"\r\n\r\n")
    elapsed = time.perf_counter() - t0
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"port {port}: {head[:200]!r}")
    return elapsed, writer


async def burst(port: int, n: int) -> list[float]:
    opened = await asyncio.gather(*(open_one(port, i) for i in range(n)))
    for _, writer in opened:
        writer.close()
    await asyncio.sleep(0.05)  # the closes reach the server before the next burst
    return [elapsed for elapsed, _ in opened]


async def wait_listening(port: int, proc: subprocess.Popen, kind: str) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited with {proc.returncode}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{kind} is not listening on {port}")


async def run(args: argparse.Namespace) -> None:
    kinds = ["raw", "uvicorn"]
    if has_granian():
        kinds += ["granian-asgi", "granian-rsgi"]
    else:
        print("granian is not installed (pip install -e '.[bench]'): its contenders are skipped")
    env = dict(os.environ, PYTHONPATH=f"{SCRIPT.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    ports = {kind: free_port() for kind in kinds}
    procs = {kind: subprocess.Popen(command(kind, ports[kind]), env=env, cwd=SCRIPT.parent) for kind in kinds}
    try:
        for kind in kinds:
            await wait_listening(ports[kind], procs[kind], kind)
        await asyncio.sleep(1.0)  # Granian's worker process starts after its port is bound
        trees = {kind: process_tree(procs[kind].pid) for kind in kinds}
        for kind in kinds:  # warm up: imports, first allocations
            await burst(ports[kind], args.burst)
        p50 = {kind: [] for kind in kinds}
        cpu = {kind: [] for kind in kinds}
        load = [os.getloadavg()[0]]
        for r in range(args.rounds):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                before = cpu_seconds(trees[kind])
                times: list[float] = []
                for _ in range(args.bursts):
                    times += await burst(ports[kind], args.burst)
                cpu[kind].append((cpu_seconds(trees[kind]) - before) * 1e6 / len(times))
                p50[kind].append(statistics.median(times) * 1e3)
        load.append(os.getloadavg()[0])
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(10)
    print(f"{os.cpu_count()} cores; load average {load[0]:.2f} -> {load[1]:.2f}; {args.rounds} interleaved rounds "
          f"x {args.bursts} bursts of {args.burst} opens per contender")
    print(f"{'contender':14s} {'open p50 ms':>11s} {'(rounds)':>13s} {'x raw, paired':>13s} {'cpu us/open+close':>18s}")
    for kind in kinds:
        paired = statistics.median(a / b for a, b in zip(p50[kind], p50["raw"]))
        print(f"{kind:14s} {statistics.median(p50[kind]):11.2f} {min(p50[kind]):6.2f}-{max(p50[kind]):<6.2f} "
              f"{paired:13.2f} {statistics.median(cpu[kind]):18.1f}")
    if args.json:
        args.json.write_text(json.dumps({kind: {"open_p50_ms": p50[kind], "cpu_us_per_open": cpu[kind]}
                                         for kind in kinds}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--burst", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write each round's figures here")
    parser.add_argument("--serve", choices=["raw"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "raw":
        serve_raw(args.port)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
