"""Socket reads into one buffer per connection (``asyncio.BufferedProtocol``).

A plain asyncio ``Protocol`` gets ``sock.recv(256 KiB)`` per read: depending on the heap's layout,
glibc serves an allocation that large with ``mmap``, shrinks it with ``mremap`` and frees it with
``munmap``, three system calls and a page fault for every read, ~20 µs of a small read's ~30 on
this repository's machine (CPython issue #85451; docs/benchmarks.md, "What a read costs at light
load"). Here the transport reads into one buffer kept for the connection (``recv_into``), and each
read's bytes are copied out at their size. No nats-py: the benchmarks' raw floors read this way too.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

try:  # mypy brings it, so the compiled build (scripts/build-compiled) has it
    from mypy_extensions import mypyc_attr
except ImportError:  # pure Python: the decorator has nothing to say
    def mypyc_attr(*_args: Any, **_kwargs: Any) -> Callable[[type], type]:  # type: ignore[misc]
        return lambda cls: cls

# Bytes one socket read may take. Under glibc's 128 KiB mmap threshold, so the copy of a full read
# comes from the heap too; at peak a read still holds hundreds of messages. (The stock path's
# transports get the same as their ``max_size``: FastClient._write_pending_now.)
READ_SIZE = 64 * 1024


# Compiled, a class takes no interpreted subclass unless it says so: the benchmarks' raw floors
# (sse_floor.RawNats, durable_floor.DurableFloor) subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class BufferedReads(asyncio.BufferedProtocol):
    """``data_received(bytes)`` fed from one reused buffer; subclasses define ``data_received``."""

    _read_buffer: memoryview | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        buffer = self._read_buffer
        if buffer is None:  # made at the first read: subclasses keep their own __init__
            buffer = self._read_buffer = memoryview(bytearray(READ_SIZE))
        return buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_buffer[:nbytes]))  # type: ignore[index]

    def data_received(self, data: bytes) -> None:
        raise NotImplementedError
