"""Edge counters for ``GET /metrics``, exposed through ``prometheus-client`` at scrape time.

The request path bumps plain integers in :class:`EdgeMetrics`; :class:`EdgeCollector` turns them
into metric families only when scraped (see :mod:`streamproc.metrics`).
"""

from __future__ import annotations

import gc
from typing import Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.codec import known_kind
from ..core.read_budget import ReadBudget
from ..core.events import ResultInfo
from ..metrics import struct_families

_NAMESPACE = "streamproc_edge"


class EdgeMetrics(msgspec.Struct):
    """Counters (rendered with ``_total``) and gauges of one edge process; HELP texts are in ``_HELP``."""

    streams_opened: int = 0
    opens_paced: int = 0
    streams_rejected: int = 0
    streams_rejected_client: int = 0
    connections_refused: int = 0
    connections_open: int = 0
    head_timeouts: int = 0
    tls_handshakes_unfinished: int = 0
    heads_too_large: int = 0
    invalid_http_requests: int = 0
    pipelines_too_deep: int = 0
    connections_stalled: int = 0
    bodies_timed_out: int = 0
    bodies_too_large: int = 0
    experts_bodies_timed_out: int = 0
    experts_bodies_refused: int = 0
    experts_bodies_abandoned: int = 0
    streams_overrun: int = 0
    streams_behind: int = 0
    streams_stalled: int = 0
    unauthorized: int = 0
    forbidden: int = 0
    unary_too_large: int = 0
    recent_dropped: int = 0
    streams_active: int = 0
    streams_completed: int = 0
    client_disconnects: int = 0
    unary_requests: int = 0
    results_sent: int = 0
    results_written_directly: int = 0
    results_seen: int = 0
    duplicates_dropped: int = 0
    malformed_results: int = 0
    gaps: int = 0
    stale_finals: int = 0
    result_timeouts: int = 0
    keepalives_sent: int = 0
    jetstream_replays: int = 0
    replay_pauses: int = 0
    replay_reads_by_subject: int = 0
    replay_consumer_waits: int = 0
    core_subscriptions: int = 0
    streams_dispatched: int = 0
    streams_fallback: int = 0
    stored_reads_refused: int = 0
    results_stream_deleted: int = 0
    results_stream_recreated: int = 0
    ring_consumers_lost: int = 0
    streams_gone: int = 0
    nats_connected: int = 0
    nats_disconnects: int = 0
    nats_reconnects: int = 0
    nats_foreign_messages: int = 0
    by_verdict: dict[str, int] = {}  # results sent, by verdict ("error" for error results)
    by_error_kind: dict[str, int] = {}

    def sent(self, result: ResultInfo) -> None:
        """One result body went to a client (DirectFrames.offer counts its own writes inline, alike)."""
        self.results_sent += 1
        verdict = "error" if result.error is not None else (result.verdict or "unknown")
        self.by_verdict[verdict] = self.by_verdict.get(verdict, 0) + 1
        if result.error is not None:
            kind = known_kind(result.error)  # the publisher's text: bounded labels
            self.by_error_kind[kind] = self.by_error_kind.get(kind, 0) + 1


