"""The recent ring: the last ``--recent`` request ids seen on ``P.results.>``, for the page's list.

:meth:`RecentRequests.note` runs once per result the edge reads (the fan-out's dispatch,
:mod:`.fanout`), so it is kept to a move and a few field updates; ``GET /v1/recent`` serves
:meth:`RecentRequests.newest_first`. Apart from :mod:`.source`, which owns the ring's subscription,
because what the ring remembers is a concept of its own, with no NATS in it.
"""

from __future__ import annotations

import collections

import msgspec

from ..core.codec import shown_kind
from ..core.events import Verdict
from ..core.wire import ResultInfo


class RecentEntry(msgspec.Struct):
    request_id: str
    # Results up to the highest seq seen: derived from the seq, so a repeated result (a processor
    # republishing after a crash) is not counted twice, and an id that fell out of the ring while
    # still running is not counted again from zero when it comes back.
    results: int = 0
    final: bool = False
    error: str | None = None
    verdicts: dict[str, int] = {}
    last_seen: float = 0.0


_VERDICT_VALUES = {v: v.value for v in Verdict}  # ``Verdict.value`` is a Python property (~0.4 µs)


class RecentRequests:
    """The last ``size`` request ids seen on ``P.results.>`` (for the page's request list)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: collections.OrderedDict[str, RecentEntry] = collections.OrderedDict()

    def note(self, result: ResultInfo, now: float) -> None:
        """Called for every result the edge reads (the fan-out's dispatch): a move to the newest end
        and a few field updates, no allocation but for a request id not in the ring."""
        entries = self._entries
        request_id = result.request_id
        entry = entries.get(request_id)
        if entry is None:
            entry = entries[request_id] = RecentEntry(request_id, verdicts={})
            while len(entries) > self.size:
                entries.popitem(last=False)
        else:
            entries.move_to_end(request_id)
        seq = result.seq
        if seq >= entry.results:
            entry.results = seq + 1
            verdict = result.verdict
            if verdict is not None:  # verdicts of the results the ring saw, each once
                value = _VERDICT_VALUES[verdict]
                entry.verdicts[value] = entry.verdicts.get(value, 0) + 1
        if result.final:
            entry.final = True
        if result.error is not None:
            entry.error = shown_kind(result.error)  # the publisher's text: bounded
        entry.last_seen = now

    def newest_first(self) -> list[RecentEntry]:
        return list(reversed(self._entries.values()))
