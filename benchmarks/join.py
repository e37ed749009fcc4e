"""P/D join cost of routed-experts payloads beside the stdlib zstd+base64 floor on the same bytes.

Rows are int32 expert ids, 58 layers x top-8 (DeepSeek-V3's MoE shape), skewed per layer as a real
router's are (benchmarks/experts.py: Zipf popularity per layer under per-layer permutations, top-k
without replacement). Prefill carries the prompt's rows, decode all rows with a stale prompt copy;
both are Base64(zstd(raw)) as the sglang-zstd worker emits them. Two requests:

- large:   4,000-token prompt, 1,001 output tokens (5,000 rows, 9.28 MB raw)
- typical: 1,000-token prompt, 256 output tokens (1,255 rows, 2.33 MB raw): P/D requests/s

floor      = stdlib base64.b64decode both, zstd-decompress both, splice, single-threaded
             zstd-compress at the same level (checksum, content size), stdlib base64.b64encode
streamproc = the SGLangZstdCodec session: absorb the prefill body, join the decode body (JSON in and
             out), with the codec's defaults (pybase64, zstd threads by core count)

Rounds are interleaved (floor, ours, floor, ours, ...) and the ratio is the median of per-round
ratios (paired), so drift on the shared machine hits both alike. With ``--baseline TREE`` a third
contender joins the same bodies in a child process whose ``PYTHONPATH`` is another source tree (e.g.
the main checkout), in the same rounds: before/after in one run. ``--steps`` prints what each step
of a join costs on its own (ours and the floor's) and exits. Then the size/speed trade-off of the
``zstd_level`` codec option on the large request.

Usage: python benchmarks/join.py [--rounds 15] [--json out.json] [--baseline /work/main] [--steps]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experts import LAYERS, TOP_K, routed_experts  # noqa: E402

from streamproc.catalog import worker_for  # noqa: E402
from streamproc.codec import CodecOptions  # noqa: E402
from streamproc.simulation import make_truth  # noqa: E402
from streamproc_sglang_zstd import SGLangZstdCodec  # noqa: E402
from streamproc_sglang_zstd.sequence import LEVEL, usable_cores, zstd_compressor  # noqa: E402

REQUESTS = {"large": (4000, 1001), "typical": (1000, 256)}
LEVELS = (-3, 1, 3, 6, 9)
TARGET = 0.6


def build(prompt: int, output: int, *, skew: float = 1.0):
    rows = prompt + output - 1
    truth = make_truth(7, prompt_len=prompt, output_len=output, num_layers=1, top_k=1, num_experts=256)
    truth = msgspec.structs.replace(truth, num_layers=LAYERS, top_k=TOP_K, experts=routed_experts(rows, s=skew),
                                    return_logprob=False, chunk_sizes=[output])
    worker = worker_for("sglang-zstd")
    return truth, worker.prefill(truth, stream=False)[0], worker.decode(truth, stream=False)[0]


def field(body: bytes) -> str:
    return msgspec.json.decode(body)["meta_info"]["routed_experts"]


def contenders(prefill_body: bytes, decode_body: bytes, level: int, format_options=()):
    codec = SGLangZstdCodec(CodecOptions(max_decompressed_bytes=64 << 20,
                                         format_options=(("zstd_level", str(level)), *format_options)))
    p_val, d_val = field(prefill_body), field(decode_body)
    compressor = zstd_compressor(level)  # single-threaded, same level, checksum and content size
    decompressor = zstandard.ZstdDecompressor()

    def floor() -> bytes:
        p = decompressor.decompress(base64.b64decode(p_val))
        d = decompressor.decompress(base64.b64decode(d_val))
        joined = p + d[len(p):]
        return base64.b64encode(compressor.compress(joined))

    def ours() -> bytes:
        session = codec.open_session()
        session.absorb_prefill([prefill_body])
        body, _verdict = session.join(decode_body, True)
        return body

    return floor, ours


def load_average() -> str:
    """The 1-minute load average, printed beside every figure (the machine is shared)."""
    return Path("/proc/loadavg").read_text().split()[0]


def timed(fn) -> tuple[float, float]:
    c0, t0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - c0, time.process_time() - t0


# The baseline contender: a child process on another source tree, joining the very same bodies with
# that tree's codec (its own defaults), timing each join itself; one line per join on stdout.
_CHILD = """
import pickle, sys, time
from streamproc.codec import CodecOptions
from streamproc_sglang_zstd import SGLangZstdCodec
prefill, decode, options = pickle.load(open(sys.argv[1], "rb"))
codec = SGLangZstdCodec(CodecOptions(max_decompressed_bytes=64 << 20, format_options=options))
def join():
    session = codec.open_session()
    session.absorb_prefill([prefill])
    return session.join(decode, True)[0]
