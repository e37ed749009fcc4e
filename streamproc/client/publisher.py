"""The worker side of the wire contract: publish native chunks with the right subject and headers.

Any NATS client can do this by following ``docs/protocol.md``; the helper exists so a worker
cannot get the subject layout, the header spelling or the ``Nats-Msg-Id`` format wrong.

Two modes. A core publish (``durable=False``, for ``--mode core``) is fire-and-forget. A durable
publish (``durable=True``, for a processor reading the JetStream chunk stream) waits for the
stream's PubAck: a chunk the stream refuses (``maximum bytes exceeded``, storage full, no stream on
the subject) raises :class:`~streamproc.core.errors.PublishRefused` in the worker instead of
vanishing. A missing PubAck is retried a bounded number of times with the same ``Nats-Msg-Id``, so a
retry of a chunk that was stored after all is dropped by the stream's duplicate window.
"""

from __future__ import annotations

from typing import Iterable

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from ..core.errors import PublishRefused
from ..core.wire import Role, Subjects, check_request_id, chunk_headers


class ChunkPublisher:
    def __init__(self, nc: NatsClient, subjects: Subjects | None = None, *, durable: bool = False,
                 timeout: float = 2.0, retries: int = 3, backoff: float = 0.2) -> None:
        if retries < 0 or timeout <= 0:
            raise ValueError("retries must be >= 0 and timeout > 0")
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.durable = durable
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._js = nc.jetstream() if durable else None

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
        """Publish one chunk of one leg. ``seq`` counts from 0 per request, role and attempt.

        Durable: returns once the chunk stream stored it; raises ``PublishRefused`` otherwise."""
        check_request_id(request_id)
        if seq < 0 or attempt < 0:
            raise ValueError(f"seq and attempt must be non-negative, got seq={seq} attempt={attempt}")
        headers = chunk_headers(request_id, role, seq, final=final, attempt=attempt, format=format,
                                traceparent=traceparent)
        subject = self.subjects.chunk(request_id, role)
        if self._js is None:
            await self.nc.publish(subject, body, headers=headers)
            return
        await self._publish_stored(subject, body, headers)

    async def _publish_stored(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        assert self._js is not None
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                await anyio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                await self._js.publish(subject, body, timeout=self.timeout, headers=headers)
                return
            except nats.js.errors.APIError as exc:  # the stream answered, and said no
                raise PublishRefused(subject, f"{exc.description or exc} (code {exc.err_code})",
                                     retryable=False) from None
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):  # no stream (yet)
                last = "no JetStream stream stores this subject (no responders)"
            except (nats.errors.TimeoutError, TimeoutError):
                last = f"no PubAck within {self.timeout}s"
        raise PublishRefused(subject, f"{last}, after {self.retries + 1} attempts", retryable=True)

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
