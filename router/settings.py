"""The router's settings: flags, FLAGSTOP_ROUTER_* variables, --config."""

import uuid
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict

from flagstop.router.auth import read_tenant_keys
from flagstop.router.discovery import parse_targets
from flagstop.router.objective_defaults import SLOTarget, check_default_keys
from flagstop.router.routing import Routing
from flagstop.server import GrpcServerKind
from flagstop.settings import Port, ServiceSettings

ToolCallParser = Literal[
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "mistral",
    "deepseek_v3",
    "kimi_k2",
    "glm45",
    "openai",
]
ReasoningParserName = Literal[
    "deepseek_r1", "deepseek_v3", "qwen3", "glm45", "kimi_k2", "openai_gptoss"
]


class RouterSettings(ServiceSettings):
    """python -m flagstop.router: the client-facing gRPC server (flagstop.v1.Generation)."""

    model_config = SettingsConfigDict(
        env_prefix="FLAGSTOP_ROUTER_", cli_prog_name="flagstop-router"
    )

    model: str = "models/flagstop-tiny"
    """tokenizer (model) directory"""
    port: Port = 50051
    http_port: Port = 8000
    """the OpenAI-compatible HTTP API (and /health, /ready, /metrics); 0: off"""
    metrics_port: Port = 8001
    """Prometheus /metrics; 0: off"""
    chat_template: Path | None = None
    """a Jinja chat template to use instead of the model's own"""
    tool_call_parser: ToolCallParser | None = None
    """how tool calls are read out of what the model writes, for tool_choice "auto",
    by the model family's format (vLLM's names): hermes (<tool_call>{"name",
    "arguments"}</tool_call>: Hermes, Qwen2.5, Qwen3 and the embedded model),
    qwen3_coder, llama3_json, mistral, deepseek_v3, kimi_k2, glm45, openai (gpt-oss's
    harmony; set with --reasoning-parser openai_gptoss). Unset: "auto" is refused
    (required and named calls need none: the output is constrained to the call)"""
    reasoning_parser: ReasoningParserName | None = None
    """split a thinking model's reasoning from its answer (vLLM's names): deepseek_r1,
    deepseek_v3, qwen3, glm45, kimi_k2 (<think>...</think>), openai_gptoss (gpt-oss's
    harmony format: the conversation rendered and the output read by openai-harmony).
    The reasoning comes back as the message's `reasoning` (and `reasoning_content`);
    tool calls and output constraints apply to the answer after it"""
    structured_outputs_in_reasoning: bool = False
    """apply output constraints to the reasoning too (vLLM's enable_in_reasoning);
    default: only to the answer after it"""
    default_chat_template_kwargs: dict[str, Any] | None = None
    """JSON: variables every chat template renders with unless a request's
    chat_template_kwargs says otherwise, e.g. '{"enable_thinking": false}'"""
    limit_mm_per_prompt: dict[str, NonNegativeInt] = Field(default_factory=lambda: {"image": 8})
    """a vision-language model: the most images a prompt may carry, as JSON (vLLM's
    flag): '{"image": 8}'; past it a 400"""
    media_max_bytes: PositiveInt = 20 << 20
    """an image's encoded bytes at most (a data: URL's, a fetched one's)"""
    media_max_pixels: PositiveInt = 4096 * 4096
    """an image's pixels (width x height) at most, checked before it is decoded"""
    media_fetch_timeout_s: PositiveFloat = 10.0
    """an http(s) image URL's fetch, whole, at most"""
    allowed_local_media_path: Path | None = None
    """file:// image URLs are read under this directory only; unset: never"""
    max_cache_ttl_s: PositiveFloat = 3600.0
    """the longest a request may ask its prompt's KV kept (prompt_cache_retention,
    cache_control's ttl, gRPC's retention): a longer one is cut to it, and the reply's
    x-flagstop-cache-ttl header says so (docs/sessions.md)"""
    scheduler: str = "127.0.0.1:50052"
    """the replicas' schedulers, comma-separated: HOST:PORT, or dns:NAME:PORT for every
    address a name resolves to (a Kubernetes headless Service). SIGHUP reads the list
    again from the environment and --config"""
    resolve_interval_s: PositiveFloat = 10.0
    """how often dns: names are resolved again (replicas that came or went)"""
    routing: Routing = "prefix"
    """replica choice: prefix (where the prompt's leading blocks were sent last,
    unless that replica is far busier), least-loaded, round-robin"""
    prefix_match_threshold: float = Field(0.5, ge=0, le=1)
    """prefix routing: the share of the prompt's full blocks a replica must hold"""
    balance_abs_threshold: NonNegativeInt = 32
    """a replica is far busier than the least loaded one, and sheds new work even when
    it holds the prefix, when it has more than this many requests more"""
    balance_rel_threshold: float = Field(1.5, ge=1)
    """... and more than this many times as many (both must hold)"""
    pd_threshold: NonNegativeInt = 512
    """prefill/decode disaggregation (replicas of --kv-role prefill and decode): a
    prompt with at least this many tokens not cached at the decode replica it goes to
    is prefilled at a prefill replica first (llm-d's pdThreshold); shorter or cached
    ones run whole at the decode replica. 0: every prompt"""
    prefix_index_blocks: PositiveInt = 1 << 17
    """block hashes the prefix index remembers (LRU, ~400 bytes each: 50 MB at the default)"""
    replica_grace_s: NonNegativeFloat = 5.0
    """seconds a lost replica's requests (its scheduler's stream gone, or its executor:
    the scheduler says so) wait for it to come back before they move on to another
    replica (as their remainders)"""
    max_queued_requests: PositiveInt = 1024
    """admission queue bound; past it RESOURCE_EXHAUSTED"""
    max_queued_tokens: PositiveInt = 1 << 20
    """prompt tokens in the admission queue at most; past it RESOURCE_EXHAUSTED"""
    slo_defaults: dict[str, SLOTarget] = Field(default_factory=dict)
    """the TTFT and TPOT targets of requests that state none, by "tenant:NAME",
    "class:NAME" or "*" (everyone), as JSON: '{"class:batch": {"ttft_ms": 30000},
    "*": {"ttft_ms": 2000, "tpot_ms": 100}}' (docs/policy.md)"""
    record_workload: Path | None = None
    """append each request, as it ends, to this JSONL file in flagstop-replay's workload
    format (arrival, prompt length and prefix-block hashes, output length, tenant,
    class, targets; no tokens): replay your own traffic against another policy"""
    max_request_bytes: PositiveInt = 4 << 20
    """largest client message; past it RESOURCE_EXHAUSTED"""
    scheduler_timeout: PositiveFloat = 60.0
    """seconds requests wait for a lost scheduler; then UNAVAILABLE"""
    api_key: SecretStr | None = None
    """require 'authorization: Bearer KEY' (UNAUTHENTICATED otherwise); better set by
    FLAGSTOP_ROUTER_API_KEY than on the command line"""
    tenant_keys: Path | None = None
    """a JSON file of tenants' API keys, '{"KEY": "TENANT", ...}', accepted beside
    --api-key: a key binds its requests to its tenant (their tenant label and
    objectives, whatever they claim) and to the tenant's own prefix cache, so that
    two tenants never share a cached block (docs/sessions.md)"""
    tls_require_client_cert: bool = False
    """clients must show a certificate from --tls-ca too"""
    router_id: str = Field(default_factory=lambda: f"router-{uuid.uuid4().hex[:8]}")
    """this router's name at the scheduler (default: random)"""
    stream_interval_ms: NonNegativeFloat = 0.0
    """after a stream's first token, at most one message per this many ms: the tokens
    of the steps in between go out together. 0: every step's token at once. At GPU
    step rates (5-30 ms) 20-50 ms cuts the router's CPU per token 2-4x (a message,
    not a token, is what costs); a client streaming text to a person sees no
    difference, a benchmark measuring inter-token latency sees bursts"""
    processes: PositiveInt = 1
    """router processes serving --port and --http-port together (SO_REUSEPORT, Linux):
    the kernel spreads new connections over them, each has its own scheduler stream,
    /metrics sums them all. One process tops out near 20k tokens/s"""
    min_uptime_s: NonNegativeFloat = 10.0
    """--processes: a router process that ends sooner than this after starting is not
    started again (it would only end again: a taken port, a model that does not
    load); the router exits instead"""
    grpc_server: GrpcServerKind = "grpcio"
    """the client-facing gRPC server: grpcio, or native (pygrpc-native: HTTP/2 in Rust,
    about a third of grpcio's CPU per streamed message; plaintext only, so TLS is
    refused; docs/load_testing.md says when to choose it)"""
    reuse_port: bool = False
    """share --port and --http-port with other router processes of this user (set by
    --processes on the processes it starts)"""
    drain_timeout: PositiveFloat = 30.0
    """on SIGTERM: seconds the streams in flight get to finish"""

    @field_validator("slo_defaults")
    @classmethod
    def _slo_keys(cls, value: dict[str, SLOTarget]) -> dict[str, SLOTarget]:
        return dict(check_default_keys(value))

    @field_validator("tenant_keys")
    @classmethod
    def _tenant_keys_readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            read_tenant_keys(value)
        return value

    @field_validator("scheduler")
    @classmethod
    def _targets(cls, value: str) -> str:
        parse_targets(value)
        return value

    @model_validator(mode="after")
    def _harmony_goes_together(self) -> Self:
        harmony = (self.tool_call_parser == "openai", self.reasoning_parser == "openai_gptoss")
        if harmony == (True, False):
            raise ValueError("--tool-call-parser openai reads gpt-oss's harmony format: set "
                             "--reasoning-parser openai_gptoss with it")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _shared_ports_are_known(self) -> Self:
        if self.processes > 1 and self.port == 0:
            raise ValueError("--processes needs a fixed --port (not 0) to share")
        return self

    @model_validator(mode="after")
    def _native_server_is_plaintext(self) -> Self:
        if self.grpc_server == "native" and self.tls_cert is not None:
            raise ValueError(
                "--grpc-server native serves plaintext only: unset --tls-cert, --tls-key "
                "and --tls-ca, or use --grpc-server grpcio"
            )
        return self
