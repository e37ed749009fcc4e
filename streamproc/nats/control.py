"""The processor's control plane: request/reply on ``P.control.<request_id>.migrate``.

The shell side of migration, nothing clever: decode the request, let the correlator decide
(:meth:`~streamproc.correlator.Correlator.migrate`), publish what it decided through the
processor's dispatch path, then reply. The decision and its dispatch run exclusively of the
message path and the timer, so a refusal's error result cannot interleave on the wire with a
result of the same request, and the reply is sent only once the seal is in effect: a chunk of
the sealed attempt that arrives after the reply is dropped.
"""

from __future__ import annotations

import logging
from typing import Protocol

import anyio
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..core.wire import (
    ContractError,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    MigrateRequest,
    Sealed,
    Subjects,
    decode_migrate_request,
    encode_control,
)
from ..core import defaults
from ..core.errors import shown
from ..logs import LogLimiter, error_text, log_event

log = logging.getLogger("streamproc.control")
# The processor's and the edge's own inboxes (pull requests, PubAcks): an answer there would be read
# as a pull status or a PubAck, so they are no migrate's reply, whatever --control-reply-prefix says.
_OWN_INBOXES = defaults.OWN_INBOX_PREFIX + "."


class MigrateTarget(Protocol):
    """What the control plane needs from the processor, and nothing more."""

    def owns(self, request_id: str) -> bool:
        """Whether this instance answers for the request."""

    async def migrate(self, request_id: str, request: MigrateRequest) -> MigrateReply:
        """Seal the request's current attempt, in order with the chunks received before the call."""


class ControlPlane:
    def __init__(self, nc: NatsClient, subjects: Subjects, target: MigrateTarget,
                 limited: LogLimiter | None = None, reply_prefix: str = defaults.CONTROL_REPLY_PREFIX) -> None:
        """``limited``: the pipeline's limiter (its timer flushes the suppressed counts).
        ``reply_prefix``: what a migrate's reply subject must start with (``--control-reply-prefix``)."""
        self._nc = nc
        self._subjects = subjects
        self._target = target
        self._reply_prefix = reply_prefix
        self.replies_refused = 0  # migrates refused for their reply subject (/metrics)
        self._sub: Subscription | None = None
        # Anyone allowed to publish on the control subjects can send bad ones (and migrates, each
        # logged) at will: every per-request line here is rate limited per event name.
        self._limited = limited if limited is not None else LogLimiter(log)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subjects.all_migrate, cb=self._on_migrate)
        await self._nc.flush()  # a migrate sent right after start() returns is heard

    async def stop(self, timeout: float) -> None:
        sub, self._sub = self._sub, None
        if sub is None or self._nc.is_closed:
            return
        with anyio.move_on_after(timeout):
            await sub.drain()  # answer the migrates already received

    def _answerable(self, reply: str) -> bool:
        """A requester's inbox: under ``--control-reply-prefix`` (and more than it), never ours."""
        prefix = self._reply_prefix
        return reply.startswith(prefix) and len(reply) > len(prefix) and not reply.startswith(_OWN_INBOXES)

    async def _on_migrate(self, msg: Msg) -> None:
        try:
            request_id = self._subjects.request_id_of_migrate(msg.subject)
        except ContractError as exc:
            self._limited.log(logging.WARNING, "bad_control_subject", subject=msg.subject, reason=exc.reason)
            return
        if msg.reply and not self._answerable(msg.reply):
            # The answer would go out with the processor's rights: to a result subject, a KV bucket
            # or the JetStream API, wherever the sender may not publish itself. Refused before the
            # request is touched (nothing sealed), and not answered.
            self.replies_refused += 1
            self._limited.log(logging.WARNING, "control_reply_refused", request_id=request_id,
                              reply=shown(msg.reply), expected_prefix=self._reply_prefix)
            return
        if not self._target.owns(request_id):
            # Durable mode: every instance hears the control subject, but only the owner of the
            # request's partition answers for it; the others stay silent so the owner's answer is
            # the one the requester gets (with no owner, e.g. mid-failover, the request times out
            # and the Migrator tries again: the next owner reads the state from JetStream).
            return
        reply: MigrateReply
        try:
            request = decode_migrate_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply = MigrateError(request_id, MigrateErrorCode.BAD_REQUEST, f"malformed migrate request: {exc}")
        else:
            reply = await self._target.migrate(request_id, request)
            if request.reason:
                self._limited.log(logging.INFO, "migrate_requested", request_id=request_id, reason=shown(request.reason))
        if isinstance(reply, Sealed):
            self._limited.log(logging.INFO, "attempt_sealed", request_id=request_id, attempt=reply.attempt,
                              emitted_tokens=reply.emitted_tokens, result_seq=reply.result_seq)
        else:
            self._limited.log(logging.INFO, "migrate_error", request_id=request_id, code=reply.code.value,
                              detail=reply.message)
        if msg.reply:
            try:
                await msg.respond(encode_control(reply))
            except Exception as exc:  # the requester gave up or NATS is gone; the decision stands
                log_event(log, logging.WARNING, "control_reply_failed", request_id=request_id,
                          error=error_text(exc))
