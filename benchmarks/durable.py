"""Durable-mode throughput and latency: `streamproc run --mode durable` beside a plain nats-py
JetStream fetch-ack-republish loop (``jsrelay.py``), same stream, same load, same run.

Both contenders are subprocesses. Each measurement gets a fresh nats-server (file storage) whose
chunk and results streams are created by streamproc's own code with the processor's defaults, so
both contenders read the same stream configuration and store their results the same way
(``Nats-Msg-Id``, PubAck before the input is acknowledged). Rounds alternate between contenders.

- Peak: the chunk stream is filled with the load first, then the contender starts; throughput is
  chunks / (first result .. last result) at a core subscriber, CPU is the contender's own.
- Latency: at half of streamproc's peak rate, chunks are published live (paced); latency is a
  result's arrival at a core subscriber minus its chunk's publish time, for both contenders; also
  per seq within a request (a request's chunks are published back to back, and its results leave
  one PubAck after another, so the tail is the last seqs of the longest requests).

- Paced (``--paced 2000``): only the light-load figure: both contenders get the same paced rate,
  rounds alternate, and the CPU per chunk of the contender and of nats-server is printed beside
  the jsrelay's and beside streamproc with write coalescing off (``streamproc-0``: flush_interval
  and ack_linger 0), target 4: <= 60 us at 2,000 chunks/s; with latency.

- Profile (``--profile DIR``): py-spy (``--nonblocking``, 500 Hz, busy stacks only) records the
  streamproc contender of every run into ``DIR/<mode>-<n>.txt`` (collapsed stacks); the CPU
  figures of a profiled run include nothing of py-spy's own (it is another process) but the
  sampling perturbs the contender a little: profile and measure in separate runs.

- Floor (``--floor``): ``durable_floor.py`` joins every run: raw asyncio NATS, the processor's wire
  work per chunk (pull, result with PubAck, one result of a request in flight, ack after the PubAck,
  the same write interval) and nothing else; the least a Python durable relay can spend per chunk.

Usage: python benchmarks/durable.py [--chunks 30000] [--rounds 3] [--latency-seconds 5] [--paced 2000]
       [--partitions 8] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from passthrough import build_load, cpu_seconds  # noqa: E402

from streamproc import config  # noqa: E402
from streamproc.sim.embedded import EmbeddedNats, stop_process  # noqa: E402
from streamproc.core.partitions import PartitionScheme  # noqa: E402
from streamproc.nats.streams import (  # noqa: E402
    CHUNKS_STREAM,
    RESULTS_STREAM,
    ChunkStreamSpec,
    ensure_chunk_stream,
    ensure_results_stream,
    server_has_fast_batches,
)

NAMES = ("jsrelay", "streamproc")
FLOOR = "floor"  # --floor: durable_floor.py, the least a Python durable relay can spend per chunk
FLOOR_FB = "floor-fb"  # --floor-fast-batch: the floor sending each request's queued results as one fast batch
FLOORS = (FLOOR, FLOOR_FB)


def contender_cmd(name: str, url: str, settings: config.Settings) -> list[str]:
    if name == "jsrelay":
        return [sys.executable, str(HERE / "jsrelay.py"), "--nats-url", url, "--stream", CHUNKS_STREAM,
                "--consumer", "jsrelay", "--batch", str(settings.fetch_batch)]
    if name in FLOORS:  # the same consumer as the relay's, the processor's write interval
        return [sys.executable, str(HERE / "durable_floor.py"), "--nats-url", url, "--stream", CHUNKS_STREAM,
                "--consumer", "jsrelay", "--batch", str(settings.fetch_batch),
                "--interval", str(settings.flush_interval), *(["--fast-batch"] if name == FLOOR_FB else [])]
    return [str(Path(sys.executable).parent / "streamproc"), "run", "--nats-url", url, "--mode", "durable",
            "--format", "sglang", "--log-level", "WARNING", "--partitions", str(settings.partitions)]


async def prepare(nc, settings: config.Settings, name: str) -> None:
    """The streams exactly as the processor creates them; the relay's consumer reads all partitions."""
    js = nc.jetstream(timeout=10)
    storage = StorageType(settings.stream_storage)
    await ensure_results_stream(js, settings.subjects, max_age=settings.results_max_age,
                                duplicate_window=settings.duplicate_window, storage=storage,
                                batched=settings.result_batch > 1 and server_has_fast_batches(nc))
    await ensure_chunk_stream(js, ChunkStreamSpec(
        CHUNKS_STREAM, PartitionScheme(settings.subjects, settings.partitions), settings.chunks_max_age,
        settings.duplicate_window, storage))
    if name == FLOOR_FB and not (await js.stream_info(RESULTS_STREAM)).config.allow_batched:
        raise SystemExit("the floor with fast batches needs a results stream with allow_batched (nats-server 2.14+)")
    if name in ("jsrelay", *FLOORS):
        await js.add_consumer(CHUNKS_STREAM, ConsumerConfig(
            durable_name="jsrelay", ack_policy=AckPolicy.EXPLICIT, ack_wait=settings.ack_wait, max_deliver=-1,
            # What the default partitions allow streamproc in all, whatever --partitions says: the
            # relay's in-flight limit must not shrink with streamproc's partition count.
            max_ack_pending=settings.max_ack_pending * config.Settings().partitions,
            filter_subject=f"{settings.prefix}.partition.>"))


