"""What the model runner needs: the model, the device, the KV cache and the batch
limits. The executor's settings (executor/settings.py) are this plus what every
service takes, so each field and its validation is written once."""

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flagstop.adapters import name_refusal
from flagstop.executor.speculative.config import SpeculativeConfig


class ExecutorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: str = "models/flagstop-tiny"
    """a local Hugging Face checkpoint directory"""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on CUDA, float32 on the CPU"""
    block_size: PositiveInt = 16
    """tokens per KV block"""
    num_blocks: PositiveInt | None = None
    """KV blocks; overrides the sizing by --kv-cache-bytes or --gpu-memory-utilization"""
    kv_cache_bytes: PositiveInt = 1 << 30
    """KV cache size on the CPU"""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    """auto: the model's dtype; fp8 (fp8_e4m3): one byte a K/V value, scaled by the
    checkpoint's k_scale/v_scale (per tensor or per head; 1.0 without), so the same
    bytes hold 2x the blocks of bfloat16 (docs/quantization.md)"""
    disable_hybrid_kv_cache_manager: bool = False
    """describe every layer as full attention: one KV cache group, window layers keeping
    every token's KV as full ones do (vLLM's flag of the same name); for prefill/decode
    disaggregation with a windowed model, whose transfers move one block table
    (docs/kv_groups.md)"""
    kv_offload_bytes: NonNegativeInt = 0
    """the prefix cache's host-memory tier: full blocks are written through to this
    many bytes of host memory (pinned on CUDA) and loaded back on a prefix hit there;
    0: none (docs/kv_tiers.md)"""
    kv_offload_path: str | None = None
    """a file to back the host tier instead of memory (mapped; created at
    --kv-offload-bytes)"""
    kv_role: Literal["both", "prefill", "decode"] = "both"
    """prefill/decode disaggregation (docs/kv_tiers.md): prefill computes long prompts
    for decode replicas and holds their blocks until one has read them, decode reads
    them from the prefill replica over Mooncake's transfer engine; both (default):
    neither"""
    kv_transfer_host: str | None = None
    """with --kv-role prefill or decode: the address other executors reach this one's
    gRPC port and transfer engine at; default: --host (which must then not be
    0.0.0.0)"""
    kv_lease_s: PositiveFloat = 30.0
    """--kv-role prefill: seconds a handed-off request's blocks stay held for a decode
    replica that has not read them (each renewal restarts it); then they are freed and
    a later read fails loudly"""
    kv_transfer_timeout_s: PositiveFloat = 10.0
    """--kv-role decode: a handshake, lease call or read of a prefill executor taking
    longer fails, and the request recomputes its prompt here"""
    media_store_bytes: PositiveInt = 1 << 30
    """a vision-language model: the host bytes of images' pixels kept from their
    PrepareMedia to their encoder step (the most recent; a request whose image left
    before its encoder step fails, the log naming this flag)"""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """share of the GPU's memory for weights, activations and the KV cache (CUDA)"""
    max_num_seqs: PositiveInt = 256
    """requests in the batch at most"""
    max_num_batched_tokens: PositiveInt = 2048
    """tokens in one step at most"""
    max_model_len: PositiveInt | None = None
    """default: the model's own limit"""
    onednn_cache_capacity: PositiveInt = 256
    """CPU: oneDNN primitives kept, in each of its two caches (ideep's and oneDNN's own):
    one per weight shape and padded row count, 1-3 ms to build, some 0.1-0.2 MiB each;
    docs/memory.md has the measurements behind the default"""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """auto: triton on CUDA, torch on the CPU"""
    seed: int = 0
    max_loras: NonNegativeInt = 0
    """LoRA adapters one step may run (device slots); 0: no LoRA (docs/lora.md)"""
    max_lora_rank: PositiveInt = Field(16, le=512)
    """the largest adapter rank accepted (the slots' size)"""
    lora_modules: list[str] = []
    """adapters loaded at start-up, each name=DIR (a PEFT adapter directory)"""
    tensor_parallel_size: PositiveInt = 1
    """ranks the model is split over (this process is rank 0 and starts the others on
    this machine, unless torchrun started them all)"""
    expert_parallel: bool = False
    """Mixture-of-Experts models under tensor parallelism: place whole experts on the
    ranks (num_experts split N ways) instead of slicing every expert; attention
    stays tensor-parallel"""
    tp_timeout: PositiveFloat = 30.0
    """seconds a rank waits for the others in a collective before the group is lost"""
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    """config.json fields over the checkpoint's, as JSON (vLLM's flag): Qwen3-Reranker
    is served as a yes/no scorer with {"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}
    (docs/pooling.md)"""
    speculative_config: SpeculativeConfig | None = None
    """speculative decoding, as vLLM's JSON: {"method": "ngram"|"draft_model"|"suffix",
    "num_speculative_tokens": k, ...} (docs/speculative.md)"""
    simulate_acceptance_rate: float = Field(0.7, ge=0, le=1)
    """the simulator's chance that each draft token is accepted (with --speculative-config)"""
    simulate: bool = False
    """a LOAD-TEST TOOL, not a model: wait a cost model's step time and return hashed
    tokens (executor/simulator.py); --model lends only its config.json"""
    simulate_base_ms: NonNegativeFloat = 6.0
    """the simulator's step time: this ..."""
    simulate_us_per_scheduled_token: NonNegativeFloat = 8.0
    """... plus this per token computed in the step ..."""
    simulate_us_per_context_token: NonNegativeFloat = 0.03
    """... plus this per token of context read (all scheduled requests' lengths)"""
    simulate_mean_output_tokens: NonNegativeInt = 0
    """the simulator emits a request's stop token about once in this many tokens
    (never before min_tokens); 0: never"""
    simulate_num_blocks: PositiveInt = 65536
    """the simulator's KV blocks, unless --num-blocks says"""
    simulate_kv_transfer_us_per_token: NonNegativeFloat = 5.0
    """the simulator's reads of a prefill executor's KV (--kv-role decode): this many
    microseconds a token (an 8B model's 128 KiB of KV a token over a 200 Gb/s NIC, like
    the step costs above)"""

    @field_validator("speculative_config", "hf_overrides", mode="before")
    @classmethod
    def _unset_when_empty(cls, value, info: ValidationInfo):
        # compose passes ${SPEC:-}: an empty value is no speculative decoding.
        if isinstance(value, str) and not value.strip():
            return None if info.field_name == "speculative_config" else {}
        return value

    @property
    def num_speculative_tokens(self) -> int:
        """The most draft tokens a request gets a step (0: speculative decoding off)."""
        speculative = self.speculative_config
        return speculative.num_speculative_tokens if speculative is not None else 0

    @property
    def speculative_method(self) -> str:
        return self.speculative_config.method if self.speculative_config is not None else ""

    @property
    def lora_module_paths(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, directory) pairs."""
        return [(name, path) for name, _, path in (s.partition("=") for s in self.lora_modules)]

    @field_validator("lora_modules")
    @classmethod
    def _name_equals_dir(cls, value: list[str]) -> list[str]:
        names = set()
        for entry in value:
            name, sep, path = entry.partition("=")
            if not (name and sep and path):
                raise ValueError(f"{entry!r}: each adapter is name=DIR")
            if name in names:
                raise ValueError(f"{name!r} is named twice: one adapter a name")
            names.add(name)
        return value

    @model_validator(mode="after")
    def _loras_need_slots(self) -> "ExecutorConfig":
        if self.lora_modules and not self.max_loras:
            raise ValueError("--lora-modules needs --max-loras (the adapters' slots)")
        for name, _ in self.lora_module_paths:
            if refusal := name_refusal(name, Path(self.model).name):
                raise ValueError(f"--lora-modules: {refusal}")
        if self.kv_offload_path and not self.kv_offload_bytes:
            raise ValueError("--kv-offload-path needs --kv-offload-bytes (the file's size)")
        if self.kv_role != "both" and self.kv_offload_bytes:
            raise ValueError(f"--kv-role {self.kv_role} with --kv-offload-bytes: a host tier "
                             "beside disaggregation is not supported yet; drop one")  # fmt: skip
        return self
