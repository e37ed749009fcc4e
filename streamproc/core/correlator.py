"""The correlator: a sans-I/O state machine that turns worker chunks into ordered results.

Chunks and the current time go in; decisions come out (:class:`~streamproc.wire.Result` to
publish, :class:`Settle` for input that contributes to nothing, :class:`Notice` for logs).
It never reads a clock, never blocks and never raises on bad input, which is what lets the
property tests drive it with arbitrary interleavings at thousands of cases per second.

Per request it keeps a reorder buffer for the output leg (``agg`` or ``decode``) and the
prefill leg's chunks. Results leave strictly in seq order. A decode chunk the codec says needs
prefill data waits for the prefill leg, at most ``prefill_timeout``; then the codec applies its
omission policy. Every bound (in-flight requests, buffered chunks, remembered finished ids)
is explicit in :class:`CorrelatorConfig`.

:meth:`Correlator.migrate` seals a request's current attempt (seal-then-resume): the next attempt's
chunks continue the result seqs, and the codec's migration session stitches their bodies.
"""

from __future__ import annotations

import functools
from array import array
from collections import OrderedDict
from typing import Annotated, Callable, Iterable, Iterator, Sequence

import msgspec
from msgspec import Meta

from . import defaults
from .codec import Codec, Emitted, ErrorKind, JoinSession, MigrationSession, OmissionReason
from .errors import MAX_ERROR_TEXT, ContractError, MigrationRefused, UnknownFormat, cut_error_text, shown
from .latency import LatencyHistogram
from .wire import decode_migrate_reply, encode_control, encode_seal_record, max_seals
from .events import (  # noqa: F401  (Settle, Notice, Decision also re-exported under their old path)
    Chunk,
    Decision,
    MigrateError,
    MigrateErrorCode,
    MigrateReply,
    Notice,
    Result,
    Role,
    Sealed,
    SealRecord,
    Settle,
    Verdict,
)


# Enum member lookups cost ~70 ns each on CPython 3.11; the hot path uses module constants.
_AGG, _PREFILL, _DECODE = Role.AGG, Role.PREFILL, Role.DECODE
_PASSTHROUGH, _JOINED = Verdict.PASSTHROUGH, Verdict.JOINED
_OMISSION_REASONS = frozenset(r.value for r in OmissionReason)
OMISSIONS_READ_BYTES = 256 << 10  # omitted result bodies read for the count by reason, at most this long (~0.12 ms to parse here)
_STITCHED = Verdict.STITCHED
# The Notice (log event) of a chunk dropped because its request's results can never be stored
# (Correlator.unstorable); counted in Stats.unstorable.
UNSTORABLE_CHUNK = "unstorable_chunk"


class Work:
    """A decision: run :meth:`run` off the event loop (a worker thread), then hand this object to
    :meth:`Correlator.finish`. The join of a P/D chunk that carries sequence data (decompression,
    row splicing) and a resumed attempt's stitch (which may inflate and splice rows too) are the
    per-message work whose cost a client controls; the request waits meanwhile (its later chunks
    queue), every other request goes on. The correlator stays pure: it never starts a thread, it
    only says which call may run elsewhere and takes the outcome back in order."""

    __slots__ = ("request_id", "_job", "outcome", "cpu", "decodes", "reserved")

    def __init__(self, request_id: str, job: Callable[[], tuple[bytes, Verdict]],
                 decodes: int | None = None) -> None:
        self.request_id = request_id
        self._job = job
        self.outcome: tuple[bytes, Verdict] | Exception | None = None
        self.cpu = 0.0  # seconds of CPU the job took, when run() was given a clock
        self.decodes = decodes  # the session's decodes count when the join was handed out; None: charged
        # Bytes of the byte budget held for what the job decodes (JoinSession.join_bytes), charged
        # from hand-out until Correlator.finish, whatever becomes of the request meanwhile.
        self.reserved = 0

    def run(self, cpu_clock: Callable[[], float] | None = None) -> None:
        """Called once, in any thread; never raises (the outcome carries the exception).
        ``cpu_clock``: the shell's CPU clock for joins (``streamproc.nats.input.join_cpu_clock``:
        the join's thread and the codec's helper threads), charged to the request's decode-time
        budget by :meth:`Correlator.finish` when the join decoded sequence data."""
        start = cpu_clock() if cpu_clock is not None else 0.0
        try:
            self.outcome = self._job()
        except Exception as exc:  # noqa: BLE001  (a codec failure ends this request as internal)
            self.outcome = exc
        if cpu_clock is not None:
            self.cpu = max(0.0, cpu_clock() - start)  # two clocks read apart: never below 0


def _stitch(migration: MigrationSession, body: bytes, verdict: Verdict, final: bool) -> tuple[bytes, Verdict]:
    """A resumed attempt's body (``verdict``: what its join did) continued from the earlier attempts.
    The stitch reads the joined body, the join's omission markers included, and may drop one (a
    value the client was sent is known again), so a body it rewrites has its verdict: ``omitted``
    exactly when a marker is left (``MigrationSession.stitch``)."""
    stitched = migration.stitch(body, final)
    if stitched is None:
        return body, verdict
    return stitched


def _stitched(migration: MigrationSession, join: Callable[[bytes, bool], tuple[bytes, Verdict]] | None,
              body: bytes, final: bool) -> tuple[bytes, Verdict]:
    """A resumed attempt's chunk as the loop would publish it: joined (``join``; None for an
    aggregated chunk), then stitched. Run as one :class:`Work`, so a stitch that inflates rows
    (sglang-zstd) never runs on the event loop while offloading is on."""
    joined, verdict = join(body, final) if join is not None else (body, _PASSTHROUGH)
    return _stitch(migration, joined, verdict, final)


# Stands in for the running Work while a finished join's request is drained with others waiting:
# its next join, if any, is queued behind them instead of starting at once.
_TURN_OVER = Work("", lambda: (b"", Verdict.JOINED))


class CorrelatorConfig(msgspec.Struct, frozen=True):
    """The correlator's timeouts (seconds) and bounds; ``streamproc.config.Settings`` documents each."""

    prefill_timeout: float = defaults.PREFILL_TIMEOUT
    request_timeout: float = defaults.REQUEST_TIMEOUT
    finished_grace: float = defaults.FINISHED_GRACE
    max_inflight: int = defaults.MAX_INFLIGHT
    max_buffered_chunks: int = defaults.MAX_BUFFERED_CHUNKS
    max_finished: int = defaults.MAX_FINISHED
    # Bytes the finished ids may take (FINISHED_ENTRY_BYTES + the id's length each): long ids must
    # not buy memory outside every budget. Past either bound the oldest are forgotten first.
    max_finished_bytes: int = defaults.MAX_FINISHED_BYTES
    # At max_inflight, the request without progress for longest is ended to admit a new one if it
    # has been idle this long; else the new one is refused.
    shed_min_idle: float = defaults.SHED_MIN_IDLE
    # Published bodies kept (by reference) per request for a possible migration; past this the
    # codec folds them into its compact progress state and they are released.
    max_retained_bytes: int = defaults.MAX_RETAINED_BYTES
    # Bytes of chunk bodies one request may buffer (reorder buffer + prefill leg), and bytes of
    # buffered bodies plus decoded payloads kept by join sessions across all requests.
    max_buffered_bytes: int = defaults.MAX_BUFFERED_BYTES
    max_total_bytes: int = defaults.MAX_TOTAL_BYTES
    # CPU seconds the joins of one request that decode sequence data may take (measured around
    # offloaded joins, the codec's helper threads included); past it the request is ended, so
    # payloads that inflate cannot buy unbounded decode time. 0: no budget.
    max_decode_cpu: float = defaults.MAX_DECODE_CPU
    # Migrations one request may have: the migrate past it is refused and ends the request.
    max_migrations: int = defaults.MAX_MIGRATIONS


class Stats(msgspec.Struct, gc=False):
    """The correlator's counters: each is `streamproc_<name>_total` on /metrics, its description the HELP."""

    chunks: Annotated[int, Meta(description="chunks received (every role)")] = 0
    passthrough: Annotated[int, Meta(description="aggregated results passed through byte for byte")] = 0
    joined: Annotated[int, Meta(description="P/D results joined from both legs")] = 0
    omitted: Annotated[int, Meta(description="P/D results with a field omitted and its reason")] = 0
    errors: Annotated[int, Meta(description="error results published (every kind)")] = 0
    duplicates: Annotated[int, Meta(description="chunks whose seq was already received (a redelivery or a "
                                                "worker's repeat), dropped")] = 0
    late: Annotated[int, Meta(description="chunks of a request that had already finished, dropped")] = 0
    unstorable: Annotated[int, Meta(description="chunks of a request ended because the results stream refuses "
                                                "its results for good (its subject full), dropped and "
                                                "acknowledged on arrival")] = 0
    rejected: Annotated[int, Meta(description="chunks that broke the contract (invalid_chunk): their request"
                                              " ended with an error result")] = 0
    timeouts: Annotated[int, Meta(description="requests ended because no chunk came for --request-timeout")] = 0
    prefill_timeouts: Annotated[int, Meta(description="P/D requests whose prefill leg did not come within "
                                                      "--prefill-timeout (the join field omitted)")] = 0
    overloaded: Annotated[int, Meta(description="requests refused or ended as overloaded (a bound on "
                                                "requests or bytes was full)")] = 0
    stitched: Annotated[int, Meta(description="results of a migrated request's later attempt, continuing its"
                                              " stream")] = 0
    migrations: Annotated[int, Meta(description="migrates honoured: the request's attempt sealed and "
                                                "answered")] = 0
    migrations_refused: Annotated[int, Meta(description="migrates refused (the request unknown, finished, or"
                                                        " its state too large to seal)")] = 0
    sealed: Annotated[int, Meta(description="chunks of a sealed (migrated-away) attempt, dropped")] = 0
    over_budget: Annotated[int, Meta(description="requests ended because they passed max_buffered_bytes or "
                                                 "max_total_bytes")] = 0
    internal_errors: Annotated[int, Meta(description="messages whose handling raised (a bug): their request "
                                                     "ended as internal")] = 0
    shed: Annotated[int, Meta(description="requests ended (overloaded) because their partition held too many"
                                          " unacknowledged chunks")] = 0
    over_cpu: Annotated[int, Meta(description="requests ended because their joins used more than "
                                              "max_decode_cpu seconds of CPU")] = 0
    evicted: Annotated[int, Meta(description="idle requests ended (overloaded) to admit a new one at "
                                             "max_inflight")] = 0

    @property
    def results(self) -> int:
        return self.passthrough + self.joined + self.omitted + self.stitched + self.errors


