"""The serving layer's side of migration: seal the lost attempt, rebuild the request, send it on.

When a worker dies mid-stream, the serving layer calls :meth:`Migrator.migrate` with the request
id and the original native request body::

    migrator = Migrator(nc, format="sglang")
    resumed = await migrator.migrate(request_id, request_body, send=publish_request(nc, "workers.generate"))

1. The format's :meth:`~streamproc.codec.Codec.check_migratable` looks at the request (``n > 1``,
   guided decoding, ...). A refusal ends the request at the processor with a ``migration_refused``
   error result, so the client's stream ends at once, and raises :class:`MigrationRefused`.
2. A NATS request on ``P.control.<request_id>.migrate`` seals the current attempt. The processor
   replies with the next attempt number and what the client has been sent; an error reply raises
   :class:`MigrationError` (``unknown_request``, ``finished``, ``attempt_mismatch``, ``refused``).
3. The format's :meth:`~streamproc.codec.Codec.resume_request` builds the resumed native request
   (prompt + emitted tokens, a smaller budget), and ``send`` hands it to a worker, which must put
   ``Streamproc-Attempt: <attempt>`` on every chunk it publishes for it.

No processor listening, no reply, or ``unavailable`` (durable mode: the owner could not record the
seal) are retried within ``timeout``, so a processor failover is absorbed; after it, NATS failures
propagate as nats-py exceptions. An answer that is no migrate reply for this request (not JSON,
another shape, numbers out of range, a seal of another request) raises
:class:`~streamproc.core.errors.ContractError`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Awaitable, Callable

import anyio
import msgspec
import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from ..catalog import codec_class
from ..core.codec import Codec, Emitted
from ..core.defaults import FRONTEND_INBOX_PREFIX
from ..core.errors import ContractError, MigrationError, MigrationRefused, shown
from ..logs import log_event
from .connection import check_client
from ..core.wire import (
    ATTEMPT,
    MSG_ID,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    MigrateRequest,
    Sealed,
    Subjects,
    check_request_id,
    decode_migrate_reply,
    encode_control,
)

__all__ = ["MigrationError", "MigrationRefused", "Migrator", "Resumed", "publish_request"]

log = logging.getLogger("streamproc.migration")

MIN_PAUSE = 0.01  # seconds between two tries at least (the back-off's first step; a retry_after below it)


class Resumed(msgspec.Struct, frozen=True):
    """A resumed request, ready for a worker."""

    request_id: str
    attempt: int  # Streamproc-Attempt of every chunk the worker publishes for it
    emitted_tokens: int
    result_seq: int
    body: bytes  # the native request body


Send = Callable[[Resumed], Awaitable[None]]


def publish_request(nc: NatsClient, subject: str) -> Send:
    """A ``send`` that publishes the resumed request on ``subject`` with its attempt in a header."""

    async def send(resumed: Resumed) -> None:
        headers = {ATTEMPT: str(resumed.attempt), MSG_ID: f"{resumed.request_id}.resume.{resumed.attempt}"}
        await nc.publish(subject, resumed.body, headers=headers)

    return send


class Migrator:
    def __init__(self, nc: NatsClient, subjects: Subjects | None = None, *, format: str,
                 timeout: float = 15.0, codec: Codec | None = None, attempt_timeout: float = 1.0) -> None:
        """``format`` names the codec whose hooks rebuild requests (the processor's ``--format``);
        ``timeout`` bounds a whole call with its retries, ``attempt_timeout`` one try. The default
        outlasts a durable failover at the default lease (about 4/3 x ``lease_ttl`` 6 s = 8 s, plus
        an ack wait), so a migrate sent while an instance dies is still answered."""
        check_client(nc)
        self.nc = nc
        self.attempt_timeout = attempt_timeout
        self.subjects = subjects or Subjects()
        self.codec = codec or codec_class(format)()
        self.timeout = timeout

    async def migrate(self, request_id: str, request: bytes, send: Send | None = None, *,
                      expected_attempt: int | None = None, reason: str = "") -> Resumed:
        """Seal, rebuild, send. ``expected_attempt`` guards against two migrators racing."""
        check_request_id(request_id)
        try:
            self.codec.check_migratable(request)
        except MigrationRefused as exc:
            await self.refuse(request_id, exc.reason)
            raise
        sealed = await self.seal(request_id, expected_attempt=expected_attempt, reason=reason)
        try:
            body = self.codec.resume_request(request, Emitted(sealed.emitted_token_ids, sealed.state))
        except MigrationRefused as exc:
            await self.refuse(request_id, exc.reason)
            raise
        resumed = Resumed(request_id, sealed.attempt, sealed.emitted_tokens, sealed.result_seq, body)
        if send is not None:
            await send(resumed)
        return resumed

    async def seal(self, request_id: str, *, expected_attempt: int | None = None, reason: str = "") -> Sealed:
        """Only the seal: the processor's view of what the client has been sent, and the next attempt."""
        # One id for every retry of this seal: if the processor recorded it and died before its reply
        # arrived, the next owner answers the retry with the same seal, not attempt_mismatch.
        message = MigrateRequest(expected_attempt=expected_attempt, reason=reason, id=secrets.token_hex(8))
        reply = await self._request(request_id, message)
        if isinstance(reply, MigrateError):
            raise MigrationError(reply)
        return reply

    async def _ask(self, subject: str, data: bytes, timeout: float) -> Msg:
        """``nc.request`` with the reply on an inbox under ``FRONTEND_INBOX_PREFIX``, whatever inbox
        prefix the caller's connection has: the reply holds the token ids the client was sent, and
        the shipped permissions keep that prefix from the workers (docs/security.md). Raises what
        ``nc.request`` raises: ``NoRespondersError``, ``TimeoutError``."""
        inbox = f"{FRONTEND_INBOX_PREFIX}.{secrets.token_hex(12)}"
        sub = await self.nc.subscribe(inbox, max_msgs=1)
        try:
            await self.nc.publish(subject, data, reply=inbox)
            msg = await sub.next_msg(timeout=timeout)
        finally:
            with contextlib.suppress(nats.errors.Error):  # already gone once its one reply came
                await sub.unsubscribe()
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    def _too_short(self, reply: MigrateError, left: float) -> MigrateError:
        """The last ``unavailable`` reply, arriving with ``left`` seconds of the timeout to go. When
        the processor had said it needs longer than that (chunks a killed owner held come back
        within its ``ack_wait`` of a failover), the error says so: a Migrator timeout below the
        processor's ack_wait plus a failover is a deployment error, not bad luck."""
        if reply.retry_after is None or reply.retry_after <= left:
            return reply
        hint = (f" (the processor needed up to {reply.retry_after:.3g} s more, {left:.3g} s of this Migrator's "
                f"{self.timeout:g} s timeout were left: keep the timeout above the processor's ack_wait "
                "plus the time a failover takes)")
        log_event(log, logging.WARNING, "migrate_timeout_too_short", request_id=reply.request_id,
                  timeout=self.timeout, retry_after=reply.retry_after)
        return msgspec.structs.replace(reply, message=reply.message + hint)

    @staticmethod
    def _decode(request_id: str, data: bytes) -> MigrateReply:
        """The reply, if it is one for this request: anything else (not JSON, another shape, an
        unknown code, numbers out of range, a seal of another request) breaks the contract, and is
        never taken for this request's seal (its token ids would go into the resumed request)."""
        try:
            reply = decode_migrate_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # msgspec's text names the field and the rule, never a long value: kept, at most 200 characters
            raise ContractError(f"the answer to a migrate is no migrate reply: {str(exc)[:200]}", request_id) from None
        if reply.request_id != request_id:
            raise ContractError(f"the answer to a migrate is about request {shown(reply.request_id)}", request_id)
        return reply

    async def refuse(self, request_id: str, reason: str) -> MigrateReply:
        """End the request with a ``migration_refused`` error result (its stream cannot continue)."""
        return await self._request(request_id, MigrateRequest(refuse=reason, id=secrets.token_hex(8)))

    async def _request(self, request_id: str, message: MigrateRequest) -> MigrateReply:
        """One control request, retried until ``timeout`` while no processor answers for the request.

        Nobody may be listening for a moment (a processor restarting), or nobody answers (durable
        mode: the instance owning the request's partition was killed and its lease has not moved
        yet; the others stay silent), or the owner could not record the seal (``unavailable``).
        Each try waits at most ``attempt_timeout``. A retry sends the same message, so
        ``expected_attempt`` means the same and a seal recorded before a lost reply is answered
        again (``MigrateRequest.id``). The last failure is raised (nats-py's exception, or the
        ``unavailable`` reply) when ``timeout`` runs out.
        """
        deadline = time.monotonic() + self.timeout
        delay = MIN_PAUSE
        while True:
            remaining = deadline - time.monotonic()
            pause = delay
            try:
                msg = await self._ask(self.subjects.migrate(request_id), encode_control(message),
                                      max(min(remaining, self.attempt_timeout), 0.001))
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                if deadline - time.monotonic() <= delay:
                    raise
            else:
                reply = self._decode(request_id, msg.data)
                if not (isinstance(reply, MigrateError) and reply.code is MigrateErrorCode.UNAVAILABLE):
                    return reply
                if reply.retry_after is not None:  # ask again when the processor expects to answer: sooner
                    # than the back-off, or later (a rate refusal's reserved turn; asked sooner, it is
                    # refused again and reserves a later one)
                    pause = max(reply.retry_after, MIN_PAUSE)
                left = deadline - time.monotonic()
                if left <= pause:
                    return self._too_short(reply, left)
            await anyio.sleep(pause)
            delay = min(delay * 2, 0.25)
