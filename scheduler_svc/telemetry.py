"""What the scheduler service reports: a span per request lifetime (child of the
router's span), a `scheduler.step` span per iteration linked to the requests it
served, and the Prometheus gauges and counters of the engine."""

import time

from opentelemetry import trace
from opentelemetry.trace import Link, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from flagstop.scheduler_svc.core.kv_connector import KVConnector
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.telemetry import LATENCY_BUCKETS, Telemetry, extract, inject
from flagstop.v1 import executor_pb2

RUNNING = Gauge("vllm:num_requests_running", "Requests in the running batch", ["model_name"])
WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"])
KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", ["model_name"])
PREEMPTIONS = Counter("vllm:num_preemptions", "Requests preempted", ["model_name"])
PREFIX_QUERIES = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up", ["model_name"])
PREFIX_HITS = Counter("vllm:prefix_cache_hits", "Prompt tokens found cached", ["model_name"])
EXTERNAL_QUERIES = Counter(
    "vllm:external_prefix_cache_queries",
    "Prompt tokens of requests admitted with a KV connector (a host tier, a prefill replica)",
    ["model_name"],
)  # fmt: skip
EXTERNAL_HITS = Counter(
    "vllm:external_prefix_cache_hits", "Of those, tokens loaded from the connector",
    ["model_name"],
)  # fmt: skip
HOST_USAGE = Gauge(
    "vllm:cpu_cache_usage_perc", "Fraction of the host tier's blocks holding a block (0-1)",
    ["model_name"],
)  # fmt: skip
LOADING = Gauge(
    "flagstop:num_requests_loading_kv",
    "Requests whose KV is arriving from a connector (WAITING_FOR_REMOTE_KVS)", ["model_name"],
)  # fmt: skip
KV_LEASES = Gauge(
    "flagstop:num_kv_leases",
    "Prefill replica: handed-off requests whose blocks are held for a decode replica",
    ["model_name"],
)  # fmt: skip
KV_LOAD_FAILURES = Counter(
    "flagstop:kv_load_failures",
    "KV loads that failed (a prefill side lost, timed out, refused, or its lease over "
    "before the read): the request recomputes", ["model_name"],
)  # fmt: skip
EXECUTOR_LOSSES = Counter(
    "flagstop:executor_losses", "Executor streams lost (dead or hung)", ["model_name"]
)
# Speculative decoding, as vLLM names them (AL = 1 + accepted / drafts).
SPEC_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Drafts verified (one request, one step)",
                      ["model_name"])  # fmt: skip
SPEC_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified",
                            ["model_name"])  # fmt: skip
SPEC_ACCEPTED = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                        ["model_name"])  # fmt: skip
SPEC_ACCEPTED_PER_POS = Counter(
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by position in the draft",
    ["model_name", "position"],
)  # fmt: skip
# As vLLM exports it, and the Gateway API Inference Extension's endpoint picker reads
# it: one series, its labels the adapters of the running and the waiting requests
# (comma-separated), its value when they were last set.
LORA_INFO = Gauge(
    "vllm:lora_requests_info", "Running and waiting LoRA adapters",
    ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
)  # fmt: skip
# The KV cache as the executor's layers make it (docs/kv_groups.md): one series per
# model, its labels the groups and the KV bytes a token takes over all layers on one
# rank (vLLM exports its cache config the same way, as an info gauge).
# The fair policy's virtual token counters (docs/policy.md): the service each tenant
# got, weighted and lifted as the policy counts it; their gap is its fairness.
TENANT_SERVICE = Gauge(
    "flagstop:tenant_service", "Service each tenant got, as the policy counts it (fair: its "
    "virtual token counter)", ["policy", "tenant"],
)  # fmt: skip
# The scheduling policy's own decisions (docs/policy.md), and a shadow policy's
# comparisons with them.
POLICY_COUNTS = {
    "num_shed": Counter("flagstop:policy_shed_requests", "Requests the policy shed (429)",
                        ["policy"]),
    "num_held_steps": Counter("flagstop:policy_held_steps",
                              "Steps whose running requests the policy partly held out",
                              ["policy"]),
    "num_ignored_decisions": Counter("flagstop:policy_ignored_decisions",
                                     "Parts of policy decisions ignored as nonsense",
                                     ["policy"]),
    "shadow_decisions": Counter("flagstop:shadow_decisions", "Steps a shadow policy decided",
                                ["policy"]),
    "shadow_agreed": Counter("flagstop:shadow_agreed_decisions",
                             "Shadow decisions equal to the live one (the first admissions "
                             "and the sheds)", ["policy"]),
    "shadow_would_shed": Counter("flagstop:shadow_would_shed_requests",
                                 "Requests a shadow policy would have shed", ["policy"]),
}  # fmt: skip
ENCODER_CACHE_USAGE = Gauge(
    "flagstop:encoder_cache_usage_perc",
    "Fraction of the encoder cache's embedding tokens in use (0-1; images)", ["model_name"],
)  # fmt: skip
ENCODER_COUNTS = {
    "num_encoded_images": Counter("flagstop:encoder_images", "Images run through the encoder",
                                  ["model_name"]),
    "num_encoded_tokens": Counter("flagstop:encoder_tokens",
                                  "Embedding tokens the encoder computed", ["model_name"]),
    "encoder_cache_hits": Counter("flagstop:encoder_cache_hits",
                                  "Images a prefill chunk found in the encoder cache",
                                  ["model_name"]),
}  # fmt: skip
RETAINED_BLOCKS = Gauge("flagstop:kv_retained_blocks",
                        "Free KV blocks kept by a session's retention, by priority",
                        ["model_name", "priority"])  # fmt: skip
