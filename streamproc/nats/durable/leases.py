"""Partition leases: which processor instance reads which partition, agreed through a JetStream KV bucket.

The server's pinned-client priority groups (ADR-42) would do this, but nats-py 2.16 cannot use
them: its ``ConsumerConfig`` has no priority fields and its pull requests carry no group or
``Nats-Pin-Id``. So ownership is a lease per partition in a KV bucket whose entries expire ``ttl``
seconds after their last write (the bucket's max age):

- ``p.<n>`` holds the owner's instance id. It is taken with a create (compare-and-set on "absent"),
  renewed with an update on the owner's last revision and given back with a delete on that
  revision. Every write is a compare-and-set decided by the stream leader, so two instances never
  both hold a lease.
- ``m.<instance>`` is each live instance's heartbeat; everybody derives the same fair share,
  ``ceil(partitions / live instances)``, from the number of such keys.

:meth:`LeaseTable.step` runs every ``ttl / 3``: renew, count members, report surplus partitions
(above the share; the caller hands them over and calls :meth:`release`) and take free ones (below
it). An instance that cannot renew must stop serving a partition at :meth:`expired`, i.e. ``ttl``
minus a margin after it sent the last successful write, before the server lets anybody else in.

A lease ends only in :meth:`expired` (and :meth:`release`), never inside :meth:`step`: the step
awaits KV requests, and a partition it dropped there would be served on, unseen by the caller's
check before results are sent (``Partitions.fence``), until the step returned. A lease the step
finds taken over is marked lapsed instead, for the next :meth:`expired` to report.

Failover: a killed instance's leases expire at most ``ttl`` after its last renewal, and a survivor
takes them at its next step, so partitions move within ``ttl * 4/3`` (plus the server's expiry
timer granularity).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from ...core.partitions import fnv1a32
from ...core.errors import LeaseBucketMismatch
from ...logs import error_text, log_event
from ..streams import _close

log = logging.getLogger("streamproc.leases")

MARGIN = 0.1  # fraction of ttl a lease is given up before the server could expire it


class Lease(msgspec.Struct):
    partition: int
    revision: int
    valid_until: float  # local clock: after this the lease may have expired on the server


class LeaseChange(msgspec.Struct, frozen=True):
    acquired: tuple[int, ...] = ()
    surplus: tuple[int, ...] = ()  # still held, above the fair share: hand over, then release()
    # (No "lost": a lease taken by another instance or not renewed in time is reported by expired().)


class LeaseTable:
    """This instance's view of the partition leases in one KV bucket."""

    def __init__(self, nc: NatsClient, bucket: str, partitions: int, instance: str, ttl: float, *,
                 replicas: int = 1, storage: StorageType = StorageType.FILE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Creating a replicated bucket may take a while; a renewal must not wait longer than a
        # fraction of the ttl (right after a server restart, JetStream requests go unanswered
        # until it has recovered, and a step stuck on them would let every lease run out).
        self.js = nc.jetstream(timeout=10)
        self._fast = nc.jetstream(timeout=max(0.5, ttl / 4))
        self.bucket = bucket
        self.partitions = partitions
        self.instance = instance
        self.ttl = ttl
        self.replicas = replicas
        self.storage = storage
        self._clock = clock
        self._value = instance.encode()
        self._kv: KeyValue | None = None
        self.owned: dict[int, Lease] = {}
        # step() found a lease taken over that expired() has not reported yet: a caller that checks
        # expired() only now and then (the fence of every send) checks at once while this is set.
        self.taken_over = False
        self.members = 1
        # The bucket's max age as last read (each step reads it with the member count): edited under
        # a running instance (start-up checks it in open()), a shorter one lets the server expire a
        # lease before ttl and a peer take it while this instance still serves it.
        self.bucket_ttl = ttl
        self.bucket_ttl_changes = 0  # times a step found the bucket's max age changed (/metrics)
        # The bucket deleted (and maybe made again by a peer or an operator) under the running instances:
        # its leases are gone while their owners may serve them until their validity runs out, so no
        # partition is taken until a ttl after a step first saw the new bucket (or made it).
        self.bucket_recreations = 0  # times a step found the bucket gone or made again (/metrics)
        self._created: object = None  # the bucket stream's creation time, as last read
        self._quiet_until = -math.inf
        # Instances start their search at different partitions, so simultaneous starters spread out.
        self._offset = fnv1a32(self._value) % partitions

    @property
    def share(self) -> int:
        return math.ceil(self.partitions / max(1, self.members))

    @property
    def valid_for(self) -> float:
        """Seconds a lease is served after its write was sent: before the server can expire it, by
        the shorter of ``ttl`` and the bucket's max age (0: the server never expires it)."""
        ttl = min(self.ttl, self.bucket_ttl) if self.bucket_ttl > 0 else self.ttl
        return ttl * (1 - MARGIN)

    @property
    def period(self) -> float:
        """Seconds between two steps: a third of the lease's life."""
        return self.valid_for / (3 * (1 - MARGIN))

    @staticmethod
    def key(partition: int) -> str:
        return f"p.{partition}"

    @property
    def member_key(self) -> str:
        return f"m.{self.instance}"

    async def open(self) -> None:
        """Bind to the bucket, creating it if needed; an existing bucket must have the same ttl."""
        try:
            await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            await self.js.create_key_value(self._config())
            self._kv = await self._fast.key_value(self.bucket)
            return
        self._kv = await self._fast.key_value(self.bucket)
        info = await self.js.stream_info(f"KV_{self.bucket}")
        differences = []
        if not _close(info.config.max_age, self.ttl):
            differences.append(f"ttl is {info.config.max_age}s, not {self.ttl}s")
        if (info.config.num_replicas or 1) != self.replicas:
            differences.append(f"replicas is {info.config.num_replicas or 1}, not {self.replicas}")
        if differences:
            raise LeaseBucketMismatch(f"KV_{self.bucket}", differences)

    def _config(self) -> KeyValueConfig:
        return KeyValueConfig(bucket=self.bucket, description="streamproc partition leases", history=1,
                              ttl=self.ttl, replicas=self.replicas, storage=self.storage)

    def expired(self, now: float) -> list[int]:
        """Partitions whose lease may have run out on the server, or that :meth:`step` found taken
        over: stop serving them now. The one place a lease is given up, other than :meth:`release`."""
        self.taken_over = False
        gone = [n for n, lease in self.owned.items() if now >= lease.valid_until]
        for n in gone:
            del self.owned[n]
        return gone

    async def step(self) -> LeaseChange:
        """Renew, recount members, take free partitions up to the fair share, report the surplus.

        Gives up no lease and renews none that lapsed: call :meth:`expired` before (so what lapsed
        is not counted in the share) and after (what lapsed, or was found taken over, while the step
        waited)."""
        assert self._kv is not None
        kv = self._kv
        try:
            await kv.put(self.member_key, self._value)
        except _UNREACHABLE as exc:
            log_event(log, logging.DEBUG, "member_heartbeat_failed", error=error_text(exc))
        for n, lease in list(self.owned.items()):
            sent = self._clock()
            if self.owned.get(n) is not lease or sent >= lease.valid_until:
                continue  # given up by expired() meanwhile, or lapsed: expired()'s to give up, never renewed
            try:
                lease.revision = await kv.update(self.key(n), self._value, last=lease.revision)
            except KeyWrongLastSequenceError:  # expired and taken over, or deleted by an operator
                # Lapsed at once, not dropped here: the next expired() (maybe the fence of the very
                # next send, while this step still awaits the KV) gives the partition up.
                lease.valid_until = -math.inf
                self.taken_over = True
                log_event(log, logging.WARNING, "lease_taken_over", partition=n, instance=self.instance)
                continue
            except _UNREACHABLE as exc:
                log_event(log, logging.DEBUG, "lease_renewal_failed", partition=n, error=error_text(exc))
                continue  # still ours until valid_until; expired() gives it up in time
            lease.valid_until = sent + self.valid_for
        try:
            self.members = max(1, await self._count_members())
        except NotFoundError:  # the bucket's stream is gone
            await self._make_again()
        except _UNREACHABLE as exc:
            log_event(log, logging.DEBUG, "member_count_failed", error=error_text(exc))
        share = self.share
        now = self._clock()
        held = sorted(n for n, lease in self.owned.items() if lease.valid_until > now)  # not the lapsed ones
        surplus = tuple(held[share:])
        acquired: list[int] = []
        if now < self._quiet_until:  # a new bucket: the old one's leases may still be served
            return LeaseChange((), surplus)
        for i in range(self.partitions):
            if len(held) + len(acquired) >= share:
                break
            n = (self._offset + i) % self.partitions
            if n in self.owned:
                continue
            sent = self._clock()
            try:
                revision = await kv.create(self.key(n), self._value)
            except KeyWrongLastSequenceError:
                continue  # somebody holds it
            except _UNREACHABLE as exc:
                log_event(log, logging.DEBUG, "lease_create_failed", partition=n, error=error_text(exc))
                break
            self.owned[n] = Lease(n, revision, sent + self.valid_for)
            acquired.append(n)
        return LeaseChange(tuple(acquired), surplus)

    async def release(self, partition: int) -> None:
        """Give a lease back (after the partition was handed over) so a peer can take it at once."""
        lease = self.owned.pop(partition, None)
        if lease is None or self._kv is None:
            return
        try:
            await self._kv.delete(self.key(partition), last=lease.revision)
        except (KeyWrongLastSequenceError, *_UNREACHABLE) as exc:
            log_event(log, logging.DEBUG, "lease_release_failed", partition=partition, error=error_text(exc),
                      detail="it expires anyway")

    async def leave(self) -> None:
        """Release every lease and remove this member, so peers rebalance without waiting for expiry."""
        for n in list(self.owned):
            await self.release(n)
        if self._kv is None:
            return
        try:
            # A purge marker that itself expires after a second: the member key disappears from
            # the subject count almost at once (a plain delete would linger as a marker for ttl).
            await self._kv.purge(self.member_key, msg_ttl=1)
        except _UNREACHABLE as exc:
            log_event(log, logging.DEBUG, "member_removal_failed", error=error_text(exc), detail="it expires anyway")

    async def _count_members(self) -> int:
        info = await self._fast.stream_info(f"KV_{self.bucket}", subjects_filter=f"$KV.{self.bucket}.m.>")
        self._check_bucket_ttl(info.config.max_age or 0.0)
        if self._created is None:
            self._created = info.created
        elif info.created != self._created:  # deleted and made again (by a peer or an operator) since
            self._created = info.created
            self._go_quiet("made again under the running processor")
        return len(info.state.subjects or {})

    async def _make_again(self) -> None:
        """The bucket is gone (deleted under the running processor): make it again, and take no
        partition for a ttl, by when every lease of the old bucket has lapsed (its owners, unable to
        renew, stop serving at their validity)."""
        self._created = None  # this instance's own creation is not a peer's
        try:
            await self.js.create_key_value(self._config())  # a peer's making it the same way first is no error
        except _UNREACHABLE as exc:  # not now (or not ours to make): the next step tries again, and
            # until then no partition can be taken (the bucket is gone) and no lease renewed
            log_event(log, logging.DEBUG, "lease_bucket_create_failed", error=error_text(exc))
            return
        self._go_quiet("deleted under the running processor: made again")

    def _go_quiet(self, what: str) -> None:
        self.bucket_recreations += 1
        self._quiet_until = self._clock() + self.ttl
        log_event(log, logging.ERROR, "lease_bucket_gone", bucket=f"KV_{self.bucket}", instance=self.instance,
                  detail=f"{what}; every lease it held is lost, so no partition is taken for lease_ttl "
                         f"({self.ttl:g} s), by when the old leases have lapsed")

    def _check_bucket_ttl(self, max_age: float) -> None:
        """The bucket's max age was changed since the last step: serve each lease only as long as the
        server keeps it (shortened: before a peer can take it; renewed at the next step), and say so."""
        if _close(max_age, self.bucket_ttl):
            return
        before = self.valid_for
        self.bucket_ttl = max_age
        self.bucket_ttl_changes += 1
        shift = self.valid_for - before
        if shift < 0:
            for lease in self.owned.values():
                lease.valid_until += shift  # as if renewed under the bucket's max age
            # A peer's lease, written under the old age, is served until its owner's next step sees the
            # new one: the server may expire it before that, so take nothing while one may be served.
            self._quiet_until = max(self._quiet_until, self._clock() + before)
        log_event(log, logging.ERROR, "lease_bucket_changed", bucket=f"KV_{self.bucket}", max_age=max_age,
                  lease_ttl=self.ttl, detail=(
                      "max age edited under the running processor: leases are held for the shorter of the two"
                      if max_age > 0 else "max age removed: the leases of an instance that dies never expire")
                  + "; restore the bucket's max age to --lease-ttl")


# Any failure of one KV operation (timeout, no responders, a stream electing a leader, a closed or
# buffering connection) means "not now": the step goes on, and expiry decides what is still held.
_UNREACHABLE = (nats.errors.Error, TimeoutError, OSError)
