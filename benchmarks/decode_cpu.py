"""CPU of the joins --max-decode-cpu charges, for legitimate requests and for inflating ones.

The budget sums, per request, the CPU of its joins that run off the event loop and decode sequence
data (``Work.cpu``: the process's CPU minus the event loop thread's, so the join thread plus zstd's
compression worker threads; ``streamproc.nats.input.join_cpu_clock``). Joins that decode nothing
(logprob copies: the session's ``decodes`` count did not grow) are not charged. This measures, per
join, the join thread's CPU (what was charged before) and the process CPU (what is charged now), at
the defaults (``max_payload`` 1 MiB, ``--max-total-bytes`` 96 MiB):

- expert join: an SGLang P/D request with routed experts (DeepSeek-V3 shape, skewed ids from
  benchmarks/experts.py) whose legs are as large as ``max_payload`` allows; SGLang sends the rows on
  the terminal chunk only, so this is one join per request.
- streamed chunk: every decode chunk carrying output logprobs is joined (prefill's prompt-side
  logprobs are copied in); per chunk, without prompt logprobs (SGLang's default
  ``logprob_start_len = -1``; an 8-token prompt stands in) and with those of a 4,096-token and of a
  30,000-token prompt (whose prefill leg is near ``max_payload``).
- inflating join: a decode chunk of ~2 KB whose rows inflate to 32 MiB (tests/helpers.py
  ``inflating_pd_legs``), and to 47 MiB per leg (about what the 96 MiB budget lets one join decode).

Usage: python benchmarks/decode_cpu.py [--rounds 5] [--chunks 32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from experts import LAYERS, TOP_K, routed_experts  # noqa: E402
from helpers import inflating_pd_legs  # noqa: E402

from streamproc.catalog import codec_class, worker_for  # noqa: E402
from streamproc.codec import CodecOptions  # noqa: E402
from streamproc.core import defaults  # noqa: E402
from streamproc.sim.simulation import make_truth  # noqa: E402

MAX_PAYLOAD = 1 << 20  # nats-server's default


def measure(fn, rounds: int) -> tuple[float, float]:
    """Median (thread CPU, process CPU) seconds of ``fn()``."""
    threads, procs = [], []
    for _ in range(rounds):
        p, t = time.process_time(), time.thread_time()
        fn()
        threads.append(time.thread_time() - t)
        procs.append(time.process_time() - p)
    return statistics.median(threads), statistics.median(procs)


def expert_legs(prompt: int, output: int) -> tuple[bytes, bytes]:
    truth = make_truth(7, prompt_len=prompt, output_len=output, num_layers=1, top_k=1, num_experts=256)
    truth = msgspec.structs.replace(truth, num_layers=LAYERS, top_k=TOP_K,
                                    experts=routed_experts(prompt + output - 1), return_logprob=False,
                                    chunk_sizes=[output])
    worker = worker_for("sglang-zstd")
    return worker.prefill(truth, stream=False)[0], worker.decode(truth, stream=False)[0]


def largest_expert_legs(output: int = 256) -> tuple[int, bytes, bytes]:
    """The longest prompt (in steps of 100 tokens) whose legs both fit ``max_payload``."""
    prompt, legs = 100, expert_legs(100, output)
    while True:
        bigger = expert_legs(prompt + 100, output)
        if max(map(len, bigger)) > MAX_PAYLOAD:
            return prompt, *legs
        prompt, legs = prompt + 100, bigger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=32768, help="streamed chunks of the long request")
    args = parser.parse_args()
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    zstd = codec_class("sglang-zstd")(CodecOptions())

    prompt, prefill, decode = largest_expert_legs()

    def expert_join() -> None:
        session = zstd.open_session()
        session.absorb_prefill([prefill])
        session.join(decode, True)

    expert = measure(expert_join, args.rounds)
    print(f"expert join, legs {len(prefill):,}/{len(decode):,} B ({prompt:,}-token prompt + 256): "
          f"thread {expert[0] * 1e3:.1f} ms, process {expert[1] * 1e3:.1f} ms (charged)")

    sglang = codec_class("sglang")(CodecOptions())
    per_chunk = {}
    for prompt_len in (8, 4096, 30000):
        truth = make_truth(3, prompt_len=prompt_len, output_len=257, num_layers=1, top_k=1, num_experts=64)
        truth = msgspec.structs.replace(truth, chunk_sizes=[1] * 257, return_experts=False)
        worker = worker_for("sglang")
        legs, bodies = worker.prefill(truth, stream=True), worker.decode(truth, stream=True)[:-1]
        session = sglang.open_session()
        session.absorb_prefill(legs)
        cost = measure(lambda s=session, b=bodies: [s.join(body, False) for body in b], args.rounds)
        per_chunk[prompt_len] = cost[0] / len(bodies)
        assert session.decodes == 0  # a logprob copy: not charged
        print(f"streamed chunk, prompt logprobs of {prompt_len:,} tokens (prefill leg {sum(map(len, legs)):,} B): "
              f"thread {per_chunk[prompt_len] * 1e3:.3f} ms per chunk (not charged: decodes nothing)")

    for prompt_len in (2048, 3000):
        prefill_leg, decode_leg = inflating_pd_legs(prompt=prompt_len)
        session = zstd.open_session()
        session.absorb_prefill([prefill_leg])
        session.decode_budget = defaults.MAX_TOTAL_BYTES
        session.join(decode_leg, True)  # prefill's rows decoded once, as a streamed attack's later joins find them
        cost = measure(lambda s=session, leg=decode_leg: s.join(leg, True), args.rounds)
        print(f"inflating join, {len(decode_leg):,} B decode chunk -> {prompt_len * 16384 / 2**20:.0f} MiB of rows: "
              f"thread {cost[0] * 1e3:.1f} ms, process {cost[1] * 1e3:.1f} ms (charged; "
              f"{defaults.MAX_DECODE_CPU / cost[1]:,.0f} of them per {defaults.MAX_DECODE_CPU:g} s budget)")

    print(f"a request of one expert join + {args.chunks:,} streamed chunks: charged {expert[1]:.3f} s (the expert "
          "join); before, thread CPU of every join:")
    for prompt_len, cost in per_chunk.items():
        print(f"  prompt logprobs of {prompt_len:,} tokens: {expert[0] + args.chunks * cost:.2f} s")


if __name__ == "__main__":
    main()