RETENTION_COUNTS = {
    "num_retentions": Counter("flagstop:kv_retentions", "Blocks given a retention",
                              ["model_name"]),
    "retention_hits": Counter("flagstop:kv_retention_hits",
                              "Prefix hits on free retained blocks", ["model_name"]),
    "retained_evictions": Counter("flagstop:kv_retained_evictions",
                                  "Retained blocks evicted while retained (the pool full)",
                                  ["model_name"]),
    "retention_expiries": Counter("flagstop:kv_retention_expiries",
                                  "Retentions that ran out or were demoted by the bound",
                                  ["model_name"]),
}  # fmt: skip
KV_GROUPS_INFO = Gauge(
    "flagstop:kv_cache_groups_info", "KV cache groups, KV bytes per token, tokens a sequence",
    ["model_name", "groups", "kv_bytes_per_token", "capacity_tokens"],
)  # fmt: skip
STEP_SECONDS = Histogram(
    "flagstop:step_duration_seconds", "From planning a step to applying its tokens",
    ["model_name"], buckets=LATENCY_BUCKETS,
)  # fmt: skip


class SchedulerTelemetry:
    __slots__ = (
        "_model_name",
        "arrivals",
        "enabled",
        "kv_connector",
        "last_encoder",
        "last_external",
        "last_hits",
        "last_lora",
        "last_policy",
        "last_preemptions",
        "last_queries",
        "last_spec",
        "metrics",
        "request_spans",
        "steps",
        "tracer",
    )  # fmt: skip

    def __init__(self, telemetry: Telemetry) -> None:
        self.enabled, self.tracer = telemetry.enabled, telemetry.tracer
        self.request_spans: dict[str, trace.Span] = {}
        self.arrivals: dict[str, float] = {}
        self.steps: dict[int, tuple[float, trace.Span | None]] = {}
        # Unknown until the executor describes its model: no series before then (one
        # under model_name="" would sit at zero beside the real one for good).
        self._model_name = ""
        self.last_preemptions = self.last_queries = self.last_hits = 0
        self.last_external = (0, 0)  # external prefix-cache queries, hits
        self.last_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])
        self.metrics: tuple = ()  # this model's labelled metrics, looked up once
        self.last_lora: tuple[str, str, str] | None = None
        self.last_policy = dict.fromkeys(POLICY_COUNTS, 0)
        self.last_encoder: dict[str, int] = {}  # the encoder and retention counts exported
        # The core's KV connector, whose metrics exist only where there is one.
        self.kv_connector: KVConnector | None = None

    def kv_cache_groups(self, groups: str, kv_bytes_per_token: int, capacity: int) -> None:
        KV_GROUPS_INFO.labels(self._model_name, groups, str(kv_bytes_per_token),
                              str(capacity)).set(1)  # fmt: skip

    def lora_requests(self, running: list[str], waiting: list[str], max_loras: int) -> None:
        """vllm:lora_requests_info: a new series when the adapters change (the old one
        removed: one series at a time, whatever passes)."""
        labels = (str(max_loras), ",".join(waiting), ",".join(running))
        if labels != self.last_lora:
            if self.last_lora is not None:
                LORA_INFO.remove(*self.last_lora)
            self.last_lora = labels
        LORA_INFO.labels(*labels).set(time.time())

    @property
    def model_name(self) -> str:
        return self._model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self._model_name = name
        # .labels() per step costs a dict lookup and a lock each: resolve them once.
        self.metrics = tuple(m.labels(name) for m in (
            STEP_SECONDS, RUNNING, WAITING, KV_USAGE, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS,
        ))  # fmt: skip

    def on_add(self, request_id: str, num_prompt_tokens: int, traceparent: str) -> None:
        if not self.enabled:
            return
        self.arrivals[request_id] = time.monotonic()
        self.request_spans[request_id] = self.tracer.start_span(
            "scheduler.request", context=extract(traceparent),
            attributes={
                "flagstop.request_id": request_id,
                "gen_ai.usage.input_tokens": num_prompt_tokens,
            },
        )  # fmt: skip

    def on_schedule(
        self, plan: SchedulerOutput, step: executor_pb2.StepRequest, scheduler: Scheduler
    ) -> None:
        span = None
        if self.enabled:
            span = self._step_span(plan, scheduler)
            step.traceparent = inject(span)
        self.steps[plan.step_id] = (time.monotonic(), span)

    def _step_span(self, plan: SchedulerOutput, scheduler: Scheduler) -> trace.Span:
        now, spans = time.monotonic(), self.request_spans
        for data in plan.scheduled_new_reqs:
            if (span := spans.get(data.req_id)) is not None:
                queued = now - self.arrivals.pop(data.req_id, now)
                span.set_attribute("flagstop.queue_time_s", queued)
                span.set_attribute("flagstop.num_cached_tokens", data.num_computed_tokens)
        for req_id in plan.preempted_req_ids:
            if (span := spans.get(req_id)) is not None:
                span.add_event("preempted", {"flagstop.step": plan.step_id})
        num_decodes = sum(1 for n in plan.num_scheduled_tokens.values() if n == 1)
        links = [
            Link(s.get_span_context()) for r in plan.num_scheduled_tokens if (s := spans.get(r))
        ]
        budget = scheduler.config.max_num_batched_tokens
        return self.tracer.start_span("scheduler.step", links=links, attributes={
            "flagstop.step": plan.step_id,
            "flagstop.scheduled_tokens": plan.total_num_scheduled_tokens,
            "flagstop.budget_used": plan.total_num_scheduled_tokens / budget,
            "flagstop.decode_requests": num_decodes,
            "flagstop.prefill_requests": len(plan.num_scheduled_tokens) - num_decodes,
            "flagstop.running": len(scheduler.running),
            "flagstop.waiting": len(scheduler.waiting),
            "flagstop.preempted": len(plan.preempted_req_ids),
            "flagstop.kv_cache_usage": scheduler.kv_cache_usage,
            "flagstop.draft_slots": sum(plan.num_draft_slots.values()),
        })  # fmt: skip

    def on_update(
        self,
        plan: SchedulerOutput,
        outputs: dict[str, OwnerOutputs],
        scheduler: Scheduler,
        num_queued_at_routers: int = 0,
        result: executor_pb2.StepResult | None = None,
    ) -> None:
        started, span = self.steps.pop(plan.step_id, (time.monotonic(), None))
        self.metrics[0].observe(time.monotonic() - started)
        if result is not None and result.failed_recving:
            KV_LOAD_FAILURES.labels(self._model_name).inc(len(result.failed_recving))
        if span is not None:
            if result is not None and result.num_draft_tokens:
                span.set_attribute("flagstop.drafted_tokens", sum(result.num_draft_tokens))
                span.set_attribute("flagstop.accepted_tokens", sum(result.num_sampled_tokens)
                                   - len(result.num_sampled_tokens))  # fmt: skip
            span.end()
        if self.enabled:
            for out in outputs.values():
                for req_id, reason in out.finished.items():
                    self.on_finish(req_id, reason)
        self._export_gauges(scheduler, num_queued_at_routers)

    def executor_lost(self, scheduler: Scheduler) -> None:
        """The steps in flight will never report; every request starts over."""
        if self.model_name:
            EXECUTOR_LOSSES.labels(self.model_name).inc()
        for _, span in self.steps.values():
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, "executor lost"))
                span.end()
        self.steps.clear()
        for request_id in scheduler.requests:
            if (span := self.request_spans.get(request_id)) is not None:
                span.add_event("executor lost: recompute")

    def event(self, name: str, attributes: dict) -> None:
        """An event on the newest step still in flight (the iteration it happened in),
        or on a span of its own when the engine is between steps."""
        if not self.enabled:
            return
        open_steps = [span for _, span in self.steps.values() if span is not None]
        if open_steps:
            open_steps[-1].add_event(name, attributes)
            return
        span = self.tracer.start_span("scheduler.event")
        span.add_event(name, attributes)
        span.end()

    def on_finish(self, request_id: str, reason: FinishReason) -> None:
        self.arrivals.pop(request_id, None)
        span = self.request_spans.pop(request_id, None)
        if span is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [reason.label])
            span.end()

    def _export_gauges(self, scheduler: Scheduler, num_queued_at_routers: int) -> None:
        stats = scheduler.stats()
        _, running, waiting, kv_usage, preemptions, queries, hits = self.metrics
        running.set(stats.num_running)
        # What still waits at the routers is this replica's backlog too: a gateway
        # weighing replicas by this gauge must see it.
        waiting.set(stats.num_waiting + num_queued_at_routers)
        kv_usage.set(stats.kv_cache_usage)
        preemptions.inc(stats.num_preemptions - self.last_preemptions)
        queries.inc(stats.prefix_cache_queries - self.last_queries)
        hits.inc(stats.prefix_cache_hits - self.last_hits)
        self.last_preemptions = stats.num_preemptions
        self.last_queries, self.last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if scheduler.drafts.stats.num_drafts != self.last_spec[0]:
            self._export_spec(scheduler)
        self._export_policy(stats)
        if stats.encoder_cache_size:
            self._export_encoder(stats)
        self._export_retention(scheduler, stats)
        self._export_service(scheduler.policy_step.policy)
        if self.kv_connector is not None:
            self._export_connector(self.kv_connector, stats)

    def _export_policy(self, stats) -> None:
        last = self.last_policy
        for name, counter in POLICY_COUNTS.items():
            value = getattr(stats, name)
            if value != last[name]:  # a swap restarts the core's counts: count from there
                policy = stats.shadow_policy if name.startswith("shadow") else stats.policy
                counter.labels(policy).inc(max(0, value - last[name]))
                last[name] = value

    def _export_encoder(self, stats) -> None:
        name, last = self._model_name, self.last_encoder
        ENCODER_CACHE_USAGE.labels(name).set(stats.encoder_cache_used_tokens
                                             / stats.encoder_cache_size)  # fmt: skip
        for field, counter in ENCODER_COUNTS.items():
            value = getattr(stats, field)
            counter.labels(name).inc(max(0, value - last.get(field, 0)))
            last[field] = value

    def _export_retention(self, scheduler: Scheduler, stats) -> None:
        name, last = self._model_name, self.last_encoder
        for priority, level in scheduler.kv.pool.retained.levels.items():
            RETAINED_BLOCKS.labels(name, str(priority)).set(level.num_free_blocks)
        for field, counter in RETENTION_COUNTS.items():
            value = getattr(stats, field)
            if value != last.get(field, 0):
                counter.labels(name).inc(max(0, value - last.get(field, 0)))
                last[field] = value

    def _export_service(self, policy) -> None:
        for tenant, service in policy.service_by_tenant().items():
            TENANT_SERVICE.labels(policy.name, tenant).set(service)

    def _export_connector(self, connector: KVConnector, stats) -> None:
        name = self._model_name
        queries, hits = stats.external_prefix_cache_queries, stats.external_prefix_cache_hits
        EXTERNAL_QUERIES.labels(name).inc(queries - self.last_external[0])
        EXTERNAL_HITS.labels(name).inc(hits - self.last_external[1])
        self.last_external = (queries, hits)
        LOADING.labels(name).set(stats.num_loading)
        if connector.hands_off:
            KV_LEASES.labels(name).set(stats.num_kv_leases)
        if connector.num_host_blocks:
            HOST_USAGE.labels(name).set(stats.num_host_cached_blocks / connector.num_host_blocks)

    def _export_spec(self, scheduler: Scheduler) -> None:
        drafted, name = scheduler.drafts.stats, self._model_name
        drafts, draft_tokens, accepted, per_pos = self.last_spec
        SPEC_DRAFTS.labels(name).inc(drafted.num_drafts - drafts)
        SPEC_DRAFT_TOKENS.labels(name).inc(drafted.num_draft_tokens - draft_tokens)
        SPEC_ACCEPTED.labels(name).inc(drafted.num_accepted_tokens - accepted)
        for position, count in enumerate(drafted.accepted_per_pos):
            before = per_pos[position] if position < len(per_pos) else 0
            if count != before:
                SPEC_ACCEPTED_PER_POS.labels(name, str(position)).inc(count - before)
        self.last_spec = (drafted.num_drafts, drafted.num_draft_tokens, drafted.num_accepted_tokens,
                          list(drafted.accepted_per_pos))  # fmt: skip
