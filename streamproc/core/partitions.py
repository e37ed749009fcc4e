"""The partition scheme: which durable consumer sees which request, computed like the server does.

The chunk stream stores ``P.chunks.<request_id>.<role>`` under ``P.partition.<n>.<request_id>.<role>``
with ``n = {{partition(N,1)}}``, a stream subject transform hashing the request-id token only. Both
legs of a P/D request therefore land in one partition, so one processor instance sees all of its
chunks, in the order they were stored. Each partition is read by one durable pull consumer.

The server's ``partition`` function is FNV-1a (32 bit) over the listed tokens' bytes, modulo N
(nats-server ``subject_transform.go``); :func:`partition_of` reproduces it so tests and tools can
tell where a request lives without asking the server.
"""

from __future__ import annotations

import msgspec

from .wire import Subjects

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193
MAX_PARTITIONS = 1024


def fnv1a32(data: bytes) -> int:
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def partition_of(request_id: str, partitions: int) -> int:
    """The partition the server's ``{{partition(partitions,1)}}`` mapping puts ``request_id`` in."""
    return fnv1a32(request_id.encode()) % partitions


class PartitionScheme(msgspec.Struct, frozen=True):
    """Subjects of a chunk space split into ``count`` partitions."""

    subjects: Subjects
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be between 1 and {MAX_PARTITIONS}, got {self.count}")

    @property
    def source(self) -> str:
        """Well-formed chunk subjects: the transform's source."""
        return f"{self.subjects.prefix}.chunks.*.*"

    @property
    def destination(self) -> str:
        return (f"{self.subjects.prefix}.partition.{{{{partition({self.count},1)}}}}"
                ".{{wildcard(1)}}.{{wildcard(2)}}")

    def head(self, n: int) -> str:
        """Stored subjects of partition ``n`` start with this (then ``<request_id>.<role>``)."""
        return f"{self.subjects.prefix}.partition.{n}."

    def filter(self, n: int) -> str:
        return f"{self.head(n)}*.*"

    def of(self, request_id: str) -> int:
        return partition_of(request_id, self.count)
