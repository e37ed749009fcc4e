"""P/D join cost of a large routed-experts payload beside bare zstd+base64 on the same bytes.

The payload is 5,000 token positions x 58 layers x top-8 int32 expert ids (DeepSeek-V3's MoE shape):
a 4,000-token prompt and 1,001 output tokens, so prefill carries 4,000 rows and decode 5,000 rows whose
first 4,000 are stale. Both are Base64(zstd(raw)) as the sglang-zstd worker emits them.

baseline  = b64decode both, zstd-decompress both, splice, zstd-compress, b64encode (same level/params)
streamproc = SGLangZstdCodec session: absorb the prefill body, join the decode body (JSON in and out)

Usage: python benchmarks/join.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import time

import msgspec
import numpy as np
import zstandard

from streamproc.catalog import Catalog, worker_for
from streamproc.codec import CodecOptions
from streamproc.simulation import make_truth

PROMPT, OUTPUT, LAYERS, TOP_K, EXPERTS = 4000, 1001, 58, 8, 256


def build():
    rows = PROMPT + OUTPUT - 1
    rng = np.random.default_rng(7)
    experts = rng.integers(0, EXPERTS, size=(rows, LAYERS, TOP_K), dtype="<i4").tobytes()
    truth = make_truth(7, prompt_len=PROMPT, output_len=OUTPUT, num_layers=1, top_k=1, num_experts=EXPERTS)
    truth = msgspec.structs.replace(truth, num_layers=LAYERS, top_k=TOP_K, experts=experts,
                                    return_logprob=False, chunk_sizes=[OUTPUT])
    worker = worker_for("sglang-zstd")
    prefill = worker.prefill(truth, stream=False)[0]
    decode = worker.decode(truth, stream=False)[0]
    return truth, prefill, decode


def field(body: bytes) -> str:
    return msgspec.json.decode(body)["meta_info"]["routed_experts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    truth, prefill_body, decode_body = build()
    codec = Catalog(CodecOptions(max_decompressed_bytes=64 * 1024 * 1024))("sglang-zstd")
    from streamproc_sglang_zstd.sequence import LEVEL as level, zstd_compressor

    p_val, d_val = field(prefill_body), field(decode_body)
    compressor = zstd_compressor()  # the worker's and the codec's settings: same level, checksum, size
    decompressor = zstandard.ZstdDecompressor()

    def baseline() -> bytes:
        p = decompressor.decompress(base64.b64decode(p_val))
        d = decompressor.decompress(base64.b64decode(d_val))
        joined = p + d[len(p):]
        return base64.b64encode(compressor.compress(joined))

    def streamproc_join() -> bytes:
        session = codec.open_session()
        session.absorb_prefill([prefill_body])
        body, _verdict = session.join(decode_body, True)
        return body

    # Correctness first: both produce the ground truth.
    assert decompressor.decompress(base64.b64decode(baseline())) == truth.experts
    joined = field(streamproc_join())
    assert decompressor.decompress(base64.b64decode(joined)) == truth.experts

    base_t, ours_t = [], []
    for _ in range(args.rounds):  # interleaved so drift on a noisy machine hits both alike
        t0 = time.perf_counter()
        baseline()
        t1 = time.perf_counter()
        streamproc_join()
        t2 = time.perf_counter()
        base_t.append(t1 - t0)
        ours_t.append(t2 - t1)

    raw = len(truth.experts)
    b, o = statistics.median(base_t), statistics.median(ours_t)
    print(f"payload: {PROMPT + OUTPUT - 1} rows x {LAYERS} layers x top-{TOP_K} = {raw / 1e6:.2f} MB raw int32, "
          f"prefill field {len(p_val) / 1e6:.2f} MB, decode field {len(d_val) / 1e6:.2f} MB (base64 zstd-{level})")
    print(f"{'':28}{'median ms':>10}{'min ms':>10}")
    print(f"{'bare zstd+base64':28}{b * 1e3:10.1f}{min(base_t) * 1e3:10.1f}")
    print(f"{'streamproc P/D join':28}{o * 1e3:10.1f}{min(ours_t) * 1e3:10.1f}")
    print(f"ratio streamproc/bare (median): {o / b:.3f}  (target <= 1.3)")


if __name__ == "__main__":
    main()
