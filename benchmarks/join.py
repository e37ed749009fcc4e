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
ratios (paired), so drift on the shared machine hits both alike. Then the size/speed trade-off of
the ``zstd_level`` codec option on the large request.

Usage: python benchmarks/join.py [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
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


def timed(fn) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def paired(floor, ours, rounds: int) -> dict:
    floor(), ours()  # warm-up: thread pools, allocator
    f_wall, o_wall, f_cpu, o_cpu, ratios = [], [], [], [], []
    for _ in range(rounds):
        fw, fc = timed(floor)
        ow, oc = timed(ours)
        f_wall.append(fw), o_wall.append(ow), f_cpu.append(fc), o_cpu.append(oc), ratios.append(ow / fw)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), 0, max(ratios)]
    return {"floor_ms": statistics.median(f_wall) * 1e3, "ours_ms": statistics.median(o_wall) * 1e3,
            "floor_cpu_ms": statistics.median(f_cpu) * 1e3, "ours_cpu_ms": statistics.median(o_cpu) * 1e3,
            "ratio": statistics.median(ratios), "ratio_q1": quartiles[0], "ratio_q3": quartiles[2],
            "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    out: dict = {"cores": usable_cores(), "level": LEVEL, "requests": {}, "levels": []}

    print(f"join: {LAYERS} layers x top-{TOP_K} int32 ids, Zipf(s=1) per layer; zstd level {LEVEL}; "
          f"{usable_cores()} usable cores; {args.rounds} interleaved rounds; ratio = median of paired ratios")
    print(f"{'request':10}{'rows':>6}{'raw MB':>8}{'floor ms':>10}{'ours ms':>9}{'ratio':>7}{'IQR':>13}"
          f"{'floor cpu':>11}{'ours cpu':>10}{'floor B':>10}{'ours B':>10}{'floor req/s':>12}{'ours req/s':>11}")
    for name, (prompt, output) in REQUESTS.items():
        truth, prefill_body, decode_body = build(prompt, output)
        floor, ours = contenders(prefill_body, decode_body, LEVEL)
        # Correctness first: both produce the ground truth; output sizes side by side.
        floor_frame = base64.b64decode(floor())
        our_frame = base64.b64decode(field(ours()), validate=True)
        assert zstandard.ZstdDecompressor().decompress(floor_frame) == truth.experts
        assert zstandard.ZstdDecompressor().decompress(our_frame) == truth.experts
        r = paired(floor, ours, args.rounds)
        r.update(rows=prompt + output - 1, raw_bytes=len(truth.experts), floor_frame_bytes=len(floor_frame),
                 ours_frame_bytes=len(our_frame), floor_rps=1e3 / r["floor_ms"], ours_rps=1e3 / r["ours_ms"])
        out["requests"][name] = r
        print(f"{name:10}{r['rows']:6}{r['raw_bytes'] / 1e6:8.2f}{r['floor_ms']:10.1f}{r['ours_ms']:9.1f}"
              f"{r['ratio']:7.3f}{r['ratio_q1']:7.2f}-{r['ratio_q3']:.2f}{r['floor_cpu_ms']:11.1f}"
              f"{r['ours_cpu_ms']:10.1f}{r['floor_frame_bytes']:10}{r['ours_frame_bytes']:10}"
              f"{r['floor_rps']:12.1f}{r['ours_rps']:11.1f}")
    large = out["requests"]["large"]
    print(f"ratio streamproc/floor (large, median of paired): {large['ratio']:.3f}  (target <= {TARGET}); "
          f"typical P/D requests/s {out['requests']['typical']['ours_rps']:.1f} vs floor "
          f"{out['requests']['typical']['floor_rps']:.1f} ({out['requests']['typical']['ratio']:.3f}x time)")

    # The zstd_level option's trade-off, and what the skew does to the size (uniform ids beside).
    print("\nzstd_level trade-off on the large request (each level: ours vs the floor at that level)")
    print(f"{'level':>6}{'frame MB':>10}{'% of raw':>9}{'uniform %':>10}{'ours ms':>9}{'floor ms':>9}{'ratio':>7}")
    truth, prefill_body, decode_body = build(*REQUESTS["large"])
    uniform_raw = routed_experts(len(truth.experts) // (LAYERS * TOP_K * 4), s=0.0)
    for level in LEVELS:
        floor, ours = contenders(prefill_body, decode_body, level)
        frame = base64.b64decode(field(ours()), validate=True)
        uniform = len(zstd_compressor(level).compress(uniform_raw))
        r = paired(floor, ours, max(3, args.rounds // 3))
        row = {"level": level, "frame_bytes": len(frame), "raw_bytes": len(truth.experts),
               "uniform_frame_bytes": uniform, **r}
        out["levels"].append(row)
        print(f"{level:6}{len(frame) / 1e6:10.3f}{100 * len(frame) / len(truth.experts):9.1f}"
              f"{100 * uniform / len(uniform_raw):10.1f}{r['ours_ms']:9.1f}{r['floor_ms']:9.1f}{r['ratio']:7.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