sys.stdout.write(join().hex() + "\\n"); sys.stdout.flush()
for _ in sys.stdin:
    c0, t0 = time.perf_counter(), time.process_time()
    join()
    sys.stdout.write(f"{time.perf_counter() - c0} {time.process_time() - t0}\\n"); sys.stdout.flush()
"""


class Baseline:
    """``ours`` from another source tree, in a child process (see ``_CHILD``)."""

    def __init__(self, tree: Path, prefill_body: bytes, decode_body: bytes, format_options) -> None:
        self._file = tempfile.NamedTemporaryFile(suffix=".pickle")  # noqa: SIM115 (closed in close())
        pickle.dump((prefill_body, decode_body, tuple(format_options)), self._file)
        self._file.flush()
        path = os.pathsep.join(str(tree / p) for p in ("", "codecs/sglang", "codecs/vllm", "codecs/sglang-zstd"))
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, self._file.name], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env={**os.environ, "PYTHONPATH": path})
        self.body = bytes.fromhex(self._proc.stdout.readline())

    def timed(self) -> tuple[float, float]:
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()
        wall, cpu = self._proc.stdout.readline().split()
        return float(wall), float(cpu)

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._file.close()


def paired(floor, ours, rounds: int, baseline: Baseline | None = None) -> dict:
    floor(), ours()  # warm-up: thread pools, allocator
    if baseline is not None:
        baseline.timed()
    f_wall, o_wall, f_cpu, o_cpu, ratios = [], [], [], [], []
    b_wall, b_cpu, b_ratios, ob_ratios, ob_cpu = [], [], [], [], []
    for _ in range(rounds):
        fw, fc = timed(floor)
        ow, oc = timed(ours)
        f_wall.append(fw), o_wall.append(ow), f_cpu.append(fc), o_cpu.append(oc), ratios.append(ow / fw)
        if baseline is not None:
            bw, bc = baseline.timed()
            b_wall.append(bw), b_cpu.append(bc), b_ratios.append(bw / fw), ob_ratios.append(ow / bw)
            ob_cpu.append(oc / bc)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), 0, max(ratios)]
    out = {"floor_ms": statistics.median(f_wall) * 1e3, "ours_ms": statistics.median(o_wall) * 1e3,
           "floor_cpu_ms": statistics.median(f_cpu) * 1e3, "ours_cpu_ms": statistics.median(o_cpu) * 1e3,
           "ratio": statistics.median(ratios), "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
           "rounds": rounds}
    if baseline is not None:
        out.update(baseline_ms=statistics.median(b_wall) * 1e3, baseline_cpu_ms=statistics.median(b_cpu) * 1e3,
                   baseline_ratio=statistics.median(b_ratios), ours_vs_baseline=statistics.median(ob_ratios),
                   ours_vs_baseline_cpu=statistics.median(ob_cpu))
    return out


def steps(name: str, rounds: int) -> None:
    """Each step of one join on its own, median wall and CPU ms over ``rounds``, ours beside the floor."""
    import pybase64
    import xxhash
    from streamproc_sglang import native
    from streamproc_sglang_zstd.splice import splice_frame

    truth, prefill_body, decode_body = build(*REQUESTS[name])
    p_val, d_val = field(prefill_body), field(decode_body)
    p_frame, d_frame = pybase64.b64decode(p_val), pybase64.b64decode(d_val)
    dctx = zstandard.ZstdDecompressor()
    p_rows, d_rows = dctx.decompress(p_frame), dctx.decompress(d_frame)
    generated = memoryview(d_rows)[len(p_rows):]
    joined = p_rows + bytes(generated)
    single = zstd_compressor(LEVEL)
    cores = usable_cores()
    threaded = zstd_compressor(LEVEL, 2, 2 << 20) if cores > 1 else None
    bare = zstd_compressor(LEVEL, bare=True)
    frame = single.compress(joined)
    spliced = splice_frame(p_frame, p_rows, generated, bare)
    doc = native.parse(decode_body)
    doc["meta_info"]["routed_experts"] = pybase64.b64encode_as_string(spliced)
    table = [
        ("floor", "base64.b64decode both legs", lambda: (base64.b64decode(p_val), base64.b64decode(d_val))),
        ("floor", "zstd decompress prefill", lambda: dctx.decompress(p_frame)),
        ("floor", "zstd decompress decode", lambda: dctx.decompress(d_frame)),
        ("floor", "splice p + d[len(p):]", lambda: p_rows + d_rows[len(p_rows):]),
        ("floor", "zstd compress all rows, 1 thread", lambda: single.compress(joined)),
        ("floor", "base64.b64encode", lambda: base64.b64encode(frame)),
        ("ours", "JSON decode both bodies (msgspec)", lambda: (native.parse(prefill_body), native.parse(decode_body))),
        ("ours", "pybase64 decode both legs", lambda: (pybase64.b64decode(p_val, validate=True),
                                                      pybase64.b64decode(d_val, validate=True))),
        ("ours", "zstd decompress prefill", lambda: dctx.decompress(p_frame)),
        ("ours", "zstd decompress decode", lambda: dctx.decompress(d_frame)),
        ("ours", "(before) join rows + compress all, 2 threads",
         (lambda: threaded.compress(b"".join((p_rows, generated)))) if threaded else None),
        ("ours", "zstd compress generated rows only", lambda: bare.compress(generated[9:])),
        ("ours", "XXH64 of the joined rows", lambda: (xxhash.xxh64(p_rows).update(generated))),
        ("ours", "splice_frame (all of the above two + assembly)",
         lambda: splice_frame(p_frame, p_rows, generated, bare)),
        ("ours", "pybase64 encode", lambda: pybase64.b64encode_as_string(spliced)),
        ("ours", "JSON encode the joined body", lambda: native.encode(doc)),
    ]
    table = [row for row in table if row[2] is not None]
    figures: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(table))}
    for _ in range(rounds):
        for i, (_, _, fn) in enumerate(table):
            figures[i].append(timed(fn))
    print(f"steps of the {name} join ({len(truth.experts) / 1e6:.2f} MB raw), median of {rounds} rounds "
          f"(load average {load_average()})")
    print(f"{'who':6}{'step':50}{'wall ms':>9}{'cpu ms':>9}")
    for i, (who, label, _) in enumerate(table):
        print(f"{who:6}{label:50}{statistics.median(w for w, _ in figures[i]) * 1e3:9.2f}"
              f"{statistics.median(c for _, c in figures[i]) * 1e3:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--baseline", type=Path, help="also join with this source tree's codec (e.g. /work/main)")
    parser.add_argument("--steps", action="store_true", help="print each step's cost and exit")
    args = parser.parse_args()
    if args.steps:
        for name in REQUESTS:
            steps(name, args.rounds)
        return
    load = load_average()
    out: dict = {"cores": usable_cores(), "level": LEVEL, "requests": {}, "levels": []}

    print(f"join: {LAYERS} layers x top-{TOP_K} int32 ids, Zipf(s=1) per layer; zstd level {LEVEL}; "
          f"{usable_cores()} usable cores; {args.rounds} interleaved rounds; ratio = median of paired ratios")
    print(f"{'request':10}{'rows':>6}{'raw MB':>8}{'floor ms':>10}{'ours ms':>9}{'ratio':>7}{'IQR':>13}"
          f"{'floor cpu':>11}{'ours cpu':>10}{'floor B':>10}{'ours B':>10}{'floor req/s':>12}{'ours req/s':>11}"
          + (f"{'base ms':>9}{'base cpu':>9}{'base/floor':>11}{'ours/base':>10}{'cpu o/b':>8}{'base B':>9}"
             if args.baseline else ""))
    for name, (prompt, output) in REQUESTS.items():
        truth, prefill_body, decode_body = build(prompt, output)
        floor, ours = contenders(prefill_body, decode_body, LEVEL)
        # Correctness first: both produce the ground truth; output sizes side by side.
        floor_frame = base64.b64decode(floor())
        our_frame = base64.b64decode(field(ours()), validate=True)
        assert zstandard.ZstdDecompressor().decompress(floor_frame) == truth.experts
        assert zstandard.ZstdDecompressor().decompress(our_frame) == truth.experts
        baseline = Baseline(args.baseline, prefill_body, decode_body, ()) if args.baseline else None
        if baseline is not None:
            base_frame = base64.b64decode(field(baseline.body), validate=True)
            assert zstandard.ZstdDecompressor().decompress(base_frame) == truth.experts
        try:
            r = paired(floor, ours, args.rounds, baseline)
        finally:
            if baseline is not None:
                baseline.close()
        r.update(rows=prompt + output - 1, raw_bytes=len(truth.experts), floor_frame_bytes=len(floor_frame),
                 ours_frame_bytes=len(our_frame), floor_rps=1e3 / r["floor_ms"], ours_rps=1e3 / r["ours_ms"])
        if baseline is not None:
            r.update(baseline_frame_bytes=len(base_frame), baseline_tree=str(args.baseline))
        out["requests"][name] = r
        print(f"{name:10}{r['rows']:6}{r['raw_bytes'] / 1e6:8.2f}{r['floor_ms']:10.1f}{r['ours_ms']:9.1f}"
              f"{r['ratio']:7.3f}{r['ratio_q1']:7.2f}-{r['ratio_q3']:.2f}{r['floor_cpu_ms']:11.1f}"
              f"{r['ours_cpu_ms']:10.1f}{r['floor_frame_bytes']:10}{r['ours_frame_bytes']:10}"
              f"{r['floor_rps']:12.1f}{r['ours_rps']:11.1f}"
              + (f"{r['baseline_ms']:9.1f}{r['baseline_cpu_ms']:9.1f}{r['baseline_ratio']:11.3f}"
                 f"{r['ours_vs_baseline']:10.3f}{r['ours_vs_baseline_cpu']:8.3f}{r['baseline_frame_bytes']:9}"
                 if baseline is not None else ""))
    large = out["requests"]["large"]
    print(f"ratio streamproc/floor (large, median of paired): {large['ratio']:.3f}  (target <= {TARGET}); "
          f"typical P/D requests/s {out['requests']['typical']['ours_rps']:.1f} vs floor "
          f"{out['requests']['typical']['floor_rps']:.1f} ({out['requests']['typical']['ratio']:.3f}x time)")

    # The zstd_level option's trade-off, and what the skew does to the size (uniform ids beside).
    print("\nzstd_level trade-off on the large request (each level: ours vs the floor at that level; the prefill "
          f"worker compresses at {LEVEL}).\nzstd_splice=auto recompresses everything at levels other than {LEVEL}; "
          "'spliced' is zstd_splice=on there: the prompt rows keep the worker's level-3 blocks")
    print(f"{'level':>6}{'frame MB':>10}{'% of raw':>9}{'uniform %':>10}{'ours ms':>9}{'floor ms':>9}{'ratio':>7}"
          f"{'spliced MB':>11}{'spliced ms':>11}{'ratio':>7}")
    truth, prefill_body, decode_body = build(*REQUESTS["large"])
    uniform_raw = routed_experts(len(truth.experts) // (LAYERS * TOP_K * 4), s=0.0)
    for level in LEVELS:
        floor, ours = contenders(prefill_body, decode_body, level)
        frame = base64.b64decode(field(ours()), validate=True)
        uniform = len(zstd_compressor(level).compress(uniform_raw))
        r = paired(floor, ours, max(3, args.rounds // 3))
        row = {"level": level, "frame_bytes": len(frame), "raw_bytes": len(truth.experts),
               "uniform_frame_bytes": uniform, **r}
        line = (f"{level:6}{len(frame) / 1e6:10.3f}{100 * len(frame) / len(truth.experts):9.1f}"
                f"{100 * uniform / len(uniform_raw):10.1f}{r['ours_ms']:9.1f}{r['floor_ms']:9.1f}{r['ratio']:7.3f}")
        if level != LEVEL:
            floor, spliced = contenders(prefill_body, decode_body, level, (("zstd_splice", "on"),))
            spliced_frame = base64.b64decode(field(spliced()), validate=True)
            rs = paired(floor, spliced, max(3, args.rounds // 3))
            row["spliced"] = {"frame_bytes": len(spliced_frame), **rs}
            line += f"{len(spliced_frame) / 1e6:11.3f}{rs['ours_ms']:11.1f}{rs['ratio']:7.3f}"
        out["levels"].append(row)
        print(line)
    out["load"] = {"start": float(load), "end": float(load_average())}
    print(f"load average (1 min) at start {out['load']['start']}, at end {out['load']['end']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
