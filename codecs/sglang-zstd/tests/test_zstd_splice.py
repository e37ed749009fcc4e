"""Spliced joined frames (splice.py): prefill's own compressed blocks, then the generated rows' blocks,
in one zstd frame that every decoder reads as the joined rows, with a checksum that is checked."""

from __future__ import annotations

import base64
import shutil
import subprocess

import msgspec
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from streamproc.codec import CodecOptions, CorruptPayload
from streamproc.decompress import encode_base64
from streamproc.simulation import make_truth
from streamproc.wire import Verdict
from streamproc_sglang.join import SGLangJoinSession
from streamproc_sglang_zstd import Base64ZstdRows, SGLangZstdCodec, SGLangZstdWorker
from streamproc_sglang_zstd.sequence import zstd_compressor
from streamproc_sglang_zstd.splice import MIN_PREFIX, splice_frame

LIMIT = 64 << 20
OPTIONS = CodecOptions(max_decompressed_bytes=LIMIT)
# A streamproc whose SGLang join predates the ``encode_after`` hook still joins correctly (it
# recompresses everything); only the join-level splice tests need the hook.
needs_join_hook = pytest.mark.skipif(not hasattr(SGLangJoinSession, "_encode_joined"),
                                     reason="the installed streamproc_sglang join has no encode_after hook")


def routed_rows(rows: int, *, width: int = 58 * 8, experts: int = 256, dtype: str = "<i4", seed: int = 0) -> bytes:
    """Expert ids with a per-column hot set, so the rows compress as real captures do."""
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, experts, size=(1, width))
    ids = np.where(rng.random((rows, width)) < 0.6, hot, rng.integers(0, experts, size=(rows, width)))
    return ids.astype(dtype).tobytes()


def prefill_frame(data: bytes, level: int, threads: int, sized: bool, checksum: bool) -> bytes:
    """A worker's frame: one-shot (content size in the header) or streamed (no size)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level, threads=threads, write_checksum=int(checksum), write_content_size=int(sized))
    cctx = zstandard.ZstdCompressor(compression_params=params)
    if sized:
        return cctx.compress(data)
    chunker = cctx.compressobj()
    return chunker.compress(data) + chunker.flush()


def blocks_of(frame: bytes) -> bytes:
    """A frame's blocks before its last block's header (whose last-block bit a splice clears)."""
    pos = zstandard.frame_header_size(frame)
    while True:
        header = int.from_bytes(frame[pos:pos + 3], "little")
        if header & 1:
            return frame[zstandard.frame_header_size(frame):pos]
        pos += 3 + (1 if header >> 1 & 3 == 1 else header >> 3)


# The three 7-byte blocks a splice puts after prefill's blocks (header: compressed, 7 bytes; no
# literals, one sequence, RLE tables; offset code 3 + extra 3 = offset 8, 2 + 3 = 4, 2 + 0 = 1).
RESET_BLOCKS = [bytes.fromhex(h) for h in ("3c0000 00 01 54 00 03 00 0b", "3c0000 00 01 54 00 02 00 07",
                                           "3c0000 00 01 54 00 02 00 04")]


def spliced(joined: bytes, prefill: bytes) -> bool:
    """Whether ``joined`` carries prefill's blocks followed by the offset-resetting blocks."""
    at = joined.find(blocks_of(prefill))
    return at > 0 and all(joined.find(block, at) > 0 for block in RESET_BLOCKS)


