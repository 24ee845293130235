"""Traces across the three processes into a real OTLP collector, and /metrics."""

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from flagstop.v1 import generation_pb2
from tests.helpers.metrics import scrape
from tools.make_model import write_model
from tools.otlp_collector import attributes, start_collector, wait_for
from tools.stack import start_stack

pytestmark = pytest.mark.processes  # every test here runs processes

MODEL = "flagstop-tiny"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    server, collector, port = start_collector()
    model_dir = write_model(tmp_path_factory.mktemp("model") / MODEL, "tiny")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "256"], env=env
    )
    yield stack, collector
    assert set(stack.stop().values()) == {0}
    server.stop(0)


def stream(stack, max_tokens: int, metadata=()) -> list[int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=[0, 5, 6, 7], max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    call = stack.generation().Generate(request, timeout=60, metadata=metadata)
    return [t for chunk in call for t in chunk.token_ids]


def test_one_trace_per_request_across_the_three_processes(traced):
    stack, collector = traced
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = (("traceparent", f"00-{client_trace}-{client_span}-01"),)
    with ThreadPoolExecutor(3) as pool:
        futures = {
            n: pool.submit(stream, stack, n, traceparent if n == 5 else ()) for n in (5, 7, 9)
        }
        received = {n: f.result() for n, f in futures.items()}

    def router_spans():
        spans = {
            attributes(s).get("gen_ai.request.max_tokens"): s
            for s in collector.named(f"generate {MODEL}")
        }
        return spans if {5, 7, 9} <= set(spans) else None

    routers = wait_for(router_spans)

    # The scheduler's spans of these very traces: a count would be met by the spans of
    # requests other tests of this module sent earlier (in random order), before this
    # test's batch is exported.
    def request_spans():
        spans = collector.named("scheduler.request")
        traces = {r.trace_id for r in spans}
        return spans if all(s.trace_id in traces for s in routers.values()) else None

    requests = wait_for(request_spans)
    for max_tokens, span in routers.items():
        if max_tokens not in received:
            continue
        attrs = attributes(span)
        assert span.kind == span.SPAN_KIND_SERVER
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.request.model"] == MODEL and attrs["gen_ai.usage.input_tokens"] == 4
        assert attrs["gen_ai.usage.output_tokens"] == len(received[max_tokens]) == max_tokens
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.server.time_to_first_token"] > 0
        assert any(e.name == "first token" for e in span.events)
        [child] = [r for r in requests if r.trace_id == span.trace_id]
        assert child.parent_span_id == span.span_id
    honoured = routers[5]
    assert honoured.trace_id.hex() == client_trace and honoured.parent_span_id.hex() == client_span

    request_ids = {
        r.span_id for r in requests if r.trace_id in {s.trace_id for s in routers.values()}
    }

    # Spans arrive in export batches: wait for all that the assertions need.
    def steps_linking_every_request():
        steps = collector.named("scheduler.step")
        linked = {link.span_id for step in steps for link in step.links}
        return steps if request_ids <= linked else None

    steps = wait_for(steps_linking_every_request)
    assert all(link.span_id in {r.span_id for r in collector.named("scheduler.request")}
               for step in steps for link in step.links)  # fmt: skip
    served = [s for s in steps if any(link.span_id in request_ids for link in s.links)]

    def executor_spans_of_every_served_step():
        children = {(e.trace_id, e.parent_span_id) for e in collector.named("executor.step")}
        return all((s.trace_id, s.span_id) in children for s in served)

    wait_for(executor_spans_of_every_served_step)

    def executor_spans_all_under_steps():
        step_ids = {(s.trace_id, s.span_id) for s in collector.named("scheduler.step")}
        executors = collector.named("executor.step")
        return all((e.trace_id, e.parent_span_id) in step_ids for e in executors)

    wait_for(executor_spans_all_under_steps)
    assert sum(attributes(s)["flagstop.scheduled_tokens"] for s in served) >= 3 * 4 + 5 + 7 + 9 - 3
    assert collector.services() == {"flagstop-router", "flagstop-scheduler", "flagstop-executor"}


def test_metrics_move_with_traffic(traced):
    stack, _ = traced
    ports = stack.metrics_ports
    label = str(sorted({"model_name": MODEL}.items()))
    before = {name: scrape(port) for name, port in ports.items()}
    tokens = sum(len(stream(stack, n)) for n in (4, 6))
    stack.wait_idle()
    after = {name: scrape(port) for name, port in ports.items()}

    def delta(service: str, name: str, labels: str = label) -> float:
        return after[service].get(name + labels, 0) - before[service].get(name + labels, 0)

    assert delta("router", "vllm:generation_tokens_total") == tokens == 10
    assert delta("router", "vllm:prompt_tokens_total") == 8
    assert delta("router", "vllm:time_to_first_token_seconds_count") == 2
    assert delta("router", "vllm:e2e_request_latency_seconds_count") == 2
    # One inter-token interval per chunk after a stream's first: at most a token's each.
    assert 0 <= delta("router", "vllm:inter_token_latency_seconds_count") <= tokens - 2
    assert delta("router", "vllm:inter_token_latency_seconds_sum") <= delta(
        "router", "vllm:e2e_request_latency_seconds_sum")  # fmt: skip
    assert "vllm:inter_token_latency_seconds_count" + label in after["router"]
    success = str(sorted({"model_name": MODEL, "finished_reason": "length"}.items()))
    assert delta("router", "vllm:request_success_total", success) == 2
    assert delta("scheduler", "flagstop:step_duration_seconds_count") >= 6
    assert delta("scheduler", "vllm:prefix_cache_queries_total") == 8
    assert after["scheduler"]["vllm:num_requests_running" + label] == 0
    assert after["scheduler"]["vllm:kv_cache_usage_perc" + label] == 0
    assert delta("executor", "flagstop:executor_step_seconds_count") >= 6


def test_an_abandoned_stream_leaves_an_abort_event(traced):
    stack, collector = traced
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=[0, 9, 9], max_tokens=500, ignore_eos=True, top_k=77
    )
    call = stack.generation().Generate(request, timeout=60)
    next(call)
    call.cancel()
    stack.wait_idle()

    def aborted():
        spans = [
            s
            for s in collector.named(f"generate {MODEL}")
            if attributes(s).get("gen_ai.request.top_k") == 77
        ]
        return spans[0] if spans else None

    span = wait_for(aborted)
    assert any(e.name == "abort" for e in span.events)
    assert span.status.code == span.status.STATUS_CODE_ERROR
    [request_span] = wait_for(
        lambda: [r for r in collector.named("scheduler.request") if r.trace_id == span.trace_id]
    )
    assert attributes(request_span)["gen_ai.response.finish_reasons"] == ["abort"]