CodecResolver = Callable[[str], Codec]


class _Request:
    """Mutable per-request state; slots keep the hot path allocation-light."""

    __slots__ = (
        "request_id", "codec", "format", "session", "kind", "next_seq", "pending", "final_seq",
        "prefill", "prefill_final", "prefill_state", "waiting_since", "held", "traceparent", "last",
        "attempt", "offset", "retained", "retain", "budget", "migration", "refusal",
        "buffered", "absorbed", "decoded", "work", "outcome", "cpu", "missing",
        "last_seal", "join_timed", "progress", "omitted", "repeats", "repeated", "seals",
    )

    def __init__(self, request_id: str, codec: Codec, format: str, retain: int) -> None:
        self.request_id = request_id
        self.codec = codec
        self.format = format
        self.session: JoinSession | None = None
        self.kind: Role | None = None  # AGG or DECODE: which leg carries the results
        self.next_seq = 0
        self.pending: dict[int, Chunk] = {}
        self.final_seq: int | None = None
        self.prefill: dict[int, Chunk] = {}
        self.prefill_final: int | None = None
        self.prefill_state = _PREFILL_OPEN
        self.waiting_since: float | None = None
        self.join_timed = False  # the next result's prefill wait is observed (join_wait)
        self.held: list = []  # tokens of chunks whose results are not stored yet (prefill leg, its repeats)
        # Tokens of repeats of a buffered output chunk, by its result seq: settled by that result.
        self.repeated: dict[int, list] | None = None
        self.repeats = 0  # tokens in held and repeated that repeat a held chunk (maybe its stored message: _held_count)
        self.traceparent: str | None = None
        self.last = 0.0  # time of the last accepted chunk (request timeout)
        self.attempt = 0  # chunks of earlier attempts are sealed; later ones were never granted
        self.offset = 0  # result seq of the current attempt's chunk seq 0
        self.retained: list[bytes] = []  # bodies published in this attempt, not yet absorbed
        self.retain = retain  # max_retained_bytes
        self.budget = retain  # bytes that may still be retained before the codec folds them
        self.migration: MigrationSession | None = None
        self.refusal: str | None = None  # why this request can never migrate, once known
        # Bytes charged to the global budget: bodies in pending/prefill, the absorbed prefill leg
        # (its parsed form lives in the session), decoded payloads the session keeps.
        self.buffered = 0
        self.absorbed = 0
        self.decoded = 0
        self.progress = 0  # the migration session's progress state (progress_bytes), also charged
        self.omitted: set[str] | None = None  # omission reasons counted for it (Correlator._count_omissions)
        self.work: Work | None = None  # a join running off the loop for the chunk at next_seq
        self.outcome: tuple[bytes, Verdict] | Exception | None = None  # its result, not yet applied
        self.cpu = 0.0  # CPU seconds its offloaded joins took (max_decode_cpu)
        # Leading results whose bodies are not retained here (published by another instance, or
        # released at the retention bound before they were read back): a migrate needs them first.
        self.missing = 0
        # (MigrateRequest.id, encoded reply) of the last seal, for a retry whose reply was lost. Encoded
        # (about 6 bytes a token id, not a list of ints at 36) and charged as progress state.
        self.last_seal: tuple[str, bytes] | None = None
        # The result seq where each later attempt starts (the seal record's ``seals``): measured with the
        # record at a migrate. None until the first seal (no list per request that never moves). An
        # array('q'), SEAL_BYTES a seal, charged as progress state (_count_progress).
        self.seals: array | None = None


_PREFILL_OPEN, _PREFILL_DONE = 0, 1
_REFUSED = "migration refused: "  # a migration_refused error result's text, before the reason
_ENTRY = defaults.FINISHED_ENTRY_BYTES
_SEAL = defaults.SEAL_BYTES


def is_retry(sealed: Sealed, expected_attempt: int | None, attempt: int | None, next_seq: int | None) -> bool:
    """Whether a migrate naming the same ``id`` as the seal that answered ``sealed`` can be a retry
    of it (its reply lost), so gets ``sealed`` again. A retry carries the same ``expected_attempt``,
    and nobody knew the granted attempt, so the request (``attempt``, ``next_seq``: its state here,
    None when unknown) is still where the seal left it. Anything else is another migrate that
    reuses the id: answered with the stale seal it would seal nothing, and the frontend would
    resume from tokens the client is past while the attempt it gave up stays live."""
    if expected_attempt is not None and expected_attempt != sealed.attempt - 1:
        return False
    if attempt is not None and attempt != sealed.attempt:
        return False
    return next_seq is None or next_seq == sealed.result_seq


def _sealed_reply(req: _Request, emitted: Emitted, attempt: int) -> Sealed:
    """The ``Sealed`` reply granting ``attempt`` after ``emitted`` (measured before the seal, sent by it)."""
    return Sealed(req.request_id, attempt, len(emitted.token_ids), list(emitted.token_ids), req.next_seq,
                  req.format, dict(emitted.state))


def _held_count(req: _Request, stored: Callable[[object], int] | None) -> int:
    """The input tokens ``req`` holds; with ``stored``, the stored messages they deliver (only held
    repeats can deliver one twice: a buffered chunk's seq is pending once, a prefill seq held once).
    ``stored`` is asked only of a request holding a repeat: on a timer, once per held token it was
    7x the cost of the count (10,000 held prefill legs: 15 ms a call, 2 ms without)."""
    n = len(req.held) + len(req.pending)
    if not req.repeats:
        return n
    repeated = req.repeated
    if stored is None:
        return n + (sum(len(tokens) for tokens in repeated.values()) if repeated else 0)
    messages = {stored(t) for t in req.held} | {stored(c.token) for c in req.pending.values()}
    if repeated:
        for tokens in repeated.values():
            messages.update(stored(t) for t in tokens)
    return len(messages)


