"""OpenTelemetry spans for the processor and the edge: the optional extra ``streamproc[otel]``.

Tracing is off unless the extra is installed *and* an exporter is configured by the standard
variables (``OTEL_TRACES_EXPORTER``, or an ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``). Off, nothing
here runs per message: :func:`from_environment` returns None once at start-up, and the inputs bind
the correlator's and nats-py's own methods (``Pipeline.receive``, ``Pipeline.finish``,
``Pipeline.publisher``), exactly as without this module.

On, the processor continues the worker's W3C ``traceparent`` (chunk header) with three spans::

    worker span -> streamproc.correlate (one per chunk, the correlator call)
                   -> streamproc.join (one per P/D result: joined, omitted or stitched)
                      -> streamproc.publish (one per publish attempt of a result)

and the result carries the publish span's ``traceparent``; the edge continues it with a
``streamproc.edge.frame`` span per SSE frame (parent: that result's publish span) and one
``streamproc.edge.stream`` span per SSE response (see :class:`StreamTrace` for why spans and not
events). Contexts are passed explicitly, never attached to the current context: the hot path is a
callback and the edge's frames an async generator, where attach/detach across ``await``/``yield``
breaks, and explicit contexts cost less.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping

from .core import defaults
from .core.codec import shown_kind
from .core.correlator import Work
from .core.errors import ConfigError
from .core.events import Result, ResultInfo, Verdict
from .core.wire import ERROR, ERROR_MSG_ID_SUFFIX, JOIN, MSG_ID, TRACEPARENT
from .logs import log_event

log = logging.getLogger("streamproc.tracing")

INSTRUMENTATION = "streamproc"
EXTRA_HINT = "pip install 'streamproc[otel]'"

# Span attributes (OpenTelemetry semantic conventions where one exists: messaging.*).
REQUEST_ID = "streamproc.request_id"
ROLE = "streamproc.role"
SEQ = "streamproc.seq"
VERDICT = "streamproc.verdict"
ERROR_KIND = "streamproc.error"
BYTES = "messaging.message.body.size"
OFFLOADED = "streamproc.join.offloaded"

MAX_REMEMBERED = (
    defaults.MAX_INFLIGHT
)  # requests whose latest correlate span context is kept (the oldest go first)

_JOIN_VERDICTS = frozenset({Verdict.JOINED, Verdict.OMITTED, Verdict.STITCHED})

Receive = Callable[[Any, float], list]
Publish = Callable[..., Awaitable[None]]


def available() -> bool:
    """Whether the ``otel`` extra (the OpenTelemetry SDK) is installed."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """Trace exporters the ``OTEL_*`` variables ask for; [] means tracing is off.

    ``OTEL_TRACES_EXPORTER`` as the SDK reads it (``opentelemetry.sdk._configuration
    ._get_exporter_names``: comma separated, ``none`` for none); unset, an OTLP endpoint variable
    alone selects ``otlp`` (the SDK's documented default exporter), and nothing selects nothing: a
    processor started without any ``OTEL_*`` variable never pays for tracing.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    out = [n.strip() for n in names.split(",") if n.strip()]
    return [] if out == ["none"] else [n for n in out if n != "none"]


def _entry_point_name(name: str, environ: Mapping[str, str]) -> str:
    """``otlp`` -> ``otlp_proto_grpc`` or ``otlp_proto_http`` by ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``,
    as ``opentelemetry.sdk._configuration._get_exporter_entry_point`` maps it."""
    if name != "otlp":
        return name
    variable = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
                     if environ.get(v)), None)
    protocol = environ[variable].strip() if variable else "grpc"
    by_protocol = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
    if protocol not in by_protocol:
        raise ConfigError(f"{variable}={protocol!r}: unsupported OTLP protocol (grpc or http/protobuf)")
    return by_protocol[protocol]


