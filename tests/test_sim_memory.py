"""`streamproc simulate` holds what is in flight, not every request it plans (found by an attacker).

Every request and every message used to be built before connecting, about 10 KB a request: at
20,000 requests VmHWM 223 MiB (69 MiB at 2,000) and 5-6 s before the first chunk went out; with
--verify, 306 MiB, since every result was kept to the end too. `--requests` allows 10,000,000.
Now the traffic is planned, published and verified one window of requests at a time, so the peak
must not grow with the request count. The figures are the child's own (``wait4``'s ru_maxrss).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from typing import Callable

import anyio
import nats
import pytest
from conftest import CLI
from helpers import chunks_published_by, clean_env

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

SMALL, LARGE = 2_000, 20_000
# Growth of the peak from SMALL to LARGE requests. Before: 154 MiB publishing, 232 MiB verifying.
GROWTH_MIB = 16


class Measured:
    def __init__(self, code: int, out: str, err: str, peak_mib: float, first_chunk_s: float | None) -> None:
        self.code, self.out, self.err, self.peak_mib, self.first_chunk_s = code, out, err, peak_mib, first_chunk_s


def measure(nats_url: str, *args: str, timeout: float = 240) -> Measured:
    """Run ``streamproc simulate`` to its end; its peak RSS and when its first chunk reached NATS."""
    first: list[float] = []

    async def main() -> Measured:
        nc = await nats.connect(nats_url)

        async def seen(msg) -> None:
            if not first:
                first.append(time.perf_counter())

        sub = await nc.subscribe("streamproc.chunks.>", cb=seen)
        await nc.flush()
        started = time.perf_counter()
        proc = subprocess.Popen([*CLI, "simulate", "--nats-url", nats_url, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=clean_env())
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            # the pipes are drained while it runs (a full pipe would stall it); wait4 gives its own peak
            out, err = await anyio.to_thread.run_sync(_drain, proc)
            _, status, usage = await anyio.to_thread.run_sync(os.wait4, proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        await sub.unsubscribe()
        await nc.close()
        peak = usage.ru_maxrss / 1024  # KiB on Linux
        print(f"simulate {' '.join(args)}: peak {peak:.1f} MiB, first chunk after "
              f"{first[0] - started if first else float('nan'):.2f} s")
        return Measured(proc.returncode, out, err, peak, first[0] - started if first else None)

    return anyio.run(main)


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    result: dict[str, bytes] = {}
    reader = threading.Thread(target=lambda: result.setdefault("err", proc.stderr.read()))
    reader.start()
    out = proc.stdout.read()
    reader.join()
    return out.decode(errors="replace"), result["err"].decode(errors="replace")


def both(run: Callable[[int], Measured]) -> tuple[Measured, Measured]:
    small, large = run(SMALL), run(LARGE)
    for m in (small, large):
        assert m.code == 0, m.out[-2000:] + m.err[-2000:]
    return small, large


def test_simulate_publishes_twenty_thousand_requests_in_the_memory_of_two_thousand(nats_url):
    small, large = both(lambda n: measure(nats_url, "--requests", str(n), "--duplicates", "0.1"))
    assert re.search(rf"published \d+ chunks for {LARGE} requests", large.out), large.out
    assert large.peak_mib - small.peak_mib < GROWTH_MIB, (small.peak_mib, large.peak_mib)
    # nothing is planned ahead: the first chunk goes out as soon as the first window is (before: 5.7 s later)
    assert small.first_chunk_s is not None and large.first_chunk_s is not None
    assert large.first_chunk_s - small.first_chunk_s < 2.0, (small.first_chunk_s, large.first_chunk_s)


def test_simulate_verify_keeps_only_the_requests_in_flight(nats_url, streamproc_run):
    with streamproc_run("--format", "sglang"):
        small, large = both(lambda n: measure(nats_url, "--format", "sglang", "--requests", str(n),
                                              "--verify", "--timeout", "120"))
    assert f"verified OK: all {LARGE} requests" in large.out, large.out[-2000:]
    assert large.peak_mib - small.peak_mib < GROWTH_MIB, (small.peak_mib, large.peak_mib)


def test_simulate_verify_without_a_processor_stops_publishing_when_nothing_ends(nats_url, run_cli):
    """Publishing waits while 512 requests are open; with nothing answering it gives up after --timeout
    instead of publishing the rest (before: every request was published, then all were waited for)."""
    proc, received = chunks_published_by(nats_url, lambda: run_cli(
        "simulate", "--nats-url", nats_url, "--requests", "5000", "--verify", "--timeout", "1", timeout=60),
        expect=r"(\d+) chunks published")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopped publishing after 512 requests" in proc.stdout, proc.stdout
    assert "verified FAIL: 512 of 512 requests wrong or missing" in proc.stdout, proc.stdout
    assert len(received) == int(re.search(r"(\d+) chunks published", proc.stdout).group(1))
