"""What the router reports: one SERVER span per request with GenAI semantic-convention
attributes, and the request-level Prometheus histograms and counters."""

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flagstop.scheduler_svc.core.objectives import NO_OBJECTIVES, Objectives
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.telemetry import LATENCY_BUCKETS, extract_metadata, inject

# vLLM's metric names: gateways (the Gateway API Inference Extension, llm-d), KEDA
# autoscalers and Grafana dashboards for vLLM read these, so they read ours unchanged.
TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
                 buckets=LATENCY_BUCKETS)  # fmt: skip
TPOT = Histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token",
                 ["model_name"], buckets=LATENCY_BUCKETS)  # fmt: skip
E2E = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                ["model_name"], buckets=LATENCY_BUCKETS)  # fmt: skip
ITL = Histogram("vllm:inter_token_latency_seconds", "Time between a request's chunks of tokens",
                ["model_name"], buckets=LATENCY_BUCKETS)  # fmt: skip
SUCCESS = Counter("vllm:request_success", "Finished requests", ["model_name", "finished_reason"])
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", ["model_name"])
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"])
# The same latencies by tenant and class (the request's objectives), and whether each
# finished request met its targets.
BY = ["model_name", "tenant", "class"]
TENANT_TTFT = Histogram("flagstop:time_to_first_token_seconds", "Time to first token", BY,
                        buckets=LATENCY_BUCKETS)  # fmt: skip
TENANT_TPOT = Histogram("flagstop:request_time_per_output_token_seconds",
                        "Mean time per output token", BY, buckets=LATENCY_BUCKETS)  # fmt: skip
TENANT_E2E = Histogram("flagstop:e2e_request_latency_seconds", "End-to-end request latency", BY,
                       buckets=LATENCY_BUCKETS)  # fmt: skip
SLO = Counter("flagstop:slo_requests", "Finished requests by whether they met their TTFT and "
              "TPOT targets (met, missed_ttft, missed_tpot, no_target) or were shed",
              [*BY, "result"])  # fmt: skip
ROUTED = Counter(
    "flagstop:routed_requests",
    "Requests sent to each replica, and why (prefix, least-cached, least-loaded, "
    "round-robin, moved, lora-warm, lora-room, session)",
    ["replica", "reason"],
)


class EngineLoad:
    """The engine's load as a vLLM server shows it beside its request metrics on its one
    port (aiperf and dashboards scrape :8000/metrics; so does llm-d's endpoint picker,
    every 50 ms: docs/llm-d.md): each replica's last reported running and waiting
    requests, KV cache usage, prefix-cache counters, pool shape and LoRA adapters,
    labelled by model and engine (the replica's place, vLLM's data-parallel rank
    label). Read at scrape time, so it costs the step loop nothing."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # Per replica: its last (running, waiting) adapters and when they changed
        # (vllm:lora_requests_info's value is the last update's time).
        self.loras: dict[int, tuple[tuple, float]] = {}

    def collect(self):
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Requests in the running batch", labels=labels)  # fmt: skip
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting",
                                    labels=labels)  # fmt: skip
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "Fraction of KV blocks in use (0-1)", labels=labels)  # fmt: skip
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                                      labels=labels)  # fmt: skip
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found cached",
                                   labels=labels)  # fmt: skip
        config = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's shape",
                                   labels=[*labels, "block_size", "num_gpu_blocks"])  # fmt: skip
        loras = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running and waiting LoRA adapters (the value: "
            "when they last changed)", labels=[*labels, "max_lora", "running_lora_adapters",
                                               "waiting_lora_adapters"])  # fmt: skip
        model = self.engine.model_info.model_name
        for rank, replica in enumerate(self.engine.replicas):
            load, where = replica.reported, [model, str(rank)]
            running.add_metric(where, load.num_running)
            waiting.add_metric(where, load.num_waiting)
            usage.add_metric(where, load.kv_cache_usage)
            queries.add_metric(where, load.prefix_cache_queries)
            hits.add_metric(where, load.prefix_cache_hits)
            config.add_metric([*where, str(replica.block_size), str(replica.num_blocks)], 1)
            if replica.max_loras:
                adapters = (",".join(load.running_loras), ",".join(load.waiting_loras))
                loras.add_metric([*where, str(replica.max_loras), *adapters],
                                 self._lora_updated(rank, adapters))  # fmt: skip
        return [running, waiting, usage, queries, hits, config, loras]

    def _lora_updated(self, rank: int, adapters: tuple) -> float:
        last = self.loras.get(rank)
        if last is None or last[0] != adapters:
            last = self.loras[rank] = (adapters, time.time())
        return last[1]


def engine_registry(engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineLoad(engine))
    return registry


def export_model(model: str) -> None:
    """The model's series, at zero, from the moment it is served (as vLLM does): a
    scrape before the first request, or a dashboard's rate(), sees them."""
    for family in (TTFT, TPOT, E2E, ITL, PROMPT_TOKENS, GENERATION_TOKENS):
        family.labels(model)
    for reason in (FinishReason.STOP, FinishReason.LENGTH):
        SUCCESS.labels(model, reason.label)


