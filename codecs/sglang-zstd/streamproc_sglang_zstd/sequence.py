"""``routed_experts`` as ``Base64(zstd(raw int32 rows))``: the one thing this format changes.

Both directions are bounded and strict: the Base64 text may not exceed what a legitimate frame for
``max_decompressed_bytes`` could need, the frame must be exactly one zstd frame, and its decompressed
size is judged from the header (or by a bounded streaming pass) before any output is allocated.
"""

from __future__ import annotations

import binascii
import math
import os

import numpy as np
import pybase64
import zstandard

from streamproc.codec import CodecOptions, CorruptPayload, SequenceCodec
from streamproc.decompress import (
    CORRUPT,
    decode_base64,
    decompress_zstd,
    encode_base64,
    zstd_declared_size,
    zstd_decompressor,
    zstd_frame_bound,
)

from .splice import splice_frame

LEVEL = 3  # the engine-side default and the codec's unless ``--format-option zstd_level=N``
LEVEL_OPTION = "zstd_level"
THREADS_OPTION = "zstd_threads"  # ``auto`` (default): one per usable core; ``0``: single-threaded
# ``on``: a P/D join keeps prefill's compressed blocks for the prompt rows and compresses only the
# generated rows (splice.py), so the prompt rows stay at whatever level the prefill worker used;
# ``off``: the whole joined payload is recompressed at ``zstd_level``. ``auto`` (default): ``on``
# unless ``zstd_level`` asks for a level other than the engines' default, whose promise is that
# level for the whole frame (a level-3 prefill spliced into a level-9 join was 0.9% larger on
# benchmarks/experts.py rows than recompressing at 9, 6.8% on more compressible test rows).
SPLICE_OPTION = "zstd_splice"
# zstd cuts a multi-threaded frame into jobs compressed in parallel; the job size is picked per
# payload: the larger size when it still gives every thread two jobs, else the smaller. Measured at
# level 3 on skewed routed-expert rows, 2 cores, paired rounds against single-threaded: 9.28 MB
# (5,000 rows) 0.90x with 2 MiB jobs (+0.03% size), 0.93x with 1 MiB; 2.33 MB (a 1,000 + 256
# token request) 0.81x with 1 MiB jobs (+0.12% size) but 1.03x with 2 MiB (one 2 MiB job and a
# 0.3 MiB one). 512 KiB jobs lose 0.3% of ratio for nothing. zstd itself refuses jobs under
# 512 KiB and stays single-threaded for inputs below that.
JOB_SIZES = (1 << 20, 2 << 20)
MAX_THREADS = 8  # a join is one request; more workers than this only add thread start-up


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Cores this process may run on: its affinity mask, not the machine's count, lowered to a
    container's CPU quota (a zstd worker per visible core under a one-core quota only adds
    hand-offs). The quota is read where a container sees its own cgroup, v2 or v1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time per period the cgroup allows (``cpu.max`` quota / period, or v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), None when unlimited or unreadable."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def job_size(size: int, threads: int) -> int:
    """The job size for a ``size``-byte input on ``threads`` workers (see :data:`JOB_SIZES`)."""
    fitting = [job for job in JOB_SIZES if size >= 2 * threads * job]
    return fitting[-1] if fitting else JOB_SIZES[0]


def compression_threads(cores: int) -> int:
    """zstd worker threads for ``cores``: none on one core (a worker thread there only adds
    hand-offs), else one per core up to :data:`MAX_THREADS`."""
    return 0 if cores < 2 else min(cores, MAX_THREADS)