def from_environment(service: str, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """A :class:`Tracing` with the exporters ``OTEL_*`` configures, or None (tracing off).
    Raises :class:`ConfigError` (exit 2) for a variable naming no installed exporter or protocol.

    ``service`` is the ``service.name`` unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES``
    names one. The sampler is the SDK's (``OTEL_TRACES_SAMPLER``, default parent-based always-on,
    so a worker's sampling decision in its ``traceparent`` flags is followed). Spans leave through
    a ``BatchSpanProcessor`` (``OTEL_BSP_*``), off the message path.
    """
    environ = os.environ if environ is None else environ
    names = exporter_names(environ)
    if not names:
        return None
    if not available():
        log_event(
            log,
            logging.WARNING,
            "tracing_unavailable",
            exporters=",".join(names),
            detail=f"OTEL_* variables ask for traces but the otel extra is not installed: {EXTRA_HINT}",
        )
        return None
    from importlib.metadata import entry_points

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = "OTEL_SERVICE_NAME" in environ or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: service}))
    for name in names:
        point = _entry_point_name(name, environ)
        found = entry_points(group="opentelemetry_traces_exporter", name=point)
        if not found:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r}: no installed trace exporter {point!r}")
        provider.add_span_processor(BatchSpanProcessor(next(iter(found)).load()()))
    log_event(log, logging.INFO, "tracing_enabled", service=service, exporters=",".join(names))
    return Tracing(provider, owned=True)


