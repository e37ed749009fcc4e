"""Socket reads into one buffer per connection, for the benchmarks' raw asyncio floors.

streamproc's NATS connections read this way (``streamproc/nats/eager_reads.py``): a plain asyncio
``Protocol`` gets ``sock.recv(256 KiB)`` per read, which glibc may serve with ``mmap``, ``mremap``
and ``munmap`` each time (docs/benchmarks.md, "What a read costs at light load"). A floor that paid
that would not be a floor.
"""

from __future__ import annotations

import asyncio

READ_SIZE = 64 * 1024  # as streamproc/nats/eager_reads.py READ_SIZE


class BufferedReads(asyncio.BufferedProtocol):
    """``data_received(bytes)`` fed from one reused buffer (subclasses define ``data_received``)."""

    _read_buffer: memoryview | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(READ_SIZE))
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_buffer[:nbytes]))  # type: ignore[index]

    def data_received(self, data: bytes) -> None:
        raise NotImplementedError
