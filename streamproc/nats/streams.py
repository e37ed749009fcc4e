"""The JetStream streams: results (late attach, de-duplication) and chunks (durable input).

Results are published on ``P.results.<request_id>``; a stream capturing ``P.results.>`` stores them
with their ``Nats-Msg-Id`` (``<request_id>.<seq>``), so a processor that republishes after a restart
is de-duplicated inside ``duplicate_window``. The edge replays a request's subject from this stream,
then follows it live.

In durable mode a second stream captures every chunk subject ``P.chunks.<request_id>.<role>``
(work-queue retention: a chunk is deleted once acknowledged) and stores it partitioned by request id
(see :mod:`streamproc.partitions`); each partition is read by one durable pull consumer.

The ``ensure_*`` functions create a stream or check an existing one; they never change a stream
that exists, because a silently shortened ``max_age`` would lose other people's data.
"""

from __future__ import annotations

from typing import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    ConsumerInfo,
    DeliverPolicy,
    DiscardPolicy,
    ReplayPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
    SubjectTransform,
)
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from ..core import defaults
from ..core.errors import ChunkStreamMismatch, ConfigError, ResultsStreamCannotStore, ResultsStreamMismatch
from ..core.events import Role
from ..core.partitions import PartitionScheme
from ..core.wire import MAX_REQUEST_ID_LEN, Subjects

RESULTS_STREAM = "STREAMPROC_RESULTS"
CHUNKS_STREAM = "STREAMPROC_CHUNKS"


class ResultsStreamSpec(msgspec.Struct, frozen=True):
    """What a results stream must look like."""

    name: str
    subject: str
    max_age: float
    duplicate_window: float
    storage: StorageType
    replicas: int = 1
    batched: bool = False  # allow_batched: a request's results may be published as a fast batch

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description="streamproc results, for late-attaching edges and client resume",
            allow_batched=True if self.batched else None,
            subjects=[self.subject],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            storage=self.storage,
            num_replicas=self.replicas,
            allow_direct=True,
        )

    def differences(self, actual: StreamConfig) -> list[str]:
        found = []
        if not any(covers(pattern, self.subject) for pattern in actual.subjects or []):
            found.append(f"subjects {actual.subjects} do not capture {self.subject!r}")
        if actual.retention not in (RetentionPolicy.LIMITS, RetentionPolicy.LIMITS.value):
            found.append(
                f"retention is {_value(actual.retention)!r}, not 'limits' (results must stay readable)"
            )
        found.extend(_limit_differences(actual, self))
        return found


def _value(x: object) -> object:
    return getattr(x, "value", x)


def _close(a: float | None, b: float) -> bool:
    return abs((a or 0.0) - b) < 1e-3


