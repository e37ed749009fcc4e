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
from typing import TYPE_CHECKING

import anyio
import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..core.wire import (
    ContractError,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    Sealed,
    decode_migrate_request,
    encode_control,
)

if TYPE_CHECKING:
    from .processor import Processor

log = logging.getLogger("streamproc.control")


class ControlPlane:
    def __init__(self, processor: Processor) -> None:
        self._processor = processor
        self._subjects = processor.subjects
        self._sub: Subscription | None = None

    async def start(self) -> None:
        nc = self._processor.nc
        assert nc is not None
        self._sub = await nc.subscribe(self._subjects.all_migrate, cb=self._on_migrate)
        await nc.flush()  # a migrate sent right after start() returns is heard

    async def stop(self, timeout: float) -> None:
        sub, self._sub = self._sub, None
        nc = self._processor.nc
        if sub is None or nc is None or nc.is_closed:
            return
        with anyio.move_on_after(timeout):
            await sub.drain()  # answer the migrates already received

    async def _on_migrate(self, msg: Msg) -> None:
        from .processor import kv  # the processor module imports this one

        try:
            request_id = self._subjects.request_id_of_migrate(msg.subject)
        except ContractError as exc:
            log.warning(kv(event="bad_control_subject", subject=msg.subject, reason=exc.reason))
            return
        owns = getattr(self._processor.input, "owns", None)
        if owns is not None and not owns(request_id):
            # Durable mode: every instance hears the control subject, but only the owner of the
            # request's partition has its state; the others stay silent so the owner's answer is
            # the one the requester gets (with no owner, e.g. mid-failover, the request times out).
            return
        reply: MigrateReply
        try:
            request = decode_migrate_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply = MigrateError(request_id, MigrateErrorCode.BAD_REQUEST, f"malformed migrate request: {exc}")
        else:
            correlator = self._processor.correlator
            await self._processor.caught_up()  # chunks the server delivered before this request count
            reply = await self._processor.exclusive(lambda now: correlator.migrate(
                request_id, now, expected_attempt=request.expected_attempt, refuse=request.refuse))
            if request.reason:
                log.info(kv(event="migrate_requested", request_id=request_id, reason=request.reason))
        if isinstance(reply, Sealed):
            log.info(kv(event="attempt_sealed", request_id=request_id, attempt=reply.attempt,
                        emitted_tokens=reply.emitted_tokens, result_seq=reply.result_seq))
        else:
            log.info(kv(event="migrate_error", request_id=request_id, code=reply.code.value, detail=reply.message))
        if msg.reply:
            try:
                await msg.respond(encode_control(reply))
            except Exception as exc:  # the requester gave up or NATS is gone; the decision stands
                log.warning(kv(event="control_reply_failed", request_id=request_id,
                               error=f"{type(exc).__name__}: {exc}"))
