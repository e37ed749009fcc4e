"""Pulls of the durable partitions: what a pull request asks for, sending it, and reading the
status messages the server answers on a partition's inbox.

The credit rules (when to pull, how many messages and bytes, when a pull is lost) are pure, in
:mod:`streamproc.core.credit`; this is their I/O, for every partition of a
:class:`~streamproc.nats.durable.input.DurableInput`: the pull request body, published on the
partition's ``$JS.API.CONSUMER.MSG.NEXT`` subject (with the next write, or from the read loop without
awaiting), nothing pulled while the partition's results wait past their share of the outbox
(:class:`~streamproc.core.partition_bounds.QueuedResultShare`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from ...config import Settings
from ...core.credit import PullCredit, pull_max_bytes, uncut_batch
from ...core.errors import shown
from ...core.outbox import Outbox
from ...core.partition_bounds import QueuedResultShare, queued_result_share
from ...core.partitions import PartitionScheme
from ...logs import LogLimiter, error_text, log_event

if TYPE_CHECKING:
    from .input import DurableStats
    from .partitions import Partition

log = logging.getLogger("streamproc.durable")

PULL_EXPIRES = 10.0  # seconds a pull request lives on the server
HEARTBEAT = 1.0  # idle heartbeat the server sends for a waiting pull request
# Bytes the pulls of all partitions may bring at once (both pulls a partition may have out), shared by the
# --partitions an instance may own (a partition's two pulls still bring at least two maximal messages, see
# __init__).
PULL_MAX_BYTES = 16 << 20
LOST_PULL_AFTER = 3 * HEARTBEAT  # no message and no heartbeat for this long: the server forgot our pulls
RETRY_AFTER_ERROR = 0.5  # seconds before a failed pull (or one the server refused) is tried again
# Seconds a partition's pulls stay careful (never cut by max_bytes, core/credit.py) after the last
# redelivery or "409 Message Size Exceeds MaxBytes" it saw: a redelivery queue is served before any new
# message (nats-server consumer.go getNextMsg), so its entries follow each other closely; this long
# without one, it has drained.
CAREFUL_HOLD = 2.0
# Beyond ack_wait after this instance took a partition, for chunks a previous owner held to come back.
REDELIVERY_SLACK = 1.0


class Pulls:
    """The pull requests of a durable input's partitions, and the credit each partition starts with."""

    def __init__(self, nc: NatsClient, settings: Settings, scheme: PartitionScheme, outbox: Outbox,
                 stats: DurableStats, clock: Callable[[], float], limited: LogLimiter) -> None:
        self.nc = nc
        self.scheme = scheme
        self.outbox = outbox
        self.stats = stats
        self.limited = limited
        self._clock = clock
        self._publish_pull = getattr(nc, "publish_deferred", None) or nc.publish  # leaves with the next write
        # Outstanding credit reaches 1.5 batches; kept under nats-py's queue limit it can never make
        # the client drop deliveries (bytes can still overflow: the dropped() hook accounts for that).
        self.batch = max(1, min(settings.fetch_batch, settings.pending_msgs_limit * 2 // 3))
        # A pull is bounded in bytes too (the server ends it with 409 "Message Size Exceeds MaxBytes"
        # when the next message would pass it): with message credit alone, up to 1.5 batches of
        # max_payload messages could wait in nats-py's queue while the handler is slow (a recovery
        # lookup under load), 384 MB of 1 MB chunks. At least two maximal messages fit, so every
        # message can be delivered. What is in flight is not charged to --max-total-bytes, so the
        # bound is shared by the partitions: at 16 MiB each, 8 partitions' subscription queues held up
        # to 38 MiB not yet handled on a loaded machine, on top of a full
        # budget (peak RSS 202 MiB against the 200 MiB bound, tests/test_durable_hostile.py,
        # concurrent attackers); shared, at most 4.9 MiB in 4 runs. Two pulls may be out at once (the
        # credit sends the next while one still waits behind the current one), so each asks for half a
        # partition's share (core/credit.py pull_max_bytes): with one pull's max_bytes at the whole
        # share, the subscription queues held 32 MiB of ~1 MB chunks at 4 partitions while the
        # partitions waited for parked bytes to free (tests/test_durable_attack_review.py, lookups 0.5 s
        # slower: peak RSS +56 MiB over the 16 MiB parked + 16 MiB pulls budgets). 256 chunks of up to
        # 4 KiB fit one pull at 8 partitions (two such pulls out: 8 KiB).
        max_payload = getattr(nc, "max_payload", 0) or (1 << 20)
        self._max_bytes = max_bytes = pull_max_bytes(PULL_MAX_BYTES // settings.partitions, max_payload)
        # While redeliveries are expected (after taking a partition, after a redelivery or a 409 MaxBytes),
        # pulls ask for no more messages than max_bytes always holds, so that none is cut by bytes: a cut
        # sends a redelivery to the back of the consumer's redelivery queue (core/credit.py;
        # docs/operations.md, "Redelivery order"). 7 at 1 partition, 1 from 4 on, with 1 MiB max_payload.
        # Otherwise as many as max_bytes holds at the largest delivery seen lately, up to fetch_batch.
        self._careful_batch = min(self.batch, uncut_batch(max_bytes, max_payload))
        self._pull_body = self._pull_request(self.batch)
        self._pull_bodies: dict[int, bytes] = {}  # the other batches' requests, made once each
        # Nothing pulled for a partition while its queued results pass their share (core/partition_bounds.py).
        share = queued_result_share(settings.partitions, max_payload)
        self._queue_full = QueuedResultShare(outbox, scheme.of, share).full

    def credit(self, now: float) -> PullCredit:
        """The pull credit of a partition taken at ``now``."""
        return PullCredit(self.batch, expires=PULL_EXPIRES, lost_after=LOST_PULL_AFTER,
                          retry_after=RETRY_AFTER_ERROR, now=now, careful_batch=self._careful_batch,
                          hold=CAREFUL_HOLD, max_bytes=self._max_bytes)

    def _pull_request(self, batch: int) -> bytes:
        """The body of a pull request for ``batch`` messages."""
        return msgspec.json.encode({"batch": batch, "max_bytes": self._max_bytes, "expires": int(PULL_EXPIRES * 1e9),
                                    "idle_heartbeat": int(HEARTBEAT * 1e9)})

    def _pull_body_of(self, batch: int) -> bytes:
        if batch == self.batch:
            return self._pull_body
        body = self._pull_bodies.get(batch)
        if body is None:  # at most fetch_batch of them
            body = self._pull_bodies[batch] = self._pull_request(batch)
        return body

    async def pull(self, part: Partition) -> None:
        if self._queue_full(part.n):
            return
        credit = part.credit
        batch = credit.pulled(self._clock())
        self.stats.pulls += 1
        try:
            await self._publish_pull(part.pull_subject, self._pull_body_of(batch), part.inbox)
        except Exception as exc:
            credit.pull_failed(self._clock(), batch)
            log_event(log, logging.DEBUG, "pull_failed", partition=part.n, error=error_text(exc))

    def pull_nowait(self, part: Partition) -> None:
        """:meth:`pull` without awaiting (the inline handler; only with ``FastClient.enqueue``)."""
        if self._queue_full(part.n):
            return
        credit = part.credit
        batch = credit.pulled(self._clock())
        self.stats.pulls += 1
        try:  # our own subject and inbox: not checked again
            self.nc.enqueue(part.pull_subject, self._pull_body_of(batch), part.inbox,  # type: ignore[attr-defined]
                            checked=True, defer=True)
        except Exception as exc:
            credit.pull_failed(self._clock(), batch)
            log_event(log, logging.DEBUG, "pull_failed", partition=part.n, error=error_text(exc))

    def on_status(self, part: Partition, msg: Msg) -> bool:
        """A status message on a pull inbox; True when a pull should go out now.

        Only JetStream publishes here (no permission of the shipped config lets anyone else), but a
        message without a ``Status`` header, or with a reply that is no ack subject, is not taken on
        trust: read as a status it reset the pull credit and held pulls back for ``retry_after``.
        Counted and ignored instead (``inbox_strays``)."""
        headers = msg.headers or {}
        code = headers.get("Status", "")
        if not code or msg.reply:
            self.stats.inbox_strays += 1
            self.limited.log(logging.WARNING, "inbox_stray", partition=part.n, subject=shown(msg.subject),
                             reply=shown(msg.reply or ""))
            return False
        description = headers.get("Description", "")
        pull = part.credit.status(code, headers.get("Nats-Pending-Messages"), description, self._clock())
        if code not in ("100", "408", "404") and not (code == "409" and ("MaxBytes" in description
                                                                      or "Batch Completed" in description)):
            log_event(log, logging.INFO, "pull_status", partition=part.n, status=code, description=description)
        return pull
