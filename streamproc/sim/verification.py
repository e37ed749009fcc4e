"""Simulated traffic verified as each request ends, then forgotten: memory bounded by what is in flight.

``streamproc simulate --verify`` and the demo used to plan every request, publish every message
and keep every result until the end, about 10 KB a request (306 MiB at 20,000 requests, and
``--requests`` allows 10,000,000). A :class:`Verifier` instead holds a request (its plan, its
results so far) from the moment its window is published until its final result, checks it then
with :func:`~streamproc.sim.traffic.verify` and keeps only the tallies and the first
:data:`MAX_PROBLEMS_KEPT` failures. Publishing waits while :data:`MAX_OUTSTANDING` requests are
still open, so what the run holds does not grow with the number of requests.
"""

from __future__ import annotations

from typing import Callable, Iterable

import anyio
import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ..core.reorder import SeqOrder
from ..core.wire import ContractError, ResultInfo, Subjects, result_from_message
from ..client.results import AllResults
from . import traffic
from .simulation import SimulatedWorker

# Requests published and not yet ended, at most (eight windows, ~5 MB of plans). Enough to keep a
# processor busy (thousands of chunks in flight); the demo's missing prefill legs each stay open
# for its 1 s prefill timeout, about 5% of its requests.
MAX_OUTSTANDING = 8 * traffic.WINDOW
MAX_PROBLEMS_KEPT = 100  # failed requests whose problems are kept; the tallies count every one


class Published(msgspec.Struct):
    """What :meth:`Verifier.publish` got out."""

    messages: int = 0
    requests: int = 0
    timed_out: str | None = None  # why it stopped before the last window


class _Open:
    __slots__ = ("order", "plan", "results")

    def __init__(self, plan: traffic.PlannedRequest) -> None:
        self.plan = plan
        self.order = SeqOrder()
        self.results: list[ResultInfo] = []


class Verifier(AllResults):
    """Results of planned requests through one wildcard subscription, each request checked as it ends."""

    def __init__(self, nc: NatsClient, subjects: Subjects, worker: SimulatedWorker, *,
                 max_outstanding: int = MAX_OUTSTANDING) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker = worker
        self.max_outstanding = max(max_outstanding, traffic.WINDOW)
        self.rows: dict[str, traffic.Tally] = {}
        self.problems: dict[str, list[str]] = {}  # the first MAX_PROBLEMS_KEPT failed requests
        self.faults: dict[str, list[int]] = {}  # planned fault -> [requests, ended as they must]
        self.finished = 0  # requests checked (ended or, at close, not)
        self.malformed = 0  # result messages that broke the contract (ignored)
        self._open: dict[str, _Open] = {}
        self._ended = anyio.Event()  # set (and replaced) whenever a request ends
        self._sub: Subscription | None = None

    @property
    def outstanding(self) -> int:
        return len(self._open)

    def expect(self, plans: Iterable[traffic.PlannedRequest]) -> None:
        """Hold these requests until they end: call before publishing them (results may come at once)."""
        for p in plans:
            self._open[p.request_id] = _Open(p)

    async def publish(self, windows: Iterable[tuple[list[traffic.PlannedRequest], list[traffic.Message]]],
                      *, format: str, durable: bool, timeout: float) -> Published:
        """Publish window by window (:func:`~streamproc.sim.traffic.windows`), each once there is room
        for it. No room within ``timeout`` (no processor, or a stuck one) stops it: ``timed_out``."""
        done = Published()
        for plans, messages in windows:
            try:
                await self.room(len(plans), timeout)
            except TimeoutError as exc:
                done.timed_out = f"{exc}; stopped publishing after {done.requests} requests"
                return done
            self.expect(plans)
            done.messages += await traffic.publish(self.nc, self.subjects, messages, format=format, durable=durable)
            done.requests += len(plans)
        return done

    async def room(self, requests: int, timeout: float) -> None:
        """Wait until ``requests`` more fit under ``max_outstanding``; TimeoutError after ``timeout``."""
        await self._wait(lambda: self.outstanding + requests <= self.max_outstanding, timeout,
                         f"for room for {requests} more requests ({self.outstanding} open)")

    async def drain(self, timeout: float) -> None:
        """Wait until every expected request has ended; TimeoutError naming the first missing ones."""
        await self._wait(lambda: not self._open, timeout, "for the final results")

    async def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        with anyio.move_on_after(timeout):
            while not ready():
                await self._ended.wait()
        if not ready():
            first = list(self._open)[:5]
            raise TimeoutError(f"{self.outstanding} requests had no final result within {timeout}s waiting "
                               f"{what} (first: {first})")

    def close(self) -> None:
        """Check every request still open with the results it has (missing ones fail)."""
        for rid in list(self._open):
            self._end(rid)

    def summary(self) -> dict[str, traffic.Tally]:
        return dict(sorted(self.rows.items()))

    async def _on_msg(self, msg: Msg) -> None:
        try:
            result = result_from_message(self.subjects, msg.subject, msg.headers, msg.data)
        except (ContractError, ValueError):
            self.malformed += 1
            return
        held = self._open.get(result.request_id)
        if held is None:  # a repeat after the final, or a request that is not ours
            return
        try:
            held.results.extend(held.order.push(result))
        except OverflowError as exc:
            self._end(result.request_id, f"results: {exc}")
            return
        if held.order.done:
            self._end(result.request_id)

    def _end(self, rid: str, problem: str | None = None) -> None:
        held = self._open.pop(rid)
        p = held.plan
        found = traffic.verify(p, held.results, self.worker) + ([problem] if problem else [])
        self.rows.setdefault(traffic.row_name(p), traffic.Tally()).add(p.kind, held.results, found)
        if p.fault is not None:
            counts = self.faults.setdefault(p.fault, [0, 0])
            counts[0] += 1
            counts[1] += not found
        if found and len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems[rid] = found
        self.finished += 1
        self._ended.set()
        self._ended = anyio.Event()
