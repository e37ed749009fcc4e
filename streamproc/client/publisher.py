"""The worker side of the wire contract: publish native chunks with the right subject and headers.

Any NATS client can do this by following ``docs/protocol.md``; the helper exists so a worker
cannot get the subject layout, the header spelling or the ``Nats-Msg-Id`` format wrong.

Two modes. A core publish (``durable=False``, for ``--mode core``) is fire-and-forget. A durable
publish (``durable=True``, for a processor reading the JetStream chunk stream) waits for the
stream's PubAck: a chunk the stream refuses (``maximum bytes exceeded``, storage full, no stream on
the subject) raises :class:`~streamproc.core.errors.PublishRefused` in the worker instead of
vanishing. A missing PubAck is retried a bounded number of times with the same ``Nats-Msg-Id``, so a
retry of a chunk that was stored after all is dropped by the stream's duplicate window.

A PubAck saying ``duplicate`` for a chunk this publisher has not stored means someone else stored
that ``Nats-Msg-Id`` first (docs/security.md: any publisher with rights on ``P.chunks.>`` can): the
stored copy is read back and compared, and unless it is this very chunk :class:`ChunkIdTaken` is
raised, since the processor will never see this one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from ..core.errors import ChunkIdTaken, PublishRefused, shown
from ..nats.robust import header_block_size
from ..core.wire import MAX_SEQ, MSG_ID, SEQ, Role, Subjects, check_request_id, chunk_headers
from .connection import check_client


class ChunkPublisher:
    def __init__(self, nc: NatsClient, subjects: Subjects | None = None, *, durable: bool = False,
                 timeout: float = 2.0, retries: int = 3, backoff: float = 0.2) -> None:
        if retries < 0 or timeout <= 0:
            raise ValueError("retries must be >= 0 and timeout > 0")
        if durable:  # its PubAcks come to an inbox subscription (client/connection.py says why it matters)
            check_client(nc)
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.durable = durable
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._js = nc.jetstream() if durable else None
        self._sent: OrderedDict[str, None] = OrderedDict()  # Nats-Msg-Ids this publisher sent, newest last

    MAX_REMEMBERED = 65_536  # sent Nats-Msg-Ids remembered, to tell a worker's own retries from another's chunk

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

        Durable: returns once the chunk stream stored it; raises ``PublishRefused`` otherwise. In
        both modes a chunk whose body and headers together exceed the server's ``max_payload``
        raises ``PublishRefused`` (``retryable=False``) before anything is sent. ``body`` is
        ``bytes`` (or a bytes-like object, published as the bytes it holds)."""
        check_request_id(request_id)
        if not isinstance(body, (bytes, bytearray)):
            if isinstance(body, str):
                raise TypeError("a chunk body is bytes (the engine's JSON as it wrote it, encoded), not str")
            # len() of a memoryview counts items, and the size in the PUB line is len(): 4-byte items
            # made the server read the rest of the body as protocol and close the connection
            body = memoryview(body).tobytes()
        for name, value in (("seq", seq), ("attempt", attempt)):
            # bool is an int; 1.5 or 10**18 would put a header on the wire the processor refuses
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ:
                raise ValueError(f"{name} must be an int from 0 to {MAX_SEQ}, got {value!r}")
        headers = chunk_headers(request_id, role, seq, final=final, attempt=attempt, format=format,
                                traceparent=traceparent)
        subject = self.subjects.chunk(request_id, role)
        size = len(body) + header_block_size(headers)
        if size > self.nc.max_payload:
            # The server counts headers and body against max_payload and closes a connection that sends
            # more, losing everything written with it; stock nats-py checks the body alone.
            raise PublishRefused(subject, f"{len(body)} bytes of body and {size - len(body)} of headers exceed "
                                          f"the server's max_payload ({self.nc.max_payload} bytes)", retryable=False)
        if self._js is None:
            await self.nc.publish(subject, body, headers=headers)
            return
        await self._publish_stored(subject, body, headers)

    async def _publish_stored(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        assert self._js is not None
        msg_id = headers[MSG_ID]
        sent_before = msg_id in self._sent
        self._sent[msg_id] = None
        self._sent.move_to_end(msg_id)
        if len(self._sent) > self.MAX_REMEMBERED:
            self._sent.popitem(last=False)
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                await anyio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                ack = await self._js.publish(subject, body, timeout=self.timeout, headers=headers)
            except nats.js.errors.APIError as exc:  # the stream answered, and said no
                raise PublishRefused(subject, f"{exc.description or exc} (code {exc.err_code})",
                                     retryable=False) from None
            except (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError):  # no stream (yet)
                last = "no JetStream stream stores this subject (no responders)"
            except (nats.errors.TimeoutError, TimeoutError):
                last = f"no PubAck within {self.timeout}s"
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:  # nats-py parsing a reply
                raise PublishRefused(subject, f"the reply is not a PubAck ({type(exc).__name__}): something other "
                                              "than a JetStream stream answers this subject", retryable=False) from None
            else:
                if not (isinstance(ack.stream, str) and type(ack.seq) is int):  # JSON that is no PubAck
                    raise PublishRefused(subject, "the reply is not a PubAck (no stream name and sequence): something "
                                                  "other than a JetStream stream answers this subject", retryable=False)
                if ack.duplicate:
                    await self._check_duplicate(subject, body, headers, ack.stream, ack.seq,
                                                sent_before or attempt > 0)
                return
        raise PublishRefused(subject, f"{last}, after {self.retries + 1} attempts", retryable=True)

    async def _check_duplicate(self, subject: str, body: bytes, headers: dict[str, str], stream: str, seq: int,
                               sent: bool) -> None:
        """The stream already held this ``Nats-Msg-Id``: fine when the stored copy is this chunk (a
        retry of ours whose PubAck was lost), :class:`ChunkIdTaken` when it is another. A copy that
        can no longer be read (consumed already, or no rights to read it) is taken for ours only if
        this publisher sent that id before (``sent``)."""
        assert self._js is not None
        stored = None
        try:
            with anyio.fail_after(self.timeout):
                stored = await self._js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - consumed and deleted, no read permission, no answer
            stored = None
        if stored is not None:
            if stored.data == body and (stored.headers or {}).get(SEQ) == headers[SEQ]:
                return
            # The PubAck's stream name is the answerer's (a peer on the subject may answer first): shown
            raise ChunkIdTaken(subject, f"the stream already stored a different chunk under Nats-Msg-Id "
                                        f"{headers[MSG_ID]!r} (stream {shown(stream)} seq {seq}): this one was "
                                        "dropped as a duplicate; another publisher used this request id "
                                        "(docs/security.md)")
        if sent:
            return
        raise ChunkIdTaken(subject, f"the stream already stored a chunk under Nats-Msg-Id {headers[MSG_ID]!r} "
                                    f"(stream {shown(stream)} seq {seq}, no longer readable to compare) that this "
                                    "publisher did not send: this one was dropped as a duplicate; another publisher "
                                    "(or an earlier worker) used this request id (docs/security.md)")

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
