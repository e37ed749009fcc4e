"""A JetStream stream's results of one request stored before its feed registered.

With a results stream, the edge's recent ring reads every new result through one ordered consumer
whose messages are dispatched to the open streams (:mod:`.fanout`). A stream opened at a moment
when that consumer had delivered up to stream sequence ``upto`` gets every later result from the
dispatch; the earlier ones, if any, are read here from the stream, oldest first, until the next
one is past ``upto``. Nothing is missed and nothing is read twice: sequences up to ``upto`` were
delivered to the edge before the registration (and dropped: no feed yet), later ones after it. A
result both replayed and dispatched (the same seq) is dropped by the feed's ``SeqOrder`` anyway.

First one probe: ``$JS.API.STREAM.MSG.GET`` with ``{"seq": 1, "next_by_subj": subject}`` (the first
message of the subject, as nats-py 2.16 ``JetStreamManager.get_msg(..., next=True)`` asks). For a
request with nothing stored yet (a client that opens before its request starts, the usual case)
that "no message found" is the whole replay: one request, no consumer. A request with results
stored (a late attach, a resume) then reads the rest with a temporary ordered consumer of its
subject from the next sequence, as every open did before (one request per stored result measured
1.6-3.2k results/s at ~170 µs of CPU each; this consumer 22-29k/s at ~20 µs), stopping at
``upto`` or when the consumer reports nothing more pending (every sequence up to ``upto`` is stored
already, so a later one is past it), and unsubscribing it.
"""

from __future__ import annotations

import base64
import contextlib

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError

from ..nats.fast_client import parse_header_block
from . import pending

NO_MESSAGE = 10037  # JSNoMessageFoundErr (nats-server server/errors.json): no message at or after seq


class StoredMessage(msgspec.Struct):
    subject: str
    seq: int
    hdrs: str | None = None  # base64 of the header block
    data: str | None = None  # base64 of the body


class ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class MsgGetResponse(msgspec.Struct):
    message: StoredMessage | None = None
    error: ApiError | None = None


_decode = msgspec.json.Decoder(MsgGetResponse).decode


class Replay:
    """``await replay.next()``: the next stored result of ``subject`` with a stream sequence up to
    ``upto`` as (subject, headers, body), or None when there is none left (then call nothing but
    :meth:`close`). Raises nats-py's errors (``nats.errors.TimeoutError``, ``APIError`` for any
    other JetStream error); :meth:`close` frees the temporary consumer, also after an error."""

    def __init__(self, nc: NatsClient, api_prefix: str, stream: str, subject: str, upto: int,
                 timeout: float, consumer_options: dict | None = None) -> None:
        self.nc = nc
        self.api_subject = f"{api_prefix}.STREAM.MSG.GET.{stream}"
        self.stream = stream
        self.subject = subject
        self.upto = upto
        self.timeout = timeout
        self.consumer_options = consumer_options or {}  # pending limits, inactive threshold
        self.next_seq = 1
        self.read = 0  # messages replayed (tests)
        self.sub = None  # the temporary ordered consumer, after a probe found a stored result
        self.done = upto < 1

    async def next(self) -> tuple[str, dict[str, str] | None, bytes] | None:
        if self.done:
            return None
        if self.sub is None and self.read == 0:
            return await self._probe()
        if self.sub is None:
            self.sub = await self.nc.jetstream().subscribe(
                self.subject, stream=self.stream, ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.next_seq),
                **self.consumer_options)
            # Nothing stored after the probe's one: the consumer would deliver nothing. Its info
            # answers on our connection after whatever it delivered before, so those are queued.
            info = await self.sub.consumer_info()
            if info.num_pending == 0 and self.sub.pending_msgs == 0:
                await self._finish()
                return None
        msg = pending.take(self.sub)  # Subscription.next_msg without its tasks per message (pending.py)
        if msg is None:
            if not await pending.wait(self.sub, self.timeout):
                raise nats.errors.TimeoutError
            msg = pending.take(self.sub)
            assert msg is not None
        reply = pending.flow_control_due(self.sub)
        if reply is not None:
            await self.nc.publish(reply)
        meta = msg.metadata
        if meta.sequence.stream > self.upto:  # later ones come from the dispatch
            await self._finish()
            return None
        self.read += 1
        if meta.sequence.stream >= self.upto or meta.num_pending == 0:
            await self._finish()  # this one is the last stored up to upto
        return msg.subject, msg.headers, msg.data

    async def _probe(self) -> tuple[str, dict[str, str] | None, bytes] | None:
        request = msgspec.json.encode({"seq": self.next_seq, "next_by_subj": self.subject})
        reply = await self.nc.request(self.api_subject, request, timeout=self.timeout)
        response = _decode(reply.data)
        if response.error is not None:
            if response.error.err_code == NO_MESSAGE or response.error.code == 404:
                self.done = True
                return None
            raise APIError(code=response.error.code, err_code=response.error.err_code,
                           description=response.error.description)
        message = response.message
        if message is None or message.seq > self.upto:
            self.done = True
            return None
        self.next_seq = message.seq + 1
        self.read += 1
        self.done = message.seq >= self.upto
        block = base64.b64decode(message.hdrs) if message.hdrs else b""
        headers = parse_header_block(block) if len(block) > 10 and block[8] != 32 else None
        return message.subject, headers, base64.b64decode(message.data) if message.data else b""

    async def _finish(self) -> None:
        self.done = True
        await self.close()

    async def close(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
