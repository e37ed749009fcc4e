"""Durable mode: migration state that outlives the processor instance that sealed it.

Two JetStream stores together are a request's whole migration state, so any instance can answer a
migrate for a request another (dead) instance served, and stitch its resumed attempt:

- the **results stream** is already the durable record of what the client was sent: the stored
  result bodies of ``P.results.<request_id>``, in seq order;
- the **migrations bucket** (a KV bucket, ``<chunk stream>_MIGRATIONS``) keeps one
  :class:`~streamproc.core.events.SealRecord` per migrated request: the result seqs where its
  later attempts start and the last seal's reply. Every write is a compare-and-set on the key's
  revision (``KeyValue.create`` for the first seal, ``KeyValue.update(last=...)`` after it),
  decided by the bucket's stream leader, so of two instances sealing the same attempt exactly one
  wins (nats-py's KV sends ``Nats-Expected-Last-Subject-Sequence``; nats-server ``stream.go``
  checks it against ``store.LoadLastMsg(subject)`` in ``processJetStreamMsg``, or before
  proposing when clustered, and refuses a mismatch with ``NewJSStreamWrongLastSequenceError``,
  which nats-py raises as ``KeyWrongLastSequenceError``).

An instance seals locally first (later chunks of the sealed attempt are dropped from then on), waits
until the request's results are stored, and only then records the seal; the reply goes out after
the record. So a record never names results that are not stored, and "emitted tokens" is always
a function of stored bodies: a new owner replays them through the format's migration session,
sealing at each recorded point, and gets the session the dead instance had
(:meth:`~streamproc.core.correlator.Correlator.resume`).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
from collections.abc import Mapping
from datetime import datetime

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from ...core import defaults
from ...core.errors import HistoryOverBound, MigrationBucketMismatch, MissingResults, UnreadableRecord
from ...core.events import SealRecord
from ...core.recovery import history_over_bound, resume_point
from ...core.wire import decode_seal_record, encode_seal_record, max_seals
from ...logs import error_text, log_event

log = logging.getLogger("streamproc.durable")

HISTORY_TIMEOUT = 2.0  # longest wait for the next stored result while reading them back
SCAN_TIMEOUT = 10.0  # longest read of the bucket's keys when partitions are taken (at most)


def record_key(request_id: str) -> str:
    """KV keys allow ``[-/_=.a-zA-Z0-9]`` only; request ids are any printable ASCII: base64url them."""
    return "r." + base64.urlsafe_b64encode(request_id.encode()).decode().rstrip("=")


def request_id_of(key: str) -> str | None:
    """The request id a record key names (:func:`record_key` reversed); None for any other key."""
    if not key.startswith("r."):
        return None
    text = key[2:]
    try:
        rid = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True).decode("ascii")
    except (binascii.Error, ValueError):
        return None
    return rid or None


def bucket_problems(actual: StreamConfig) -> list[str]:
    """Why a pre-created migrations bucket would lose seal records or never confirm them. Each key
    is one request's record and only its last value counts, so any history (``max_msgs_per_subject``)
    is safe; a bucket-wide ``max_msgs``/``max_bytes`` with discard ``old`` evicts the records of
    requests still being served (a sealed attempt's late chunk would then restart its request), and
    ``no_ack`` leaves every compare-and-set write unconfirmed."""
    found = []
    if actual.no_ack:
        found.append("no_ack is true: no seal record write is ever confirmed")
    discard = getattr(actual.discard, "value", actual.discard)
    if discard != DiscardPolicy.NEW.value:
        limits = [f"{name} {value}" for name, value in (("max_msgs", actual.max_msgs), ("max_bytes", actual.max_bytes))
                  if value is not None and value > 0]
        if limits:
            found.append(f"discard is {discard!r} with {' and '.join(limits)}: once reached, the oldest seal "
                         "records of requests still served are evicted (use discard 'new' or no such limit)")
    return found


class _ServerTime(msgspec.Struct):
    """The part of a JetStream info reply read here: when the server wrote it (nats-server 2.10+)."""

    ts: datetime | None = None


class MigrationLedger:
    """Seal records in the migrations bucket, and stored result bodies read back from the results stream."""

    def __init__(self, nc: NatsClient, bucket: str, results_stream: str, results_head: str, *,
                 ttl: float, replicas: int = 1, storage: StorageType = StorageType.FILE,
                 max_buffered_bytes: int = defaults.MAX_BUFFERED_BYTES) -> None:
        self._nc = nc
        self.js = nc.jetstream(timeout=10)
        self.bucket = bucket
        self.results_stream = results_stream
        self._results_head = results_head  # "P.results."
        # What one history read may keep of one request (history_over_bound): bytes, results; and how
        # many times either it may receive in all (copies of a seq stored again included).
        self.max_history_bytes = defaults.MAX_HISTORY_BYTES
        self.max_history_results = defaults.MAX_HISTORY_RESULTS
        self.max_history_copies = defaults.MAX_HISTORY_COPIES
        # Seals a record read back may hold (wire.max_seals): counted before the list is built, so a
        # record of millions of seals (a large max_payload, or a forger) is unreadable, not held.
        self.max_seals = max_seals(max_buffered_bytes)
        self.ttl = ttl
        self.replicas = replicas
        self.storage = storage
        self._kv: KeyValue | None = None

    async def open(self) -> None:
        """Bind to the bucket, creating it if needed. Records expire with the results they describe.
        An existing bucket that would lose or never confirm seal records is refused
        (:func:`bucket_problems`)."""
        try:
            self._kv = await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            await self.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, description="streamproc seal records of migrated requests", history=1,
                ttl=self.ttl, replicas=self.replicas, storage=self.storage))
            self._kv = await self.js.key_value(self.bucket)
            return
        problems = bucket_problems((await self.js.stream_info(f"KV_{self.bucket}")).config)
        if problems:
            raise MigrationBucketMismatch(f"KV_{self.bucket}", problems)

    async def read(self, request_id: str) -> tuple[SealRecord | None, int | None]:
        """The request's seal record and its revision, ``(None, None)`` when it never migrated.
        A read of the leader (nats-py's ``KeyValue.get`` without direct get): never a stale follower."""
        assert self._kv is not None
        try:
            entry = await self._kv.get(record_key(request_id))
        except KeyNotFoundError:
            return None, None
        if not entry.value:
            return None, entry.revision  # a delete marker: create() on it fails, update() on its revision works
        try:
            return decode_seal_record(entry.value, self.max_seals), entry.revision
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise UnreadableRecord(request_id, str(exc)) from None

    async def write(self, request_id: str, record: SealRecord, revision: int | None) -> int:
        """Compare-and-set: create when there was no record, else update on ``revision``.
        Raises ``KeyWrongLastSequenceError`` when another seal was recorded first."""
        assert self._kv is not None
        key, value = record_key(request_id), encode_seal_record(record)
        if revision is None:
            return await self._kv.create(key, value)
        return await self._kv.update(key, value, last=revision)

    async def sealed(self, timeout: float = SCAN_TIMEOUT) -> list[tuple[str, float]]:
        """Every request with a seal record, and the record's age in seconds, oldest write first.

        What a new owner of a partition reads once before it pulls: a request sealed by the
        previous owner may still see the sealed attempt's first output chunk (nothing was stored
        for it), which must not start the request afresh. One ordered consumer, last value per
        key, headers only (nats-py ``KeyValue.keys``' watcher, ``watchall(ignore_deletes=True,
        meta_only=True)``, kept here for each entry's timestamp); it ends at the marker nats-py
        queues when ``num_pending`` reaches 0. Raises (``TimeoutError`` included) when the bucket
        cannot be read within ``timeout``."""
        assert self._kv is not None
        out: list[tuple[str, float]] = []
        with anyio.fail_after(timeout):
            # Ages on the server's clock, which stamped the records: the host's clock ahead of it by
            # more than the records' ttl made every age past it, and each record listed was dropped
            # at this instance's next seal while it was still in the bucket.
            now = await self._server_now()
            watcher = await self._kv.watchall(ignore_deletes=True, meta_only=True)
            try:
                async for entry in watcher:
                    if entry is None:  # nats-py's end-of-initial-values marker
                        break
                    rid = request_id_of(entry.key)
                    if rid is not None:
                        created = entry.created.timestamp() if entry.created is not None and now else now
                        out.append((rid, max(0.0, now - created)))
            finally:
                with anyio.CancelScope(shield=True):
                    await watcher.stop()
        return out

    async def _server_now(self) -> float:
        """The server's time (its stream info's ``ts``), seconds since the epoch; 0.0 when it tells
        none: then every age reads 0, each record listed for a whole ttl more (a lookup too many
        at worst, never a seal missed)."""
        reply = await self._nc.request(f"{self.js._prefix}.STREAM.INFO.KV_{self.bucket}", b"", timeout=10)
        ts = msgspec.json.decode(reply.data, type=_ServerTime).ts
        return ts.timestamp() if ts is not None and ts.year > 1 else 0.0  # Go's zero time: not told

    async def history(self, request_id: str, count: int) -> list[bytes]:
        """The stored bodies of results ``[0, count)`` of ``request_id``, in seq order.

        One ordered push consumer filtered on the request's subject (nats-py
        ``JetStreamContext.subscribe(ordered_consumer=True)``; the server walks its per-subject
        index) streams them in stream order, instead of a round trip per result. Copies of a seq
        stored again after the duplicate window are skipped: only the first copy of each is kept. Raises
        ``MissingResults`` on a gap, ``HistoryOverBound`` (a ``MissingResults``) once more than
        ``max_history_results`` results were asked for, more than ``max_history_bytes`` bytes were kept,
        or more than ``max_history_copies`` times either came in all (received or queued, every copy),
        and ``nats.errors.TimeoutError`` when the server stops sending before its last one (retried).
        Held at once: the kept bodies (at most ``max_history_bytes`` plus one message) and the queue (the
        subscription's pending limits: the same bytes plus one message; nats-server's flow control keeps
        a push consumer's unanswered bytes under ``JsFlowControlMaxPending``, 32 MiB, in consumer.go)."""
        if count <= 0:
            return []
        self._check_bound(request_id, count, 0)
        bodies: dict[int, bytes] = {}
        received = received_bytes = kept_bytes = 0
        try:
            sub = await self.js.subscribe(self._results_head + request_id, stream=self.results_stream,
                                          ordered_consumer=True,
                                          # Every copy may be queued (received + queued counts toward the
                                          # copies bound, max_history_copies x max_history_results), plus
                                          # one: an asyncio.Queue(maxsize=pending_msgs_limit) that is full
                                          # drops the message in nats-py 2.x Client._process_msg ("except
                                          # asyncio.QueueFull: ... SlowConsumerError") after the ordered
                                          # consumer counted its sequence, so it never comes again: a
                                          # timeout. nats-server's flow control counts bytes, not messages.
                                          pending_msgs_limit=self.max_history_copies * self.max_history_results
                                          + 1,
                                          # One message always fits: nats-py 2.x Client._process_msg drops
                                          # one once "sub._pending_size >= sub._pending_bytes_limit"
                                          # (SlowConsumerError), and a dropped one here is a timeout.
                                          pending_bytes_limit=self.max_history_bytes + self._nc.max_payload)
        except nats.js.errors.APIError as exc:
            # No consumer to be had, e.g. the stream's consumers at nats-server's limit (1000 per
            # stream, 2.15.1): the edge may create consumers on this stream, as many as it likes
            # (docs/security.md). Read them one by one instead, as the edge reads stored results.
            log_event(log, logging.WARNING, "history_without_consumer", stream=self.results_stream,
                      results=count, error=error_text(exc))
            return await self._history_by_get(request_id, count)
        try:
            while len(bodies) < count:
                try:
                    msg = await sub.next_msg(timeout=HISTORY_TIMEOUT)
                except nats.errors.TimeoutError:
                    # The server went quiet before saying nothing is left (num_pending 0): the store
                    # did not answer, which says nothing of what is stored. Not MissingResults, which
                    # a take-over without a seal record takes for bodies gone for good (recovery.py).
                    raise nats.errors.TimeoutError(
                        f"stored results of {request_id!r} stopped coming after {len(bodies)} of {count} "
                        f"({HISTORY_TIMEOUT} s)") from None
                received += 1
                received_bytes += len(msg.data)
                kept_bytes += self._keep(bodies, msg.headers, msg.data, count)
                # Kept bodies, and every copy the server sent so far (the queued part included).
                self._check_bound(request_id, count, kept_bytes, received + sub.pending_msgs,
                                  received_bytes + sub.pending_bytes)
                if not msg.metadata.num_pending:
                    break
        finally:
            await sub.unsubscribe()
        if len(bodies) < count:
            raise MissingResults(request_id, count, _first_missing(bodies, count))
        return [bodies[i] for i in range(count)]

    async def _history_by_get(self, request_id: str, count: int) -> list[bytes]:
        """:meth:`history` without a consumer: ``$JS.API.STREAM.MSG.GET`` with ``next_by_subj``, one
        round trip per stored result (nats-py ``JetStreamContext.get_msg(next=True)``)."""
        subject = self._results_head + request_id
        bodies: dict[int, bytes] = {}
        seq = 1
        received = received_bytes = kept_bytes = 0
        while len(bodies) < count:
            try:
                msg = await self.js.get_msg(self.results_stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            received += 1
            received_bytes += len(msg.data or b"")
            kept_bytes += self._keep(bodies, msg.headers, msg.data or b"", count)
            self._check_bound(request_id, count, kept_bytes, received, received_bytes)
            seq = (msg.seq or seq) + 1
        if len(bodies) < count:
            raise MissingResults(request_id, count, _first_missing(bodies, count))
        return [bodies[i] for i in range(count)]

    @staticmethod
    def _keep(bodies: dict[int, bytes], headers: Mapping[str, str] | None, body: bytes, count: int) -> int:
        """Keep ``body`` under its seq when it is the first copy of a seq below ``count``; the bytes kept."""
        point = resume_point(headers)
        if point is None or point[0] - 1 >= count or point[0] - 1 in bodies:
            return 0
        bodies[point[0] - 1] = body
        return len(body)

    def _check_bound(self, request_id: str, results: int, kept_bytes: int, received: int = 0,
                     received_bytes: int = 0) -> None:
        why = history_over_bound(results, kept_bytes, self.max_history_results, self.max_history_bytes,
                                 received=received, received_bytes=received_bytes,
                                 max_copies=self.max_history_copies)
        if why is not None:
            raise HistoryOverBound(request_id, why)


# Any failure of a store operation means "not now": the caller answers ``unavailable`` or retries.
def _first_missing(bodies: Mapping[int, bytes], count: int) -> list[int]:
    """The first five seqs below ``count`` without a body. One is at most ``len(bodies)``, so this is
    ``len(bodies)`` steps, whatever ``count`` a stored result's ``Streamproc-Seq`` named: a set of
    ``range(count)`` was ~1.5 GB for a forger's 19,999,999 and held the event loop past the lease."""
    return list(itertools.islice((seq for seq in range(count) if seq not in bodies), 5))


UNREACHABLE = (nats.errors.Error, TimeoutError, OSError, UnreadableRecord, MissingResults)