class Correlator:
    def __init__(
        self,
        resolve: CodecResolver,
        default_format: str,
        config: CorrelatorConfig | None = None,
    ) -> None:
        self._resolve = resolve
        self.default_format = default_format
        self._default_codec = resolve(default_format)
        self.config = config or CorrelatorConfig()
        self.stats = Stats()
        # For metrics, read at scrape time: error results by kind, and how long decode results
        # waited for their prefill leg (0 when it was already there; observed when the wait ends).
        self.error_kinds: dict[str, int] = {}
        # Requests with a field omitted, by reason (an OmissionReason value, else "other"): read from a
        # request's first omitted result and its final one, so a stream omitted chunk by chunk costs
        # two reads, not one per chunk.
        self.omission_reasons: dict[str, int] = {}
        self.join_wait = LatencyHistogram()
        # The codec join's own CPU seconds, wherever it ran: inline (timed with ``join_clock``, the
        # shell's per-thread CPU clock; None: inline joins are not timed) or off the loop (Work.cpu).
        self.join_seconds = LatencyHistogram()
        self.join_clock: Callable[[], float] | None = None
        # Insertion order == deadline order because each timeout is one constant duration.
        self._active: OrderedDict[str, _Request] = OrderedDict()
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._finished: OrderedDict[str, float] = OrderedDict()
        # Of those, the ones ended by unstorable(): their late chunks are counted apart. An id leaves
        # it when it leaves _finished, so it is bounded as _finished is.
        self._unstorable: set[str] = set()
        self._grace = self.config.finished_grace
        self._max_finished = self.config.max_finished
        self._max_finished_bytes = self.config.max_finished_bytes
        self.finished_bytes = 0  # the finished ids' charge (FINISHED_ENTRY_BYTES + len(id) each)
        # Error results of other requests ended to make room (the byte budget's biggest holders),
        # decided deep inside one request's handling; the entry points put them first in their output.
        self._aside: list[Decision] = []
        self._max_retained = self.config.max_retained_bytes
        # Bodies kept for a possible migration, all requests (each request's retain - budget): past
        # a quarter of max_total_bytes a request's bodies are folded into its progress state (which
        # is charged) at once instead of at max_retained_bytes. They were charged nowhere: 1,200
        # streamed requests of one ~200 KB chunk each held 240 MB outside every budget, up to
        # max_inflight x max_retained_bytes (2.5 GiB at the defaults; tests/test_durable_attack_review.py).
        self.retained_total = 0
        self._retained_cap = max(self.config.max_total_bytes // 4, self._max_retained)
        self.charged_bytes = 0  # sum of every active request's buffered + absorbed + decoded bytes
        # When set (core mode), joins of chunks that need the prefill leg are returned as Work
        # decisions instead of running inline. Off by default: an input must understand Work.
        self.offload_joins = False
        # One Work outstanding at a time: its decode budget is then exact (the previous join's
        # decoded rows are charged before the next is handed a budget). Requests whose join would
        # be next wait here, in order; a request whose join finished queues behind them for its
        # next one (round robin), so buffered joins of one request never starve another's.
        self._working: Work | None = None
        self._queued: OrderedDict[str, _Request] = OrderedDict()

    # ------------------------------------------------------------------ inputs

    def receive(self, chunk: Chunk, now: float) -> list[Decision]:
        stats = self.stats
        stats.chunks += 1
        rid = chunk.request_id
        active = self._active
        req = active.get(rid)
        if req is None:
            finished = self._finished
            if rid in finished:
                return self._late(chunk)
            if chunk.attempt != 0:
                return self._reject_new(chunk, f"attempt {chunk.attempt} of a request this processor has no "
                                               "state for (attempts above 0 only follow a migration)", now)
            if chunk.role is _AGG and chunk.final and chunk.seq == 0:
                # Unary aggregated response: the common case gets no per-request state at all.
                # (Aggregated bodies never reach a codec, so even an unknown format passes through.)
                finished[rid] = now + self._grace
                self.finished_bytes += _ENTRY + len(rid)
                if len(finished) > self._max_finished or self.finished_bytes > self._max_finished_bytes:
                    self._trim_finished()
                stats.passthrough += 1
                return [Result(rid, 0, chunk.body, True, _PASSTHROUGH, None, chunk.traceparent,
                               (chunk.token,), chunk.format)]
            if len(active) >= self.config.max_inflight:
                evicted = self._evict_idle(now)
                if evicted is None:
                    return self._overloaded(chunk, now)
                stats.chunks -= 1
                return evicted + self.receive(chunk, now)  # once: there is room now
            try:
                codec = self._codec_for(chunk.format)
            except UnknownFormat as exc:
                return self._reject_new(chunk, str(exc), now, ErrorKind.UNKNOWN_FORMAT)
            req = _Request(rid, codec, chunk.format or self.default_format, self._max_retained)
            req.traceparent = chunk.traceparent
            req.last = now
            active[rid] = req
        elif chunk.attempt != req.attempt:
            return self._other_attempt(req, chunk, now)
        # req.last (the request timeout) moves only for a chunk that is accepted: a duplicate or a
        # replay is no progress, so re-sending one cannot hold a request open forever.

        if chunk.format is not None and chunk.format != req.format:
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"chunk format {shown(chunk.format)} differs from the request's {req.format!r}",
                              now, extra=(chunk.token,))
        if chunk.role is _PREFILL:
            out = self._receive_prefill(req, chunk, now)
        else:
            out = self._receive_output(req, chunk, now)
        if self._aside:
            out = self._take_aside(out)
        return out

    def receive_agg(self, rid: str, seq: int, final: bool, body: bytes, traceparent: str | None,
                    now: float) -> bool:
        """:meth:`receive` of an attempt-0 aggregated chunk without a format, for its common cases
        only, with no Chunk, Result or list built (the fused passthrough path,
        :mod:`streamproc.core.passthrough`).

        True: handled exactly as ``receive`` would, and its one decision is the passthrough result
        ``(rid, seq, body, final, traceparent)`` (core mode settles nothing, so no tokens are kept).
        False: nothing was changed; call ``receive`` with the Chunk.
        """
        active = self._active
        req = active.get(rid)
        stats = self.stats
        if req is None:
            finished = self._finished
            if seq != 0 or rid in finished:
                return False
            if final:  # unary: receive()'s branch for a new final seq-0 aggregated chunk
                finished[rid] = now + self._grace
                self.finished_bytes += _ENTRY + len(rid)
                if len(finished) > self._max_finished or self.finished_bytes > self._max_finished_bytes:
                    self._trim_finished()
                stats.chunks += 1
                stats.passthrough += 1
                return True
            if (len(active) >= self.config.max_inflight or len(body) > self._max_retained
                    or self.retained_total + len(body) > self._retained_cap):
                return False  # (a body past the retention bound is folded: receive() charges that)
            # the first chunk of a streamed response: receive()'s new-request branch, then in order
            req = _Request(rid, self._default_codec, self.default_format, self._max_retained)
            req.traceparent = traceparent
            req.kind = _AGG
            active[rid] = req
        # _receive_output()'s in-order branch (held tokens only exist in durable mode; leave them to it)
        elif (req.kind is not _AGG or req.attempt or seq != req.next_seq or req.pending
                or req.final_seq is not None or req.held
                or (not final and (len(body) > req.budget or self.retained_total + len(body) > self._retained_cap))):
            return False  # (a body past the retention bound is folded: receive() charges that)
        stats.chunks += 1
        req.last = now
        active.move_to_end(rid)
        req.next_seq = seq + 1
        stats.passthrough += 1
        if final:
            self._forget(req, now)
        else:  # within req.budget and the total (above): no fold here
            req.retained.append(body)
            req.budget -= len(body)
            self.retained_total += len(body)
        return True

    def reject(self, request_id: str, reason: str, now: float, token: object = None,
               kind: ErrorKind = ErrorKind.INVALID_CHUNK, attempt: int | None = None) -> list[Decision]:
        """A message for ``request_id`` broke the contract before it became a Chunk (or, ``kind``
        ``internal``, handling it raised): end the request with a final error result. Unless it
        names (``attempt``, when readable) an attempt that was sealed: dropped as ``sealed`` like any
        chunk of it, since the worker it came from was given up and may publish anything."""
        req = self._active.get(request_id)
        if req is not None and attempt is not None and attempt < req.attempt:
            self.stats.sealed += 1
            return [Settle((token,)), Notice(request_id, "sealed_chunk",
                                             f"a malformed chunk of sealed attempt {attempt} (now {req.attempt}): "
                                             f"{reason}")]
        if kind is ErrorKind.INVALID_CHUNK:
            self.stats.rejected += 1
        else:
            self.stats.internal_errors += 1
        tokens = (token,) if token is not None else ()
        if request_id in self._finished:
            self.stats.late += 1
            return [Settle(tokens), Notice(request_id, "rejected_after_finish", reason)]
        req = self._active.get(request_id)
        if req is None:
            req = _Request(request_id, self._default_codec, self.default_format, self._max_retained)
            self._active[request_id] = req
        return self._fail(req, kind, reason, now, extra=tokens)

    def unpublishable(self, request_id: str, seq: int, reason: str, now: float,
                      format: str | None = None, settles: tuple = ()) -> list[Decision]:
        """Result ``seq`` of ``request_id`` can never be published (with its header block it is larger
        than the NATS server accepts): the request ends with an ``internal`` error result at that seq
        instead, so its client gets an error in its place rather than waiting for its timeout. An
        active request is released; one already finished (that result was its final one) stays
        finished. The error is in the request's codec's native shape: an active request's own, else
        that of ``format`` (the chunk's ``Streamproc-Format``; a finished request keeps no codec),
        else the default one. ``settles``: input tokens the error result acknowledges once stored
        besides what the request holds (durable mode: those of the results it replaces)."""
        req = self._active.get(request_id)
        if req is not None:
            return self._fail(req, ErrorKind.INTERNAL, reason, now, extra=settles, seq=seq)
        try:
            codec = self._codec_for(format)
        except UnknownFormat:
            codec = self._default_codec
        req = _Request(request_id, codec, format or self.default_format, self._max_retained)
        return self._fail(req, ErrorKind.INTERNAL, reason, now, extra=settles, seq=seq)  # and remembered as finished

    def migrate(self, request_id: str, now: float, *, expected_attempt: int | None = None,
                refuse: str | None = None, id: str | None = None,
                max_seal_bytes: int | None = None,
                max_record_bytes: int | None = None) -> tuple[MigrateReply, list[Decision]]:
        """Seal the request's current attempt and grant the next one (seal-then-resume).

        The reply says exactly what the client has been sent: the results already published, never
        chunks still buffered or waiting for prefill (those are dropped and settled; the resumed
        attempt produces them again). Later chunks of the sealed attempt are dropped as ``sealed``.
        A request whose state cannot move (``refuse``, or the codec's verdict on its bodies) is
        ended with a final ``migration_refused`` error result, so the client is not left waiting.
        A retry of the last seal (same ``id``, its reply lost) gets that seal's reply again.
        ``max_seal_bytes``: the most the encoded reply may take (one NATS message); ``max_record_bytes``
        (durable mode): the most the seal record holding it may take, measured exactly as the shell
        writes it (:func:`~.wire.encode_seal_record`: this seal's reply, every seal's result seq, ``id``).
        A seal past either is refused before anything is sealed (else, sealed, its reply could not be
        sent, nor its record stored, and no retry would ever get through).
        """
        req = self._active.get(request_id)
        if req is not None and id is not None and req.last_seal is not None and req.last_seal[0] == id:
            again = decode_migrate_reply(req.last_seal[1])
            if isinstance(again, Sealed) and is_retry(again, expected_attempt, req.attempt, req.next_seq):
                return again, []
            # The same id for another migrate (a frontend reusing ids): decided as a new one below.
        if req is None:
            if request_id in self._finished:
                return MigrateError(request_id, MigrateErrorCode.FINISHED,
                                    "the request's final result is already published; nothing to resume"), []
            if refuse is None or expected_attempt not in (None, 0):
                return MigrateError(request_id, MigrateErrorCode.UNKNOWN_REQUEST,
                                    "no chunk of this request has reached this processor, so nothing was sent to "
                                    "the client (or it finished longer than finished_grace ago)"), []
            # Its worker was lost before anything reached us, and it cannot move: nothing here would
            # ever end the client's wait (no state, so no request timeout either). It ends now, with
            # the refusal as its one result, and is remembered as finished (the lost worker's late
            # chunks are dropped, not taken for a new request).
            req = _Request(request_id, self._default_codec, self.default_format, self._max_retained)
            self._active[request_id] = req
            self.stats.migrations_refused += 1
            decisions = self._fail(req, ErrorKind.MIGRATION_REFUSED, f"{_REFUSED}{refuse}", now)
            return MigrateError(request_id, MigrateErrorCode.REFUSED, refuse, 0), decisions
        if expected_attempt is not None and expected_attempt != req.attempt:
            return MigrateError(request_id, MigrateErrorCode.ATTEMPT_MISMATCH,
                                f"expected attempt {expected_attempt}, but the current attempt is {req.attempt}",
                                req.attempt), []
        if req.missing and refuse is None:
            return MigrateError(request_id, MigrateErrorCode.UNAVAILABLE,
                                f"the bodies of results 0..{req.missing - 1} were published by another instance "
                                "and are not read back yet", req.attempt), []
        over = False  # refused by a byte budget (counted in over_budget too)
        try:
            if refuse is not None:
                raise MigrationRefused(refuse)
            if req.attempt >= self.config.max_migrations:
                raise MigrationRefused(f"it was migrated {req.attempt} times already (max_migrations "
                                       f"{self.config.max_migrations})")
            emitted = self._progress(req).seal()
            encoded = None  # the reply's bytes, measured before the seal: the seal sends the same reply
            if max_seal_bytes is not None or max_record_bytes is not None:
                granted = _sealed_reply(req, emitted, req.attempt + 1)
                encoded = encode_control(granted)
                size = len(encoded)
                if max_seal_bytes is not None and size > max_seal_bytes:
                    raise MigrationRefused(
                        f"its sealed state ({len(emitted.token_ids)} emitted tokens: {size} bytes) does not fit one "
                        f"NATS message ({max(0, max_seal_bytes)} bytes with max_payload); the request cannot move")
                if max_record_bytes is not None:
                    record = len(encode_seal_record(SealRecord([*(req.seals or ()), req.next_seq], granted, id)))
                    if record > max_record_bytes:
                        raise MigrationRefused(
                            f"its seal record ({req.attempt + 1} seals, {len(emitted.token_ids)} emitted tokens: "
                            f"{record} bytes) does not fit one NATS message ({max(0, max_record_bytes)} bytes: "
                            f"max_payload less the record write's headers); the request cannot move")
            over = True  # last: nobody is ended to make room for a seal refused for another reason
            self._room_for_seal(req, now, max_record_bytes is not None)  # raises MigrationRefused
            over = False
        except MigrationRefused as exc:
            reason = exc.reason
        except Exception as exc:  # a codec bug costs this request, not the processor
            over = False
            reason = f"codec {req.codec.name!r} failed: {type(exc).__name__}: {exc}"
        else:
            reply, decisions = self._seal(req, emitted, now)
            if id is not None:
                req.last_seal = (id, encoded if encoded is not None else encode_control(reply))
                self._count_progress(req)
            if self._aside:  # requests ended to make room for the seal (_room_for_seal)
                decisions = self._take_aside(decisions)
            return reply, decisions
        # A codec plugin's exception (or a refuse) chooses the reason's length: the reply is cut where it is
        # encoded (wire.encode_control), the error result's text by _fail, each once (errors.MAX_ERROR_TEXT).
        self.stats.migrations_refused += 1
        if over:
            self.stats.over_budget += 1
        attempt = req.attempt
        decisions = self._fail(req, ErrorKind.MIGRATION_REFUSED, f"{_REFUSED}{reason}", now)
        if self._aside:
            decisions = self._take_aside(decisions)
        return MigrateError(request_id, MigrateErrorCode.REFUSED, reason, attempt), decisions

    def needs_published(self, request_id: str, next_seq: int, final: bool, format: str | None = None, *,
                        role: Role | None = None) -> bool:
        """Whether :meth:`resume` of a request without a seal record wants its stored bodies
        ``[0, next_seq)`` as ``history``: its codec's sessions count across the published chunks
        (:attr:`Codec.needs_published`), and something is left to join. Pure; False for a request
        already held here, so a codec that does not count costs a take-over no read. ``role``: that of
        the chunk the take-over is for, when known; an aggregated one's bodies never reach a codec, so
        no session counts them (a request is agg or P/D, never both: a mix ends it as invalid)."""
        if (request_id in self._active or request_id in self._finished or final or next_seq <= 0
                or role is _AGG):
            return False
        return self._resumed_codec(format)[0].needs_published

    def _resumed_codec(self, format: str | None) -> tuple[Codec, str]:
        """The codec (and its name) a request resumed with ``format`` gets: the default one when the
        format is unknown or broken, and :meth:`receive` ends the request over the chunk itself."""
        if format is not None and format != self.default_format:
            try:
                return self._resolve(format), format
            except Exception:
                pass
        return self._default_codec, self.default_format

    def resume(self, request_id: str, next_seq: int, final: bool, now: float,
               format: str | None = None, *, seals: Sequence[int] = (),
               history: Sequence[bytes] | None = None, lost: str | None = None) -> None:
        """Adopt a request whose results ``[0, next_seq)`` are already stored (durable-mode recovery).

        The shell calls this, before feeding a chunk, for a request this correlator does not know
        but another (dead) instance may have served: results already published are never
        published again, and their input chunks become duplicates to settle. ``final`` says the
        stored results already end the request. ``format`` is the chunk's ``Streamproc-Format``
        (the request's codec), so the chunk is not taken for one of another format.

        ``seals`` are the result seqs where the request's later attempts start (its seal record),
        so the current attempt is ``len(seals)``. ``history`` is the stored result bodies
        ``[0, next_seq)``, required when there are seals: replaying them through the format's
        migration session, sealing at each seal point, rebuilds exactly the session the dead
        instance had (``absorb`` and ``seal`` depend on the published bodies alone), so the current
        attempt is stitched as it would have been. Without ``history`` the bodies are read back
        before a migrate (:meth:`missing`, :meth:`restore`). Without seals, ``history`` is read back
        when :meth:`needs_published` says so (the join session counts them); without them such a
        session is told they are lost (``lost``: why), and omits what depends on them
        (:meth:`JoinSession.published_lost`).
        """
        if request_id in self._active or request_id in self._finished:
            return
        if final:
            self._remember_finished(request_id, now)
            return
        if next_seq <= 0 and not seals:
            return
        if len(seals) * _SEAL > self.config.max_buffered_bytes:
            # Before anything is held: the seal list is charged as progress state (SEAL_BYTES a seal),
            # and a record past the per-request bound is no honest instance's (its migrate refuses
            # the seal first). The shell's read bounds the list before it is built (wire.max_seals).
            raise ValueError(f"a seal record of {len(seals)} seals ({len(seals) * _SEAL} bytes held) passes "
                             f"the per-request bound of {self.config.max_buffered_bytes} bytes "
                             "(max_buffered_bytes)")
        codec, name = self._resumed_codec(format)
        req = _Request(request_id, codec, name, self._max_retained)
        req.next_seq = next_seq
        req.last = now
        self._active[request_id] = req
        if seals:
            if history is None or len(history) != next_seq or any(not 0 <= s <= next_seq for s in seals):
                raise ValueError("resuming a migrated request needs its stored bodies [0, next_seq) and seals within them")
            req.attempt = len(seals)
            req.seals = array("q", seals)
            req.offset = seals[-1]
            try:
                session = req.migration = codec.open_migration()
                start = 0
                for point in seals:
                    session.absorb(history[start:point])
                    session.seal()
                    start = point
            except MigrationRefused as exc:  # cannot happen for bodies a seal accepted, unless the codec changed
                req.refusal = exc.reason
                req.migration = None
                return
            except Exception as exc:
                req.refusal = f"codec {codec.name!r} failed: {type(exc).__name__}: {exc}"
                req.migration = None
                return
            self._count_progress(req)
            self._retain(req, history[start:])
            self._adopt_session(req, history[start:])
        elif history is not None:
            self._retain(req, history)
            self._adopt_session(req, history)
        else:
            req.missing = next_seq
            if codec.needs_published:  # not read back: the session must not count on part of the attempt
                join = self._session(req)
                try:
                    join.published_lost(next_seq, lost or "the stored results were not read back")
                except Exception:  # a codec bug: the session starts without knowing, as before
                    req.session = None

    def end_adopted(self, request_id: str, next_seq: int, attempt: int, now: float, reason: str,
                    format: str | None = None) -> list[Decision]:
        """Adopt a migrated request whose results ``[0, next_seq)`` are stored, at ``attempt``, and end
        it at once with a final ``migration_refused`` error result at ``next_seq``: its migration
        session cannot be rebuilt here (its stored bodies cannot be read back, e.g. past the take-over's
        bound), and a stitch on part of them would be made from stale data. Nothing for a request known
        here (active or finished). Remembered as finished: its later chunks are settled as late."""
        if request_id in self._active or request_id in self._finished:
            return []
        codec, name = self._resumed_codec(format)
        req = _Request(request_id, codec, name, self._max_retained)
        req.next_seq = next_seq
        req.attempt = attempt
        req.last = now
        self._active[request_id] = req
        self.stats.migrations_refused += 1
        return self._fail(req, ErrorKind.MIGRATION_REFUSED, f"{_REFUSED}{reason}", now)

    def _adopt_session(self, req: _Request, bodies: Sequence[bytes]) -> None:
        """Hand the join session the current attempt's published bodies (:meth:`JoinSession.published`):
        their chunks were settled by the dead instance and are never redelivered, so a session counting
        across chunks would otherwise decide the rest of the attempt on part of it."""
        if not bodies:
            return
        session = self._session(req)
        try:
            session.published(bodies)
        except Exception:  # a codec bug costs the counts, not the adoption: the session starts without them
            req.session = None

    def missing(self, request_id: str) -> int:
        """How many leading result bodies of an active request must be read back before a migrate."""
        req = self._active.get(request_id)
        return req.missing if req is not None else 0

    def next_seq_of(self, request_id: str) -> int | None:
        """The next result seq of an active request (None when it is not active here)."""
        req = self._active.get(request_id)
        return req.next_seq if req is not None else None

    def attempt_of(self, request_id: str) -> int | None:
        """The current attempt of an active request (None when it is not active here)."""
        req = self._active.get(request_id)
        return req.attempt if req is not None else None

    def restore(self, request_id: str, history: Sequence[bytes]) -> bool:
        """Hand back the stored bodies of results ``[0, missing)``; False (nothing changes) when the
        request no longer misses exactly these (it ended, or more bodies were released meanwhile)."""
        req = self._active.get(request_id)
        if req is None or not req.missing or len(history) != req.missing:
            return False
        self.retained_total -= req.retain - req.budget
        later, req.retained, req.budget = req.retained, [], req.retain
        req.missing = 0
        self._retain(req, [*history, *later])
        return True

    def _retain(self, req: _Request, bodies: Iterable[bytes]) -> None:
        for body in bodies:
            req.retained.append(body)
            req.budget -= len(body)
            self.retained_total += len(body)
        if req.budget < 0 or self.retained_total > self._retained_cap:
            self._compact(req)

    def finish(self, work: Work, now: float) -> list[Decision]:
        """Apply the outcome of a :class:`Work` decision and go on with its request."""
        # The join's decoding is over: its reservation goes, and what the session keeps of it is
        # charged below (_check_decoded in _drain), or was freed with the request.
        self.charged_bytes -= work.reserved
        work.reserved = 0
        if self._working is work:
            self._working = None
        self.join_seconds.observe(work.cpu)  # it ran, whatever became of its request meanwhile
        out: list[Decision] = []
        req = self._active.get(work.request_id)
        if req is not None and req.work is work:  # else it ended or was sealed meanwhile: stale outcome
            req.work = None
            # Only joins that decoded sequence data are charged (the codec's count of decodes grew,
            # or it does not count): the budget bounds inflation. A join that only copies the
            # prefill leg's logprobs costs what a copy of one body costs, and is not charged. A Work
            # that stitches is handed out with decodes None (the stitch's decodes are not the
            # session's to count): always charged.
            decodes = req.session.decodes if req.session is not None else None
            if decodes is None or decodes != work.decodes:
                req.cpu += work.cpu
            budget = self.config.max_decode_cpu
            if budget and req.cpu > budget:
                self.stats.over_cpu += 1
                out.extend(self._fail(req, ErrorKind.OVERLOADED,
                                      f"decode time budget exhausted: the request's joins took {req.cpu:.2f} s of "
                                      f"CPU (max_decode_cpu {budget:g} s)", now))
            else:
                req.outcome = work.outcome
                if self._queued:  # round robin: its next join, if any, queues behind those waiting
                    self._working = _TURN_OVER
                    try:
                        out.extend(self._drain(req, now))
                    finally:
                        self._working = None
                else:
                    out.extend(self._drain(req, now))
        while self._working is None and self._queued:
            _, waiting = self._queued.popitem(last=False)
            if self._active.get(waiting.request_id) is waiting:
                out.extend(self._drain(waiting, now))
        return self._take_aside(out) if self._aside else out

    def knows(self, request_id: str) -> bool:
        """Whether the request is active or recently finished here (no recovery lookup needed)."""
        return request_id in self._active or request_id in self._finished

    def abandon(self, belongs: Callable[[str], bool], unstored: Iterable[str] = ()) -> list[object]:
        """Forget, without any result, the active requests ``belongs`` selects; return their input tokens.

        Durable mode calls this when a partition moves to another instance, which recovers those
        requests from the stored results and the redelivered chunks: nothing may be published for
        them here any more (a timeout here would end a request that lives on over there).
        ``unstored`` names finished requests whose final result the shell gave up before it was
        stored: they are forgotten too, so their redelivered chunks are recovered, not taken as late.
        """
        tokens: list[object] = []
        for rid in [rid for rid in self._active if belongs(rid)]:
            req = self._active.pop(rid)
            self._waiting.pop(rid, None)
            self._release(req)
            tokens.extend(req.held)  # the prefill leg's tokens are held from the moment it arrives
            tokens.extend(c.token for c in req.pending.values())
            tokens.extend(_repeated(req))
        for rid in unstored:
            if self._finished.pop(rid, None) is not None:
                self.finished_bytes -= _ENTRY + len(rid)
                self._unstorable.discard(rid)
        return [t for t in tokens if t is not None]

    def unstorable(self, request_id: str, now: float) -> list[object]:
        """End ``request_id`` for good, without a result: the results stream refuses its results and
        will refuse every later one (its subject is full), so not even an error result can be stored.
        Its state is freed and its held input tokens returned (the shell terminates them: redelivered,
        they could only be refused again); it is remembered as finished, and its chunks that still
        come are dropped and acknowledged on arrival as ``unstorable`` (not held behind the gap the
        refused result left until ``request_timeout``)."""
        tokens = self.abandon(lambda r: r == request_id)
        self._remember_finished(request_id, now)
        if request_id in self._finished:  # (a tiny max_finished may trim it at once)
            self._unstorable.add(request_id)
        return tokens

    def held_tokens(self, group: Callable[[str], int],
                    stored: Callable[[object], int] | None = None) -> dict[int, int]:
        """Input tokens held (prefill legs, buffered chunks, held duplicates) per ``group`` of request
        ids: a durable shell's partitions, whose unacknowledged deliveries the server bounds. Only
        requests that hold something are grouped, so a shell can call this on a timer. ``stored``
        names the stored message a token delivers: a redelivery held with the original counts once,
        as the server counts it (a consumer recreated under the processor delivers every held chunk
        again: counted twice, requests were shed below the limit)."""
        out: dict[int, int] = {}
        for rid, req in self._active.items():
            n = _held_count(req, stored)
            if n:
                g = group(rid)
                out[g] = out.get(g, 0) + n
        return out

    def shed(self, belongs: Callable[[str], bool], release: int, now: float, reason: str,
             stored: Callable[[object], int] | None = None) -> list[Decision]:
        """End the least recently progressing requests ``belongs`` selects that hold input tokens,
        until at least ``release`` tokens (counted as :meth:`held_tokens` counts them) are freed; each
        gets a final ``overloaded`` error result (whose storage settles its tokens). Held legs must
        never stall the rest of their partition: a request that keeps progressing moves to the back
        of the line, so the idle ones go first."""
        victims: list[_Request] = []
        freed = 0
        for rid, req in self._active.items():  # least recent progress first
            if freed >= release:
                break
            n = _held_count(req, stored)
            if n and belongs(rid):
                victims.append(req)
                freed += n
        out: list[Decision] = []
        for req in victims:
            self.stats.shed += 1
            out.extend(self._fail(req, ErrorKind.OVERLOADED, reason, now))
        return out

    def tick(self, now: float) -> list[Decision]:
        """Fire every timeout due at ``now``."""
        out: list[Decision] = []
        cfg = self.config
        while self._waiting:
            rid, req = next(iter(self._waiting.items()))
            if req.waiting_since is None or req.waiting_since + cfg.prefill_timeout > now:
                break
            del self._waiting[rid]
            self.stats.prefill_timeouts += 1
            out.append(Notice(rid, OmissionReason.PREFILL_TIMEOUT, f"no complete prefill leg after {cfg.prefill_timeout}s"))
            try:
                self._prefill_done(req, None, OmissionReason.PREFILL_TIMEOUT)
            except Exception as exc:
                out.extend(self._codec_failed(req, exc, now))
                continue
            out.extend(self._drain(req, now))
        while self._active:
            req = next(iter(self._active.values()))
            if req.last + cfg.request_timeout > now:
                break
            self.stats.timeouts += 1
            out.extend(self._fail(req, ErrorKind.TIMEOUT, f"no progress for {cfg.request_timeout}s", now))
        while self._finished:
            rid, expiry = next(iter(self._finished.items()))
            if expiry > now and len(self._finished) <= cfg.max_finished:
                break
            del self._finished[rid]
            self.finished_bytes -= _ENTRY + len(rid)
            self._unstorable.discard(rid)
        return self._take_aside(out) if self._aside else out

    def next_deadline(self) -> float | None:
        """The earliest time at which :meth:`tick` has something to do."""
        cfg = self.config
        times = []
        if self._waiting:
            req = next(iter(self._waiting.values()))
            if req.waiting_since is not None:
                times.append(req.waiting_since + cfg.prefill_timeout)
        if self._active:
            times.append(next(iter(self._active.values())).last + cfg.request_timeout)
        if self._finished:
            times.append(next(iter(self._finished.values())))
        return min(times) if times else None

    # ------------------------------------------------------------- inspection

    @property
    def inflight(self) -> int:
        return len(self._active)

    def buffered_bytes(self) -> int:
        """Bytes of chunk bodies held in reorder and prefill buffers (O(buffered chunks): for scrapes)."""
        return sum(len(c.body) for req in self._active.values()
                   for buf in (req.pending, req.prefill) for c in buf.values())

    def retained_bytes(self) -> int:
        """Bytes of published bodies kept by reference for a possible migration (for scrapes)."""
        return sum(len(b) for req in self._active.values() for b in req.retained)

    def is_finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def is_unstorable(self, request_id: str) -> bool:
        """Whether ``request_id`` was ended by :meth:`unstorable` and is still remembered."""
        return request_id in self._unstorable

    def unsettled(self) -> Iterator[object]:
        """Tokens of every input chunk still held (for extending ack deadlines)."""
        for req in self._active.values():
            yield from req.held
            for c in req.pending.values():
                if c.token is not None:
                    yield c.token
            if req.repeated:
                for tokens in req.repeated.values():
                    yield from tokens

    # --------------------------------------------------------------- internals

    def _codec_for(self, name: str | None) -> Codec:
        if name is None or name == self.default_format:
            return self._default_codec
        return self._resolve(name)

    def _late(self, chunk: Chunk) -> list[Decision]:
        if self._unstorable and chunk.request_id in self._unstorable:
            self.stats.unstorable += 1
            return [Settle((chunk.token,)), Notice(chunk.request_id, UNSTORABLE_CHUNK,
                                                    f"{chunk.role.value} seq {chunk.seq} of a request whose results "
                                                    "the results stream refuses for good (its subject is full)")]
        self.stats.late += 1
        return [Settle((chunk.token,)), Notice(chunk.request_id, "late_chunk",
                                                f"{chunk.role.value} seq {chunk.seq} after the request finished")]

    def _overloaded(self, chunk: Chunk, now: float) -> list[Decision]:
        self.stats.overloaded += 1
        self.stats.errors += 1
        self._count_error(ErrorKind.OVERLOADED)
        self._remember_finished(chunk.request_id, now)
        body = self._default_codec.error_body(
            f"processor overloaded: {self.config.max_inflight} requests in flight", ErrorKind.OVERLOADED)
        return [Result(chunk.request_id, 0, body, True, error=ErrorKind.OVERLOADED.value,
                       traceparent=chunk.traceparent, settles=(chunk.token,)),
                Notice(chunk.request_id, "overloaded", f"max_inflight={self.config.max_inflight}")]

    def _reject_new(self, chunk: Chunk, reason: str, now: float,
                    kind: ErrorKind = ErrorKind.INVALID_CHUNK) -> list[Decision]:
        self.stats.rejected += 1
        req = _Request(chunk.request_id, self._default_codec, self.default_format, self._max_retained)
        req.traceparent = chunk.traceparent
        req.last = now
        self._active[chunk.request_id] = req
        return self._fail(req, kind, reason, now, extra=(chunk.token,))

    def _receive_prefill(self, req: _Request, chunk: Chunk, now: float) -> list[Decision]:
        if req.kind is _AGG:
            return self._fail(req, ErrorKind.INVALID_CHUNK, "prefill chunk for an aggregated request", now,
                              extra=(chunk.token,))
        req.kind = _DECODE
        if req.prefill_final is not None and chunk.seq > req.prefill_final:  # also once the leg is done:
            # never seen, so no duplicate (and no repeat of a held chunk)
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"prefill seq {chunk.seq} after final seq {req.prefill_final}", now,
                              extra=(chunk.token,))
        if req.prefill_state is _PREFILL_DONE or chunk.seq in req.prefill:
            self.stats.duplicates += 1
            if req.held and chunk.token is not None:
                # Maybe a redelivery of a chunk still held (same stored message): settle them together.
                req.held.append(chunk.token)
                req.repeats += 1
                return []
            return [Settle((chunk.token,))]
        if chunk.final:
            if any(s > chunk.seq for s in req.prefill):
                return self._fail(req, ErrorKind.INVALID_CHUNK,
                                  f"prefill final seq {chunk.seq} below an earlier seq", now, extra=(chunk.token,))
            req.prefill_final = chunk.seq
        refused = self._admit(req, chunk, now)
        if refused is not None:
            return refused
        req.prefill[chunk.seq] = chunk
        if chunk.token is not None:
            req.held.append(chunk.token)
        if req.prefill_final is None or len(req.prefill) != req.prefill_final + 1:
            return []
        bodies = [req.prefill[s].body for s in range(req.prefill_final + 1)]
        self._waiting.pop(req.request_id, None)
        try:
            self._prefill_done(req, bodies, "")
        except Exception as exc:  # a codec bug must cost one request, not the processor
            return self._codec_failed(req, exc, now)
        over = self._check_decoded(req, now)
        if over is not None:
            return over
        return self._drain(req, now)

    def _prefill_done(self, req: _Request, bodies: list[bytes] | None, reason: str) -> None:
        req.prefill_state = _PREFILL_DONE
        prefill_bytes = sum(len(c.body) for c in req.prefill.values())
        req.buffered -= prefill_bytes
        req.prefill.clear()  # bodies now live (parsed) in the session only
        session = self._session(req)
        if bodies is None:
            self.charged_bytes -= prefill_bytes
            session.prefill_unavailable(reason)
        else:
            req.absorbed = prefill_bytes  # still charged: the session holds their parsed form
            session.decode_budget = self.config.max_total_bytes - self.charged_bytes + req.decoded
            session.absorb_prefill(bodies)

    def _session(self, req: _Request) -> JoinSession:
        if req.session is None:
            req.session = req.codec.open_session()
        return req.session

    def _receive_output(self, req: _Request, chunk: Chunk, now: float) -> list[Decision]:
        role = chunk.role
        if req.kind is None:
            req.kind = role
        elif req.kind is not role:
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"{role.value} chunk for a request whose results come from {req.kind.value}",
                              now, extra=(chunk.token,))
        seq = chunk.seq
        if role is _AGG and seq == req.next_seq and not req.pending and req.final_seq is None and not req.attempt:
            # In-order aggregated chunk (the common streaming case): it cannot be a duplicate or
            # conflict with a final seq, so no buffering, no bound checks, no drain loop.
            req.last = now
            self._active.move_to_end(req.request_id)
            req.next_seq = seq + 1
            self.stats.passthrough += 1
            body = chunk.body
            settles: tuple[object, ...] = (chunk.token,)  # mypyc: else a 1-tuple, checked at (token, *held)
            if chunk.final:
                if req.held:  # repeats of chunks that were buffered, held until the request ends
                    settles = (chunk.token, *req.held)
                self._forget(req, now)
            else:  # keep a reference only; the codec reads it if the request ever migrates
                req.retained.append(body)
                req.budget -= len(body)
                self.retained_total += len(body)
                if req.budget < 0 or self.retained_total > self._retained_cap:
                    self._compact(req)
                    over = self._over_progress(req, now)
                    if over is not None:
                        return [Result(req.request_id, seq, body, False, _PASSTHROUGH, None,
                                       chunk.traceparent, settles, req.format), *over]
            return [Result(req.request_id, seq, body, chunk.final, _PASSTHROUGH, None,
                           chunk.traceparent, settles, req.format)]
        seq += req.offset  # result seq: an attempt continues where the previous one was sealed
        if seq < req.next_seq or seq in req.pending:
            self.stats.duplicates += 1
            if seq >= req.next_seq and chunk.token is not None:
                # Maybe a redelivery of the buffered chunk (same stored message): acking it now
                # would release the original before its result is stored. That result settles it:
                # from then on it delivers nothing new (held to the request's end, it counted
                # towards the partition's held chunks after its message was acknowledged).
                if req.repeated is None:
                    req.repeated = {}
                req.repeated.setdefault(seq, []).append(chunk.token)
                req.repeats += 1
                return []
            return [Settle((chunk.token,))]
        if req.final_seq is not None and (seq > req.final_seq or chunk.final):
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"{role.value} seq {seq} conflicts with final seq {req.final_seq}", now,
                              extra=(chunk.token,))
        if chunk.final:
            if req.pending and max(req.pending) > seq:
                return self._fail(req, ErrorKind.INVALID_CHUNK,
                                  f"final seq {seq} below an earlier seq", now, extra=(chunk.token,))
            req.final_seq = seq
        refused = self._admit(req, chunk, now)
        if refused is not None:
            return refused
        req.pending[seq] = chunk
        if seq != req.next_seq or req.waiting_since is not None:
            return []
        return self._drain(req, now)

    def _hand_out(self, req: _Request, job: Callable[[], tuple[bytes, Verdict]],
                  decodes: int | None, reserved: int = 0) -> list[Decision]:
        """Run ``job`` (this chunk's join, stitch or both) off the loop: a :class:`Work` now, holding
        ``reserved`` bytes of the budget (:meth:`_reserve`), or the request queued for its turn (one
        Work at a time, round robin) if another is running."""
        if self._working is not None:
            self._queued[req.request_id] = req
            return []
        req.work = self._working = Work(req.request_id, job, decodes)
        req.work.reserved = reserved
        return [req.work]  # type: ignore[list-item]  # a Work goes out among the decisions

    def _drain(self, req: _Request, now: float) -> list[Decision]:
        """Publish every chunk that is next in order and ready."""
        out: list[Decision] = []
        if req.work is not None:
            return out  # finish() goes on once the join running elsewhere is done
        pending = req.pending
        stats = self.stats
        while req.next_seq in pending:
            chunk = pending[req.next_seq]
            final = chunk.final
            try:
                outcome = req.outcome
                if outcome is not None:  # this chunk's join and stitch ran elsewhere (finish): final as is
                    req.outcome = None
                    if isinstance(outcome, Exception):
                        raise outcome
                    body, verdict = outcome
                    session = req.session
                    if session is not None and (req.decoded or session.retained_bytes()):
                        over = self._check_decoded(req, now)
                        if over is not None:
                            out.extend(over)
                            return out
                elif req.kind is _AGG:
                    body, verdict = chunk.body, _PASSTHROUGH
                    if req.attempt and self.offload_joins:
                        out.extend(self._hand_out(req, functools.partial(
                            _stitched, req.migration, None, chunk.body, final), None))  # type: ignore[arg-type]
                        return out
                    if req.attempt:
                        body, verdict = _stitch(req.migration, body, verdict, final)  # type: ignore[arg-type]
                else:
                    session = self._session(req)
                    needs = session.needs_prefill(chunk.body, final)
                    if needs and req.prefill_state is _PREFILL_OPEN:
                        session.set_aside()
                        if req.waiting_since is None:
                            req.waiting_since = now
                            self._waiting[req.request_id] = req
                        return out
                    if not req.join_timed:
                        # The wait for the prefill leg (if any) ends here, before the join runs
                        # (inline, off the loop, or queued for the join thread): join_wait is the
                        # wait alone, once per result, 0 when the leg was there.
                        waited = req.waiting_since
                        self.join_wait.observe(0.0 if waited is None else now - waited)
                        req.waiting_since = None
                        req.join_timed = True
                    if self.offload_joins and (needs or req.attempt):
                        if self._working is not None:  # queued for its turn, reserved when it comes
                            session.set_aside()
                            self._queued[req.request_id] = req
                            return out
                        # What the join will decode is charged before it leaves (_reserve), so the
                        # chunks that arrive while it runs cannot fill the room it decodes into.
                        reserved = self._reserve(req, session.join_bytes(chunk.body, final), now)
                        # It decodes within what is left, and within its share (join_share): the
                        # request's bytes besides the rows it keeps count against it.
                        session.decode_budget = min(
                            self.config.max_total_bytes - self.charged_bytes + reserved + req.decoded,
                            join_share(self.config.max_total_bytes) - _held(req) + req.decoded)
                        # A resumed attempt's stitch may inflate rows too: it runs after the join, in
                        # the same job, and is always charged (its decodes are not the session's).
                        if req.attempt:
                            job = functools.partial(_stitched, req.migration, session.join, chunk.body, final)  # type: ignore[arg-type]
                            out.extend(self._hand_out(req, job, None, reserved))
                        else:
                            job = functools.partial(session.join, chunk.body, final)
                            out.extend(self._hand_out(req, job, session.decodes, reserved))
                        return out
                    session.decode_budget = self.config.max_total_bytes - self.charged_bytes + req.decoded
                    clock = self.join_clock
                    if clock is None:
                        body, verdict = session.join(chunk.body, final)
                    else:
                        started = clock()
                        try:
                            body, verdict = session.join(chunk.body, final)
                        finally:
                            self.join_seconds.observe(clock() - started)
                    if req.decoded or session.retained_bytes():
                        over = self._check_decoded(req, now)
                        if over is not None:
                            out.extend(over)
                            return out
                    if req.attempt:  # a resumed attempt: the codec makes it continue the earlier ones
                        body, verdict = _stitch(req.migration, body, verdict, final)  # type: ignore[arg-type]
            except Exception as exc:
                out.extend(self._codec_failed(req, exc, now))
                return out
            del pending[req.next_seq]
            req.buffered -= len(chunk.body)
            self.charged_bytes -= len(chunk.body)
            req.waiting_since = None
            req.join_timed = False
            settles: tuple = (chunk.token,)
            repeated = req.repeated
            if repeated and req.next_seq in repeated:  # repeats of this chunk: nothing new from now on
                tokens = repeated.pop(req.next_seq)
                settles = settles + tuple(tokens)
                req.repeats -= len(tokens)
            if final:
                settles = settles + tuple(req.held)
                req.held.clear()
                req.repeats = 0
            out.append(Result(req.request_id, req.next_seq, body, final, verdict, None, chunk.traceparent, settles,
                              req.format))
            if verdict is _PASSTHROUGH:
                stats.passthrough += 1
            elif verdict is _JOINED:
                stats.joined += 1
            elif verdict is _STITCHED:
                stats.stitched += 1
            else:
                stats.omitted += 1
                if req.omitted is None or final:
                    self._count_omissions(req, body)
            req.next_seq += 1
            if final:
                self._forget(req, now)
                return out
            req.retained.append(body)
            req.budget -= len(body)
            self.retained_total += len(body)
            if req.budget < 0 or self.retained_total > self._retained_cap:
                self._compact(req)
                over = self._over_progress(req, now)
                if over is not None:
                    out.extend(over)
                    return out
        return out

    # ---------------------------------------------------------------- migration

    def _other_attempt(self, req: _Request, chunk: Chunk, now: float) -> list[Decision]:
        if chunk.attempt < req.attempt:
            self.stats.sealed += 1
            return [Settle((chunk.token,)), Notice(
                req.request_id, "sealed_chunk",
                f"{chunk.role.value} seq {chunk.seq} of sealed attempt {chunk.attempt} (now {req.attempt})")]
        return self._fail(req, ErrorKind.INVALID_CHUNK,
                          f"attempt {chunk.attempt} was never granted (current attempt {req.attempt}); "
                          "a new attempt starts with a migrate", now, extra=(chunk.token,))

    def _progress(self, req: _Request) -> MigrationSession:
        """The request's migration session with every retained body absorbed. Raises MigrationRefused."""
        if req.refusal is not None:
            raise MigrationRefused(req.refusal)
        try:
            if req.migration is None:
                req.migration = req.codec.open_migration()
            if req.retained:
                self.retained_total -= req.retain - req.budget
                bodies, req.retained, req.budget = req.retained, [], req.retain
                req.migration.absorb(bodies)
                self._count_progress(req)
        except MigrationRefused as exc:
            req.refusal = exc.reason
            raise
        except Exception as exc:
            # Cut: kept with the request and sent in every later migrate's reply; with room for the error
            # result's prefix, so its text is cut once and still says how long the exception's was
            req.refusal = cut_error_text(f"codec {req.codec.name!r} failed: {type(exc).__name__}: {exc}",
                                         MAX_ERROR_TEXT - len(_REFUSED))
            raise MigrationRefused(req.refusal) from None
        return req.migration

    def _count_progress(self, req: _Request) -> None:
        """Charge the migration session's progress state (it grows with the output) to the budget,
        with the last seal's reply kept for a retry (every emitted token id) and the seal list
        (SEAL_BYTES a migration)."""
        size = req.migration.progress_bytes() if req.migration is not None else 0
        if req.last_seal is not None:
            size += len(req.last_seal[1])
        if req.seals is not None:
            size += len(req.seals) * _SEAL
        self.charged_bytes += size - req.progress
        req.progress = size

    def _over_progress(self, req: _Request, now: float) -> list[Decision] | None:
        """After a fold: a progress state past the per-request or the global byte budget ends the
        request (``overloaded``), so a stream that never ends cannot grow memory without bound."""
        cfg = self.config
        if req.progress > cfg.max_buffered_bytes:
            detail = (f"the request's migration progress state ({req.progress} bytes of emitted tokens) passes "
                      f"the per-request bound of {cfg.max_buffered_bytes} bytes")
        elif self.charged_bytes > cfg.max_total_bytes and self._make_room(req, 0, now):
            detail = (f"processor byte budget exhausted: {self.charged_bytes} of {cfg.max_total_bytes} bytes held "
                      f"by requests in flight, the most ({_held(req)} bytes) by this request, {req.progress} of them "
                      "by its migration progress state")
        else:
            return None
        self.stats.over_budget += 1
        return self._fail(req, ErrorKind.OVERLOADED, detail, now)

    def _compact(self, req: _Request) -> None:
        """Retention bound reached: fold the retained bodies into the codec's progress state."""
        if req.missing:  # the session cannot absorb them before the bodies it misses: read back later
            req.missing = req.next_seq
        elif req.refusal is None:
            try:
                self._progress(req)
                return
            except MigrationRefused:
                pass  # remembered in req.refusal; a migrate will be refused with it
        self.retained_total -= req.retain - req.budget
        req.retained = []
        req.budget = req.retain

    def _room_for_seal(self, req: _Request, now: float, recorded: bool) -> None:
        """The seal about to be made adds one entry to ``req``'s seal list (SEAL_BYTES), charged as
        its progress state: raises MigrationRefused when that passes the per-request bound, or the
        global one with ``req`` the biggest holder (else the biggest are ended to make room, their
        results in ``_aside``), before anything is sealed: the client is never granted an attempt
        whose request then ends over budget. ``recorded`` (durable mode): the seal record must also be
        one another instance reads back (:func:`~.wire.max_seals`), else a take-over could not."""
        cfg = self.config
        seals = len(req.seals) if req.seals is not None else 0
        if recorded and seals + 1 > max_seals(cfg.max_buffered_bytes):
            raise MigrationRefused(
                f"its seal record would hold {seals + 1} seals, more than another instance reads back "
                f"({max_seals(cfg.max_buffered_bytes)} within max_buffered_bytes {cfg.max_buffered_bytes})")
        if req.progress + _SEAL > cfg.max_buffered_bytes:
            raise MigrationRefused(
                f"its migration state ({req.progress} bytes: emitted tokens, the last seal's reply and "
                f"{seals} seals) would pass the per-request bound of {cfg.max_buffered_bytes} bytes "
                "(max_buffered_bytes) with one more seal")
        if self.charged_bytes + _SEAL > cfg.max_total_bytes and self._make_room(req, _SEAL, now):
            raise MigrationRefused(
                f"processor byte budget exhausted: {self.charged_bytes} of {cfg.max_total_bytes} bytes held "
                f"by requests in flight, the most ({_held(req)} bytes, {seals} seals) by this request")

    def _seal(self, req: _Request, emitted: Emitted, now: float) -> tuple[MigrateReply, list[Decision]]:
        rid = req.request_id
        tokens = [*req.held, *(c.token for c in req.pending.values()), *_repeated(req)]
        dropped = len(req.pending) + len(req.prefill)
        self._release(req, keep_progress=True)  # the migration session lives on into the next attempt
        req.work = req.outcome = None
        req.pending.clear()
        req.prefill.clear()
        req.held.clear()
        req.repeated = None
        req.repeats = 0
        self._waiting.pop(rid, None)
        req.prefill_final = None
        req.prefill_state = _PREFILL_OPEN
        req.waiting_since = None
        req.join_timed = False
        req.session = None  # the next attempt has its own prefill leg (for the extended prompt)
        req.kind = None  # ... and may be aggregated where the last one was P/D, or the reverse
        req.final_seq = None
        req.attempt += 1
        if req.seals is None:
            req.seals = array("q")
        req.seals.append(req.next_seq)
        self._count_progress(req)  # the seal list's new entry (_room_for_seal made room for it)
        req.offset = req.next_seq
        req.last = now
        self._active.move_to_end(rid)
        self.stats.migrations += 1
        reply = _sealed_reply(req, emitted, req.attempt)
        decisions: list[Decision] = [Notice(
            rid, "migrated", f"attempt {req.attempt} granted after {reply.emitted_tokens} emitted tokens; "
                             f"results continue at seq {req.next_seq}; {dropped} unpublished chunks dropped")]
        settle = tuple(t for t in tokens if t is not None)
        if settle:
            decisions.insert(0, Settle(settle))
        return reply, decisions

    def _touch(self, req: _Request, now: float) -> None:
        """The request made progress: its request timeout starts again."""
        req.last = now
        self._active.move_to_end(req.request_id)

    def _admit(self, req: _Request, chunk: Chunk, now: float) -> list[Decision] | None:
        """The bounds every buffered chunk passes (count, then bytes); None when it may be buffered,
        which counts as the request's progress."""
        if len(req.pending) + len(req.prefill) >= self.config.max_buffered_chunks:
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"more than {self.config.max_buffered_chunks} buffered chunks", now,
                              extra=(chunk.token,))
        over = self._charge(req, chunk, now)
        if over is not None:
            return over
        self._touch(req, now)
        return None

    def _charge(self, req: _Request, chunk: Chunk, now: float) -> list[Decision] | None:
        """Charge a chunk about to be buffered; past a byte budget, end the request instead."""
        size = len(chunk.body)
        cfg = self.config
        if req.buffered + size > cfg.max_buffered_bytes:
            self.stats.over_budget += 1
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"more than {cfg.max_buffered_bytes} bytes of buffered chunks", now,
                              extra=(chunk.token,))
        if self.charged_bytes + size > cfg.max_total_bytes and self._make_room(req, size, now):
            self.stats.over_budget += 1
            return self._fail(req, ErrorKind.OVERLOADED,
                              f"processor byte budget exhausted: {self.charged_bytes} of {cfg.max_total_bytes} "
                              f"bytes held by requests in flight, and this request would hold the most "
                              f"({_held(req) + size} bytes)", now, extra=(chunk.token,))
        req.buffered += size
        self.charged_bytes += size
        return None

    def _check_decoded(self, req: _Request, now: float) -> list[Decision] | None:
        """Charge what the session keeps decoded; past the global budget, end this request."""
        session = req.session
        decoded = session.retained_bytes() if session is not None else 0
        self.charged_bytes += decoded - req.decoded
        req.decoded = decoded
        if self.charged_bytes <= self.config.max_total_bytes or not self._make_room(req, 0, now):
            return None
        self.stats.over_budget += 1
        held = self.charged_bytes
        return self._fail(req, ErrorKind.OVERLOADED,
                          f"processor byte budget exhausted: decoded payloads would hold {held} of "
                          f"{self.config.max_total_bytes} bytes, and this request the most ({_held(req)} bytes)", now)

    def _reserve(self, req: _Request, need: int | None, now: float) -> int:
        """Charge what the join about to leave for another thread will decode (``need``, from
        ``JoinSession.join_bytes``; None: unknown, all that is left), so that chunks arriving while it
        runs meet a budget that already counts it. Short of room, the requests holding more than
        ``req`` would with the join are ended first (``_make_room``, the rule a chunk meets); what is
        then still missing is not reserved, and the join's ``decode_budget`` (what was left) makes
        the codec omit (``too_large``) what does not fit, as before. The request holds at most
        :func:`join_share` of the budget with its reservation: the request whose join runs is no
        eviction victim, so without a share a frame declaring more than the budget left no room for
        any other request's buffered chunk while it ran. Returns the bytes reserved, at most what
        the budget had left: ``charged_bytes`` stays within ``max_total_bytes``."""
        limit = self.config.max_total_bytes
        share = max(0, join_share(limit) - _held(req))
        need = share if need is None else min(need, share)
        if need <= 0:
            return 0
        if self.charged_bytes + need > limit:
            self._make_room(req, need, now)  # True (req holds the most): it keeps only what is left
        reserved = min(need, max(0, limit - self.charged_bytes))
        self.charged_bytes += reserved
        return reserved

    def _make_room(self, req: _Request, need: int, now: float) -> bool:
        """The global byte budget is short of ``need`` bytes: end the requests holding the most bytes
        (``overloaded``; their results wait in ``_aside``) until it is not. True when ``req`` itself
        holds the most (with ``need``), so it is the one to end. Like an OOM killer: the biggest
        holder is the offender, so backlogs held under the per-request cap cannot refuse everyone
        else. Ties go against ``req``; among others, the least recently progressed goes first.
        O(requests in flight) per request ended."""
        cfg = self.config
        while self.charged_bytes + need > cfg.max_total_bytes:
            most = _held(req) + need
            victim = None
            for other in self._active.values():
                held = other.buffered + other.absorbed + other.decoded + other.progress
                # A request whose join runs elsewhere frees nothing before it ends (_release).
                if held > most and other is not req and other.work is None:
                    victim, most = other, held
            if victim is None:
                return True
            self.stats.over_budget += 1
            self._aside.extend(self._fail(
                victim, ErrorKind.OVERLOADED,
                f"processor byte budget exhausted: {self.charged_bytes + need} of {cfg.max_total_bytes} bytes wanted "
                f"by requests in flight; this request held the most ({most} bytes) and was ended to make room", now))
        return False

    def _take_aside(self, out: list[Decision]) -> list[Decision]:
        aside, self._aside = self._aside, []
        aside.extend(out)
        return aside

    def _evict_idle(self, now: float) -> list[Decision] | None:
        """``max_inflight`` is reached: end the request without progress for longest (``overloaded``)
        if it has been idle ``shed_min_idle`` seconds, to admit a new one; None: refuse the new one.
        Held requests that send nothing then cannot keep newcomers out, while a burst of new
        requests (each progressing) does not evict one another. Duplicates and replays are not
        progress, so re-sending them keeps nothing in."""
        req = next(iter(self._active.values()))  # ordered by last progress
        idle = now - req.last
        if idle < self.config.shed_min_idle:
            return None
        self.stats.evicted += 1
        return self._fail(req, ErrorKind.OVERLOADED,
                          f"processor overloaded: {self.config.max_inflight} requests in flight (max_inflight) and "
                          f"this one made no progress for {idle:.1f} s, the longest: ended to admit a new request", now)

    def _trim_finished(self) -> None:
        """Forget the oldest finished ids until both bounds hold (their late chunks are then taken
        for a new request; docs/operations.md, "limits and abuse")."""
        finished = self._finished
        while finished and (len(finished) > self._max_finished or self.finished_bytes > self._max_finished_bytes):
            rid, _ = finished.popitem(last=False)
            self.finished_bytes -= _ENTRY + len(rid)
            self._unstorable.discard(rid)

    def _release(self, req: _Request, *, keep_progress: bool = False) -> None:
        held = req.buffered + req.absorbed + req.decoded
        if req.work is not None:
            # Its join is running elsewhere: the chunk body, the session and its rows stay live in
            # that thread until finish(), so their charge does too, as part of the Work's reservation.
            req.work.reserved += held
        else:
            self.charged_bytes -= held
        req.buffered = req.absorbed = req.decoded = 0
        if not keep_progress:
            self.charged_bytes -= req.progress
            req.progress = 0
            self.retained_total -= req.retain - req.budget
            req.retained = []
            req.budget = req.retain

    def _count_omissions(self, req: _Request, body: bytes) -> None:
        """Count the reasons ``body``'s omission markers give, each once per request (a codec whose
        ``omissions`` raises counts ``other``: the result is made by then). A body past
        :data:`OMISSIONS_READ_BYTES` (a joined payload beside the omitted field) is not parsed on the
        loop for a counter: it counts as ``unread``."""
        seen = req.omitted if req.omitted is not None else set()
        req.omitted = seen
        if len(body) > OMISSIONS_READ_BYTES:
            reasons = {"unread"}
        else:
            try:
                markers = req.codec.omissions(body)
                reasons = {r if r in _OMISSION_REASONS else "other" for r in markers.values()}
            except Exception:  # noqa: BLE001 - a plugin's bug costs the count, never the result already made
                reasons = {"other"}
        counts = self.omission_reasons
        for reason in reasons - seen:
            counts[reason] = counts.get(reason, 0) + 1
        seen |= reasons

    def _codec_failed(self, req: _Request, exc: Exception, now: float) -> list[Decision]:
        if isinstance(exc, RecursionError):
            # Parsers recurse per nesting level (msgspec, json): 100k-deep JSON from a worker is bad
            # input, not a processor bug, so the client is told it was the chunk.
            return self._fail(req, ErrorKind.INVALID_CHUNK,
                              f"a chunk body is nested too deeply to parse (codec {req.codec.name!r}: {exc})", now)
        if isinstance(exc, ContractError):  # the codec refused a worker's body (JoinSession.join)
            return self._fail(req, ErrorKind.INVALID_CHUNK, f"codec {req.codec.name!r}: {exc}", now)
        detail = f"codec {req.codec.name!r} failed: {type(exc).__name__}: {exc}"
        return self._fail(req, ErrorKind.INTERNAL, detail, now)

    def _fail(self, req: _Request, kind: ErrorKind, message: str, now: float, extra: tuple = (),
              seq: int | None = None) -> list[Decision]:
        """End a request with a final error result at the next seq (or ``seq``: in place of a result
        that cannot be published); release everything it held."""
        tokens = list(req.held)
        tokens.extend(c.token for c in req.pending.values())
        tokens.extend(_repeated(req))
        tokens.extend(t for t in extra if t is not None)
        message = cut_error_text(message)  # bounded: it must fit max_payload (errors.MAX_ERROR_TEXT)
        body = req.codec.error_body(message, kind)
        result = Result(req.request_id, req.next_seq if seq is None else seq, body, True, error=kind.value,
                        traceparent=req.traceparent, settles=tuple(t for t in tokens if t is not None))
        self.stats.errors += 1
        self._count_error(kind)
        self._forget(req, now)
        return [result, Notice(req.request_id, f"error:{kind.value}", message)]

    def _count_error(self, kind: ErrorKind) -> None:
        self.error_kinds[kind.value] = self.error_kinds.get(kind.value, 0) + 1

    def _forget(self, req: _Request, now: float) -> None:
        rid = req.request_id
        self._release(req)
        req.work = req.outcome = None
        self._active.pop(rid, None)
        self._waiting.pop(rid, None)
        req.pending.clear()
        req.prefill.clear()
        req.held.clear()
        req.repeated = None
        req.repeats = 0
        req.retained = []
        req.migration = None
        self._remember_finished(rid, now)

    def _remember_finished(self, rid: str, now: float) -> None:
        finished = self._finished
        if rid not in finished:
            self.finished_bytes += _ENTRY + len(rid)
        finished[rid] = now + self._grace
        finished.move_to_end(rid)
        if len(finished) > self._max_finished or self.finished_bytes > self._max_finished_bytes:
            self._trim_finished()


def join_share(max_total_bytes: int) -> int:
    """The most of the byte budget one request whose join runs off the event loop may hold, the
    join's reservation included; what its join decodes past it is omitted (``too_large``). The
    last quarter stays for the chunks other requests buffer while it runs (a prefill leg waiting
    for its decode leg, an out-of-order chunk): the running join's request cannot be ended to make
    room for them, since it frees nothing before its join ends."""
    return max_total_bytes - max_total_bytes // 4


def _repeated(req: _Request) -> list:
    """The tokens of repeats of ``req``'s buffered output chunks (``_Request.repeated``)."""
    return [t for tokens in req.repeated.values() for t in tokens] if req.repeated else []


def _held(req: _Request) -> int:
    """Bytes a request holds in the global byte budget."""
    return req.buffered + req.absorbed + req.decoded + req.progress
