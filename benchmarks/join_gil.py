"""How long each step of a large P/D join keeps other threads (the event loop) from running.

A join that runs in the worker thread delays the event loop only while it holds the GIL (or both
cores are busy). A probe thread sleeps 0.2 ms in a loop and records how late it wakes; the longest
lateness while a step runs is that step's hold. The steps are those of a sglang-zstd join of 2 x
32 MiB expert rows (tests/helpers.py ``inflating_pd_legs``, as in tests/test_hostile.py), each run
alone, and the whole join. The row splice is measured both ways, interleaved: the old
``bytes.join`` with a memoryview part (the baseline) and ``np.concatenate`` (what the codec does);
so is a migration's row stitch (bytes slice compare + ``bytes.join`` against numpy).

Usage: python benchmarks/join_gil.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import inflating_pd_legs  # noqa: E402

from streamproc.catalog import codec_class  # noqa: E402
from streamproc.codec import CodecOptions  # noqa: E402
from streamproc.decompress import decode_base64, decompress_zstd, encode_base64  # noqa: E402

SLEEP = 0.0002


class Probe:
    """A thread that records (start, end, lateness) of each of its short sleeps."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            start = time.perf_counter()
            time.sleep(SLEEP)
            end = time.perf_counter()
            self.samples.append((start, end, end - start - SLEEP))

    def hold(self, fn) -> tuple[float, float]:
        """(wall seconds of ``fn()``, the probe's longest lateness while it ran)."""
        self.samples = []
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        lateness = [late for (s, e, late) in self.samples if e >= start and s <= end]
        return end - start, max(lateness) if lateness else end - start  # no wake-up at all: held throughout

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    prefill, decode = inflating_pd_legs(prompt=2048)
    codec = codec_class("sglang-zstd")(CodecOptions())
    rows_codec = codec.sequences["routed_experts"]
    import msgspec

    value = msgspec.json.decode(decode)["meta_info"]["routed_experts"]
    frame = decode_base64(value, 1 << 30)
    decode_rows = decompress_zstd(frame, 512 << 20, rows_codec._dctx)
    session = codec.open_session()
    session.absorb_prefill([prefill])
    session.join(decode, False)  # not final: the session keeps prefill's decoded rows (a final join drops them)
    prefill_rows = session._rows.rows
    generated = memoryview(decode_rows)[len(prefill_rows):]
    joined = np.concatenate((np.frombuffer(prefill_rows, np.uint8), np.frombuffer(generated, np.uint8)))
    compressed = rows_codec._compressor(len(joined)).compress(joined)

    # A migration stitch (codecs/sglang/migration.py): an earlier attempt's rows win over the resumed
    # attempt's leading rows. Baseline: bytes slice + compare, then bytes.join with a memoryview.
    earlier, current = prefill_rows, decode_rows

    def stitch_bytes() -> None:
        if current[:len(earlier)] != earlier:
            b"".join((earlier, memoryview(current)[len(earlier):]))

    def stitch_numpy() -> None:
        earlier_ids, current_ids = np.frombuffer(earlier, np.uint8), np.frombuffer(current, np.uint8)
        if not np.array_equal(current_ids[:len(earlier)], earlier_ids):
            np.concatenate((earlier_ids, current_ids[len(earlier):]))

    def fresh_join() -> None:
        s = codec.open_session()
        s.absorb_prefill([prefill])
        s.join(decode, True)

    steps = {
        "splice: bytes.join((bytes, memoryview)) [baseline]": lambda: b"".join((prefill_rows, generated)),
        "splice: np.concatenate [ours]": lambda: np.concatenate(
            (np.frombuffer(prefill_rows, np.uint8), np.frombuffer(generated, np.uint8))),
        "stitch: bytes slice compare + bytes.join [baseline]": stitch_bytes,
        "stitch: np.array_equal + np.concatenate [ours]": stitch_numpy,
        "zstd decompress 32 MiB (+ free)": lambda: decompress_zstd(frame, 512 << 20, rows_codec._dctx),
        "zstd compress 32 MiB (codec's context)": lambda: rows_codec._compressor(len(joined)).compress(joined),
        "base64 encode of the frame": lambda: encode_base64(compressed),
        "whole join, prefill rows cached (not final)": lambda: session.join(decode, False),
        "whole join, fresh session": fresh_join,
    }
    probe = Probe()
    time.sleep(0.05)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    try:
        for _ in range(args.rounds):  # interleaved: every step once per round
            for name, fn in steps.items():
                results[name].append(probe.hold(fn))
    finally:
        probe.stop()
    print(f"{'step':52s} {'wall ms':>8s} {'held ms (median)':>17s} {'held ms (worst)':>16s}")
    for name, runs in results.items():
        walls = statistics.median(w for w, _ in runs)
        holds = [h for _, h in runs]
        print(f"{name:52s} {walls * 1e3:8.2f} {statistics.median(holds) * 1e3:17.2f} {max(holds) * 1e3:16.2f}")
    base = statistics.median(h for _, h in results["splice: bytes.join((bytes, memoryview)) [baseline]"])
    ours = statistics.median(h for _, h in results["splice: np.concatenate [ours]"])
    print(f"splice hold, ours / baseline: {ours / base:.3f}")
    base = statistics.median(h for _, h in results["stitch: bytes slice compare + bytes.join [baseline]"])
    ours = statistics.median(h for _, h in results["stitch: np.array_equal + np.concatenate [ours]"])
    print(f"migration stitch hold, ours / baseline: {ours / base:.3f}")


if __name__ == "__main__":
    main()
