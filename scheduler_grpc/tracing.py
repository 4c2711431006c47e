"""OpenTelemetry traces: off unless the standard `OTEL_*` environment variables turn them on.

One trace per run. The span that makes a run (`TriggerJob`'s `run.trigger`, the leader's
`run.fire`) is recorded with it: its W3C `traceparent` is written in the run's first attempt row
(`job_executions.trace_context`, migration 0013) and copied to every later attempt of the run. The
worker's claim reads it back, so each attempt's `run.claim` and `run.attempt` spans (and the
attempt's `handler <name>` span under it) are children of the span that made the run, whichever
process and machine they run on; the webhook handler sends the handler span's `traceparent`. An
RPC's span (`interceptors.ApiInterceptor`) continues the caller's trace when the call carries a
`traceparent` in its metadata.

Switch (`configure`, at each role's start): tracing is on when `OTEL_SDK_DISABLED` is not `true`
and either `OTEL_TRACES_EXPORTER` names an exporter other than `none` (`otlp`, `console`) or an
OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). The
SDK reads the rest itself (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
the OTLP exporter's endpoint, headers and timeouts, the batch processor's bounds).

Off, it costs nothing on the hot paths: no span object is made, and each instrumented place pays
one look-up of `enabled`. The SDK is imported only when tracing is turned on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from scheduler_grpc import logs

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

enabled = False
"""Whether spans are made (read at each instrumented place: `if tracing.enabled:`)."""

INSTRUMENTATION: Final = "scheduler_grpc"
DEFAULT_SERVICE: Final = "scheduler-grpc"
_EXPORTERS: Final = frozenset({"otlp", "console", "none"})

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
# The API's functions this module calls, bound by `install` (so an untraced process never imports
# OpenTelemetry, and a traced one pays no import statement per call).
_api: Any = None


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether these environment variables turn tracing on (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = _exporters(environ)
    if exporters is not None:
        return exporters != ["none"]
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporters(environ: Mapping[str, str]) -> list[str] | None:
    text = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not text:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in _EXPORTERS]
    if unknown:
        from scheduler_grpc.errors import ConfigError

        raise ConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} unknown (expected otlp, console or none)")
    return names


def configure(role: str, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process if the environment asks for it (a no-op otherwise).

    Spans go to the exporters named by `OTEL_TRACES_EXPORTER` (default `otlp`: OTLP over gRPC,
    where `OTEL_EXPORTER_OTLP_ENDPOINT` says, else localhost:4317) through a batch processor, so
    exporting is off the event loop. The resource is `OTEL_SERVICE_NAME` (default
    `scheduler-grpc`) with `scheduler.role` = `role`, and whatever `OTEL_RESOURCE_ATTRIBUTES` adds.

    Returns:
        Whether tracing is on.

    Raises:
        ConfigError: `OTEL_TRACES_EXPORTER` names an exporter this service does not ship.
    """
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    attributes: dict[str, Any] = {"scheduler.role": role}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = DEFAULT_SERVICE
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in _exporters(environ) or ["otlp"]:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()
        else:
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on", extra={"exporters": ",".join(_exporters(environ) or ["otlp"])})
    return True


def install(provider: TracerProvider) -> None:
    """Make spans with `provider` from now on (tests hand it an in-memory exporter)."""
    global enabled, _tracer, _provider, _api
    _api = _Api()
    _provider = provider
    _tracer = provider.get_tracer(INSTRUMENTATION)
    logs.span_ids = current_ids
    enabled = True


def uninstall() -> None:
    """Make no more spans (what was made stays with its provider)."""
    global enabled, _tracer, _provider
    enabled = False
    _tracer = None
    _provider = None
    logs.span_ids = None


def shutdown() -> None:
    """Export what is left (bounded by the SDK's export timeout) and stop; at the role's exit."""
    provider = _provider
    uninstall()
    if provider is not None:
        provider.shutdown()


def tracer() -> Tracer:
    assert _tracer is not None, "tracing is off"
    return _tracer


# -- context ---------------------------------------------------------------------------------------


class _Api:
    """The OpenTelemetry API calls of this module, imported once."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.attach = context.attach
        self.detach = context.detach
        self.current_span = trace.get_current_span
        self.in_context = trace.set_span_in_context
        self.propagator = TraceContextTextMapPropagator()
        self.Status = trace.Status
        self.ERROR = trace.StatusCode.ERROR
        self.SERVER = trace.SpanKind.SERVER
        self.CLIENT = trace.SpanKind.CLIENT
        self.INTERNAL = trace.SpanKind.INTERNAL
        self.PRODUCER = trace.SpanKind.PRODUCER
        self.CONSUMER = trace.SpanKind.CONSUMER


def traceparent(span: Span) -> str:
    """The W3C `traceparent` of `span` (`00-<trace id>-<span id>-<flags>`)."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def trace_id_of(value: str | None) -> str | None:
    """The trace id of a `traceparent` (None when absent or malformed)."""
    if not value:
        return None
    parts = value.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    try:
        int(parts[1], 16)
    except ValueError:
        return None
    return parts[1].lower()


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The context a `traceparent` (and `tracestate`) in `carrier` names; None without a valid one."""
    if "traceparent" not in carrier:
        return None
    context = _api.propagator.extract(carrier)
    return context if _api.current_span(context).get_span_context().is_valid else None


def parent(value: str | None) -> Context | None:
    """The context a stored `traceparent` names (a run's `trace_context`); None without one."""
    return extract({"traceparent": value}) if value else None


def inject(headers: MutableMapping[str, str]) -> None:
    """Set `traceparent` (and `tracestate`) of the current span in `headers`, replacing any there
    (whatever their case); nothing when no span is current."""
    carrier: dict[str, str] = {}
    _api.propagator.inject(carrier)
    if not carrier:
        return
    for key in [key for key in headers if key.lower() in ("traceparent", "tracestate")]:
        del headers[key]
    headers.update(carrier)


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids in hex (what log lines carry); None without one."""
    context = _api.current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


@contextmanager
def current(span: Span) -> Iterator[None]:
    """Make `span` the current span inside the block (log lines and outgoing requests see it)."""
    token = _api.attach(_api.in_context(span))
    try:
        yield
    finally:
        _api.detach(token)


def span_error(span: Span, description: str) -> None:
    """Mark `span` failed with `description`."""
    span.set_status(_api.Status(_api.ERROR, description))


def start(
    name: str,
    *,
    parent: Context | None = None,
    kind: str = "INTERNAL",
    attributes: Mapping[str, Any] | None = None,
    start_time: int | None = None,
) -> Span:
    """Start a span (end it with `span.end()`): a child of `parent`, else of the current span, else
    the root of a new trace. `kind` names a `SpanKind` (`SERVER`, `CLIENT`, `INTERNAL`, ...);
    `start_time` is in nanoseconds since the epoch (default now)."""
    return tracer().start_span(
        name, context=parent, kind=getattr(_api, kind), attributes=attributes, start_time=start_time
    )
