"""A P/D join through the correlator as core and durable mode run it, paired against another source tree.

``benchmarks/join.py`` times the codec session alone. This times what the correlator adds around an
offloaded join (``offload_joins``): the prefill leg received and absorbed, the decode chunk received
and handed out as ``Work`` (with its byte-budget reservation, ``JoinSession.join_bytes``), the job
run, ``finish`` applying the outcome. The bodies are join.py's (sglang-zstd, DeepSeek-V3-shaped
skewed rows): ``typical`` (1,000 + 256 tokens) and ``large`` (4,000 + 1,001). Each tree runs in a
child process of its own (``PYTHONPATH`` = that tree and its codecs), the rounds interleaved (this
tree, the baseline, this tree, ...), each round ``--joins`` requests; the figure is the median of
the per-round ratios of CPU per join (paired), so drift on the shared machine hits both alike.

Usage: python benchmarks/join_correlator.py --baseline /path/to/other/tree [--rounds 15] [--joins 20]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from join import build, load_average  # noqa: E402

_CHILD = """
import pickle, sys, time
from streamproc.catalog import Catalog
from streamproc.codec import CodecOptions
from streamproc.correlator import Correlator, CorrelatorConfig, Work
from streamproc.wire import Chunk, Role
prefill, decode, joins = pickle.load(open(sys.argv[1], "rb"))
c = Correlator(Catalog(CodecOptions(max_decompressed_bytes=64 << 20)), "sglang-zstd", CorrelatorConfig())
c.offload_joins = True
n = 0
def one():
    global n
    n += 1
    rid = f"r{n}"
    c.receive(Chunk(rid, Role.PREFILL, 0, prefill, True), 0.0)
    (work,) = [d for d in c.receive(Chunk(rid, Role.DECODE, 0, decode, True), 0.0) if isinstance(d, Work)]
    work.run()
    assert [d for d in c.finish(work, 0.0) if getattr(d, "seq", None) == 0][0].verdict.value == "joined"
for _ in range(3):
    one()
sys.stdout.write("ready\\n"); sys.stdout.flush()
for _ in sys.stdin:
    t0 = time.process_time()
    for _ in range(joins):
        one()
    sys.stdout.write(f"{(time.process_time() - t0) / joins}\\n"); sys.stdout.flush()
"""


class Tree:
    def __init__(self, tree: Path, data: str) -> None:
        path = os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, data], text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        assert self.proc.stdout.readline().strip() == "ready"

    def round(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="the other source tree (e.g. a main checkout)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--joins", type=int, default=20, help="joins per round")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    print(f"load average {load_average()} at the start")
    print(f"{'request':8}{'ours ms':>9}{'base ms':>9}{'ratio':>8}{'q1':>7}{'q3':>7}")
    for name, (prompt, output) in (("typical", (1000, 256)), ("large", (4000, 1001))):
        _truth, prefill, decode = build(prompt, output)
        with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
            pickle.dump((prefill, decode, args.joins), f)
            f.flush()
            ours, base = Tree(here, f.name), Tree(args.baseline, f.name)
            try:
                o, b = [], []
                for _ in range(args.rounds):
                    o.append(ours.round())
                    b.append(base.round())
            finally:
                ours.close()
                base.close()
        ratios = [x / y for x, y in zip(o, b)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{name:8}{statistics.median(o) * 1e3:9.2f}{statistics.median(b) * 1e3:9.2f}"
              f"{statistics.median(ratios):8.3f}{q1:7.3f}{q3:7.3f}")
    print(f"load average {load_average()} at the end")


if __name__ == "__main__":
    main()
