"""Prometheus metrics of the processor and the edge, built with ``prometheus-client``.

Nothing here runs per message: the hot paths keep bumping plain integers in their stats structs
(``Stats``, ``IOStats``, ``DurableStats``, ``EdgeMetrics``) and filling the core's
:class:`~streamproc.core.latency.LatencyHistogram`; a custom collector turns them into metric
families when ``/metrics`` is scraped. Each component gets its own registry, so several
processors or edges in one process (tests, the demo) never share counters.
"""

from __future__ import annotations

import functools
import typing
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .core.latency import LatencyHistogram

if TYPE_CHECKING:
    from .nats.processor import Processor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Correlator counters that are results by verdict; the rest become ``streamproc_<name>_total``.
_VERDICT_FIELDS = {"passthrough": "passthrough", "joined": "joined", "omitted": "omitted",
                   "stitched": "stitched", "errors": "error"}
# Struct fields that are gauges (a level now), not counters.
GAUGES = frozenset({"partitions", "members", "streams_active", "nats_connected"})


@functools.cache
def descriptions(struct: type[msgspec.Struct]) -> dict[str, str]:
    """Each field's ``Meta(description=...)``: a counter's HELP text lives on the field that counts it."""
    texts: dict[str, str] = {}
    for name, hint in typing.get_type_hints(struct, include_extras=True).items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, msgspec.Meta) and meta.description:
                texts[name] = meta.description
    return texts


def histogram(name: str, text: str, hist: LatencyHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, text, buckets=hist.cumulative(), sum_value=hist.total)


def struct_families(namespace: str, stats: msgspec.Struct, texts: Mapping[str, str] | None = None,
                    skip: Iterable[str] = ()) -> Iterator[Metric]:
    """One counter (or gauge, see ``GAUGES``) per integer field of a stats struct, described by
    ``texts`` or else by the fields' own descriptions."""
    texts = descriptions(type(stats)) if texts is None else texts
    skipped = set(skip)
    for field in stats.__struct_fields__:
        if field in skipped:
            continue
        value = getattr(stats, field)
        text = texts.get(field, field.replace("_", " "))
        if field in GAUGES:
            yield GaugeMetricFamily(f"{namespace}_{field}", text, value=value)
        else:
            yield CounterMetricFamily(f"{namespace}_{field}", text, value=value)


class ProcessorCollector(Collector):
    """Reads one processor's counters at scrape time."""

    def __init__(self, processor: Processor) -> None:
        self._p = processor

    def collect(self) -> Iterator[Metric]:
        p = self._p
        correlator = p.correlator
        stats = correlator.stats
        results = CounterMetricFamily("streamproc_results", "results published, by verdict", labels=["verdict"])
        for field, verdict in _VERDICT_FIELDS.items():
            results.add_metric([verdict], getattr(stats, field))
        yield results
        errors = CounterMetricFamily("streamproc_error_results", "error results, by error kind", labels=["kind"])
        for kind, n in sorted(correlator.error_kinds.items()):
            errors.add_metric([kind], n)
        yield errors
        omissions = CounterMetricFamily(
            "streamproc_omissions", "requests with a field omitted, by omission reason (unread: a result "
            "body too large to read for it; other: a reason this version does not know)", labels=["reason"])
        for reason, n in sorted(correlator.omission_reasons.items()):
            omissions.add_metric([reason], n)
        yield omissions
        yield from struct_families("streamproc", stats, skip=_VERDICT_FIELDS)
        yield from struct_families("streamproc", p.io)
        durable = p.input.stats if p.input is not None else None
        if durable is not None:
            yield from struct_families("streamproc_durable", durable)
        outbox = p.input.outbox if p.input is not None else None  # durable mode: results leave through it
        if outbox is not None:
            yield histogram("streamproc_durable_puback_latency_seconds",
                            "a result's last publish -> its PubAck (stored in the results stream)",
                            outbox.puback_latency)
            yield histogram("streamproc_durable_result_latency_seconds",
                            "chunk received -> the results it made ready stored (PubAck), end to end",
                            outbox.result_latency)
        yield histogram("streamproc_join_wait_seconds",
                        "time a P/D result waited for its prefill leg (0 when it was already there; "
                        "the join's own time is not in it)",
                        correlator.join_wait)
        yield histogram("streamproc_join_seconds",
                        "CPU time of the codec's join of one P/D result (its own run, on the loop or off "
                        "it; the wait for the prefill leg is streamproc_join_wait_seconds)",
                        correlator.join_seconds)
        yield histogram("streamproc_result_latency_seconds",
                        "chunk received -> the results it made ready handed to NATS (core and durable mode)",
                        p.pipeline.result_latency)
        yield GaugeMetricFamily("streamproc_inflight_requests", "requests with state in the correlator",
                                value=correlator.inflight)
        yield GaugeMetricFamily("streamproc_buffered_bytes", "chunk bodies held in reorder and prefill buffers",
                                value=correlator.buffered_bytes())
        yield GaugeMetricFamily("streamproc_retained_bytes",
                                "published bodies kept by reference for a possible migration",
                                value=correlator.retained_bytes())
        for name, text, value in (
                ("replies_refused", "migrates refused unanswered: their reply subject is outside --control-reply-prefix",
                 p.control_replies_refused),
                ("migrates_throttled", "migrates answered unavailable, untouched, past --max-migrate-rate",
                 p.control_migrates_throttled),
                ("migrates_dropped", "migrates nats-py dropped unread: the control subscription's queue was full",
                 p.control_migrates_dropped)):
            yield CounterMetricFamily(f"streamproc_control_{name}", text, value=value)
        server = p.status_server
        if server is not None:
            yield CounterMetricFamily("streamproc_http_connections_evicted",
                                      "status-server connections closed unanswered to make room: 64 were open",
                                      value=server.evicted)
            yield CounterMetricFamily("streamproc_http_accept_errors",
                                      "status-server accepts that failed (no file descriptors left, ...)",
                                      value=server.accept_errors)
        yield GaugeMetricFamily("streamproc_nats_connected", "1 while the NATS connection is up",
                                value=1 if p.connected else 0)
        yield GaugeMetricFamily("streamproc_ready", "1 while subscribed (core) or owning partitions (durable)",
                                value=1 if p.ready else 0)


def registry_for(*collectors: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def parse(text: str) -> dict[str, Any]:
    """``{'name{label="v"}': value}`` from an exposition, for tests and the demo."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out
