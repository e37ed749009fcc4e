"""Simulated worker traffic: plan requests from ground truths, publish them, check what came back.

Used by ``streamproc simulate``, the demo and the integration tests. Each planned request keeps
its :class:`~streamproc.simulation.Truth` and the exact bodies that were published, so results
can be verified without trusting the processor: aggregated results must be the published bytes,
P/D results must carry the truth's expert rows (and never stale ones).

A planned request with its bodies is about 10 KB, so the commands plan lazily
(:func:`planned`, :func:`windows`): a run of millions of requests holds one window of them,
not all (:mod:`streamproc.sim.verification` keeps the ones still waiting for results).
"""

from __future__ import annotations

import itertools
import random
import secrets
from typing import Any, Iterable, Iterator, Literal

import msgspec
from nats.aio.client import Client as NatsClient

from ..catalog import worker_for
from ..client.publisher import ChunkPublisher
from .simulation import Damage, SimulatedWorker, Truth, make_truth
from ..core.wire import ResultInfo, Role, Subjects, Verdict

TrafficMode = Literal["agg", "pd", "mixed"]


class PlannedRequest(msgspec.Struct):
    """One simulated request: its truth and every body its legs publish."""

    request_id: str
    kind: Literal["agg", "pd"]
    stream: bool
    truth: Truth
    agg: list[bytes] = []
    prefill: list[bytes] = []
    decode: list[bytes] = []
    # A planned fault and what it must lead to: "corrupt_prefill" (the prefill leg's sequence
    # payload is garbage) and "missing_prefill" (no prefill leg: the prefill timeout) end in
    # omitted results with a reason, never spliced rows; "contract" (a prefill chunk on an
    # aggregated request) ends in an invalid_chunk error result.
    fault: str | None = None

    @property
    def output(self) -> list[bytes]:
        """The leg whose chunks become results."""
        return self.agg if self.kind == "agg" else self.decode


# What each planned fault (PlannedRequest.fault) must end in, as the demo's summary says it.
FAULT_OUTCOMES = {
    "corrupt_prefill": "corrupt prefill legs -> omitted with a reason",
    "missing_prefill": "missing prefill legs -> omitted with a reason (prefill timeout)",
    "contract": "contract violations -> invalid_chunk error results",
}


class Message(msgspec.Struct, frozen=True):
    request_id: str
    role: Role
    seq: int
    body: bytes
    final: bool


def plan(format: str, **options: Any) -> list[PlannedRequest]:
    """Every request of :func:`planned` (same keywords) at once: tests; the commands plan lazily."""
    return list(planned(format, **options))