class RequestTrace:
    """The span and clocks of one client request."""

    __slots__ = ("by", "first_token_at", "itl", "last_token_at", "model", "objectives", "span",
                 "started")  # fmt: skip

    def __init__(
        self, tracer: trace.Tracer, model: str, request, num_prompt: int, metadata,
        operation: str = "text_completion", objectives: Objectives = NO_OBJECTIVES,
    ) -> None:  # fmt: skip
        """operation: gen_ai.operation.name, "text_completion" or "chat"."""
        self.model, self.started, self.first_token_at = model, time.monotonic(), 0.0
        self.last_token_at, self.itl = 0.0, ITL.labels(model)
        self.objectives, self.by = objectives, (model, objectives.tenant, objectives.request_class)
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "gen_ai.request.temperature": request.temperature
            if request.HasField("temperature")
            else 1.0,
            "gen_ai.request.top_p": request.top_p if request.HasField("top_p") else 1.0,
            "gen_ai.request.top_k": request.top_k,
            "gen_ai.usage.input_tokens": num_prompt,
        }
        if request.HasField("max_tokens"):
            attributes["gen_ai.request.max_tokens"] = request.max_tokens
        if request.HasField("seed"):
            attributes["gen_ai.request.seed"] = request.seed
        # An incoming W3C traceparent makes this span part of the client's trace.
        self.span = tracer.start_span(
            f"generate {model}", context=extract_metadata(metadata), kind=SpanKind.SERVER,
            attributes=attributes,
        )  # fmt: skip
        PROMPT_TOKENS.labels(model).inc(num_prompt)

    def traceparent(self) -> str:
        return inject(self.span) if self.span.is_recording() else ""

    def handed_off(self, decode_replica: str) -> None:
        """Its prefill is done at a prefill replica; its decode goes on elsewhere."""
        self.span.add_event("handed off", {"flagstop.decode_replica": decode_replica})

    def first_token(self) -> None:
        self.first_token_at = self.last_token_at = time.monotonic()
        self.span.add_event("first token")
        self.span.set_attribute(
            "gen_ai.server.time_to_first_token", self.first_token_at - self.started
        )
        TTFT.labels(self.model).observe(self.first_token_at - self.started)
        TENANT_TTFT.labels(*self.by).observe(self.first_token_at - self.started)

    def next_tokens(self) -> None:
        """A chunk of tokens after the first: vLLM's inter-token latency, one interval
        per chunk (a step's tokens, or several steps' when the stream fell behind), so
        it costs the stream one observation per message, never one per token."""
        now = time.monotonic()
        self.itl.observe(now - self.last_token_at)
        self.last_token_at = now

    def finish(self, reason: int, num_generated: int) -> None:
        now, name = time.monotonic(), FinishReason(reason).label
        self.span.set_attribute("gen_ai.usage.output_tokens", num_generated)
        self.span.set_attribute("gen_ai.response.finish_reasons", [name])
        E2E.labels(self.model).observe(now - self.started)
        TENANT_E2E.labels(*self.by).observe(now - self.started)
        tpot = None
        if num_generated > 1:
            tpot = (now - self.first_token_at) / (num_generated - 1)
            TPOT.labels(self.model).observe(tpot)
            TENANT_TPOT.labels(*self.by).observe(tpot)
        if reason != FinishReason.ABORT and self.first_token_at:
            ttft = self.first_token_at - self.started
            SLO.labels(*self.by, self.objectives.attained(ttft, tpot)).inc()
        GENERATION_TOKENS.labels(self.model).inc(num_generated)
        SUCCESS.labels(self.model, name).inc()
        self.span.end()

    def shed(self) -> None:
        """The scheduler's policy refused it (it would miss its targets)."""
        SLO.labels(*self.by, "shed").inc()

    def abort(self, why: str) -> None:
        """The stream ended early: cancelled, past its deadline, or failed."""
        if self.span.is_recording():
            self.span.add_event("abort", {"flagstop.reason": why})
            self.span.set_status(Status(StatusCode.ERROR, why))
            self.span.end()
