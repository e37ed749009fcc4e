"""Give freed result memory back to the operating system after streams close.

Result bodies are tens of KiB each, below glibc's default mmap threshold, so they live in the
malloc heap; once the streams that held them are gone the memory is free but may stay in the
process. glibc's ``malloc_trim(0)`` returns the free pages (madvise) anywhere in the heap. The
edge calls it a moment after streams were released, at most every ``interval`` seconds; on a C
library without it (musl) this is a no-op.

``streamproc edge`` also fixes glibc's mmap threshold at :data:`MMAP_THRESHOLD` (``mallopt``;
by default it rises to 32 MiB after the first large free, glibc malloc/malloc.c "dynamic mmap
threshold"): result bodies at least that large get their own mapping, returned to the system
the moment the body is freed.

This is not what kept RSS up after slow readers left (883 MiB in issue 11): that was results
still queued in unsubscribed, unreachable nats-py subscriptions (``pending.drop``). With
that fixed, the three rounds of slow readers of tests/test_edge_memory.py measured RSS +5.6 MiB over
baseline with neither of these, +1.0 MiB with both (one run each, core mode).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import anyio


M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD = 32 * 1024


def _libc_function(name: str):
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):  # not glibc
        return None


def _malloc_trim():
    return _libc_function("malloc_trim")


def tune_allocator() -> bool:
    """Large result bodies in their own mappings (see the module docstring); False if not glibc."""
    mallopt = _libc_function("mallopt")
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


class HeapTrimmer:
    """``released()`` after a stream ends; :meth:`run` trims once per ``interval`` while there were."""

    def __init__(self, interval: float = 2.0) -> None:
        self.interval = interval
        self._trim = _malloc_trim()
        self._dirty = False
        self.trims = 0
        self.seconds = 0.0  # time spent trimming (the cost of this, for /metrics)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def released(self) -> None:
        self._dirty = True

    def trim(self) -> None:
        self._dirty = False
        if self._trim is None:
            return
        started = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - started
        self.trims += 1

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval)
            if self._dirty:
                self.trim()
