"""Durable peak drain of two source trees of streamproc (a change beside its base), same loads,
same run: `durable.py`'s peak measurement with only ``PYTHONPATH`` differing between contenders.

For a change to the durable hot path that must not cost anything measurable (e.g. the seal list
of migration across crashes: one dict membership test per new request). Two loads: unary
aggregated chunks (every chunk is a new request, the worst case for a per-request cost) and
streamed requests. Rounds alternate which tree goes first; the figure is the paired median of
candidate / baseline CPU per chunk (the contender's own user+system time, in clock ticks: about
0.5 us per chunk of resolution at 20,000 chunks), throughput beside it (noisy on a shared box).

Usage: python benchmarks/durable_trees.py --baseline ../base-checkout --candidate . [--chunks 20000] [--rounds 5]
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


def python_path(tree: Path) -> str:
    """The tree's package and its built-in codecs, as tests/helpers' env does for a worktree."""
    return os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))


async def main(args: argparse.Namespace) -> None:
    trees = {"baseline": python_path(Path(args.baseline).resolve()),
             "candidate": python_path(Path(args.candidate).resolve())}
    for stream in (False, True):
        load = build_load(args.chunks, stream, "streamproc")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                os.environ["PYTHONPATH"] = trees[name]  # inherited by the `streamproc run` subprocess
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
              f"(rounds {', '.join(f'{x:.3f}' for x in cpu)}), chunks/s x{statistics.median(rate):.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="source tree of the base (e.g. the main checkout)")
    parser.add_argument("--candidate", default=".", help="source tree of the change")
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
