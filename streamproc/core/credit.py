"""Pull credit of one JetStream pull consumer: when to ask for more, when the server forgot us.

Pure bookkeeping the durable input's shell consults on every delivery, status message and
watchdog round. A pull asks for ``batch`` messages; a new one goes out when the outstanding
credit falls to ``low`` (half a batch), so credit never exceeds ``low + batch``. The server may
forget waiting pulls (a restart: nats-io/nats.py#504): that shows as no message and no idle
heartbeat for ``lost_after`` while credit is outstanding, as a reconnect, or as the pull's
expiry; the credit is then written off and asked for again. Two misses in a row (lost pulls,
"consumer deleted", no responders) mean the consumer itself may be gone: repair it.

**Careful pulls keep the redelivery queue's order.** nats-server serves a pull from the consumer's
redelivery queue first (``server/consumer.go`` ``getNextMsg``: ``o.getNextToRedeliver()``, the
front of ``o.rdq``). When the message does not fit what is left of a waiting pull's ``max_bytes``,
``nextWaiting`` ends that pull (``409 Message Size Exceeds MaxBytes``) and tries the next waiting
one; when none takes it, ``loopAndGatherMsgs`` gives a *redelivery* back with
``o.decDeliveryCount(pmsg.seq); o.addToRedeliverQueue(pmsg.seq)``, which appends it
(``o.rdq = append(o.rdq, seqs...)``): it comes back after every other queued redelivery, a gap in
its request that the request's reorder buffer must bridge. (A first delivery is not reordered:
``o.sseq--`` puts the stream cursor back.) A pull that its ``batch`` ends first is never cut:
``nextWaiting`` charges ``sz <= wr.b``, and ``waitQueue.pop`` removes the pull once ``wr.n`` is 0,
with nothing given back. So while redeliveries are expected (:meth:`PullCredit.expect_redeliveries`,
:meth:`PullCredit.redelivered`, a ``409 ... MaxBytes``) pulls ask for ``careful_batch`` messages,
:func:`uncut_batch`: at most ``max_bytes / (max_payload + 64 KiB)``; a new one goes out while a full
one still waits behind the current one (``careful_low``: ``careful_batch``, or half a ``batch`` when
that is less), so the outstanding bytes stay under two pulls' ``max_bytes`` and the credit under
``low + batch``. When no redelivery is expected (the fast path) pulls ask for ``batch``, or, once
deliveries near ``max_bytes / batch`` have been seen (:meth:`PullCredit.fast_batch`), for as many as
``max_bytes`` holds at the largest of them: a hand-over's NAKs reach the pulls already out too (the
previous owner's, sent before it noticed its lease lapsed), and a redelivery of a message no larger
than those seen does not cut such a pull.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PullCredit", "Watch", "pull_max_bytes", "uncut_batch", "DELIVERY_OVERHEAD", "SIZE_ALLOWANCE"]

# What nats-server charges a delivery beyond its payload and headers (``loopAndGatherMsgs``:
# ``sz = len(pmsg.subj) + len(ackReply) + len(pmsg.hdr) + len(pmsg.msg)``): the stored subject and
# the ack subject. A message's headers and body together are at most ``max_payload``.
DELIVERY_OVERHEAD = 64 << 10
# What a sized pull allows a delivery beyond what ``PullCredit.delivered`` was told (its headers: a
# chunk's are a few hundred bytes). A delivery with more headers than this can still cut a sized pull.
SIZE_ALLOWANCE = 1 << 10


def pull_max_bytes(share: int, max_payload: int) -> int:
    """The ``max_bytes`` of one pull of a partition whose pulls may bring ``share`` bytes at once.

    :class:`PullCredit` keeps a second pull waiting behind the current one (a new pull goes out at
    ``low``, ``careful_low`` or the sized batch while the previous one is still out), so two pulls'
    ``max_bytes`` can be delivered and wait, unhandled, in the client's queue while the handler is
    held up (a partition waiting for a recovery lookup to free parked bytes): each pull gets half
    the share. At least one maximal delivery (``max_payload`` + DELIVERY_OVERHEAD), so every message
    can be delivered, and two outstanding pulls still bring two of them."""
    return max(share // 2, max_payload + DELIVERY_OVERHEAD)


def uncut_batch(max_bytes: int, max_payload: int) -> int:
    """The largest ``batch`` a pull of ``max_bytes`` can ask for and never be cut by bytes, however large
    the messages (at least 1: a pull's ``max_bytes`` always takes one maximal message here)."""
    return max(1, max_bytes // (max_payload + DELIVERY_OVERHEAD))


class Watch(NamedTuple):
    """What a watchdog round found for one partition."""

    lost: bool  # outstanding credit went unanswered: pulls written off
    repair: bool  # ensure the consumer exists again
    pull: bool  # ask for more now


class PullCredit:
    __slots__ = ("batch", "low", "fast_low", "careful_batch", "careful_low", "hold", "careful_until", "max_bytes",
                 "size_window", "largest", "earlier", "window_end", "expires", "lost_after", "retry_after",
                 "requested", "expires_at", "last_seen", "retry_at", "misses")

    def __init__(self, batch: int, *, expires: float, lost_after: float, retry_after: float,
                 now: float = 0.0, careful_batch: int | None = None, hold: float = 0.0, max_bytes: int = 0,
                 size_window: float = 10.0) -> None:
        self.batch = batch
        self.low = batch // 2
        self.fast_low = self.low  # refill point of the last fast pull: half a batch, or its sized batch
        # Pulls while redeliveries are expected: never cut by max_bytes (uncut_batch), never larger
        # than the fast path's.
        self.careful_batch = max(1, min(batch, careful_batch if careful_batch is not None else batch))
        self.careful_low = min(self.careful_batch, self.low)  # credit stays under low + batch here too
        self.hold = hold  # seconds pulls stay careful after a redelivery or a 409 MaxBytes was seen
        self.careful_until = 0.0  # our clock
        # Sized pulls: a fast pull asks for no more messages than max_bytes holds at the largest delivery
        # seen in this window or the one before (``delivered``'s ``size``), so a redelivery of one of
        # them cannot cut it either (a hand-over's NAKs may meet the pulls already out). 0: unsized.
        self.max_bytes = max_bytes
        self.size_window = size_window
        self.largest = 0
        self.earlier = 0
        self.window_end = now + size_window
        self.expires = expires  # seconds a pull lives on the server
        self.lost_after = lost_after
        self.retry_after = retry_after  # pause after a failed pull or an error status
        self.requested = 0  # messages asked for and not delivered yet
        self.expires_at = 0.0
        self.last_seen = now
        self.retry_at = 0.0
        self.misses = 0

    def careful(self, now: float) -> bool:
        """Whether pulls ask for ``careful_batch`` now (redeliveries expected) rather than ``batch``."""
        return now < self.careful_until

    def expect_redeliveries(self, until: float) -> None:
        """Redeliveries may come until ``until`` (e.g. ``ack_wait`` after the partition was taken)."""
        if until > self.careful_until:
            self.careful_until = until

    def redelivered(self, now: float) -> None:
        """A redelivery arrived: more may wait in the server's redelivery queue behind it."""
        self.expect_redeliveries(now + self.hold)

    def _low(self, now: float) -> int:
        return self.careful_low if now < self.careful_until else self.fast_low

    def fast_batch(self, now: float) -> int:
        """The batch of a pull when no redelivery is expected: ``batch``, or fewer when the largest
        delivery seen lately (``size`` plus SIZE_ALLOWANCE for headers) would let ``max_bytes`` end it;
        ``careful_batch`` while none was seen lately (a sized pull needs a size: a pull of ``batch``
        cut by ``max_bytes`` would make pulls careful for ``hold``, one message each at 8 partitions:
        a fresh drain of 8 KiB chunks ran at half the rate once a pull's max_bytes was halved)."""
        if now >= self.window_end:
            self.earlier, self.largest = self.largest, 0
            self.window_end = now + self.size_window
        if not self.max_bytes:
            return self.batch
        big = self.largest if self.largest > self.earlier else self.earlier
        if not big:
            return self.careful_batch
        return max(self.careful_batch, min(self.batch, self.max_bytes // (big + SIZE_ALLOWANCE)))

    def pulled(self, now: float) -> int:
        """A pull went out; returns its ``batch`` (``careful_batch`` while redeliveries are expected,
        else :meth:`fast_batch`)."""
        if now < self.careful_until:
            batch = self.careful_batch
        else:
            batch = self.fast_batch(now)
            self.fast_low = min(batch, self.low)
        self.requested += batch
        self.expires_at = now + self.expires
        return batch

    def pull_failed(self, now: float, batch: int | None = None) -> None:
        """The pull just counted by :meth:`pulled` (which returned ``batch``) did not leave."""
        self.requested = max(0, self.requested - (self.batch if batch is None else batch))
        self.retry_at = now + self.retry_after

    def delivered(self, now: float, size: int = 0) -> bool:
        """A message arrived (``size``: its payload, subject and ack subject); True when a pull should go
        out now."""
        self.last_seen = now
        self.requested -= 1
        if size > self.largest:
            self.largest = size
        return self.requested <= (self.fast_low if now >= self.careful_until else self.careful_low)

    def dropped(self) -> None:
        """The client dropped a delivery (slow consumer): it used up credit all the same."""
        self.requested = max(0, self.requested - 1)

    def status(self, code: str, pending: str | None, description: str, now: float) -> bool:
        """A status message on the pull inbox (``Status``, ``Nats-Pending-Messages``, ``Description``
        headers); True when a pull should go out now. Counts a miss when the consumer may be gone."""
        self.last_seen = now
        if code == "100":  # idle heartbeat
            return self.requested <= self._low(now) and now >= self.retry_at
        if code in ("408", "409") and pending is not None and pending.isdigit():
            self.requested = max(0, self.requested - int(pending))  # a pull ended unfilled
            if code == "408":
                return self.requested <= self._low(now) and now >= self.retry_at
            if "maxbytes" in description.lower():  # cut by bytes: a redelivery may have gone to the back
                self.redelivered(now)
        else:
            self.requested = 0
            self.retry_at = now + self.retry_after
        lowered = description.lower()
        if "consumer deleted" in lowered or code == "503" or "no responders" in lowered:
            self.misses += 1
        return self.requested <= self._low(now) and now >= self.retry_at

    def watch(self, now: float, reconnected: bool, behind: bool = False) -> Watch:
        """A watchdog round: write off forgotten pulls, decide on repair and a new pull.

        ``behind``: deliveries wait to be handled (the handler is held up, e.g. waiting for parked
        bytes to free). The server is answering, and what the pulls out may still bring is all the
        partition may hold beside them: nothing is written off and nothing pulled (the handler pulls
        as it catches up, or a later round once it has). Written off instead, a partition whose
        handler waited for a hung recovery lookup was sent two more pulls' worth every ``lost_after``
        (from 29 to 69 ~1 MB chunks delivered and undecided in 8 s at 1 partition,
        tests/test_durable_attack_review.py)."""
        if behind and not reconnected:
            self.last_seen = now
            return Watch(False, False, False)
        lost = self.requested > 0 and now - self.last_seen > self.lost_after
        if reconnected or lost or now >= self.expires_at:
            if lost:
                self.misses += 1
            self.requested = 0
            self.last_seen = now
        repair = self.misses >= 2
        if repair:
            self.misses = 0
        return Watch(lost, repair, self.requested <= self._low(now) and now >= self.retry_at)
