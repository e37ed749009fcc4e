"""What the workers' and the edge's own accounts cost, against deploy/nats-server.conf at
``--old-ref`` (everyone in ``STREAMPROC``; docs/security.md, "Workers and the edge have accounts of
their own").

``--what chunks``: durable chunk publishing as the ``worker`` user, whose ``streamproc.chunks.>``
now crosses into ``STREAMPROC`` as a service import (nats-server maps each reply to a ``_R_.``
subject and back): per round ``--chunks`` ``js.publish`` calls with up to ``--window`` PubAcks
outstanding, one connection. ``--what results``: the processor user publishes ``--chunks`` results
(stored by the results stream) while the ``edge`` user subscribes to ``streamproc.results.>``,
which now crosses into ``EDGE`` as a stream import; timed until the edge has them all.

Two nats-servers, one per file; rounds alternate the order. Reported: messages/s and nats-server
CPU per message for each, and the ratios new/old per round.

Usage: python benchmarks/accounts.py [--what chunks|results] [--rounds 8] [--chunks 20000] [--window 64] [--old-ref main]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from shipped_config import CONF, shipped_server, url  # noqa: E402

from streamproc.core.wire import chunk_headers  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


async def create_streams(srv) -> None:
    nc = await nats.connect(url(srv, "processor"))
    await nc.jetstream().add_stream(name="STREAMPROC_CHUNKS", subjects=["streamproc.chunks.*.*"], max_age=60)
    await nc.jetstream().add_stream(name="STREAMPROC_RESULTS", subjects=["streamproc.results.>"], max_age=60)
    await nc.close()


async def results_round(srv, results: int, window: int) -> tuple[float, float]:
    """(seconds, nats-server CPU seconds) until the edge user has read ``results`` results."""
    edge = await nats.connect(url(srv, "edge"), inbox_prefix="_INBOX.streamproc.edge")
    processor = await nats.connect(url(srv, "processor"))
    done, count = asyncio.Event(), 0

    async def on_result(msg) -> None:
        nonlocal count
        count += 1
        if count == results:
            done.set()

    await edge.subscribe("streamproc.results.>", cb=on_result, pending_msgs_limit=results + 1)
    await edge.flush()
    cpu, start = cpu_seconds(srv.pid), time.perf_counter()
    for i in range(results):
        await processor.publish(f"streamproc.results.b{i % 97}", b'{"text":"hello world"}')
        if i % window == 0:
            await processor.flush()
    await processor.flush()
    await asyncio.wait_for(done.wait(), 60)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(srv.pid) - cpu
    await edge.close()
    await processor.close()
    return elapsed, cpu


async def one_round(srv, chunks: int, window: int) -> tuple[float, float]:
    """(seconds, nats-server CPU seconds) to publish ``chunks`` durable chunks."""
    nc = await nats.connect(url(srv, "worker"))
    js = nc.jetstream()
    slots = asyncio.Semaphore(window)

    async def publish(i: int) -> None:
        rid = f"b{i % 97}"
        async with slots:
            await js.publish(f"streamproc.chunks.{rid}.agg", b'{"text":"hello world"}',
                             headers=chunk_headers(rid, "agg", i), stream="STREAMPROC_CHUNKS")

    cpu, start = cpu_seconds(srv.pid), time.perf_counter()
    await asyncio.gather(*(publish(i) for i in range(chunks)))
    elapsed, cpu = time.perf_counter() - start, cpu_seconds(srv.pid) - cpu
    await nc.close()
    return elapsed, cpu


async def main(args: argparse.Namespace) -> None:
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.old_ref}:deploy/nats-server.conf"],
                         capture_output=True, text=True, check=True).stdout
    assert "WORKERS" not in old, f"{args.old_ref}'s file already has the workers' account"
    new = CONF.read_text()
    assert "WORKERS" in new
    with shipped_server(old) as before, shipped_server(new) as after:
        servers = {"old": before, "new": after}
        measure = one_round if args.what == "chunks" else results_round
        for srv in servers.values():
            await create_streams(srv)
            await measure(srv, 1000, args.window)  # warm-up
        times, cpus = [], []
        for r in range(args.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            got = {name: await measure(servers[name], args.chunks, args.window) for name in order}
            (t_old, c_old), (t_new, c_new) = got["old"], got["new"]
            times.append(t_new / t_old)
            cpus.append(c_new / c_old if c_old else float("nan"))
            print(f"round {r}: old {args.chunks / t_old:,.0f}/s {c_old / args.chunks * 1e6:.1f} us server CPU/message, "
                  f"new {args.chunks / t_new:,.0f}/s {c_new / args.chunks * 1e6:.1f} us; "
                  f"new/old time x{times[-1]:.3f}, server CPU x{cpus[-1]:.3f}", flush=True)
    print(f"median new/old: time x{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}), "
          f"server CPU per message x{statistics.median(cpus):.3f} ({min(cpus):.3f}-{max(cpus):.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=["chunks", "results"], default="chunks")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--window", type=int, default=64, help="PubAcks outstanding at once")
    parser.add_argument("--old-ref", default="main", help="git ref whose deploy/nats-server.conf is the baseline")
    asyncio.run(main(parser.parse_args()))
