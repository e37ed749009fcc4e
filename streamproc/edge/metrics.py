"""Edge counters, rendered in the Prometheus text exposition format for ``GET /metrics``.

A handful of plain integers is all the edge needs; they live in one process, so the
``prometheus-client`` registry (and its multiprocess caveats) would add a dependency for nothing.
"""

from __future__ import annotations

import msgspec

_NAMESPACE = "streamproc_edge"


class EdgeMetrics(msgspec.Struct):
    """Counters (rendered with ``_total``) and gauges of one edge process; HELP texts are in ``_HELP``."""

    streams_opened: int = 0
    streams_rejected: int = 0
    streams_active: int = 0
    streams_completed: int = 0
    client_disconnects: int = 0
    unary_requests: int = 0
    results_sent: int = 0
    duplicates_dropped: int = 0
    malformed_results: int = 0
    gaps: int = 0
    result_timeouts: int = 0
    keepalives_sent: int = 0
    jetstream_replays: int = 0
    core_subscriptions: int = 0
    nats_connected: int = 0
    nats_disconnects: int = 0


_HELP = {
    "streams_opened": ("counter", "result streams opened (SSE and unary)"),
    "streams_rejected": ("counter", "requests refused with 503 because --max-streams streams were open"),
    "streams_active": ("gauge", "result streams open now"),
    "streams_completed": ("counter", "SSE streams that ended with [DONE]"),
    "client_disconnects": ("counter", "SSE streams ended by the client before [DONE]"),
    "unary_requests": ("counter", "unary (application/json) result requests"),
    "results_sent": ("counter", "result bodies sent to clients"),
    "duplicates_dropped": ("counter", "repeated results dropped (same seq seen twice)"),
    "malformed_results": ("counter", "messages on a result subject that break the wire contract"),
    "gaps": ("counter", "streams ended because a seq stayed missing for --gap-timeout"),
    "result_timeouts": ("counter", "streams ended because no result came for --result-timeout"),
    "keepalives_sent": ("counter", "keep-alive comments sent"),
    "jetstream_replays": ("counter", "streams read from the JetStream results stream (replay, then live)"),
    "core_subscriptions": ("counter", "streams read from a core NATS subscription (live only)"),
    "nats_connected": ("gauge", "1 while the NATS connection is up"),
    "nats_disconnects": ("counter", "NATS disconnections"),
}


def render(metrics: EdgeMetrics) -> str:
    lines = []
    for name in metrics.__struct_fields__:
        kind, text = _HELP[name]
        full = f"{_NAMESPACE}_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}", f"{full} {getattr(metrics, name)}"]
    return "\n".join(lines) + "\n"
