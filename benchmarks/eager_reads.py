"""What a NATS message costs the receiving process at light load, with eager reads and without.

One nats-server; a publisher process sends ``--count`` messages at ``--rate`` per second, each one
flushed on its own (so each arrives in its own socket read, as at 2,000 chunks/s); a receiver
process (this script with ``--receive``) takes them with a ``FastClient`` and an inline handler that
does nothing, the least a streamproc connection does with a message. The receiver's user and system
CPU time (``getrusage``) over the run, per message, is the figure:

  eager   streamproc's client as it runs (nats/eager_reads.py: a read that arrives while the read
          loop waits is handed over in ``data_received``)
  stock   the same client with ``STOCK_NATS_READS=1``: every read through nats-py's read loop task
          (``StreamReader``, a task wake-up per read)

Rounds alternate which goes first; the figure is the median over rounds and the paired median of
eager / stock.

Usage: python benchmarks/eager_reads.py [--rounds 5] [--count 10000] [--rate 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from streamproc.nats.fast_client import STOCK_READS_ENV, FastClient  # noqa: E402
from streamproc.sim.embedded import EmbeddedNats  # noqa: E402

PUBLISHER = """
import asyncio, sys, time
import nats

async def main():
    nc = await nats.connect(sys.argv[1])
    count, rate = int(sys.argv[2]), float(sys.argv[3])
    due = time.perf_counter()
    for i in range(count):
        await nc.publish("bench.1", b'{"text":" token"}', headers={"Streamproc-Seq": str(i)})
        await nc.flush()
        due += 1 / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
    await nc.close()

asyncio.run(main())
"""


async def receive(url: str, count: int, rate: float) -> dict:
    nc = FastClient()
    await nc.connect(servers=[url])
    got = 0
    done = asyncio.get_running_loop().create_future()

    def handler(subject: str, reply: str, headers: dict | None, data: bytes) -> bool:
        nonlocal got
        got += 1
        if got == count and not done.done():
            done.set_result(None)
        return True

    sub = await nc.subscribe("bench.>")
    nc.deliver_inline(sub, handler)
    await nc.flush()
    before = resource.getrusage(resource.RUSAGE_SELF)
    publisher = await asyncio.create_subprocess_exec(sys.executable, "-c", PUBLISHER, url, str(count), str(rate))
    await asyncio.wait_for(done, count / rate * 3 + 30)
    after = resource.getrusage(resource.RUSAGE_SELF)
    await publisher.wait()
    eager = nc.eager
    await nc.close()
    return {"user": (after.ru_utime - before.ru_utime) / count * 1e6,
            "system": (after.ru_stime - before.ru_stime) / count * 1e6,
            "eager_reads": eager.eager if eager is not None else 0, "fed": eager.fed if eager is not None else None}


def run_receiver(url: str, count: int, rate: float, stock: bool) -> dict:
    env = dict(os.environ)
    env.pop(STOCK_READS_ENV, None)
    if stock:
        env[STOCK_READS_ENV] = "1"
    out = subprocess.run([sys.executable, __file__, "--receive", url, "--count", str(count), "--rate", str(rate)],
                         env=env, capture_output=True, text=True, timeout=count / rate * 3 + 120)
    if out.returncode != 0:
        raise SystemExit(f"receiver failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--receive", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        print(json.dumps(asyncio.run(receive(args.receive, args.count, args.rate))))
        return 0
    print(f"{os.cpu_count()} cores; {args.count} messages at {args.rate:,.0f}/s, each flushed alone; "
          f"{args.rounds} rounds, order alternated; receiver CPU µs per message (user + system)")
    results: dict[str, list[dict]] = {"eager": [], "stock": []}
    with EmbeddedNats(jetstream=False) as server:
        for r in range(args.rounds):
            order = ("eager", "stock") if r % 2 == 0 else ("stock", "eager")
            for name in order:
                figure = run_receiver(server.url, args.count, args.rate, stock=name == "stock")
                results[name].append(figure)
            e, s = results["eager"][-1], results["stock"][-1]
            print(f"round {r + 1}: eager {e['user'] + e['system']:.1f} (user {e['user']:.1f}; "
                  f"{e['eager_reads']} reads handed over eagerly), stock {s['user'] + s['system']:.1f} "
                  f"(user {s['user']:.1f})")
    total = {name: [f["user"] + f["system"] for f in rows] for name, rows in results.items()}
    user = {name: [f["user"] for f in rows] for name, rows in results.items()}
    ratios = [e / s for e, s in zip(total["eager"], total["stock"])]
    user_ratios = [e / s for e, s in zip(user["eager"], user["stock"])]
    for name in ("eager", "stock"):
        print(f"{name:6} median {statistics.median(total[name]):6.1f} µs/msg (range {min(total[name]):.1f}-"
              f"{max(total[name]):.1f}), user {statistics.median(user[name]):.1f}")
    print(f"eager / stock, paired median: total x{statistics.median(ratios):.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}); user x{statistics.median(user_ratios):.3f}")
    print(f"load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
