"""How long a resumed attempt's sglang-zstd chunk keeps the event loop: ``Correlator.receive`` for it
with joins inline (the stitch decompresses and compares both attempts' routed_experts on the loop:
the baseline, as before issue 10's stitch item) against offloaded (it becomes a ``Work``; the
stitch runs in the join thread). Rounds interleave the two, alternating which goes first.

Usage: python benchmarks/stitch_offload.py [--rounds 9] [--prompt 8000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from streamproc.catalog import Catalog, worker_for
from streamproc.core.correlator import Correlator, CorrelatorConfig, Work
from streamproc.sim.simulation import make_truth
from streamproc.testing.harness import leg
from streamproc.wire import Role

FORMAT = "sglang-zstd"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=8000, help="prompt tokens (rows = prompt + output, 48 x top-8)")
    args = ap.parse_args()
    worker = worker_for(FORMAT)
    truth = make_truth(3, request_id="m", prompt_len=args.prompt, output_len=8, chunk_sizes=[4, 4],
                       num_layers=48, top_k=8)
    first = leg("m", Role.AGG, worker.agg(truth, stream=True))[:1]  # 4 tokens published, then it moves
    resumed = leg("m", Role.AGG, worker.agg_resumed(truth, 4, stream=True), attempt=1)[0]
    config = CorrelatorConfig(max_total_bytes=2**34)

    lateness: list[float] = []

    def probe_while(work: Work) -> float:
        """The longest lateness of a 0.2 ms sleep while ``work`` runs in another thread."""
        done = threading.Event()
        runner = threading.Thread(target=lambda: (work.run(), done.set()))
        worst = 0.0
        runner.start()
        while not done.is_set():
            start = time.perf_counter()
            time.sleep(0.0002)
            worst = max(worst, time.perf_counter() - start - 0.0002)
        runner.join()
        return worst

    def once(offload: bool) -> float:
        c = Correlator(Catalog(), FORMAT, config)
        c.offload_joins = offload
        for ch in first:
            c.receive(ch, 0.0)
        c.migrate("m", 0.0)
        start = time.perf_counter()
        decisions = c.receive(resumed, 0.0)
        took = time.perf_counter() - start
        works = [d for d in decisions if isinstance(d, Work)]
        assert bool(works) == offload
        if works:
            lateness.append(probe_while(works[0]))
            assert c.finish(works[0], 0.0)
        return took

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for offload in ((False, True) if r % 2 else (True, False)):
            times[offload].append(once(offload))
    print(f"{FORMAT} resumed chunk of {len(resumed.body)} bytes, {args.rounds} interleaved rounds")
    for offload, label in ((False, "inline (baseline)"), (True, "offloaded")):
        v = sorted(times[offload])
        print(f"  {label:18} receive() on the loop: median {statistics.median(v) * 1e3:.3f} ms "
              f"(range {v[0] * 1e3:.3f}-{v[-1] * 1e3:.3f})")
    late = sorted(lateness)
    print(f"  offloaded: probe lateness while the Work runs: median {statistics.median(late) * 1e3:.3f} ms "
          f"(range {late[0] * 1e3:.3f}-{late[-1] * 1e3:.3f})")
    ratios = sorted(b / a for a, b in zip(times[False], times[True]))
    print(f"  paired ratio offloaded/inline: median {statistics.median(ratios):.4f} "
          f"(range {ratios[0]:.4f}-{ratios[-1]:.4f})")


if __name__ == "__main__":
    main()
