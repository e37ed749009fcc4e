"""The worker side of the wire contract: publish native chunks with the right subject and headers.

Any NATS client can do this by following ``docs/protocol.md``; the helper exists so a worker
cannot get the subject layout, the header spelling or the ``Nats-Msg-Id`` format wrong.
"""

from __future__ import annotations

from typing import Iterable

from nats.aio.client import Client as NatsClient

from ..core.wire import Role, Subjects, check_request_id, chunk_headers


class ChunkPublisher:
    def __init__(self, nc: NatsClient, subjects: Subjects | None = None) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()

    async def publish(
        self,
        request_id: str,
        role: Role | str,
        seq: int,
        body: bytes,
        *,
        final: bool = False,
        attempt: int = 0,
        format: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        """Publish one chunk of one leg. ``seq`` counts from 0 per request, role and attempt."""
        check_request_id(request_id)
        if seq < 0 or attempt < 0:
            raise ValueError(f"seq and attempt must be non-negative, got seq={seq} attempt={attempt}")
        headers = chunk_headers(request_id, role, seq, final=final, attempt=attempt, format=format,
                                traceparent=traceparent)
        await self.nc.publish(self.subjects.chunk(request_id, role), body, headers=headers)

    async def publish_leg(
        self,
        request_id: str,
        role: Role | str,
        bodies: Iterable[bytes],
        *,
        attempt: int = 0,
        format: str | None = None,
        traceparent: str | None = None,
    ) -> int:
        """Publish a whole leg in order (seq 0..n-1, the last one final). Returns n."""
        items = list(bodies)
        if not items:
            raise ValueError("a leg has at least one chunk")
        last = len(items) - 1
        for seq, body in enumerate(items):
            await self.publish(request_id, role, seq, body, final=seq == last, attempt=attempt, format=format,
                               traceparent=traceparent)
        return len(items)