def zstd_compressor(level: int = LEVEL, threads: int = 0, job: int = JOB_SIZES[-1], *,
                    bare: bool = False) -> zstandard.ZstdCompressor:
    """Content size in the header (cheap bounds) and a content checksum (detects value-level
    corruption that a size check cannot). ``threads`` > 0 makes one frame in ``job``-byte jobs
    compressed in parallel: the same format, any zstd decoder reads it. ``bare``: neither, for
    blocks that go into a spliced frame (splice.py writes that frame's header and checksum)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level, threads=threads, job_size=job if threads else 0, write_checksum=int(not bare),
        write_content_size=int(not bare), write_dict_id=0)
    return zstandard.ZstdCompressor(compression_params=params)


def _level_option(options: CodecOptions) -> int:
    text = options.option(LEVEL_OPTION, str(LEVEL))
    try:
        level = int(text)
    except ValueError:
        level = None
    if level is None or not -7 <= level <= zstandard.MAX_COMPRESSION_LEVEL or level == 0:
        raise ValueError(f"format option {LEVEL_OPTION}={text!r}: expected an integer from -7 to "
                         f"{zstandard.MAX_COMPRESSION_LEVEL}, not 0")
    return level


def _threads_option(options: CodecOptions) -> int:
    text = options.option(THREADS_OPTION, "auto")
    if text == "auto":
        return compression_threads(usable_cores())
    if not text.isdigit() or int(text) > 64:
        raise ValueError(f"format option {THREADS_OPTION}={text!r}: expected auto or 0..64")
    return int(text)


def _splice_option(options: CodecOptions, level: int) -> bool:
    text = options.option(SPLICE_OPTION, "auto")
    if text not in ("auto", "on", "off"):
        raise ValueError(f"format option {SPLICE_OPTION}={text!r}: expected auto, on or off")
    return text == "on" or (text == "auto" and level == LEVEL)


class Base64ZstdRows(SequenceCodec[bytes]):
    """Raw int32 rows <-> Base64 text of one zstd frame.

    zstd contexts are not thread safe, so each instance (one per codec instance) owns its own.
    Format options: ``zstd_level`` (default 3; the level the join compresses at, whatever the
    workers used), ``zstd_threads`` (``auto``: one per usable core) and ``zstd_splice`` (``on``:
    the prompt rows keep prefill's own compressed blocks, see :meth:`encode_after`; ``auto``: on
    at the default level).
    """

    def __init__(self, options: CodecOptions) -> None:
        super().__init__(options)
        self._limit = options.max_decompressed_bytes
        self._frame_limit = zstd_frame_bound(self._limit)
        # The join's recompression: level and threads are codec options (docs/benchmarks.md has
        # the size/speed trade-off per level on skewed routed-expert data).
        self.level = _level_option(options)
        self.threads = _threads_option(options)
        self.splice = _splice_option(options, self.level)
        self._cctx = zstd_compressor(self.level, self.threads)  # single-threaded or the largest jobs
        self._cctx_by_job: dict[tuple[int, bool], zstandard.ZstdCompressor] = {
            (JOB_SIZES[-1], False): self._cctx}  # by (job size, bare)
        self._dctx = zstd_decompressor(self._limit)

    def decode(self, value: object) -> bytes:
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        frame = decode_base64(value, self._frame_limit)
        return decompress_zstd(frame, self._limit, self._dctx)

    def decode_within(self, value: object, limit: int) -> bytes:
        """The same, but the frame may inflate to at most ``limit`` (what the body's counts allow)."""
        if not isinstance(value, str):
            raise CorruptPayload(CORRUPT, f"expected a base64 string, got {type(value).__name__}")
        limit = min(limit, self._limit)
        frame = decode_base64(value, zstd_frame_bound(limit))
        return decompress_zstd(frame, limit, self._dctx)

    def decoded_bound(self, value: object, limit: int) -> int:
        """What :meth:`decode_within` allocates for its output: the size the frame's header declares
        (read from its first 24 Base64 characters), 0 past ``limit`` (refused before allocating), and
        ``limit`` for a frame that declares none (measured, then decoded within it)."""
        if not isinstance(value, str):
            return 0
        limit = min(limit, self._limit)
        declared = zstd_declared_size(value)
        if declared is None:
            return limit
        return declared if declared <= limit else 0

    def encode(self, rows: bytes | bytearray | memoryview) -> str:
        return encode_base64(self._compressor(len(rows)).compress(rows))

    def encode_after(self, prefix_value: str, prefix: bytes, suffix: bytes | memoryview) -> str:
        """The encoding of ``prefix + suffix`` where ``prefix_value`` is an accepted encoding of
        ``prefix`` (prefill's value, which :meth:`decode` turned into ``prefix``). The frame reuses
        ``prefix_value``'s compressed blocks and compresses only ``suffix`` (splice.py), which made a
        5,000-row join's compression ~5x cheaper; when that frame cannot be built, or when splicing
        is off (:data:`SPLICE_OPTION`), the whole payload is recompressed as :meth:`encode` does."""
        if self.splice:
            # Base64 again rather than keeping the frame: ~0.1 ms per 3 MB, not a retained copy.
            try:
                frame = pybase64.b64decode(prefix_value, validate=True)
            except (binascii.Error, ValueError, TypeError):  # a text only binascii's strict mode accepts
                frame = b""
            joined = splice_frame(frame, prefix, suffix, self._compressor(len(suffix), bare=True))
            if joined is not None:
                return encode_base64(joined)
        # numpy copies without the GIL (``bytes.join`` with a memoryview part holds it throughout).
        return self.encode(np.concatenate((np.frombuffer(prefix, np.uint8), np.frombuffer(suffix, np.uint8))))

    def _compressor(self, size: int, *, bare: bool = False) -> zstandard.ZstdCompressor:
        if not self.threads and not bare:
            return self._cctx
        job = job_size(size, self.threads) if self.threads else 0
        cctx = self._cctx_by_job.get((job, bare))
        if cctx is None:  # at most 2 x len(JOB_SIZES) contexts, each with its own worker pool
            cctx = self._cctx_by_job[job, bare] = zstd_compressor(self.level, self.threads, job, bare=bare)
        return cctx
