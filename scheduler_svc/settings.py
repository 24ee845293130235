"""The scheduler service's settings: flags, FLAGSTOP_SCHEDULER_* variables, --config."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
)
from pydantic_settings import SettingsConfigDict

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.objectives import Objectives, seconds_of
from flagstop.scheduler_svc.core.policy import POLICIES
from flagstop.scheduler_svc.kv_event_publisher import KVEventsConfig
from flagstop.settings import Port, ServiceSettings, config_from

CORE = SchedulerConfig()  # the core's defaults are the flags' defaults


class SchedulerSettings(ServiceSettings):
    """python -m flagstop.scheduler_svc: the scheduling service between routers and an
    executor."""

    model_config = SettingsConfigDict(
        env_prefix="FLAGSTOP_SCHEDULER_", cli_prog_name="flagstop-scheduler"
    )

    port: Port = 50052
    metrics_port: Port = 8002
    """Prometheus /metrics; 0: off"""
    executor: str = "127.0.0.1:50053"
    """executor address"""
    max_num_batched_tokens: PositiveInt = CORE.max_num_batched_tokens
    """token budget of a step"""
    max_num_seqs: PositiveInt = CORE.max_num_seqs
    """running requests at most"""
    max_model_len: PositiveInt | None = None
    """default: the executor's"""
    long_prefill_token_threshold: NonNegativeInt = CORE.long_prefill_token_threshold
    """largest prefill chunk of one request in a step; 0: no cap"""
    no_chunked_prefill: bool = False
    no_prefix_caching: bool = False
    reserve_full_isl: bool = CORE.reserve_full_isl
    """admit a request only when the KV cache could hold its whole prompt (and outputs
    so far); --no-reserve-full-isl: as soon as its first chunk fits (the old rule,
    which thrashes under memory pressure)"""
    policy: Literal[tuple(POLICIES)] = CORE.policy  # type: ignore[valid-type]
    """fcfs, priority, hrrn (highest response ratio next), slo (deadlines: docs/policy.md),
    fair (tenant shares, VTC), remote (a SchedulerPolicy service at --policy-addr)"""
    no_shed: bool = CORE.no_shed
    """slo: never shed a request predicted to miss its TTFT target (order it only)"""
    tenant_weights: dict[str, PositiveFloat] = Field(default_factory=dict)
    """fair: each tenant's weight, as JSON: '{"acme": 3, "free": 1}' (a tenant not
    named weighs 1); its share is its weight over the active tenants' (docs/policy.md)"""
    fair_reserve: float = Field(CORE.fair_reserve, ge=0, lt=1)
    """fair: the fraction of seats and KV blocks a tenant above its share may not take
    while another tenant is active; 0: none (VTC's order alone)"""
    fair_hold: float = Field(CORE.fair_hold, ge=0, le=1)
    """fair: the most steps (a fraction) whose tenants above their share sit out, so
    that a new request of a tenant below its share has its first chunk in a step of its
    own; 0: never"""
    default_ttft_ms: NonNegativeFloat = 0.0
    """the TTFT target of a request that reaches the scheduler with none (a gRPC client
    that bypasses the router; the router's --slo-defaults resolve the rest); 0: none"""
    default_tpot_ms: NonNegativeFloat = 0.0
    """the TPOT target of a request that reaches the scheduler with none; 0: none"""
    shadow_policy: Literal["", "fcfs", "priority", "hrrn", "slo", "fair"] = ""
    """a built-in policy run in shadow: decides every step beside the live one, compared
    and counted (flagstop:shadow_*), never applied"""
    admin_key: SecretStr | None = None
    """allow the admin call SetPolicy (live policy swap, shadow) to clients sending
    'authorization: Bearer KEY'; better set by FLAGSTOP_SCHEDULER_ADMIN_KEY"""
    policy_addr: str = "127.0.0.1:50060"
    """the remote policy's address"""
    policy_deadline_ms: PositiveFloat = 20.0
    """past it a policy query is dropped and FCFS used meanwhile"""
    max_num_encoder_input_tokens: PositiveInt | None = None
    """a vision-language model: the image embedding tokens the encoder computes a step
    (the encoder's budget beside the token budget; an image larger is refused at
    admission); default: --max-num-batched-tokens"""
    encoder_cache_size: PositiveInt | None = None
    """a vision-language model: the image embedding tokens the executor's encoder cache
    holds (images a running request still needs, then the most recent others);
    default: --max-num-encoder-input-tokens"""
    retention_share: float = Field(CORE.retention_share, ge=0, le=1)
    """sessions (docs/sessions.md): the most of the KV pool that free retained blocks
    (prompt_cache_retention, cache_control, gRPC retention) may hold; past it the
    lowest retained become ordinary; 0: no retention"""
    max_retention_s: NonNegativeFloat = CORE.max_retention_s
    """the longest a request's prompt is retained here (a longer ttl is cut)"""
    kv_events_config: KVEventsConfig | None = None
    """publish every block the prefix cache gains and loses as KV events in vLLM's
    format, for a fleet's router (llm-d: docs/llm-d.md), as vLLM's JSON:
    '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic":
    "kv@${POD_IP}@${MODEL}"}' (replay_endpoint, buffer_steps, hwm too); off by default"""
    speculative_disable_batch_size: PositiveInt = CORE.speculative_disable_batch_size
    """speculative decoding: from this many decodes in a step on, none drafts"""
    speculative_min_gain: float = Field(CORE.speculative_min_gain, gt=0, le=1)
    """speculative decoding: a draft slot is given while the request's measured
    acceptance to that power is at least this"""
    max_waiting_requests: PositiveInt = 256
    """waiting here at most; the rest stay queued at the routers"""
    max_waiting_tokens: NonNegativeInt = 0
    """prompt tokens still to compute of the requests waiting here at most (roughly a
    TTFT target x prefill throughput); the rest stay queued at the routers; 0: no cap"""
    max_steps_in_flight: Annotated[int, Field(ge=1, le=2)] = 2
    """2: plan step N+1 while step N runs, so the executor never waits for us"""
    executor_heartbeat_timeout: PositiveFloat = 30.0
    """seconds a step or heartbeat may go unanswered before the executor counts as hung"""
    executor_timeout: PositiveFloat = 60.0
    """seconds requests wait for a lost executor; then UNAVAILABLE"""
    drain_timeout: PositiveFloat = 30.0
    """on SIGTERM: seconds the requests in flight get to finish"""
    step_cost_out: Path | None = None
    """write the step-cost model fitted from the executor's steps there (JSON, every
    2 s and at exit), for flagstop-replay --cost-model"""

    @field_validator("step_cost_out")
    @classmethod
    def _writable_there(cls, path: Path | None) -> Path | None:
        if path is not None and not path.parent.is_dir():
            raise ValueError(f"{path.parent} is not a directory to write {path.name} in")
        return path

    def fallback_objectives(self) -> Objectives:
        """The targets of a request that reaches the scheduler with none."""
        return Objectives(seconds_of(self.default_ttft_ms), seconds_of(self.default_tpot_ms))

    def core_config(
        self, executor_max_model_len: int, block_size: int, num_speculative_tokens: int = 0,
        max_loras: int = 0, accepts_images: bool = False, whole_images: bool = False,
    ) -> SchedulerConfig:  # fmt: skip
        """The core's config once the executor has described itself (its model's
        length, its block size, the draft tokens it proposes, its LoRA slots, whether
        it reads images; raises ValueError for a combination the core cannot run)."""
        encoder_budget = self.max_num_encoder_input_tokens or self.max_num_batched_tokens
        return config_from(
            self, SchedulerConfig,
            max_model_len=self.max_model_len or executor_max_model_len, block_size=block_size,
            num_speculative_tokens=num_speculative_tokens, max_loras=max_loras,
            max_num_encoder_input_tokens=encoder_budget if accepts_images else 0,
            encoder_cache_size=(self.encoder_cache_size or encoder_budget)
            if accepts_images else 0,
            whole_images=whole_images,
        )  # fmt: skip