def check_decodes(frame: bytes, expected: bytes) -> None:
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == len(expected) and params.has_checksum
    assert zstandard.ZstdDecompressor().decompress(frame) == expected
    with zstandard.ZstdDecompressor().stream_reader(frame) as reader:  # the windowed, streaming path
        assert reader.read() == expected
    assert Base64ZstdRows(OPTIONS).decode(encode_base64(frame)) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix_bytes=st.integers(100_000, 600_000), suffix_rows=st.integers(1, 300),
       width=st.sampled_from([58 * 2, 58 * 8]), dtype=st.sampled_from(["<i4", "<u2", "u1"]),
       experts=st.sampled_from([2, 64, 256]), worker_level=st.sampled_from([-3, 1, 3, 9]),
       worker_threads=st.sampled_from([0, 2]), sized=st.booleans(), checksum=st.booleans(),
       level=st.sampled_from([-1, 3, 7]), threads=st.sampled_from([0, 2]), zeros=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_spliced_frame_decodes_to_the_joined_rows_or_is_not_built(
        prefix_bytes, suffix_rows, width, dtype, experts, worker_level, worker_threads, sized, checksum, level,
        threads, zeros, seed):
    row_bytes = width * np.dtype(dtype).itemsize
    prefix_rows = max(1, prefix_bytes // row_bytes)
    data = bytearray(routed_rows(prefix_rows + suffix_rows, width=width, experts=experts, dtype=dtype, seed=seed))
    cut = prefix_rows * row_bytes
    if zeros:  # a long zero run (zstd emits RLE blocks for it) reaching across the boundary
        data[max(0, cut - 300_000):cut + 64] = bytes(len(data[max(0, cut - 300_000):cut + 64]))
    data = bytes(data)
    prefix, suffix = data[:cut], data[cut:]
    frame = prefill_frame(prefix, worker_level, worker_threads, sized, checksum)
    joined = splice_frame(frame, prefix, suffix, zstd_compressor(level, threads, 1 << 20, bare=True))
    if len(prefix) < MIN_PREFIX:
        assert joined is None
    event("spliced" if joined is not None else "not built")
    if joined is None:
        return
    check_decodes(joined, data)
    assert spliced(joined, frame)  # prefill's compressed blocks, not a recompression


@pytest.mark.parametrize("threads", [0, 2])
def test_skewed_int32_rows_are_spliced_not_recompressed(threads):
    # 2,000 generated rows (3.7 MB): with 2 threads the generated rows' frame is several zstd jobs.
    data = routed_rows(3000)
    prefix, suffix = data[:1000 * 58 * 8 * 4], data[1000 * 58 * 8 * 4:]
    frame = prefill_frame(prefix, 3, 0, True, True)
    joined = splice_frame(frame, prefix, suffix, zstd_compressor(3, threads, 1 << 20, bare=True))
    assert joined is not None and spliced(joined, frame)
    check_decodes(joined, data)
    whole = zstd_compressor(3).compress(data)
    assert abs(len(joined) - len(whole)) < 0.005 * len(whole)  # the same size class as recompressing


def test_rows_without_the_offset_resetting_matches_are_not_spliced():
    # No byte equals the one 8 before it: no 3-byte match at offset 8 exists to reset the offsets.
    data = bytes(range(256)) * 2048
    prefix, suffix = data[:400_000], data[400_000:]
    frame = prefill_frame(prefix, 3, 0, True, True)
    assert splice_frame(frame, prefix, suffix, zstd_compressor(3, bare=True)) is None


def test_a_prefill_frame_of_many_tiny_blocks_is_recompressed_not_walked():
    # Valid zstd: 256 KiB of rows in raw blocks, then 200,000 empty raw blocks (600 KB of frame that
    # decodes in milliseconds); walking it in Python would not be, so the join recompresses.
    data = routed_rows(300)
    prefix, suffix = data[:256 << 10], data[256 << 10:]
    raw = [(0 | 0 << 1 | (128 << 10) << 3).to_bytes(3, "little") + prefix[i:i + (128 << 10)]
           for i in range(0, len(prefix), 128 << 10)]
    empty = [(0).to_bytes(3, "little")] * 200_000 + [(1).to_bytes(3, "little")]
    frame = b"\x28\xb5\x2f\xfd" + bytes([0x00, (20 - 10) << 3]) + b"".join(raw + empty)
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=len(prefix) + 1) == prefix
    assert splice_frame(frame, prefix, suffix, zstd_compressor(3, bare=True)) is None
    # The same rows in a few blocks do splice.
    few = b"\x28\xb5\x2f\xfd" + bytes([0x00, (20 - 10) << 3]) + b"".join(raw[:-1]) + \
        (1 | (128 << 10) << 3).to_bytes(3, "little") + prefix[128 << 10:]
    joined = splice_frame(few, prefix, suffix, zstd_compressor(3, bare=True))
    assert joined is not None
    check_decodes(joined, data)


def test_a_spliced_frame_with_a_wrong_checksum_is_refused():
    data = routed_rows(600)
    prefix, suffix = data[:500 * 58 * 8 * 4], data[500 * 58 * 8 * 4:]
    joined = splice_frame(prefill_frame(prefix, 3, 0, True, True), prefix, suffix, zstd_compressor(3, bare=True))
    assert joined is not None
    check_decodes(joined, data)
    bad = joined[:-4] + bytes(b ^ 0xFF for b in joined[-4:])
    with pytest.raises(CorruptPayload, match="checksum"):
        Base64ZstdRows(OPTIONS).decode(encode_base64(bad))


