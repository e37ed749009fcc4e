"""Python and C calls per SSE event of ``streamproc edge``, core mode beside JetStream ("durable") mode.

Target 2's CPU per event differs between the modes (docs/benchmarks.md: 53.1 core, 68.1 durable in
one run), but on a shared 2-core machine CPU figures move by ±10% between runs. The calls an edge
makes per event depend only on its code and on how many events each read carries, so they show
what the durable path adds, function by function, and what a change removes, exactly.

One run of ``sse_floor.py --count-calls``'s round per mode (and per ``--tree``), interleaved: the
edge under ``call_hook.py``, 50 open SSE streams, results published at a paced ``--rate`` round
robin over them; counting from the first paced publish until every event was read. Core mode: a
server without JetStream (the ring subscribes to the results); durable: a results stream (as the
durable processor's), so the ring reads it through its ordered consumer inline (fast_client.py
``_ordered_now``) and fans out to the streams. Printed: calls per event per tree and mode, each
mode's most called functions, and the functions whose calls per event differ between the modes
(durable − core) and between trees (each ``--tree`` against the first), largest first.

Counting slows the edge several times over (more events per read than unprofiled): compare counts
of the same tool and settings only, and never read time from such a run.

Usage: python benchmarks/edge_calls.py [--rate 2000] [--seconds 3] [--rounds 1] [--batch 10]
                                       [--top 25] [--tree NAME=PATH ...] [--modes core,durable] [--c-callers]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import sse_floor  # noqa: E402
from call_counts import short  # noqa: E402
from call_hook import CALLERS_ENV  # noqa: E402
from streamproc.sim.embedded import EmbeddedNats  # noqa: E402

MODES = ("core", "durable")


def per_event(calls: dict, events: int) -> tuple[dict[str, float], dict[str, float]]:
    """The counts of one run as calls per event: Python functions by ``name (file)``, C by name."""
    python: dict[str, float] = collections.Counter()
    for file, line, name, n in calls["python"]:
        python[f"{name} ({short(file)})"] += n / events  # no line: it moves between trees
    c: dict[str, float] = collections.Counter()
    for name, n in calls["c"]:
        c[name] += n / events
    return python, c


def merged(runs: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Each function's median calls per event over the rounds (0 in a round where it was not called)."""
    tables = [per_event(r["calls"], r["events"]) for r in runs]
    out = []
    for i in (0, 1):
        names = set().union(*(t[i] for t in tables))
        out.append({name: statistics.median(t[i].get(name, 0.0) for t in tables) for name in names})
    return out[0], out[1]


def diff(label: str, a: dict[str, float], b: dict[str, float], least: float, top: int) -> None:
    """Functions whose calls per event differ by at least ``least`` between ``a`` and ``b``: ``b - a``."""
    rows = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), key=lambda r: -abs(r[0]))
    rows = [r for r in rows if abs(r[0]) >= least][:top]
    print(f"  {label}: {sum(b.values()) - sum(a.values()):+.2f} per event in all; by function (|delta| >= {least}):")
    for d, k in rows:
        print(f"    {d:+7.2f}  {k}  ({a.get(k, 0.0):.2f} -> {b.get(k, 0.0):.2f})")


async def one(name: str, mode: str, servers: dict[str, EmbeddedNats], trees: dict[str, Path],
              args: argparse.Namespace) -> dict:
    return await sse_floor.one_round(name, servers[mode], trees, args.rate, args.seconds, args.batch)


async def run(args: argparse.Namespace) -> None:
    trees = {"edge": ROOT, **{n: Path(p).resolve() for n, _, p in (s.partition("=") for s in args.tree)}}
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma-separated choice of {', '.join(MODES)}")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; {sse_floor.STREAMS} SSE streams; "
          f"{args.rate:,.0f} events/s for {args.seconds:g} s, {args.batch} per flush; {args.rounds} round(s); "
          f"calls per event counted from the first paced publish to the last event read", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {(t, m): [] for t in trees for m in modes}
    with EmbeddedNats(jetstream=False) as core, EmbeddedNats(jetstream=True) as js:
        import nats
        from streamproc.core.wire import Subjects
        from streamproc.nats.streams import ensure_results_stream
        nc = await nats.connect(js.url)
        await ensure_results_stream(nc.jetstream(), Subjects(sse_floor.PREFIX))  # the durable processor's
        await nc.close()
        servers = {"core": core, "durable": js}
        order = [(t, m) for t in trees for m in modes]
        for r in range(args.rounds):
            for key in order[r % len(order):] + order[:r % len(order)]:
                runs[key].append(await one(*key, servers, trees, args))
                x = runs[key][-1]
                print(f"round {r + 1} {key[0]}/{key[1]}: {x['python_calls']:.1f} Python + {x['c_calls']:.1f} C "
                      f"calls per event, delivered {x['delivered']:.3f}", flush=True)
    print(f"\n{'tree/mode':<24}{'Python':>9}{'C':>9}{'all':>9}   calls per event (medians of the rounds)")
    for (t, m), xs in runs.items():
        p = statistics.median(x["python_calls"] for x in xs)
        c = statistics.median(x["c_calls"] for x in xs)
        print(f"{t + '/' + m:<24}{p:9.1f}{c:9.1f}{p + c:9.1f}")
    tables = {key: merged(xs) for key, xs in runs.items()}
    if args.c_callers:
        for (t, m), xs in runs.items():
            x = xs[-1]
            print(f"\n{t}/{m}: C calls by the Python function that made them, per event (last round)")
            for file, line, name, cname, n in x["calls"]["c_callers"][:args.top]:
                print(f"  {n / x['events']:7.2f}  {cname}  in {name} ({short(file)}:{line})")
    for (t, m), (python, c) in tables.items():
        print(f"\n{t}/{m}: Python functions called most, per event")
        for k, n in sorted(python.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {n:7.2f}  {k}")
        print(f"{t}/{m}: C calls, per event")
        for k, n in sorted(c.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {n:7.2f}  {k}")
    if len(modes) == 2:
        for t in trees:
            print(f"\n{t}: durable - core")
            for i, kind in ((0, "Python"), (1, "C")):
                diff(kind, tables[(t, "core")][i], tables[(t, "durable")][i], args.least, args.top)
    first = next(iter(trees))
    for t in list(trees)[1:]:
        for m in modes:
            print(f"\n{m}: {t} - {first}")
            for i, kind in ((0, "Python"), (1, "C")):
                diff(kind, tables[(first, m)][i], tables[(t, m)][i], args.least, args.top)
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2000.0, help="events published per second")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each paced run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch", type=int, default=10, metavar="N", help="results published per flush")
    parser.add_argument("--top", type=int, default=25, help="functions listed per table")
    parser.add_argument("--least", type=float, default=0.02, help="smallest per-event difference listed")
    parser.add_argument("--c-callers", action="store_true",
                        help="also list C calls by the Python function that made them (call_hook.py's CALL_HOOK_CALLERS)")
    parser.add_argument("--modes", default="core,durable", help="core, durable or both (default)")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="also count `streamproc edge` from this source tree (e.g. base=../base)")
    args = parser.parse_args()
    if args.rate <= 0 or args.seconds <= 0 or args.rounds < 1 or args.batch < 1:
        parser.error("--rate and --seconds must be positive, --rounds and --batch at least 1")
    if args.c_callers:
        os.environ[CALLERS_ENV] = "1"  # inherited by the edges started under call_hook.py
    with tempfile.TemporaryDirectory() as tmp:
        sse_floor.COUNT_DIR = Path(tmp)
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