# The processor with write coalescing off (flush_interval, ack_linger 0): the before-figure of the paced mode.
UNCOALESCED = "streamproc-0"


# call_counts.py: rewrites a contender's command line (to run it under call_hook.py).
COMMAND_WRAPPER: Callable[[list[str]], list[str]] | None = None


def start(name: str, url: str, settings: config.Settings) -> subprocess.Popen:
    env = None
    if name == UNCOALESCED:
        env = {**os.environ, "STREAMPROC_FLUSH_INTERVAL": "0", "STREAMPROC_ACK_LINGER": "0"}
        name = "streamproc"
    cmd = contender_cmd(name, url, settings)
    if COMMAND_WRAPPER is not None:
        cmd = COMMAND_WRAPPER(cmd)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)


TICK = 0.002  # seconds: paced publishes leave in bursts this far apart
PROFILE_DIR: Path | None = None  # --profile: py-spy records every streamproc run here
PARTITIONS = config.Settings().partitions  # --partitions: of the chunk stream, and streamproc's
_profilers: dict[int, subprocess.Popen] = {}


def profile(name: str, proc: subprocess.Popen, mode: str) -> None:
    """Attach py-spy to a streamproc contender (``--profile``); stopped by :func:`finish`."""
    if PROFILE_DIR is None or name in ("jsrelay", *FLOORS):
        return
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)
    out = PROFILE_DIR / f"{mode}-{name}-{len(list(PROFILE_DIR.glob(f'{mode}-{name}-*.txt')))}.txt"
    _profilers[proc.pid] = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(proc.pid), "--rate", "500",
         "--nonblocking", "--format", "raw", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finish(proc: subprocess.Popen) -> None:
    spy = _profilers.pop(proc.pid, None)
    if spy is not None:  # py-spy writes its file on SIGINT
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
    stop_process(proc, 15)


async def peak(name: str, load) -> tuple[float, float]:
    """(chunks per second, contender CPU microseconds per chunk) draining a pre-filled stream."""
    with EmbeddedNats() as server:
        settings = config.load({}, {"nats_url": server.url, "mode": "durable", "partitions": PARTITIONS})
        nc = await nats.connect(server.url)
        proc = None
        try:
            await prepare(nc, settings, name)
            for n, (subject, body, headers) in enumerate(load):
                await nc.publish(subject, body, headers=headers)
                if n % 2000 == 1999:
                    await nc.flush()
            await nc.flush()
            js = nc.jetstream()
            while (await js.stream_info(CHUNKS_STREAM)).state.messages < len(load):
                await asyncio.sleep(0.05)

            expected, got = len(load), 0
            first = last = 0.0
            cpu0 = 0.0
            done = asyncio.Event()

            async def sink(msg) -> None:
                nonlocal got, first, last, cpu0
                got += 1
                if got == 1:
                    first = time.perf_counter()
                    cpu0 = cpu_seconds(proc.pid)
                if got == expected:
                    last = time.perf_counter()
                    done.set()

            await nc.subscribe(f"{settings.prefix}.results.>", cb=sink, pending_msgs_limit=-1, pending_bytes_limit=-1)
            await nc.flush()
            proc = start(name, server.url, settings)
            profile(name, proc, "peak")
            await asyncio.wait_for(done.wait(), 300)
            cpu = cpu_seconds(proc.pid) - cpu0
            return (expected - 1) / (last - first), cpu / (expected - 1) * 1e6
        finally:
            await nc.close()
            if proc is not None:
                finish(proc)


class Paced(NamedTuple):
    """One paced run of one contender."""

    p50: float  # ms, chunk publish -> result at a core subscriber
    p99: float
    chunks: int
    cpu_us: float  # contender CPU per chunk, from the first paced publish to the last result
    server_cpu_us: float  # nats-server CPU per chunk over the same window
    # (seq, p50 ms, p99 ms) per seq within a request: a request's next result leaves after its
    # predecessor's PubAck, so latency grows with seq by one PubAck hop per result (the chain)
    by_seq: tuple[tuple[int, float, float], ...] = ()