class Tracing:
    """Spans of one component (processor or edge) from one ``TracerProvider``.

    ``owned``: the provider was built here (from the environment), so :meth:`shutdown` flushes
    and closes it; a provider handed in (tests, an embedding application) is left to its owner.
    """

    def __init__(self, provider: Any, *, owned: bool = False) -> None:
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._owned = owned
        self._tracer = provider.get_tracer(INSTRUMENTATION)
        self._trace = trace
        self._root = Context()  # an empty context: a span without a remote parent starts a trace
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = trace.SpanKind
        self._works: dict[Work, tuple[Any, int]] = {}  # an offloaded join -> (correlate context, decided ns)
        self._last: dict[str, Any] = {}  # request id -> its latest chunk's correlate SpanContext (_remember)
        self.skips_unsampled = self._drops_unsampled_parents()

    def _drops_unsampled_parents(self) -> bool:
        """Whether the sampler drops every span whose remote parent is not sampled (parent-based,
        the default): then a chunk with such a ``traceparent`` skips the spans altogether and its
        results carry the worker's ``traceparent`` on unchanged, which is all a non-recording span
        would have left behind, at the cost of one string check instead of the SDK's span set-up.
        Asked of the sampler through its public ``should_sample``, for a few trace ids."""
        from opentelemetry.sdk.trace.sampling import Decision

        sampler = getattr(self.provider, "sampler", None)
        if sampler is None:
            return False
        for trace_id in (1, 1 << 64, (1 << 128) - 1):
            parent = self.context(f"00-{trace_id:032x}-{1:016x}-00")
            if sampler.should_sample(parent, trace_id, "streamproc.correlate").decision is not Decision.DROP:
                return False
        return True

    def shutdown(self) -> None:
        if self._owned:
            self.provider.shutdown()

    # ------------------------------------------------------------------ contexts

    def context(self, traceparent: str | None) -> Any:
        """The remote parent a ``traceparent`` names (an empty context when absent or malformed)."""
        if not traceparent:
            return self._root
        return self._propagator.extract({TRACEPARENT: traceparent}, context=self._root)

    def traceparent(self, span: Any) -> str:
        """W3C ``traceparent`` of ``span`` (version 00), as ``TraceContextTextMapPropagator.inject``
        writes it."""
        c = span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"

    def _child(self, span: Any) -> Any:
        return self._trace.set_span_in_context(span, self._root)

    # ----------------------------------------------------------------- processor

    def receive(self, inner: Receive) -> Receive:
        """``Correlator.receive`` with a ``streamproc.correlate`` span per chunk (see :meth:`_annotate`)."""
        tracer = self._tracer
        consumer = self._kinds.CONSUMER

        skip = self.skips_unsampled

        def receive(chunk: Any, now: float) -> list:
            if skip:
                traceparent = chunk.traceparent
                if traceparent is not None and traceparent.endswith("-00"):  # the worker did not sample it
                    return inner(chunk, now)
            start = time.time_ns()  # kept here: an unsampled (non-recording) span has no start_time
            span = tracer.start_span(
                "streamproc.correlate",
                self.context(chunk.traceparent),
                consumer,
                {
                    REQUEST_ID: chunk.request_id,
                    ROLE: chunk.role.value,
                    SEQ: chunk.seq,
                    BYTES: len(chunk.body),
                },
                start_time=start,
            )
            try:
                decisions = inner(chunk, now)
            except BaseException as exc:
                span.record_exception(exc)
                span.end()
                raise
            parent = self._child(span)
            self._remember(chunk.request_id, span)
            self._annotate(decisions, parent, self.traceparent(span), start)
            span.end()
            return decisions

        return receive

    def _remember(self, request_id: str, span: Any) -> None:
        """The correlate span of a request's latest chunk: the parent of a join that the
        correlator queues now and decides later, inside another request's ``finish``. Only its
        ``SpanContext`` is kept (two integers and flags), not the span."""
        last = self._last
        last.pop(request_id, None)  # re-inserted last: the oldest entry is the first to go
        last[request_id] = span.get_span_context()
        if len(last) > MAX_REMEMBERED:
            del last[next(iter(last))]

    def finish(self, inner: Callable[[Work, float], list]) -> Callable[[Work, float], list]:
        """``Correlator.finish``: an offloaded join's span runs from its Work decision to here. What
        the same call releases for other requests (queued joins) goes under their latest chunk's
        correlate span."""

        def finish(work: Work, now: float) -> list:
            started = self._works.pop(work, None)
            decisions = inner(work, now)
            rid = work.request_id
            first = None
            if started is not None:
                parent, decided = started
                first = next((d for d in decisions if d.__class__ is Result and d.request_id == rid), None)
                if first is not None:
                    span = self._tracer.start_span(
                        "streamproc.join",
                        parent,
                        links=self._links(first),
                        start_time=decided,
                        attributes={REQUEST_ID: rid, OFFLOADED: True},
                    )
                    self._label(span, first)
                    span.end()
                    first.traceparent = self.traceparent(span)
            for d in decisions:
                if d is not first and (d.__class__ is Result or d.__class__ is Work):
                    if started is not None and d.request_id == rid:
                        parent = started[0]
                    else:
                        remembered = self._last.get(d.request_id)
                        parent = (
                            None
                            if remembered is None
                            else self._child(self._trace.NonRecordingSpan(remembered))
                        )
                    self._annotate((d,), parent, None, None)
            return decisions

        return finish

    def _links(self, result: Result) -> tuple:
        """A link to the worker span of the chunk that carried the result's body."""
        if not result.traceparent:
            return ()
        return (
            self._trace.Link(
                self._trace.get_current_span(self.context(result.traceparent)).get_span_context()
            ),
        )

    def _annotate(
        self, decisions: Iterable[Any], parent: Any, traceparent: str | None, start: int | None
    ) -> None:
        """Give each result its processor parent: a ``streamproc.join`` span for a P/D result (a
        child of ``parent``, a correlate span's context, or failing that of the result's own
        worker context), else the correlate span's ``traceparent``. An inline join runs inside the
        correlator call, which the pure core does not time apart, so its span covers that call; an
        offloaded one is timed by ``finish``. The decode chunk that carried the result's body is
        linked (another chunk, e.g. the prefill leg, may have released it). A final result ends
        the request: its remembered context is dropped."""
        for d in decisions:
            cls = d.__class__
            if cls is Work:
                if parent is not None:
                    self._works[d] = (parent, time.time_ns())
                continue
            if cls is not Result:
                continue
            if d.final:
                self._last.pop(d.request_id, None)
            if parent is None and self.skips_unsampled and d.traceparent and d.traceparent.endswith("-00"):
                continue  # off the message path, of an unsampled worker trace: nothing would be recorded
            if d.verdict in _JOIN_VERDICTS:
                span = self._tracer.start_span(
                    "streamproc.join",
                    parent if parent is not None else self.context(d.traceparent),
                    links=self._links(d) if parent is not None else (),
                    start_time=start,
                    attributes={REQUEST_ID: d.request_id, OFFLOADED: False},
                )
                self._label(span, d)
                span.end()
                d.traceparent = self.traceparent(span)
            elif traceparent is not None:
                d.traceparent = traceparent

    @staticmethod
    def _label(span: Any, result: Result) -> None:
        span.set_attribute(SEQ, result.seq)
        span.set_attribute(BYTES, len(result.body))
        if result.verdict is not None:
            span.set_attribute(VERDICT, result.verdict.value)

    def publisher(self, inner: Publish) -> Publish:
        """``nc.publish`` with a ``streamproc.publish`` span around every result (a message with
        headers); the result's ``traceparent`` header becomes the publish span's. Acks and pulls
        (no headers) go straight through."""
        tracer = self._tracer
        producer = self._kinds.PRODUCER
        skip = self.skips_unsampled

        async def publish(
            subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
        ) -> None:
            if headers is None or skip and headers.get(TRACEPARENT, "").endswith("-00"):
                return await inner(subject, payload, reply, headers)
            # <request_id>.<seq>, an error result's <request_id>.<seq>.error (core.wire.result_headers)
            msg_id = headers.get(MSG_ID, "").removesuffix(ERROR_MSG_ID_SUFFIX)
            rid, _, seq = msg_id.rpartition(".")
            attributes: dict[str, Any] = {
                "messaging.system": "nats",
                "messaging.destination.name": subject,
                REQUEST_ID: rid,
                BYTES: len(payload),
            }
            if seq.isdigit():
                attributes[SEQ] = int(seq)
            verdict = headers.get(JOIN)
            if verdict:
                attributes[VERDICT] = verdict
            if ERROR in headers:
                attributes[ERROR_KIND] = headers[ERROR]
            span = tracer.start_span(
                "streamproc.publish", self.context(headers.get(TRACEPARENT)), producer, attributes
            )
            headers[TRACEPARENT] = self.traceparent(span)
            try:
                await inner(subject, payload, reply, headers)
            except BaseException as exc:
                span.record_exception(exc)
                raise
            finally:
                span.end()

        return publish

    # ---------------------------------------------------------------------- edge

    def stream(self, request_id: str) -> StreamTrace:
        return StreamTrace(self, request_id)


