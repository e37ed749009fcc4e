"""A JetStream stream's results of one request stored before its feed registered, read one by one.

With a results stream, the edge's recent ring reads every new result through one ordered consumer
whose messages are dispatched to the open streams (:mod:`.fanout`). A stream opened at a moment
when that consumer had delivered up to stream sequence ``upto`` gets every later result from the
dispatch; the earlier ones, if any, are read here from the stream by subject, oldest first, with
``$JS.API.STREAM.MSG.GET`` (``{"seq": n, "next_by_subj": subject}``: the first message of the subject
at or after ``n``, as nats-py 2.16 ``JetStreamManager.get_msg(..., next=True)`` asks), until the
next one is past ``upto``. Nothing is missed and nothing is read twice: sequences up to ``upto``
were delivered to the edge before the registration (and dropped: no feed yet), later ones after it.
A result both replayed and dispatched (the same seq) is dropped by the feed's ``SeqOrder``.

This replaces an ordered consumer per stream (a JetStream API round trip to create it, a server-side
consumer each, a second copy of every result): an open costs no round trip before its headers, and
a request with nothing stored yet one request ("no message found") on the first read.
Each read is one round trip, so a client that attaches late to a long request pays one per stored
result, as its reading pace; memory stays one result at a time.
"""

from __future__ import annotations

import base64

import msgspec
from nats.aio.client import Client as NatsClient
from nats.js.errors import APIError

from ..nats.fast_client import parse_header_block

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
    ``upto`` as (subject, headers, body), or None when there is none left. Raises nats-py's errors
    (``nats.errors.TimeoutError``, ``APIError`` for any other JetStream error)."""

    def __init__(self, nc: NatsClient, api_prefix: str, stream: str, subject: str, upto: int,
                 timeout: float) -> None:
        self.nc = nc
        self.api_subject = f"{api_prefix}.STREAM.MSG.GET.{stream}"
        self.subject = subject
        self.upto = upto
        self.timeout = timeout
        self.next_seq = 1
        self.read = 0  # messages replayed (tests, metrics)

    async def next(self) -> tuple[str, dict[str, str] | None, bytes] | None:
        if self.next_seq > self.upto:
            return None
        request = msgspec.json.encode({"seq": self.next_seq, "next_by_subj": self.subject})
        reply = await self.nc.request(self.api_subject, request, timeout=self.timeout)
        response = _decode(reply.data)
        if response.error is not None:
            if response.error.err_code == NO_MESSAGE or response.error.code == 404:
                self.next_seq = self.upto + 1
                return None
            raise APIError(code=response.error.code, err_code=response.error.err_code,
                           description=response.error.description)
        message = response.message
        if message is None or message.seq > self.upto:  # later ones come from the dispatch
            self.next_seq = self.upto + 1
            return None
        self.next_seq = message.seq + 1
        self.read += 1
        block = base64.b64decode(message.hdrs) if message.hdrs else b""
        headers = parse_header_block(block) if len(block) > 10 and block[8] != 32 else None
        return message.subject, headers, base64.b64decode(message.data) if message.data else b""
