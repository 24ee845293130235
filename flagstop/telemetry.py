"""One telemetry setup for every process: OpenTelemetry tracing configured by the
standard OTEL_* variables, W3C trace context carried as strings in our messages, and
a Prometheus /metrics endpoint.

Tracing is on only when an OTLP endpoint is configured; otherwise the tracer is a
no-op and the hot paths skip building span attributes altogether (`enabled`)."""

import atexit
import os

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# One set of histogram buckets (seconds) for every latency and step time: a 1 ms GPU
# step and a 2-minute request land in distinct buckets of the same scale.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
)  # fmt: skip


class Telemetry:
    __slots__ = ("enabled", "tracer")

    def __init__(self, service_name: str) -> None:
        self.enabled = any(os.environ.get(v) for v in ENDPOINT_VARIABLES)
        self.tracer: trace.Tracer = trace.NoOpTracer()
        if self.enabled:
            self.tracer = _sdk_tracer(service_name)


def _sdk_tracer(service_name: str) -> trace.Tracer:
    # Imported only when tracing is on: the SDK and the exporter cost start-up time.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*
    # and OTEL_EXPORTER_OTLP_* are read by the SDK itself.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    atexit.register(provider.shutdown)
    return provider.get_tracer("flagstop")


def inject(span: trace.Span) -> str:
    """The span's W3C traceparent, to carry in a message (metadata only travels when a
    stream opens, and our streams are long-lived)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def extract(traceparent: str) -> otel_context.Context | None:
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


def extract_metadata(metadata) -> otel_context.Context | None:
    """The context of an incoming call's W3C `traceparent` metadata, if any."""
    for key, value in metadata or ():
        if key == "traceparent":
            return extract(value)
    return None


def metrics_registry():
    """What /metrics shows: this process's metrics, or, when several processes serve
    together (PROMETHEUS_MULTIPROC_DIR, set by `flagstop-router --processes N`), the
    sum over all of them, so a scrape does not depend on which process answers."""
    import prometheus_client
    from prometheus_client import multiprocess

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return prometheus_client.REGISTRY
    registry = prometheus_client.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def start_metrics_server(port: int, host: str) -> None:
    """Prometheus /metrics over HTTP; port 0 turns it off."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=metrics_registry())