_HELP: dict[str, tuple[str, str]] = {
    "streams_opened": ("counter", "result streams opened (SSE and unary)"),
    "opens_paced": ("counter", "result requests that waited for a later event-loop pass because more "
                               "opens came in one pass than the edge starts per pass (edge/pacer.py)"),
    "streams_rejected": ("counter", "requests refused with 503 because --max-streams streams were open"),
    "streams_rejected_client": ("counter", "requests refused with 429 because their client had "
                                           "--max-streams-per-client streams open"),
    "connections_refused": ("counter", "connections answered 503 unread because --max-connections were open "
                                       "(over TLS: closed before their handshake, which counts against the limit)"),
    "connections_open": ("gauge", "HTTP connections open now (refused ones apart)"),
    "head_timeouts": ("counter", "connections closed (408, unless a response was in progress) with no complete request head within --head-timeout"),
    "tls_handshakes_unfinished": ("counter", "HTTPS connections that ended before their TLS handshake did (failed, "
                                             "left, or not done within --head-timeout)"),
    "heads_too_large": ("counter", "connections closed (431, unless a response was in progress) for a request head over --max-head-bytes"),
    "invalid_http_requests": ("counter", "request heads the HTTP parser refused (answered 400 and closed; "
                                         "logged as invalid_http_request, rate-limited)"),
    "pipelines_too_deep": ("counter", "connections closed unanswered because more requests were pipelined "
                                      "behind the one in progress than the edge queues (connections.MAX_PIPELINED)"),
    "connections_stalled": ("counter", "connections aborted because their client took nothing of a response "
                                       "for --write-timeout (an SSE stream's is counted as streams_stalled first)"),
    "bodies_timed_out": ("counter", "connections closed because the body of a request answered before it was "
                                    "read (401, 404, /healthz ...) did not end within --head-timeout of the answer"),
    "bodies_too_large": ("counter", "connections closed because the body of a request answered before it was "
                                    "read went on past 1 MiB after the answer (64 MiB for an upload: POST, PUT, PATCH)"),
    "experts_bodies_timed_out": ("counter", "POST /v1/experts requests answered 408 and closed because their body "
                                            "was not complete within --head-timeout"),
    "experts_bodies_refused": ("counter", "POST /v1/experts requests refused (429 for the client's share, 503 "
                                          "edge-wide) because the bodies posted meanwhile held their bound"),
    "experts_bodies_abandoned": ("counter", "POST /v1/experts requests whose client left before their body ended "
                                            "(nothing decoded, nothing answered)"),
    "streams_overrun": ("counter", "streams ended because their client fell --stream-buffer-bytes behind"),
    "streams_behind": ("counter", "times a live JetStream stream's client fell --stream-buffer-bytes behind: "
                                  "it read on from the results stream instead of ending"),
    "streams_stalled": ("counter", "streams closed because one write blocked for --write-timeout"),
    "unauthorized": ("counter", "requests refused with 401 (no, invalid or expired capability)"),
    "forbidden": ("counter", "requests refused with 403 (a valid capability for other request ids)"),
    "unary_too_large": ("counter", "unary answers refused because the results passed --max-unary-bytes"),
    "recent_dropped": ("counter", "results the /v1/recent ring missed because the edge was behind"),
    "streams_active": ("gauge", "result streams open now"),
    "streams_completed": ("counter", "SSE streams that ended with [DONE]"),
    "client_disconnects": ("counter", "SSE streams ended by the client before [DONE]"),
    "unary_requests": ("counter", "unary (application/json) result requests"),
    "results_sent": ("counter", "result bodies sent to clients"),
    "results_written_directly": ("counter", "result bodies the fan-out wrote to their idle stream's client "
                                            "itself (also in results_sent)"),
    "results_seen": ("counter", "results seen on P.results.> by the recent-requests subscription (all requests)"),
    "duplicates_dropped": ("counter", "repeated results dropped (same seq seen twice)"),
    "malformed_results": ("counter", "messages on a result subject that break the wire contract"),
    "gaps": ("counter", "streams ended because a seq stayed missing for --gap-timeout"),
    "stale_finals": ("counter", "streams ended with an error by a final result below a seq already seen"),
    "result_timeouts": ("counter", "streams ended because no result came for --result-timeout"),
    "keepalives_sent": ("counter", "keep-alive comments sent"),
    "jetstream_replays": ("counter", "streams read from the JetStream results stream (replay, then live)"),
    "replay_pauses": ("counter", "times a late attach's history came faster than its client read it: consumer stopped, read on later"),
    "replay_reads_by_subject": ("counter", "stored results a late attach read by subject because the edge held --max-replay-consumers (or kept a freed one for a waiting catch-up), or because its pulls (CONSUMER.MSG.NEXT) are refused"),
    "replay_consumer_waits": ("counter", "waits of catch-ups that may not read by subject (STREAM.MSG.GET refused) for a consumer past --max-replay-consumers: one per consumer a catch-up had to wait for, not per look while it waits"),
    "core_subscriptions": ("counter", "streams read live only (core NATS: their own subscription, or the "
                                      "recent ring's wildcard one)"),
    "streams_dispatched": ("gauge", "streams fed now from the recent ring's wildcard subscription (no "
                                    "subscription of their own)"),
    "streams_fallback": ("counter", "JetStream streams that read their stored history without "
                                    "STREAM.MSG.GET (refused, or unanswered): with consumers in the read "
                                    "budget, or an ordered consumer of their own"),
    "stored_reads_refused": ("gauge", "1 while STREAM.MSG.GET on the results stream is refused (stored "
                                      "histories are read with consumers instead; docs/security.md)"),
    "results_stream_deleted": ("counter", "times the watch found a results stream the edge read deleted"),
    "ring_consumers_lost": ("counter", "times the watch found the recent ring's consumer deleted on the server "
                                       "and made it again from the last result the ring read"),
    "results_stream_recreated": ("counter", "times the watch found a results stream to read again: created anew "
                                            "under the name it read, or found after a deletion"),
    "streams_gone": ("counter", "result streams ended with an unavailable error because the results stream "
                                "they read was deleted or recreated"),
    "nats_connected": ("gauge", "1 while the NATS connection is up"),
    "nats_disconnects": ("counter", "NATS disconnections"),
    "nats_reconnects": ("counter", "NATS reconnections"),
    "nats_foreign_messages": ("counter", "messages dropped from a JetStream consumer's inbox because they did "
                                         "not come from JetStream (forged: nats/robust.py)"),
}