@pytest.mark.skipif(shutil.which("zstd") is None, reason="the zstd command-line tool is not installed")
def test_the_zstd_command_line_tool_reads_a_spliced_frame():
    data = routed_rows(2000, seed=3)
    prefix, suffix = data[:1500 * 58 * 8 * 4], data[1500 * 58 * 8 * 4:]
    joined = splice_frame(prefill_frame(prefix, 3, 0, True, True), prefix, suffix, zstd_compressor(3, bare=True))
    assert joined is not None
    out = subprocess.run(["zstd", "-d", "-c", "-q"], input=joined, capture_output=True, check=True, timeout=60)
    assert out.stdout == data


def join(truth, format_options=()):
    options = CodecOptions(max_decompressed_bytes=LIMIT, format_options=format_options)
    worker = SGLangZstdWorker(options)
    session = SGLangZstdCodec(options).open_session()
    prefill = worker.prefill(truth, stream=False)
    session.absorb_prefill(prefill)
    body, verdict = session.join(worker.decode(truth, stream=False)[0], True)
    assert verdict is Verdict.JOINED
    value = msgspec.json.decode(prefill[0])["meta_info"]["routed_experts"]
    return base64.b64decode(value), base64.b64decode(msgspec.json.decode(body)["meta_info"]["routed_experts"])


def large_truth():
    truth = make_truth(5, prompt_len=1200, output_len=300, num_layers=1, top_k=1, num_experts=256)
    return msgspec.structs.replace(truth, num_layers=58, top_k=8, experts=routed_rows(1499, seed=5),
                                   return_logprob=False, chunk_sizes=[300])


@needs_join_hook
@pytest.mark.parametrize("format_options", [(), (("zstd_threads", "0"),), (("zstd_threads", "2"),),
                                            (("zstd_level", "3"), ("zstd_splice", "on"))])
def test_a_large_join_splices_prefills_blocks_and_splice_off_recompresses(format_options):
    truth = large_truth()
    prefill, joined = join(truth, format_options)
    check_decodes(joined, truth.experts)
    assert spliced(joined, prefill)
    _, recompressed = join(truth, (*format_options, ("zstd_splice", "off")))
    check_decodes(recompressed, truth.experts)
    assert not spliced(recompressed, prefill)
    assert abs(len(joined) - len(recompressed)) < 0.005 * len(recompressed)  # same level, same size class


@needs_join_hook
def test_a_level_other_than_the_default_recompresses_unless_splice_is_on():
    truth = large_truth()
    prefill, at_9 = join(truth, (("zstd_level", "9"),))
    check_decodes(at_9, truth.experts)
    assert not spliced(at_9, prefill)  # zstd_level=9 promises level 9 for the whole frame
    _, forced = join(truth, (("zstd_level", "9"), ("zstd_splice", "on")))
    check_decodes(forced, truth.experts)
    assert spliced(forced, prefill)  # prompt rows at the worker's level 3: larger than all at 9
    assert len(forced) > len(at_9)


def test_a_bad_zstd_splice_option_is_refused_when_the_codec_is_built():
    with pytest.raises(ValueError, match="zstd_splice"):
        SGLangZstdCodec(CodecOptions(format_options=(("zstd_splice", "yes"),)))


def test_usable_cores_follows_the_cgroup_cpu_quota(tmp_path):
    from streamproc_sglang_zstd.sequence import cgroup_cpu_quota, compression_threads, usable_cores
    assert cgroup_cpu_quota(str(tmp_path)) is None  # nothing readable: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # v2: 1.5 CPUs
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: no zstd worker threads
    assert usable_cores(str(tmp_path)) == 1 and compression_threads(usable_cores(str(tmp_path))) == 0
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1, unlimited
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.0 and usable_cores(str(tmp_path)) == 1


def test_usable_cores_follows_the_affinity_mask():
    import os
    import sys
    probe = "from streamproc_sglang_zstd.sequence import usable_cores; print(usable_cores())"
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    one = sorted(os.sched_getaffinity(0))[:1]
    out = subprocess.run([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {one}); {probe}"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "1"
