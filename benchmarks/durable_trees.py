"""Durable peak drain of two source trees of streamproc (a change beside its base), same loads,
same run: `durable.py`'s peak measurement with only ``PYTHONPATH`` differing between contenders.

For a change to the durable hot path that must not cost anything measurable (e.g. the seal list
of migration across crashes: one dict membership test per new request). Two loads: unary
aggregated chunks (every chunk is a new request, the worst case for a per-request cost) and
streamed requests. Rounds alternate which tree goes first; the figure is the paired median of
candidate / baseline CPU per chunk (the contender's own user+system time, in clock ticks: about
0.5 us per chunk of resolution at 20,000 chunks), throughput beside it (noisy on a shared box).

``--paced RATE``: instead of the peak drain, ``durable.py``'s paced measurement (chunks published
live at RATE chunks/s for ``--seconds``, streamed load): CPU µs per chunk of the processor and of
nats-server, p50/p99 chunk publish -> result, paired medians of candidate / baseline.

``--candidate-env KEY=VALUE`` (repeatable): set only while the candidate runs, e.g. an option that
is off by default.

Usage: python benchmarks/durable_trees.py --baseline ../base-checkout --candidate . [--chunks 20000] [--rounds 5]
       python benchmarks/durable_trees.py --baseline ../base-checkout --candidate . --paced 2000 [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import durable  # noqa: E402
from passthrough import build_load  # noqa: E402


CANDIDATE_ENV: dict[str, str] = {}


def use(trees: dict[str, str], name: str) -> None:
    """The environment the contender's `streamproc run` subprocess inherits: its tree, and the
    candidate's own variables only for the candidate."""
    os.environ["PYTHONPATH"] = trees[name]
    for key, value in CANDIDATE_ENV.items():
        if name == "candidate":
            os.environ[key] = value
        else:
            os.environ.pop(key, None)


def python_path(tree: Path) -> str:
    """The tree's package and its built-in codecs, as tests/helpers' env does for a worktree."""
    return os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))


async def paced(args: argparse.Namespace, trees: dict[str, str]) -> None:
    load = build_load(int(args.paced * args.seconds) + 16, True, "streamproc")
    runs: dict[str, list[durable.Paced]] = {name: [] for name in trees}
    print(f"load average {os.getloadavg()[0]:.2f}; paced {args.paced:,.0f} chunks/s for {args.seconds:g} s, "
          f"{args.rounds} rounds alternating", flush=True)
    for r in range(args.rounds):
        for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
            use(trees, name)
            p = await durable.latency("streamproc", load, args.paced, args.seconds)
            runs[name].append(p)
            print(f"  round {r} {name}: {p.cpu_us:.1f} us CPU/chunk, nats-server {p.server_cpu_us:.1f}, "
                  f"p50 {p.p50:.2f} ms, p99 {p.p99:.2f} ms", flush=True)
            print(f"  {durable.by_seq_line(p)}", flush=True)
    for name, xs in runs.items():
        print(f"{name}: median {statistics.median(x.cpu_us for x in xs):.1f} us CPU/chunk, nats-server "
              f"{statistics.median(x.server_cpu_us for x in xs):.1f}, p50 {statistics.median(x.p50 for x in xs):.2f} ms, "
              f"p99 {statistics.median(x.p99 for x in xs):.2f} ms")
    for label, key in (("CPU/chunk", "cpu_us"), ("nats-server CPU/chunk", "server_cpu_us"), ("p99", "p99")):
        ratios = [getattr(c, key) / getattr(b, key) for c, b in zip(runs["candidate"], runs["baseline"])]
        print(f"candidate/baseline {label}, paired median x{statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"load average now {os.getloadavg()[0]:.2f}")


async def main(args: argparse.Namespace) -> None:
    trees = {"baseline": python_path(Path(args.baseline).resolve()),
             "candidate": python_path(Path(args.candidate).resolve())}
    if args.paced:
        return await paced(args, trees)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for stream in [kind == "streamed" for kind in args.loads.split(",")]:
        load = build_load(args.chunks, stream, "streamproc")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                use(trees, name)  # inherited by the `streamproc run` subprocess
                rate, cpu = await durable.peak("streamproc", load)
                runs[name].append((rate, cpu))
                print(f"  {'streamed' if stream else 'unary'} round {r} {name}: {rate:,.0f} chunks/s, "
                      f"{cpu:.1f} us CPU/chunk", flush=True)
        kind = "streamed" if stream else "unary"
        for name, xs in runs.items():
            print(f"{kind} {name}: median {statistics.median(x[0] for x in xs):,.0f} chunks/s, "
                  f"{statistics.median(x[1] for x in xs):.1f} us CPU/chunk")
        cpu = [c[1] / b[1] for c, b in zip(runs["candidate"], runs["baseline"])]
        rate = [c[0] / b[0] for c, b in zip(runs["candidate"], runs["baseline"])]
        print(f"{kind} candidate/baseline, paired median: CPU/chunk x{statistics.median(cpu):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in cpu)}), chunks/s x{statistics.median(rate):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in rate)})", flush=True)
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="source tree of the base (e.g. the main checkout)")
    parser.add_argument("--candidate", default=".", help="source tree of the change")
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paced", type=float, default=0.0, help="paced mode at this many chunks/s (e.g. 2000)")
    parser.add_argument("--seconds", type=float, default=6.0, help="paced mode: seconds per run")
    parser.add_argument("--loads", default="unary,streamed", help="peak mode: which loads (unary, streamed)")
    parser.add_argument("--candidate-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable set only for the candidate (repeatable)")
    parsed = parser.parse_args()
    CANDIDATE_ENV.update(item.split("=", 1) for item in parsed.candidate_env)
    asyncio.run(main(parsed))
