"""Durable mode, one instance against two: throughput and CPU per chunk of each component.

The check for the capacity model in docs/operations.md: each round gets a fresh nats-server (file
storage, streams as the processor creates them); ``--instances`` streamproc processes start on the
empty chunk stream and share its partitions through leases (the run waits until every partition is
owned and, with two, both own some); then the load is published as fast as the harness can and a
core subscriber counts the results. Printed per instance count (rounds alternate 1, 2, 2, 1, ...):
chunks/s from the first to the last result, CPU µs per chunk of all processors together, of
nats-server, and of the harness (publisher + result subscriber, this process). The model's
assumption is that processor CPU per chunk does not grow with instances; on a 2-core machine two
instances cannot double throughput, so the script also prints the throughput the measured CPU per
chunk predicts for the cores available (``cores / sum of µs per chunk``).

Usage: python benchmarks/scale.py [--chunks 40000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from durable import prepare  # noqa: E402
from passthrough import build_load, cpu_seconds  # noqa: E402

from streamproc import config  # noqa: E402
from streamproc.sim.embedded import EmbeddedNats, stop_process  # noqa: E402

PARTITIONS_GAUGE = re.compile(rb"^streamproc_\w*partitions (\d+)", re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def owned(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            m = PARTITIONS_GAUGE.search(r.read())
    except OSError:
        return -1
    return int(m.group(1)) if m else -1


async def one(instances: int, load, partitions: int) -> dict:
    with EmbeddedNats() as server:
        settings = config.load({}, {"nats_url": server.url, "mode": "durable"})
        nc = await nats.connect(server.url)
        procs: list[tuple[subprocess.Popen, int]] = []
        try:
            await prepare(nc, settings, "streamproc")
            for _ in range(instances):
                port = free_port()
                procs.append((subprocess.Popen(
                    [str(Path(sys.executable).parent / "streamproc"), "run", "--nats-url", server.url, "--mode",
                     "durable", "--format", "sglang", "--log-level", "WARNING", "--http-port", str(port),
                     "--http-host", "127.0.0.1"], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL), port))
            deadline = time.monotonic() + 60
            while True:
                counts = [owned(port) for _, port in procs]
                if sum(counts) == partitions and min(counts) > 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"partitions not shared after 60 s: {counts}")
                await asyncio.sleep(0.5)

            expected, got = len(load), 0
            first = last = 0.0
            done = asyncio.Event()

            async def sink(msg) -> None:
                nonlocal got, first, last
                got += 1
                if got == 1:
                    first = time.perf_counter()
                if got == expected:
                    last = time.perf_counter()
                    done.set()

            await nc.subscribe(f"{settings.prefix}.results.>", cb=sink, pending_msgs_limit=-1, pending_bytes_limit=-1)
            await nc.flush()
            cpu0 = [cpu_seconds(p.pid) for p, _ in procs]
            server0, own0 = cpu_seconds(server.pid), cpu_seconds(os.getpid())
            for n, (subject, body, headers) in enumerate(load):
                await nc.publish(subject, body, headers=headers)
                if n % 1000 == 999:
                    await nc.flush()
            await nc.flush()
            await asyncio.wait_for(done.wait(), 300)
            proc_cpu = sum(cpu_seconds(p.pid) - c for (p, _), c in zip(procs, cpu0))
            n = expected
            return {"rate": (expected - 1) / (last - first), "proc_us": proc_cpu / n * 1e6,
                    "server_us": (cpu_seconds(server.pid) - server0) / n * 1e6,
                    "harness_us": (cpu_seconds(os.getpid()) - own0) / n * 1e6, "owned": counts}
        finally:
            await nc.close()
            for p, _ in procs:
                stop_process(p, 15)


async def run(args) -> None:
    load = build_load(args.chunks, True, "streamproc")
    partitions = config.Settings().partitions
    cores = os.cpu_count() or 1
    print(f"{cores} cores; load average {os.getloadavg()[0]:.2f}; {len(load)} aggregated streamed chunks per run, "
          f"{partitions} partitions, file storage; {args.rounds} rounds per instance count, alternating")
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for r in range(args.rounds):
        for k in ((1, 2) if r % 2 == 0 else (2, 1)):
            runs[k].append(await one(k, load, partitions))
    print(f"{'instances':10}{'chunks/s':>10}{'processors us/chunk':>21}{'nats-server us/chunk':>22}"
          f"{'harness us/chunk':>18}{'predicted chunks/s':>20}   partitions owned; per round chunks/s")
    med: dict[int, dict] = {}
    for k in (1, 2):
        rs = runs[k]
        m = {key: statistics.median(x[key] for x in rs) for key in ("rate", "proc_us", "server_us", "harness_us")}
        med[k] = m
        rates = ", ".join(f"{x['rate']:,.0f}" for x in rs)
        predicted = cores / (m["proc_us"] + m["server_us"] + m["harness_us"]) * 1e6
        print(f"{k:<10}{m['rate']:10,.0f}{m['proc_us']:21.1f}{m['server_us']:22.1f}{m['harness_us']:18.1f}"
              f"{predicted:20,.0f}   {rs[-1]['owned']}; {rates}")
    print(f"2 / 1 instances: throughput {med[2]['rate'] / med[1]['rate']:.2f}x, processor CPU per chunk "
          f"{med[2]['proc_us'] / med[1]['proc_us']:.2f}x, nats-server CPU per chunk "
          f"{med[2]['server_us'] / med[1]['server_us']:.2f}x; load average now {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