def _p50_p99(xs: list[float]) -> tuple[float, float]:
    """p50 and p99 in ms of latencies in seconds."""
    xs = sorted(xs)
    return xs[len(xs) // 2] * 1e3, xs[int(len(xs) * 0.99)] * 1e3


def by_seq_line(r: Paced) -> str:
    return "  by seq in request, p50/p99 ms: " + ", ".join(f"{k}: {a:.1f}/{b:.1f}" for k, a, b in r.by_seq)


async def latency(name: str, load, rate: float, seconds: float,
                  mark: Callable[[subprocess.Popen, str], Awaitable[None]] | None = None) -> Paced:
    """Latency and CPU per chunk publishing live at ``rate`` chunks/s for ``seconds``. ``mark`` is
    awaited with the contender's process and ``"start"`` before the first paced publish, and with
    ``"end"`` once the last result arrived (call_counts.py counts the calls in between)."""
    with EmbeddedNats() as server:
        settings = config.load({}, {"nats_url": server.url, "mode": "durable", "partitions": PARTITIONS})
        nc = await nats.connect(server.url)
        proc = None
        try:
            await prepare(nc, settings, "streamproc" if name == UNCOALESCED else name)
            count = min(len(load), int(rate * seconds))
            load = load[:count]
            sent: dict[tuple[str, str], float] = {}
            lat: list[float] = []
            by_seq: dict[int, list[float]] = {}
            warm = asyncio.Event()
            done = asyncio.Event()
            cut = len(f"{settings.prefix}.results.")

            async def sink(msg) -> None:
                now = time.perf_counter()
                rid = msg.subject[cut:]
                if rid == "warmup":
                    warm.set()
                    return
                seq = msg.headers["Streamproc-Seq"]
                t0 = sent.pop((rid, seq), None)
                if t0 is not None:
                    lat.append(now - t0)
                    by_seq.setdefault(int(seq), []).append(now - t0)
                    if len(lat) == count:
                        done.set()

            await nc.subscribe(f"{settings.prefix}.results.>", cb=sink, pending_msgs_limit=-1, pending_bytes_limit=-1)
            await nc.flush()
            proc = start(name, server.url, settings)
            probe = {"Streamproc-Seq": "0", "Streamproc-Final": "true", "Nats-Msg-Id": "warmup.agg.0.0"}
            await nc.publish(f"{settings.prefix}.chunks.warmup.agg", b"{}", headers=probe)
            await asyncio.wait_for(warm.wait(), 60)
            profile(name, proc, f"paced{rate:.0f}")
            await asyncio.sleep(0.5)

            tick = TICK
            server_pid = server.pid
            if mark is not None:
                await mark(proc, "start")
            cpu0, server0 = cpu_seconds(proc.pid), cpu_seconds(server_pid)
            started = time.perf_counter()
            for n, (subject, body, headers) in enumerate(load):
                due = started + n / rate
                now = time.perf_counter()
                if due > now + tick:
                    await nc.flush()
                    await asyncio.sleep(due - now)
                parts = subject.rsplit(".", 2)
                sent[(parts[-2], headers["Streamproc-Seq"])] = time.perf_counter()
                await nc.publish(subject, body, headers=headers)
            await nc.flush()
            await asyncio.wait_for(done.wait(), 120)
            cpu, server_cpu = cpu_seconds(proc.pid) - cpu0, cpu_seconds(server_pid) - server0
            if mark is not None:
                await mark(proc, "end")
            lat.sort()
            n = len(lat)
            seqs = tuple((k, *_p50_p99(v)) for k, v in sorted(by_seq.items()))
            return Paced(*_p50_p99(lat), n, cpu / n * 1e6, server_cpu / n * 1e6, seqs)
        finally:
            await nc.close()
            if proc is not None:
                finish(proc)


def floors(args) -> tuple[str, ...]:
    return (FLOOR,) * args.floor + (FLOOR_FB,) * args.floor_fast_batch


async def run(args) -> None:
    load = build_load(args.chunks, True, "streamproc")
    print(f"{os.cpu_count()} cores; {len(load)} aggregated streamed chunks per run (file storage, "
          f"{PARTITIONS} partitions, results stored with Msg-Id); {args.rounds} rounds alternating")
    names = (*NAMES, *floors(args))
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rate, cpu = await peak(name, load)
            rates[name].append(rate)
            cpus[name].append(cpu)
    relay, ours = statistics.median(rates["jsrelay"]), statistics.median(rates["streamproc"])
    relay_cpu, ours_cpu = statistics.median(cpus["jsrelay"]), statistics.median(cpus["streamproc"])
    print(f"{'peak':10}{'jsrelay chunks/s':>18}{'streamproc chunks/s':>21}{'ratio':>8}"
          f"{'jsrelay cpu us/chunk':>22}{'streamproc cpu us/chunk':>25}")
    print(f"{'streamed':10}{relay:18,.0f}{ours:21,.0f}{ours / relay:8.2f}{relay_cpu:22.1f}{ours_cpu:25.1f}")
    print(f"{'':10}   (runs jsrelay {', '.join(f'{x:,.0f}' for x in rates['jsrelay'])};"
          f" streamproc {', '.join(f'{x:,.0f}' for x in rates['streamproc'])})")
    for name in floors(args):
        floor, floor_cpu = statistics.median(rates[name]), statistics.median(cpus[name])
        print(f"{name + ' peak':10}{floor:18,.0f} chunks/s, cpu us/chunk {floor_cpu:.1f}; streamproc / {name} "
              f"{ours / floor:.2f} (runs {', '.join(f'{x:,.0f}' for x in rates[name])})")
    offered = ours / 2
    live = build_load(int(offered * args.latency_seconds) + 16, True, "streamproc")
    print(f"latency at half of streamproc's peak: {offered:,.0f} chunks/s offered for {args.latency_seconds:g} s, "
          "chunk publish -> result at a core subscriber")
    for name in names:
        r = await latency(name, live, offered, args.latency_seconds)
        print(f"{name:12} p50 {r.p50:7.2f} ms   p99 {r.p99:7.2f} ms   ({r.chunks} chunks; cpu us/chunk "
              f"{r.cpu_us:.1f}, nats-server {r.server_cpu_us:.1f})")
        print(by_seq_line(r))
    print("target: streamproc >= 2.0 x jsrelay (peak chunks/s); p99 <= 20 ms at half of peak")


async def run_paced(args) -> None:
    """Only the paced light-load figure: CPU per chunk of each contender and of nats-server at
    ``--paced`` chunks/s, rounds alternating, paired medians."""
    live = build_load(int(args.paced * args.latency_seconds) + 16, True, "streamproc")
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; paced {args.paced:,.0f} chunks/s for "
          f"{args.latency_seconds:g} s per run, {args.rounds} rounds alternating, {PARTITIONS} partitions; CPU from "
          "the first paced publish to the last result")
    names = (*NAMES, UNCOALESCED, *floors(args))
    runs: dict[str, list[Paced]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(await latency(name, live, args.paced, args.latency_seconds))
    print(f"{'contender':12}{'cpu us/chunk':>14}{'nats-server us/chunk':>22}{'p50 ms':>9}{'p99 ms':>9}   per round cpu us/chunk")
    for name in names:
        rs = runs[name]
        print(f"{name:12}{statistics.median(r.cpu_us for r in rs):14.1f}"
              f"{statistics.median(r.server_cpu_us for r in rs):22.1f}{statistics.median(r.p50 for r in rs):9.2f}"
              f"{statistics.median(r.p99 for r in rs):9.2f}   {', '.join(f'{r.cpu_us:.1f}' for r in rs)}")
    for other in names:
        if other == "streamproc":
            continue
        ratios = [o.cpu_us / j.cpu_us for o, j in zip(runs["streamproc"], runs[other])]
        print(f"streamproc / {other} cpu per chunk, paired median {statistics.median(ratios):.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    print(f"({UNCOALESCED}: streamproc with flush_interval and ack_linger 0); load average now "
          f"{os.getloadavg()[0]:.2f}")
    print(f"target: streamproc <= 60 us CPU per chunk at {args.paced:,.0f} chunks/s")


def main() -> None:
    global PROFILE_DIR, PARTITIONS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=30_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    parser.add_argument("--paced", type=float, default=0.0,
                        help="only the paced mode: offer this many chunks/s to each contender (e.g. 2000)")
    parser.add_argument("--floor", action="store_true",
                        help="add durable_floor.py (raw asyncio NATS, the processor's wire work only) to every run")
    parser.add_argument("--floor-fast-batch", action="store_true",
                        help="add the floor with --fast-batch (results stream with allow_batched) to every run")
    parser.add_argument("--partitions", type=int, default=PARTITIONS,
                        help="partitions of the chunk stream (streamproc reads one consumer per partition; the "
                             "jsrelay and the floors one consumer over all of them)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="record each streamproc run with py-spy into this directory (collapsed stacks)")
    args = parser.parse_args()
    PROFILE_DIR, PARTITIONS = args.profile, args.partitions
    asyncio.run(run_paced(args) if args.paced else run(args))


if __name__ == "__main__":
    main()