def planned(
    format: str,
    *,
    requests: int,
    mode: TrafficMode = "mixed",
    stream: bool | None = None,
    seed: int = 0,
    id_prefix: str | None = None,
    worker: SimulatedWorker | None = None,
    faults: bool = False,
) -> Iterator[PlannedRequest]:
    """``requests`` requests, each made when asked for; ``mode`` mixed alternates agg and P/D, ``stream``
    None alternates too. Request ``i`` depends only on ``seed`` and ``i``. ``faults`` plans two corrupt
    and two missing prefill legs in every 20 P/D requests and a contract violation in every 20
    aggregated ones (see :attr:`PlannedRequest.fault`)."""
    worker = worker or worker_for(format)
    id_prefix = id_prefix or f"sim-{secrets.token_hex(3)}"
    for i in range(requests):
        kind = mode if mode != "mixed" else ("agg" if i % 2 == 0 else "pd")
        is_stream = stream if stream is not None else (i // 2) % 2 == 0
        rid = f"{id_prefix}-{i}"
        truth = make_truth(seed * 1_000_003 + i, request_id=rid)
        if kind == "agg":
            planned = PlannedRequest(rid, "agg", is_stream, truth, agg=worker.agg(truth, stream=is_stream))
            if faults and i % 40 == 20:
                planned.fault = "contract"
                planned.prefill = worker.prefill(truth, stream=False)
        else:
            fault = None
            if faults:
                fault = {2: "corrupt_prefill", 3: "corrupt_prefill", 6: "missing_prefill",
                         7: "missing_prefill"}.get((i // 2) % 20)  # streamed and unary alike
            prefill = [] if fault == "missing_prefill" else worker.prefill(
                truth, stream=is_stream, damage=Damage.GARBAGE if fault == "corrupt_prefill" else None)
            planned = PlannedRequest(rid, "pd", is_stream, truth, prefill=prefill,
                                     decode=worker.decode(truth, stream=is_stream), fault=fault)
        yield planned


def _legs(p: PlannedRequest) -> list[list[Message]]:
    def leg(role: Role, bodies: list[bytes], final: bool = True) -> list[Message]:
        last = len(bodies) - 1 if final else -1
        return [Message(p.request_id, role, i, b, i == last) for i, b in enumerate(bodies)]

    if p.kind == "agg":
        if p.fault == "contract":  # the request stays open, so the stray prefill chunk always meets it
            return [leg(Role.AGG, p.agg, final=False), leg(Role.PREFILL, p.prefill)]
        return [leg(Role.AGG, p.agg)]
    return [leg(Role.PREFILL, p.prefill)] * bool(p.prefill) + [leg(Role.DECODE, p.decode)]


# Requests interleaved (and shuffled) together. Workers publish a request's legs close in time;
# interleaving every leg of every request let a P/D request's prefill leg land thousands of chunks
# from its decode leg, so past ~1,000 requests (seconds of publishing) the demo's 1 s prefill
# timeout expired on healthy traffic, and duplicates were inserted in O(n^2).
WINDOW = 64


def schedule(plans: Iterable[PlannedRequest], *, seed: int = 0, shuffle: bool = False,
             duplicates: float = 0.0) -> list[Message]:
    """Every message of :func:`windows` in one list (tests; the commands publish window by window)."""
    return [m for _, messages in windows(plans, seed=seed, shuffle=shuffle, duplicates=duplicates)
            for m in messages]


def windows(plans: Iterable[PlannedRequest], *, seed: int = 0, shuffle: bool = False,
            duplicates: float = 0.0) -> Iterator[tuple[list[PlannedRequest], list[Message]]]:
    """Interleave every leg of every request, :data:`WINDOW` requests at a time: each window's
    requests and their messages, taken from ``plans`` only when the window is asked for.

    Without ``shuffle`` each leg stays in seq order (legs and requests still interleave, so a
    decode chunk may come before its prefill leg); with it each window's sequence is shuffled.
    ``duplicates`` is the fraction of messages published a second time (within their window).
    """
    rng = random.Random(seed)
    plans = iter(plans)
    while window := list(itertools.islice(plans, WINDOW)):
        yield window, _interleave(window, rng, shuffle, duplicates)


def _interleave(plans: list[PlannedRequest], rng: random.Random, shuffle: bool,
                duplicates: float) -> list[Message]:
    queues = [leg for p in plans for leg in _legs(p)]
    out: list[Message] = []
    if shuffle:
        out = [m for leg in queues for m in leg]
        rng.shuffle(out)
    else:
        cursors = [0] * len(queues)
        live = list(range(len(queues)))
        while live:
            k = rng.randrange(len(live))
            q = live[k]
            out.append(queues[q][cursors[q]])
            cursors[q] += 1
            if cursors[q] == len(queues[q]):
                live[k] = live[-1]
                live.pop()
    if duplicates > 0:
        extra = [m for m in out if rng.random() < duplicates]
        for m in extra:
            out.insert(rng.randrange(len(out) + 1), m)
    return out


async def publish(nc: NatsClient, subjects: Subjects, messages: Iterable[Message], *,
                  format: str | None = None, durable: bool = False) -> int:
    """Publish the scheduled messages (``format`` goes in every chunk's Streamproc-Format header);
    ``durable`` waits for each chunk's PubAck and raises ``PublishRefused`` when the stream refuses."""
    publisher = ChunkPublisher(nc, subjects, durable=durable)
    count = 0
    for m in messages:
        await publisher.publish(m.request_id, m.role, m.seq, m.body, final=m.final, format=format)
        count += 1
    await nc.flush()
    return count


def verify(p: PlannedRequest, results: list[ResultInfo], worker: SimulatedWorker) -> list[str]:
    """Everything wrong with one request's results (empty when they are right)."""
    problems: list[str] = []
    expected = p.output
    if [r.seq for r in results] != list(range(len(results))):
        problems.append(f"seqs not contiguous from 0: {[r.seq for r in results]}")
    if p.fault == "contract":
        if not results or results[-1].error != "invalid_chunk" or not results[-1].final:
            problems.append(f"a contract violation must end in a final invalid_chunk error, got "
                            f"{[(r.verdict, r.error) for r in results]}")
        return problems
    errors = [f"{r.error}: {r.body[:200]!r}" for r in results if r.error]
    if errors:
        return problems + [f"error result {e}" for e in errors]
    if len(results) != len(expected):
        problems.append(f"{len(results)} results for {len(expected)} {p.kind} chunks")
    if results and not results[-1].final:
        problems.append("last result is not final")
    if any(r.final for r in results[:-1]):
        problems.append("a result before the last is final")
    if p.kind == "agg":
        for r, body in zip(results, expected):
            if r.verdict is not Verdict.PASSTHROUGH:
                problems.append(f"seq {r.seq}: verdict {r.verdict} for an aggregated chunk")
            if r.body != body:
                problems.append(f"seq {r.seq}: body differs from the worker's bytes")
        return problems
    views = []
    for r in results:
        try:
            rows, reason = worker.expert_view(r.body)
        except ValueError as exc:
            problems.append(f"seq {r.seq}: unreadable body ({exc})")
            return problems
        views.append((rows, reason))
        if rows is not None and rows != p.truth.experts:
            problems.append(f"seq {r.seq}: expert rows differ from the truth (stale or mis-joined)")
    if p.fault is not None:  # the prefill rows cannot be had: omitted with a reason, never spliced
        if p.truth.return_experts and (not results or results[-1].verdict is not Verdict.OMITTED
                                       or views[-1][0] is not None or not views[-1][1]):
            problems.append(f"{p.fault}: final result must be omitted with a reason, got verdict "
                            f"{results[-1].verdict if results else None} reason {views[-1][1] if views else None!r}")
        return problems
    if views and p.truth.return_experts and views[-1][0] is None:
        problems.append(f"final result has no expert rows (reason {views[-1][1]!r}, verdict {results[-1].verdict})")
    return problems


def row_name(p: PlannedRequest) -> str:
    """The summary row a request is counted in, e.g. ``P/D stream``."""
    return f"{'aggregated' if p.kind == 'agg' else 'P/D'} {'stream' if p.stream else 'unary'}"


class Tally(msgspec.Struct):
    """Counts for the demo's summary table."""

    requests: int = 0
    agg: int = 0
    pd: int = 0
    results: int = 0
    passthrough: int = 0
    joined: int = 0
    stitched: int = 0  # results of a migrated request's resumed attempt
    omitted: int = 0
    errors: int = 0
    verified: int = 0
    failed: int = 0

    def add(self, kind: Literal["agg", "pd"], results: list[ResultInfo], problems: list[str]) -> None:
        self.requests += 1
        if kind == "agg":
            self.agg += 1
        else:
            self.pd += 1
        self.results += len(results)
        for r in results:
            if r.error:
                self.errors += 1
            elif r.verdict is Verdict.PASSTHROUGH:
                self.passthrough += 1
            elif r.verdict is Verdict.JOINED:
                self.joined += 1
            elif r.verdict is Verdict.STITCHED:
                self.stitched += 1
            elif r.verdict is Verdict.OMITTED:
                self.omitted += 1
        if problems:
            self.failed += 1
        else:
            self.verified += 1