def covers(pattern: str, subject: str) -> bool:
    """Whether every subject matched by ``subject`` (which may hold wildcards) is matched by ``pattern``."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s):
            return False
        if token == "*":
            if s[i] == ">":
                return False
            continue
        if token != s[i]:
            return False
    return len(p) == len(s)


async def ensure_results_stream(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    name: str = RESULTS_STREAM,
    max_age: float = defaults.RESULTS_MAX_AGE,
    duplicate_window: float = defaults.DUPLICATE_WINDOW,
    storage: StorageType = StorageType.FILE,
    replicas: int = 1,
    max_payload: int = 0,
    batched: bool = False,
) -> StreamInfo:
    """Create the stream capturing ``subjects.all_results``, or check that the existing one fits.

    ``batched``: a stream created here allows fast batch publishes (``allow_batched``; only for a
    server that has them, 2.14+); an existing one is left as it is (the caller reads its config).

    Raises :class:`ResultsStreamMismatch` when a stream of that name differs, or when another
    stream already captures the results subjects (JetStream forbids overlapping streams), and
    :class:`ResultsStreamCannotStore` when its limits would refuse results (:func:`storage_problems`;
    ``max_payload``: the server's, 0 skips the size check).
    """
    spec = ResultsStreamSpec(name, subjects.all_results, max_age, duplicate_window, storage, replicas, batched)
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        other = await find_results_stream(js, subjects.all_results)
        if other is not None and other != name:
            raise ResultsStreamMismatch(
                name, [f"stream {other!r} already captures {spec.subject!r}"]
            ) from None
        return await js.add_stream(spec.config())
    differences = spec.differences(info.config)
    if differences:
        raise ResultsStreamMismatch(name, differences)
    problems = storage_problems(info.config, max_payload, stored_record_size(subjects.result("x" * MAX_REQUEST_ID_LEN),
                                                                              max_payload))
    if problems:
        raise ResultsStreamCannotStore(name, problems)
    return info


def results_stream_check(subjects: Subjects, *, name: str, max_age: float, duplicate_window: float,
                         storage: StorageType, replicas: int = 1,
                         max_payload: int = 0) -> Callable[[StreamConfig], list[str]]:
    """What :func:`ensure_results_stream` refuses in an existing stream, as a check of a config
    (read again while running: ``durable/config_watch.py``)."""
    spec = ResultsStreamSpec(name, subjects.all_results, max_age, duplicate_window, storage, replicas)
    largest = stored_record_size(subjects.result("x" * MAX_REQUEST_ID_LEN), max_payload)

    def problems(actual: StreamConfig) -> list[str]:
        return [*spec.differences(actual), *storage_problems(actual, max_payload, largest)]

    return problems


def stored_record_size(subject: str, max_payload: int) -> int:
    """What one message of ``max_payload`` bytes (headers and body) under ``subject`` counts against
    a stream's ``max_bytes`` (``filestore.go`` ``fileStoreMsgSizeRaw``: ``22 + slen + 4 + hlen + mlen
    + 8``; the memory store counts less, ``slen + hlen + mlen + 16``)."""
    return 22 + len(subject) + 4 + max_payload + 8


def storage_problems(actual: StreamConfig, max_payload: int = 0, largest: int = 0) -> list[str]:
    """Why a results stream would refuse results it is sent, or lose them, beyond a full disk.

    ``no_ack`` means no PubAck ever comes: every result would be re-sent until given up. With
    discard ``new`` a stream at ``max_msgs`` / ``max_bytes`` refuses every new message: each result
    would be retried and given up, and its request never finish (``discard old`` drops the oldest
    results instead, which readers have long read). Any positive ``max_msgs_per_subject`` drops (or,
    with ``discard_new_per_subject``, refuses) a request's results past that count, and a request has
    no bound on its result count: only -1 is safe. A ``max_msg_size`` below the server's
    ``max_payload`` refuses results that the chunk stream accepted. A ``max_bytes`` below
    ``largest`` (one maximal result as stored, :func:`stored_record_size`) loses results even with
    discard ``old``: nats-server PubAcks such a result, then evicts it and every other at once
    (tested against 2.15.1: a 5,000-byte message into ``max_bytes`` 1,000 left the stream empty).
    """
    found = []
    if actual.no_ack:
        found.append("no_ack is true: the stream sends no PubAck, so no result is ever confirmed stored (each would "
                     "be re-sent until given up, and its chunks never acknowledged)")
    if _value(actual.discard) == DiscardPolicy.NEW.value:
        limits = [f"{name} {value}" for name, value in (("max_msgs", actual.max_msgs), ("max_bytes", actual.max_bytes))
                  if value is not None and value > 0]
        if limits:
            found.append(f"discard is 'new' with {' and '.join(limits)}: once reached, every result is refused")
    found.extend(_per_subject_problems(actual, "a request's results all share its subject P.results.<id> and have "
                                               "no count bound"))
    size = actual.max_msg_size
    if size is not None and size > 0 and max_payload and size < max_payload:
        found.append(f"max_msg_size is {size} bytes, below the server's max_payload {max_payload}: larger results "
                     "are refused")
    if largest and actual.max_bytes is not None and 0 < actual.max_bytes < largest:
        found.append(f"max_bytes is {actual.max_bytes}, below one result of the server's max_payload {max_payload} "
                     f"as stored ({largest} bytes): such a result is acknowledged, then evicted with every other")
    return found


FAST_BATCH_SINCE = (2, 14)  # nats-server's fast batch publish (allow_batched) first shipped in 2.14.0


def server_has_fast_batches(nc: NatsClient) -> bool:
    """Whether the connected nats-server has fast batch publishes. Older ones would ignore
    ``allow_batched`` or refuse the stream config over it."""
    try:
        v = nc.connected_server_version
        return (v.major, v.minor) >= FAST_BATCH_SINCE
    except ValueError:  # a version string nats-py cannot parse: not assumed to have them
        return False


async def find_stream(js: JetStreamContext, subject: str) -> str | None:
    """The stream that stores ``subject``, or None (also when the server has no JetStream)."""
    try:
        return await js.find_stream_name_by_subject(subject)
    except (NotFoundError, ServiceUnavailableError, NoRespondersError):
        return None


find_results_stream = find_stream  # the edge's name for it


# ----------------------------------------------------------------------------- chunk stream

class ChunkStreamSpec(msgspec.Struct, frozen=True):
    """What the durable input's chunk stream must look like.

    Work-queue retention: a chunk leaves the stream once acknowledged, so storage holds the backlog,
    not the history. ``discard`` is ``new``: when ``max_bytes`` is reached, new chunks are refused
    (JetStream publishers see the error) instead of silently dropping stored input.

    The stream captures ``P.chunks.*.*`` rather than ``P.chunks.>``: a subject of another shape
    has no request id to partition on; a JetStream publish to it fails with "no responders", in
    core mode it is logged as unreadable. One of the right shape with a literal ``*``/``>`` token is
    captured but stored untransformed: :mod:`streamproc.nats.durable.strays` removes those.
    """

    name: str
    scheme: PartitionScheme
    max_age: float
    duplicate_window: float
    storage: StorageType
    replicas: int = 1
    max_bytes: int = -1

    @property
    def subject(self) -> str:
        return self.scheme.source

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description=f"streamproc chunks, {self.scheme.count} partitions by request id",
            subjects=[self.subject],
            retention=RetentionPolicy.WORK_QUEUE,
            discard=DiscardPolicy.NEW,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
            duplicate_window=self.duplicate_window,
            storage=self.storage,
            num_replicas=self.replicas,
            subject_transform=SubjectTransform(src=self.scheme.source, dest=self.scheme.destination),
        )

    def differences(self, actual: StreamConfig) -> list[str]:
        found = []
        if list(actual.subjects or []) != [self.subject]:
            found.append(f"subjects are {actual.subjects}, not [{self.subject!r}]")
        if actual.retention not in (RetentionPolicy.WORK_QUEUE, RetentionPolicy.WORK_QUEUE.value):
            found.append(f"retention is {_value(actual.retention)!r}, not 'workqueue'")
        transform = actual.subject_transform
        wanted = (self.scheme.source, self.scheme.destination)
        if transform is None or (transform.src, transform.dest) != wanted:
            got = None if transform is None else f"{transform.src} -> {transform.dest}"
            found.append(f"subject transform is {got!r}, not {wanted[0]} -> {wanted[1]} "
                         f"(a different partition count needs a drained, recreated stream)")
        found.extend(_limit_differences(actual, self))
        if (actual.max_bytes if actual.max_bytes is not None else -1) != self.max_bytes:
            found.append(f"max_bytes is {actual.max_bytes}, not {self.max_bytes}")
        if _value(actual.discard) != DiscardPolicy.NEW.value:
            found.append(f"discard is {_value(actual.discard)!r}, not 'new' (at a limit the stream would drop "
                         "unprocessed chunks instead of refusing new ones)")
        if actual.no_ack:
            found.append("no_ack is true: the stream sends no PubAck, so a durable ChunkPublisher never learns a "
                         "chunk was stored")
        if actual.allow_rollup_hdrs:  # a plain publish does it: workers need no JetStream API permission
            found.append("allow_rollup_hdrs is true: one chunk with a 'Nats-Rollup: all' header would purge every "
                         "unprocessed chunk of every request from the stream")
        found.extend(_per_subject_problems(actual, "a leg's chunks all share its subject and wait there until "
                                                   "processed"))
        return found


def chunk_stream_minimum(scheme: PartitionScheme, max_payload: int) -> int:
    """The least ``max_bytes`` a chunk stream needs to store one maximal chunk: the server's
    ``max_payload`` of headers and body under the longest stored subject
    (``P.partition.<n>.<256-character id>.prefill``), as :func:`stored_record_size` counts it."""
    longest = len(scheme.head(scheme.count - 1)) + MAX_REQUEST_ID_LEN + 1 + max(len(r.value) for r in Role)
    return stored_record_size("x" * longest, max_payload)


async def ensure_chunk_stream(js: JetStreamContext, spec: ChunkStreamSpec, max_payload: int = 0) -> StreamInfo:
    """Create the chunk stream, or check that the existing one (by name) fits ``spec``.

    ``max_payload`` (the server's; 0 skips the check): a ``max_bytes`` that cannot hold one maximal
    chunk is refused before anything is created."""
    if max_payload and spec.max_bytes != -1 and spec.max_bytes < chunk_stream_minimum(spec.scheme, max_payload):
        raise ConfigError(
            f"--chunks-max-bytes {spec.max_bytes} cannot hold one chunk of the server's max_payload {max_payload}: "
            f"use at least {chunk_stream_minimum(spec.scheme, max_payload)} (a maximal chunk as the stream stores "
            "it) or -1 for no limit")
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        other = await find_stream(js, spec.subject)
        if other is not None and other != spec.name:
            raise ChunkStreamMismatch(spec.name,
                                      [f"stream {other!r} already captures {spec.subject!r}"]) from None
        return await js.add_stream(spec.config())
    differences = spec.differences(info.config)
    if differences:
        raise ChunkStreamMismatch(spec.name, differences)
    return info


def partition_consumer_name(n: int) -> str:
    return f"streamproc-p{n}"


def partition_consumer_config(name: str, filter_subject: str, *, ack_wait: float,
                              max_ack_pending: int, max_deliver: int = defaults.MAX_DELIVER,
                              description: str = "streamproc partition reader") -> ConsumerConfig:
    """A durable pull consumer for one partition: explicit acks, bounded redelivery.

    A chunk is only left unacknowledged while its result is not stored, so redeliveries are rare
    (hand-overs, crashes). The processor itself settles a chunk on its ``max_deliver``-th delivery
    (it ends the request with an error result, then terminates the chunk); the consumer's own
    ``max_deliver`` is the backstop should that delivery be lost too (a crash on it): nothing is
    redelivered for ever.
    """
    return ConsumerConfig(
        name=name,
        durable_name=name,
        description=description,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        filter_subject=filter_subject,
        replay_policy=ReplayPolicy.INSTANT,
        max_waiting=512,
    )


async def ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> ConsumerInfo:
    """Create the durable consumer, or bring its tuning (ack wait, max ack pending, max deliver) in line.

    Consumers are streamproc's own, so unlike streams they are updated to the current settings.
    """
    assert config.durable_name is not None
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        return await js.add_consumer(stream, config)
    current = info.config
    if current.filter_subject != config.filter_subject:
        raise ChunkStreamMismatch(stream, [f"consumer {config.durable_name!r} filters "
                                           f"{current.filter_subject!r}, not {config.filter_subject!r}"])
    if consumer_retuned(current, config):
        return await js.add_consumer(stream, config)  # same durable name: an update of its tuning
    return info


def consumer_retuned(current: ConsumerConfig, config: ConsumerConfig) -> list[str]:
    """How a consumer's tuning differs from ours (ack wait, max ack pending, max deliver), as text."""
    found = []
    if not _close(current.ack_wait or 0.0, config.ack_wait or 0.0):
        found.append(f"ack_wait is {current.ack_wait}s, not {config.ack_wait}s")
    if current.max_ack_pending != config.max_ack_pending:
        found.append(f"max_ack_pending is {current.max_ack_pending}, not {config.max_ack_pending}")
    if current.max_deliver != config.max_deliver:
        found.append(f"max_deliver is {current.max_deliver}, not {config.max_deliver}")
    return found


async def jetstream_available(nc: NatsClient, timeout: float = 5.0) -> bool:
    """Whether the connected account can use JetStream (decides ``--mode auto``)."""
    try:
        await nc.jetstream(timeout=timeout).account_info()
    except (ServiceUnavailableError, NoRespondersError, nats.errors.TimeoutError, NotFoundError):
        return False
    except APIError as exc:  # e.g. 10039 "jetstream not enabled for account"
        if exc.code in (503, 404) or exc.err_code == 10039:
            return False
        raise
    return True


def _per_subject_problems(actual: StreamConfig, why: str) -> list[str]:
    """A ``max_msgs_per_subject`` limit on a stream whose subjects carry one request each: any
    positive value drops (discard ``old``) or refuses (``discard_new_per_subject``) that request's
    earlier messages, so only -1 (no limit) is safe; ``why`` says why no count is enough."""
    per = actual.max_msgs_per_subject
    if per is None or per <= 0:
        return []
    effect = ("refuses the rest" if _value(actual.discard) == DiscardPolicy.NEW.value and actual.discard_new_per_subject
              else "drops the older ones")
    return [f"max_msgs_per_subject is {per}: past {per} messages on one subject the stream {effect} ({why}; "
            "use -1)"]


def _limit_differences(actual: StreamConfig, spec: ResultsStreamSpec | ChunkStreamSpec) -> list[str]:
    """The limits both streams are validated on (never silently changed: a mismatch is reported)."""
    found = []
    if not _close(actual.max_age, spec.max_age):
        found.append(f"max_age is {actual.max_age}s, not {spec.max_age}s")
    if not _close(actual.duplicate_window, spec.duplicate_window):
        found.append(f"duplicate_window is {actual.duplicate_window}s, not {spec.duplicate_window}s")
    if _value(actual.storage) != _value(spec.storage):
        found.append(f"storage is {_value(actual.storage)!r}, not {_value(spec.storage)!r}")
    if (actual.num_replicas or 1) != spec.replicas:
        found.append(f"replicas is {actual.num_replicas or 1}, not {spec.replicas}")
    return found