class EdgeCollector(Collector):
    """Reads one edge's :class:`EdgeMetrics` (and its replays' read budget) at scrape time."""

    def __init__(self, metrics: EdgeMetrics, read_budget: ReadBudget | None = None) -> None:
        self._m = metrics
        self._budget = read_budget

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield from struct_families("streamproc_edge", m, {k: text for k, (_, text) in _HELP.items()},
                                   skip=("by_verdict", "by_error_kind", "streams_dispatched", "stored_reads_refused",
                                         "connections_open"))
        for gauge in ("streams_dispatched", "stored_reads_refused", "connections_open"):  # gauges (streamproc.metrics.GAUGES is shared)
            yield GaugeMetricFamily(f"streamproc_edge_{gauge}", _HELP[gauge][1], value=getattr(m, gauge))
        budget = self._budget
        if budget is not None:  # the replays' read budget (core/read_budget.py; docs/edge.md)
            yield GaugeMetricFamily("streamproc_edge_replay_read_budget_bytes", "--replay-read-budget: bytes of "
                                    "stored results all replays together may have asked nats-server for and not "
                                    "yet received", value=budget.limit)
            yield GaugeMetricFamily("streamproc_edge_replay_read_out_bytes", "bytes of stored results asked of "
                                    "nats-server (pulls' max_bytes, STREAM.MSG.GET answers) and not yet received, "
                                    "now", value=budget.out)
            yield GaugeMetricFamily("streamproc_edge_replay_read_queued", "stored reads waiting their turn in "
                                    "the read budget now", value=budget.queued)
            yield CounterMetricFamily("streamproc_edge_replay_read_bytes", "bytes of stored results the read "
                                      "budget let replays ask nats-server for", value=budget.granted_total)
            yield CounterMetricFamily("streamproc_edge_replay_read_waits", "stored reads (pulls, STREAM.MSG.GET) "
                                      "that waited for the read budget", value=budget.waits)
        verdicts = CounterMetricFamily("streamproc_edge_results_by_verdict", "result bodies sent to clients, "
                                       "by verdict", labels=["verdict"])
        for verdict, n in sorted(m.by_verdict.items()):
            verdicts.add_metric([verdict], n)
        yield verdicts
        kinds = CounterMetricFamily("streamproc_edge_error_results", "error results sent to clients, by kind",
                                    labels=["kind"])
        for kind, n in sorted(m.by_error_kind.items()):
            kinds.add_metric([kind], n)
        yield kinds
        collections = CounterMetricFamily("streamproc_edge_gc_collections", "garbage collections of this "
                                          "process, by generation (each one pauses every stream)",
                                          labels=["generation"])
        for generation, stats in enumerate(gc.get_stats()):
            collections.add_metric([str(generation)], stats["collections"])
        yield collections