def test_a_policy_fallback_is_an_event_on_the_step_in_flight():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
    from flagstop.telemetry import Telemetry

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = SchedulerTelemetry(Telemetry("test"))
    telemetry.enabled, telemetry.tracer = True, provider.get_tracer("test")
    step = telemetry.tracer.start_span("scheduler.step")
    telemetry.steps[7] = (0.0, step)
    telemetry.event("policy fallback", {"flagstop.reason": "deadline"})
    step.end()
    telemetry.steps.clear()
    telemetry.event("policy fallback", {"flagstop.reason": "unavailable"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [(e.name, e.attributes["flagstop.reason"]) for e in spans["scheduler.step"].events] == [
        ("policy fallback", "deadline")
    ]
    assert [e.name for e in spans["scheduler.event"].events] == ["policy fallback"]


def test_an_http_request_gets_the_same_span_and_honours_traceparent(traced):
    import httpx

    stack, collector = traced
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=60,
                       headers={"traceparent": f"00-{client_trace}-{client_span}-01"})  # fmt: skip
    assert reply.status_code == 200

    def the_span():
        spans = [s for s in collector.named(f"generate {MODEL}")
                 if s.trace_id.hex() == client_trace]  # fmt: skip
        return spans[0] if spans else None

    span = wait_for(the_span)
    attrs = attributes(span)
    assert span.parent_span_id.hex() == client_span and span.kind == span.SPAN_KIND_SERVER
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