class StreamTrace:
    """The spans of one SSE response at the edge.

    A span per frame rather than an event per frame on the stream span: a frame's parent must be
    *its* result's publish span (each result has its own; an event has no parent, so every frame
    after the first would fall out of its chunk's causal chain), and the frame span's duration is
    real — the async generator resumes only once the ASGI server has sent the frame, so a slow
    client shows as long frame spans. The stream span (``streamproc.edge.stream``, kind SERVER)
    starts when the client connected, takes the first result's context as parent (so it is in the
    request's trace; with no result at all it starts its own), counts frames and records how the
    stream ended; every frame span links to it.
    """

    __slots__ = ("_t", "_request_id", "_started", "_stream", "_frame", "_frames")

    def __init__(self, tracing: Tracing, request_id: str) -> None:
        self._t = tracing
        self._request_id = request_id
        self._started = time.time_ns()
        self._stream: Any = None
        self._frame: Any = None
        self._frames = 0

    def _open(self, parent: Any) -> Any:
        if self._stream is None:
            self._stream = self._t._tracer.start_span(
                "streamproc.edge.stream",
                parent,
                self._t._kinds.SERVER,
                {REQUEST_ID: self._request_id},
                start_time=self._started,
            )
        return self._stream

    def frame(self, result: ResultInfo, size: int) -> None:
        """A frame for ``result`` is about to be sent (``size`` bytes)."""
        t = self._t
        parent = t.context(result.traceparent)
        stream = self._open(parent)
        if t.skips_unsampled and result.traceparent is not None and result.traceparent.endswith("-00"):
            return  # unsampled: a non-recording span would leave nothing behind
        attributes: dict[str, Any] = {REQUEST_ID: self._request_id, SEQ: result.seq, BYTES: size}
        if result.verdict is not None:
            attributes[VERDICT] = result.verdict.value
        if result.error is not None:
            attributes[ERROR_KIND] = shown_kind(result.error)  # the results publisher's text
        self._frame = t._tracer.start_span(
            "streamproc.edge.frame",
            parent,
            t._kinds.CONSUMER,
            attributes,
            links=(t._trace.Link(stream.get_span_context()),),
        )

    def sent(self) -> None:
        """The frame left (the ASGI server's ``send`` returned)."""
        frame, self._frame = self._frame, None
        if frame is not None:
            self._frames += 1
            frame.end()

    def close(self, outcome: str) -> None:
        """The response ended: ``completed``, ``disconnected`` (client gone), ``timeout``..."""
        frame, self._frame = self._frame, None
        if frame is not None:  # the client left while this frame was being sent
            frame.set_attribute("streamproc.edge.outcome", outcome)
            frame.end()
        stream = self._open(self._t._root)
        stream.set_attribute("streamproc.edge.frames", self._frames)
        stream.set_attribute("streamproc.edge.outcome", outcome)
        stream.end()
