"""What nats-server charges for an ADR-50 atomic batch of results against the same results stored
one PubAck round trip after another (the durable outbox's two ways), on R1 file and memory streams.

Each group is ``--size`` results of ``--bytes`` bytes with their ``Nats-Msg-Id``, stored either as
singles (each publish waits for its PubAck, as a request's results do) or as one atomic batch
(only the commit waits). Both ways run on a fresh nats-server per measurement, alternating, and
print wall ms and nats-server CPU µs per group, with the batch/singles ratio of each.
Why it matters: ``newBatchStore`` (server/jetstream_batching.go) stages an R1 file stream's batch in a
file store of its own, a memory one otherwise. This is why the durable outbox does not batch
(docs/benchmarks.md, "Atomic batches of results: tried, not merged").

Usage: python benchmarks/atomic_batch.py [--groups 300] [--size 4] [--bytes 800] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import nats
from nats.js.api import StorageType, StreamConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from passthrough import cpu_seconds  # noqa: E402

from streamproc.sim.embedded import EmbeddedNats  # noqa: E402


async def measure(storage: StorageType, batch: bool, groups: int, size: int, body: bytes) -> tuple[float, float]:
    """(wall ms, nats-server CPU µs) per group."""
    with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().add_stream(StreamConfig(name="R", subjects=["r.>"], storage=storage,
                                                         allow_atomic=True, duplicate_window=60))
            cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
            for g in range(groups):
                for i in range(1, size + 1):
                    headers = {"Nats-Msg-Id": f"{g}.{i}"}
                    if batch:
                        headers.update({"Nats-Batch-Id": f"b{g}", "Nats-Batch-Sequence": str(i)})
                        if i < size:
                            await nc.publish("r.a", body, headers=headers)
                            continue
                        headers["Nats-Batch-Commit"] = "1"
                    reply = await nc.request("r.a", body, headers=headers, timeout=10)
                    assert b'"error"' not in reply.data, reply.data
            wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
        finally:
            await nc.close()
    return wall / groups * 1e3, cpu / groups * 1e6


async def main(args: argparse.Namespace) -> None:
    body = b"x" * args.bytes
    print(f"load average {os.getloadavg()[0]:.2f}; {args.groups} groups of {args.size} results of {args.bytes} bytes "
          f"per measurement, {args.rounds} rounds alternating")
    for storage in (StorageType.FILE, StorageType.MEMORY):
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for batch in (False, True) if r % 2 == 0 else (True, False):
                runs[batch].append(await measure(storage, batch, args.groups, args.size, body))
        for batch in (False, True):
            xs = runs[batch]
            print(f"{storage.value:6} {'batch' if batch else 'singles':8} wall {statistics.median(x[0] for x in xs):6.2f} ms"
                  f"  nats-server CPU {statistics.median(x[1] for x in xs):6.0f} us per group")
        wall = [b[0] / s[0] for b, s in zip(runs[True], runs[False])]
        cpu = [b[1] / s[1] for b, s in zip(runs[True], runs[False])]
        print(f"{storage.value:6} batch/singles, paired median: wall x{statistics.median(wall):.2f} "
              f"({min(wall):.2f}-{max(wall):.2f}), server CPU x{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})")
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--bytes", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
