"""``GET /v1/stats``: the few numbers the live page charts, as JSON.

Results per second come from the edge itself: every result on ``P.results.>`` that its
recent-requests subscription sees (all requests, not only the ones a client follows), and the
results it sent to clients. Latencies are measured where the join happens, in the processor, the
same way in core and durable mode (``streamproc_join_wait_seconds``: how long a P/D result waited
for its prefill leg, the join's own time not included; the page charts it as "join wait";
``streamproc_join_seconds``: the codec join's own CPU time, on or off the loop, charted beside it;
``streamproc_result_latency_seconds``: chunk received -> the results it made ready handed to
NATS); results carry no timing headers, so the edge reads those histograms from the processors' ``/metrics``
(``--processor-metrics-url``, comma-separated, one per processor) and sums them. Scrapes are
cached for ``CACHE_SECONDS`` so any number of open pages costs one scrape per processor per second.
The page turns cumulative buckets into per-interval means and quantiles itself.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request

import anyio
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from ..config import redact_query
from ..core.errors import cut_error_text
from .metrics import EdgeMetrics

HISTOGRAMS = {"join_wait": "streamproc_join_wait_seconds", "join": "streamproc_join_seconds",
              "result_latency": "streamproc_result_latency_seconds"}
RESULTS_TOTAL = "streamproc_results"  # the processor's results by verdict
CACHE_SECONDS = 1.0
SCRAPE_TIMEOUT = 2.0
MAX_SCRAPE_BYTES = 4 << 20


class Histogram(msgspec.Struct):
    """Cumulative buckets ``[[le, count], ...]`` ending with ``+Inf``, summed over processors."""

    buckets: list[tuple[float, float]] = []
    sum: float = 0.0
    count: float = 0.0


class Scrape(msgspec.Struct):
    url: str  # as given, its query values and fragment <redacted> (a scrape credential may be there)
    ok: bool
    error: str | None = None


class Stats(msgspec.Struct):
    time: float
    results_seen: int | None  # results on P.results.> (the recent-requests subscription; None with --recent 0)
    results_sent: int  # result bodies sent to this edge's clients
    streams_active: int
    processors: list[Scrape] = []
    processor_results: float | None = None  # sum of the processors' results, every verdict
    join_wait: Histogram | None = None
    join: Histogram | None = None  # the join's own CPU time, beside the wait before it
    result_latency: Histogram | None = None


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as response:  # noqa: S310 - an operator's URL
        data = response.read(MAX_SCRAPE_BYTES + 1)
    if len(data) > MAX_SCRAPE_BYTES:
        raise ValueError(f"more than {MAX_SCRAPE_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


def _add(text: str, hists: dict[str, Histogram], totals: list[float]) -> None:
    names = {family: key for key, family in HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        if family.name == RESULTS_TOTAL:
            totals.append(sum(s.value for s in family.samples if s.name.endswith("_total")))
        key = names.get(family.name)
        if key is None:
            continue
        hist = hists.setdefault(key, Histogram())
        bounds: dict[float, float] = dict(hist.buckets)
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                bounds[le] = bounds.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                hist.sum += sample.value
            elif sample.name.endswith("_count"):
                hist.count += sample.value
        hist.buckets = sorted(bounds.items())


def _scrubbed(error: str, url: str, shown: str) -> str:
    """A scrape's error text without the URL's query values: http.client's ``InvalidURL`` (a URL with a
    space or control character) repeats the path and query, as given or escaped by ``repr()``."""
    query = url.partition("#")[0].partition("?")[2]
    if not query:
        return error
    redacted = shown.partition("#")[0].partition("?")[2]
    # InvalidURL repeats them through repr(), which escapes a tab, DEL or backslash in a value
    return error.replace(query, redacted).replace(repr(query)[1:-1], redacted)


class StatsSource:
    """Builds :class:`Stats`; the processors' histograms are scraped at most once per second."""

    def __init__(self, metrics: EdgeMetrics, processor_urls: list[str], *, sees_all_results: bool) -> None:
        self.metrics = metrics
        self.sees_all_results = sees_all_results
        self.urls = processor_urls
        self.shown = [redact_query(url) for url in processor_urls]  # what /v1/stats names: never a query value
        self._cached: tuple[float, list[Scrape], dict[str, Histogram], float | None] | None = None
        self._lock = anyio.Lock()

    async def snapshot(self) -> Stats:
        m = self.metrics
        scrapes, hists, results = await self._processors()
        seen = m.results_seen if self.sees_all_results else None
        return Stats(time.time(), seen, m.results_sent, m.streams_active, scrapes, results,
                     join_wait=hists.get("join_wait"), join=hists.get("join"),
                     result_latency=hists.get("result_latency"))

    async def _processors(self) -> tuple[list[Scrape], dict[str, Histogram], float | None]:
        if not self.urls:
            return [], {}, None
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < CACHE_SECONDS:
                return self._cached[1:]
            scrapes: list[Scrape] = []
            hists: dict[str, Histogram] = {}
            totals: list[float] = []
            for url, shown in zip(self.urls, self.shown):
                try:
                    text = await anyio.to_thread.run_sync(_scrape, url)
                    _add(text, hists, totals)
                    scrapes.append(Scrape(shown, True))
                except (OSError, ValueError, urllib.error.URLError, http.client.HTTPException) as exc:
                    # Cut (errors.MAX_ERROR_TEXT bytes as JSON) once scrubbed: the text parser's ValueError
                    # repeats the offending line, up to MAX_SCRAPE_BYTES, in every /v1/stats answer
                    error = _scrubbed(str(exc) or type(exc).__name__, url, shown)
                    scrapes.append(Scrape(shown, False, cut_error_text(error)))
            results = sum(totals) if totals else None
            self._cached = (now, scrapes, hists, results)
            return scrapes, hists, results
