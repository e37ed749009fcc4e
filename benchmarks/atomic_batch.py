"""What nats-server charges for a batch of results against the same results stored one PubAck round
trip after another (the durable outbox's way), on R1 file and memory streams: ADR-50 atomic batches
and nats-server 2.14+'s fast batches.

Each group is ``--size`` results of ``--bytes`` bytes with their ``Nats-Msg-Id``, stored as
``singles`` (each publish waits for its PubAck, as a request's results do), as one ``atomic`` batch
(only the commit waits) or as one ``fast`` batch (the batch's protocol rides in the reply subject,
``<inbox>.<id>.<flow>.fail.<seq>.<op>.$FI``; flow 1 so the server acks every stored message, as the
outbox would need to settle inputs early; only the commit's PubAck is waited for). Every way runs on
a fresh nats-server per measurement, in a rotating order, and prints wall ms and nats-server CPU µs
per group, with each batch way's ratio to singles of the same round.
Why it matters: ``newBatchStore`` (server/jetstream_batching.go) stages an R1 file stream's atomic
batch in a file store of its own, a memory one otherwise; a fast batch stages nothing
(docs/benchmarks.md, "Atomic batches of results: tried, not merged" and "Fast batches").

Usage: python benchmarks/atomic_batch.py [--groups 300] [--size 4] [--bytes 800] [--rounds 3]
       [--ways singles,atomic,fast] [--storage file,memory]
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

WAYS = ("singles", "atomic", "fast")


async def fast_groups(nc, groups: int, size: int, body: bytes) -> None:
    """Each group one fast batch (flow 1, gap fail); waits for the commit's PubAck only."""
    inbox = nc.new_inbox()
    done: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_reply(msg) -> None:
        if b'"type"' not in msg.data:  # flow acks carry a type; the commit's PubAck does not
            done.put_nowait(msg.data)

    sub = await nc.subscribe(inbox + ".>", cb=on_reply)
    for g in range(groups):
        for i in range(1, size + 1):
            op = 2 if i == size else (0 if i == 1 else 1)
            await nc.publish("r.a", body, reply=f"{inbox}.g{g}.1.fail.{i}.{op}.$FI",
                             headers={"Nats-Msg-Id": f"{g}.{i}"})
        reply = await asyncio.wait_for(done.get(), 10)
        assert b'"error"' not in reply and f'"count":{size}'.encode() in reply, reply
    await sub.unsubscribe()


async def measure(storage: StorageType, way: str, groups: int, size: int, body: bytes) -> tuple[float, float]:
    """(wall ms, nats-server CPU µs) per group."""
    with EmbeddedNats() as server:
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().add_stream(StreamConfig(name="R", subjects=["r.>"], storage=storage,
                                                         allow_atomic=True, allow_batched=True,
                                                         duplicate_window=60))
            cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
            if way == "fast":
                await fast_groups(nc, groups, size, body)
            else:
                for g in range(groups):
                    for i in range(1, size + 1):
                        headers = {"Nats-Msg-Id": f"{g}.{i}"}
                        if way == "atomic":
                            headers.update({"Nats-Batch-Id": f"b{g}", "Nats-Batch-Sequence": str(i)})
                            if i < size:
                                await nc.publish("r.a", body, headers=headers)
                                continue
                            headers["Nats-Batch-Commit"] = "1"
                        reply = await nc.request("r.a", body, headers=headers, timeout=10)
                        assert b'"error"' not in reply.data, reply.data
            wall, cpu = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
            info = await nc.jetstream().stream_info("R")
            assert info.state.messages == groups * size, info.state
        finally:
            await nc.close()
    return wall / groups * 1e3, cpu / groups * 1e6


async def main(args: argparse.Namespace) -> None:
    body = b"x" * args.bytes
    ways = args.ways.split(",")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.groups} groups of {args.size} results of {args.bytes} bytes "
          f"per measurement, {args.rounds} rounds, ways in a rotating order")
    for storage in (StorageType(s) for s in args.storage.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        for r in range(args.rounds):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                runs[way].append(await measure(storage, way, args.groups, args.size, body))
        for way in ways:
            xs = runs[way]
            print(f"{storage.value:6} {way:8} wall {statistics.median(x[0] for x in xs):6.2f} ms"
                  f"  nats-server CPU {statistics.median(x[1] for x in xs):6.0f} us per group")
        for way in ways:
            if way == "singles" or "singles" not in runs:
                continue
            wall = [b[0] / s[0] for b, s in zip(runs[way], runs["singles"])]
            cpu = [b[1] / s[1] for b, s in zip(runs[way], runs["singles"])]
            print(f"{storage.value:6} {way}/singles, paired median: wall x{statistics.median(wall):.2f} "
                  f"({min(wall):.2f}-{max(wall):.2f}), server CPU x{statistics.median(cpu):.2f} "
                  f"({min(cpu):.2f}-{max(cpu):.2f})")
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--bytes", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of " + ",".join(WAYS))
    parser.add_argument("--storage", default="file,memory")
    asyncio.run(main(parser.parse_args()))
