"""Stray chunks: messages the chunk stream stored under a subject no partition consumer reads.

The chunk stream captures ``P.chunks.*.*`` and rewrites it to ``P.partition.<n>.<id>.<role>``.
nats-server accepts a publish whose subject holds a literal ``*`` or ``>`` token (it checks only
for a pedantic client, ``client.go`` ``processPub``: ``if c.opts.Pedantic &&
!IsValidLiteralSubject(...)``), and such a subject is captured by ``P.chunks.*.*``. But the subject
transform refuses it (``subject_transform.go`` ``subjectTransform.Match``: ``if
!isValidLiteralSubject(tts) { return _EMPTY_, ErrBadSubject }``) and the stream then keeps the
subject as it is (``stream.go`` ``processInboundJetStreamMsg``: ``if err == nil { subject = ts }``).
So ``P.chunks.*.prefill`` or ``P.chunks.>.x`` is stored, PubAck and all, under its own subject,
which no partition's filter matches: in a work-queue stream it would stay until ``max_age``,
counting against ``max_bytes``. Permissions cannot refuse it either: a deny rule's ``*`` matches
every token, and a literal ``*`` cannot be written (``sublist.go`` stores a ``*`` token as the
wildcard node).

Every message stored under ``P.chunks.>`` is therefore a stray (a well-formed one is always
transformed), and one more durable consumer, filtering on that, finds them. Not on ``P.chunks.*.*``:
a consumer with that filter is not delivered a stored ``P.chunks.>.x`` or ``P.chunks.a.>`` (a ``>``
token in the stored subject does not match the filter's ``*``; tested), ``P.chunks.>`` gets them all. Every instance
pulls from it (the server shares a work-queue consumer's messages between pullers); each stray is
counted, logged (rate limited, as ``unreadable_message`` like core mode) and terminated, which
removes it from the stream. There is no request to answer: the id is not a valid one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig

from ...logs import LogLimiter, error_text, log_event
from ..streams import ensure_consumer, partition_consumer_config

log = logging.getLogger("streamproc.durable")

STRAY_CONSUMER = "streamproc-strays"
STRAY_BATCH = 64
STRAY_PULL_EXPIRES = 10.0  # seconds a pull waits on the server when there is nothing to sweep
RETRY_AFTER_ERROR = 1.0
MAX_RETRY = 60.0
REASON = ("a '*' or '>' token in the chunk subject: nats-server stored it untransformed, no partition reads it "
          "(a request id is printable ASCII without '.', '*', '>')")


def stray_consumer_config(all_chunks: str, *, ack_wait: float, max_deliver: int) -> ConsumerConfig:
    """The sweeper's durable pull consumer on ``P.chunks.>``: only strays keep such a stored subject."""
    return partition_consumer_config(
        STRAY_CONSUMER, all_chunks, ack_wait=ack_wait, max_ack_pending=STRAY_BATCH * 4, max_deliver=max_deliver,
        description="streamproc: chunks with a wildcard token, stored untransformed (terminated)")


class StraySweeper:
    """Pulls strays from the chunk stream and terminates them; :meth:`run` until cancelled."""

    def __init__(self, nc: NatsClient, stream: str, config: ConsumerConfig, limited: LogLimiter,
                 on_stray: Callable[[], None]) -> None:
        self.nc = nc
        self.stream = stream
        self.config = config
        self.limited = limited
        self._on_stray = on_stray  # counts it (DurableStats.strays, IOStats.unreadable)

    async def run(self) -> None:
        js = self.nc.jetstream(timeout=10)
        sub = None
        retry = RETRY_AFTER_ERROR
        try:
            while True:
                try:
                    if sub is None:
                        await ensure_consumer(js, self.stream, self.config)
                        sub = await js.pull_subscribe_bind(durable=STRAY_CONSUMER, stream=self.stream)
                    msgs = await sub.fetch(STRAY_BATCH, timeout=STRAY_PULL_EXPIRES)
                except nats.errors.TimeoutError:
                    retry = RETRY_AFTER_ERROR
                    continue  # nothing stray
                except Exception as exc:  # noqa: BLE001  (consumer deleted, stream electing a leader: retry)
                    # A lasting cause (the stream's max_consumers reached, a permission) is retried ever
                    # more slowly and logged rate limited: it must not flood the log either.
                    self.limited.log(logging.WARNING, "stray_sweep_failed", error=error_text(exc),
                                     retry_in=f"{retry:g}s")
                    if sub is not None:
                        await _unsubscribe(sub)
                        sub = None
                    await anyio.sleep(retry)
                    retry = min(retry * 2, MAX_RETRY)
                    continue
                retry = RETRY_AFTER_ERROR
                for msg in msgs:
                    self._on_stray()
                    self.limited.log(logging.WARNING, "unreadable_message", subject=msg.subject, reason=REASON)
                    try:
                        await msg.term()
                    except Exception as exc:  # noqa: BLE001  (it comes back after ack_wait, here or elsewhere)
                        log_event(log, logging.DEBUG, "stray_term_failed", error=error_text(exc))
        finally:
            if sub is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                    await _unsubscribe(sub)


async def _unsubscribe(sub) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # noqa: BLE001, S110  (closed connection: nothing to release)
        pass
