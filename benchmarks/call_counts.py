"""Function calls per chunk of the durable processor at a paced load, beside the floor's.

``durable.py --paced``'s run (a fresh nats-server, chunks published live at ``--rate`` chunks/s
for ``--seconds``), with each contender run under ``call_hook.py``: counting starts just before the
first paced publish and stops once the last result arrived, so start-up and shutdown are not in
the figures. Printed per contender: Python function calls and C calls (builtins, methods of
builtin types) per chunk, and the Python functions and C calls with the most calls per chunk.

Contenders: ``streamproc`` (this tree, or ``--tree DIR`` once per tree to compare: each tree's
package and built-in codecs on ``PYTHONPATH``, as durable_trees.py does) and ``floor``
(``durable_floor.py``: the wire work alone, the floor under target 4's 60 µs per chunk).

Why: target 4's CPU per chunk at 2,000 chunks/s moves by ±10% between runs here, while the calls
per chunk of a tree are steady to a few percent (they still vary a little: how many chunks a read
and a write carry follows the timing). A change to the per-chunk path shows in them exactly,
where its CPU change would be lost in the noise. Counting slows a contender several times over,
so this script never reports time.

Usage: python benchmarks/call_counts.py [--rate 2000] [--seconds 4] [--top 25] [--tree DIR ...] [--no-floor]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import durable  # noqa: E402
from call_hook import OUTPUT_ENV, collect  # noqa: E402
from durable_trees import python_path  # noqa: E402
from passthrough import build_load  # noqa: E402

HOOK = str(HERE / "call_hook.py")


def wrap(cmd: list[str]) -> list[str]:
    """The contender's command line under call_hook.py, with the interpreter of this run."""
    if Path(cmd[0]).name == "streamproc":  # the console script: its command line, in-process
        return [sys.executable, HOOK, "streamproc", *cmd[1:]]
    assert cmd[0] == sys.executable, cmd
    return [sys.executable, HOOK, *cmd[1:]]


def short(path: str) -> str:
    """A source file named from its package on: ``streamproc/nats/fast_client.py``, ``asyncio/events.py``."""
    parts = Path(path).parts
    for anchor in ("streamproc", "benchmarks", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i + (anchor == "site-packages"):])
    return "/".join(parts[-2:])


async def counted(name: str, load: list, rate: float, seconds: float, out: Path) -> tuple[dict, int]:
    """One paced run of ``name`` under the hook: (the counts, chunks)."""
    out.unlink(missing_ok=True)

    counts: dict = {}

    async def mark(proc: subprocess.Popen, when: str) -> None:
        if when == "start":
            proc.send_signal(signal.SIGUSR1)
        else:
            counts.update(await collect(proc, out, name))

    os.environ[OUTPUT_ENV] = str(out)
    paced = await durable.latency(name, load, rate, seconds, mark=mark)
    return counts, paced.chunks


def report(label: str, counts: dict, chunks: int, top: int) -> tuple[float, float]:
    python = sum(row[3] for row in counts["python"]) / chunks
    c = sum(row[1] for row in counts["c"]) / chunks
    print(f"\n{label}: {python:.1f} Python calls + {c:.1f} C calls = {python + c:.1f} per chunk ({chunks} chunks)")
    print("  Python functions, calls per chunk:")
    for file, line, qualname, n in counts["python"][:top]:
        print(f"    {n / chunks:7.2f}  {qualname} ({short(file)}:{line})")
    print("  C calls, calls per chunk:")
    for qualname, n in counts["c"][:top]:
        print(f"    {n / chunks:7.2f}  {qualname}")
    return python, c


async def main(args: argparse.Namespace) -> None:
    durable.COMMAND_WRAPPER = wrap
    trees = [Path(t).resolve() for t in args.tree] or [HERE.parent]
    load = build_load(int(args.rate * args.seconds) + 16, True, "streamproc")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; paced {args.rate:,.0f} chunks/s "
          f"for {args.seconds:g} s; counted from the first paced publish to the last result")
    rows: list[tuple[str, float, float]] = []
    saved = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory() as tmp:
        for n, tree in enumerate(trees):
            os.environ["PYTHONPATH"] = python_path(tree)
            counts, chunks = await counted("streamproc", load, args.rate, args.seconds, Path(tmp) / f"s{n}.json")
            label = f"streamproc ({tree})"
            rows.append((label, *report(label, counts, chunks, args.top)))
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        if args.floor:
            counts, chunks = await counted(durable.FLOOR, load, args.rate, args.seconds, Path(tmp) / "floor.json")
            rows.append(("floor", *report("floor (durable_floor.py)", counts, chunks, args.top)))
    print(f"\n{'contender':<60} {'Python':>8} {'C':>8} {'total':>8}   calls per chunk")
    for label, python, c in rows:
        print(f"{label:<60} {python:8.1f} {c:8.1f} {python + c:8.1f}")
    print(f"load average now {os.getloadavg()[0]:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000.0, help="chunks published per second")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of the paced run")
    parser.add_argument("--top", type=int, default=25, help="functions listed per contender")
    parser.add_argument("--tree", action="append", default=[], metavar="DIR",
                        help="a source tree of streamproc to count (repeatable; default: this one)")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="leave durable_floor.py out")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.top < 0:
        parser.error("--rate and --seconds must be positive, --top at least 0")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
