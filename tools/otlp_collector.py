"""An in-process OTLP/gRPC trace collector (the real opentelemetry-proto service)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes
                     if a.key == "service.name"), "",
                )  # fmt: skip
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list:
        with self.lock:
            return [span for _, span in self.spans if span.name == name]

    def services(self) -> set[str]:
        with self.lock:
            return {service for service, _ in self.spans}


def start_collector() -> tuple[grpc.Server, Collector, int]:
    collector = Collector()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, collector, port


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        out[a.key] = (
            [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
            if kind == "array_value"
            else getattr(value, kind)
        )  # fmt: skip
    return out


def wait_for(condition, timeout: float = 20.0):
    """condition()'s first truthy result: spans reach the collector in batches, some
    time after the work that made them."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "spans did not arrive"
        time.sleep(0.1)
    return result
