from collections.abc import Mapping
from dataclasses import dataclass, field

# fair: the seats and KV blocks held back from tenants above their share (a fraction
# of each): 1/32 kept the light tenant's wait for a seat at the step's own lag on the
# Azure replay (bench/slo_bench.py), for about 1 % of the heavy tenant's throughput.
FAIR_RESERVE = 1 / 32
# fair: the most steps (a fraction, as a token bucket) whose over-share tenants sit out
# so that a request of a tenant below its share has its first chunk in a step of its
# own: 1/20 took the light tenant's TTFT over its solo run from 2.71x / 2.58x (mean /
# p99) to 2.51x / 2.27x on the Azure replay and from 3.35x / 3.51x to 2.72x / 3.00x on
# Mooncake's, for 0.6 % of Azure's output throughput (bench/slo_bench.py). More gains
# little (first 2,000 Azure requests: 1/20 2.44x, 1/10 2.35x, 3/10 2.27x).
FAIR_HOLD = 1 / 20
# Retained prefixes may hold half the pool when free: a session's turns hit while the
# other half still turns over for everyone else (bench/session_bench.py).
RETENTION_SHARE = 0.5
MAX_RETENTION_S = 3600.0  # Anthropic's longest ttl, "1h"


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    block_size: int = 16
    # 0 disables the cap; otherwise one prefill chunk never takes more than this many
    # tokens, so several long prompts cannot crowd the decodes out of a step.
    long_prefill_token_threshold: int = 0
    # Named as the scheduler's flags (--no-chunked-prefill, --no-prefix-caching).
    no_chunked_prefill: bool = False
    no_prefix_caching: bool = False
    policy: str = "fcfs"
    # The slo policy's: shed requests it predicts will miss their TTFT.
    no_shed: bool = False
    # The fair policy's: tenant -> weight (1 unless named), its reserve and its holds.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    fair_reserve: float = FAIR_RESERVE
    fair_hold: float = FAIR_HOLD
    # Admit a waiting request only when the pool could hold its whole known sequence
    # (vLLM's scheduler_reserve_full_isl). False: as soon as its first chunk fits,
    # which under memory pressure admits a long prompt, preempts it the next step and
    # loops (bench/scheduler_bench.py's memory-bound row).
    reserve_full_isl: bool = True
    # Speculative decoding: the most draft tokens a decode gets a step (the executor's
    # --speculative-config; 0: off), and the rule that adapts it (speculative.py).
    num_speculative_tokens: int = 0
    speculative_disable_batch_size: int = 32
    speculative_min_gain: float = 0.25
    # LoRA: the most distinct adapters among the running requests (the executor's
    # --max-loras slots); 0: no adapters.
    max_loras: int = 0
    # Images (a vision-language model; 0: text only): the embedding tokens the encoder
    # computes a step, and those its cache holds (encoder_cache.py).
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0
    # An image's tokens attend both ways (Gemma 3): a chunk never cuts an image.
    whole_images: bool = False
    # Sessions (docs/sessions.md): the most of the pool free retained blocks may hold
    # (past it the lowest retained become ordinary), and the longest retention.
    retention_share: float = RETENTION_SHARE
    max_retention_s: float = MAX_RETENTION_S

    def __post_init__(self) -> None:
        if min(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len) < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_model_len must be >= 1")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.num_speculative_tokens < 0 or self.speculative_disable_batch_size < 1:
            raise ValueError("num_speculative_tokens >= 0, speculative_disable_batch_size >= 1")
        if min(self.max_num_encoder_input_tokens, self.encoder_cache_size) < 0:
            raise ValueError("max_num_encoder_input_tokens and encoder_cache_size must be >= 0")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if not 0 <= self.retention_share <= 1 or self.max_retention_s < 0:
            raise ValueError("retention_share must be in [0, 1] and max_retention_s >= 0")
        if not 0 <= self.fair_reserve < 1:
            raise ValueError(f"fair_reserve must be in [0, 1), got {self.fair_reserve}")
        if not 0 <= self.fair_hold <= 1:
            raise ValueError(f"fair_hold must be in [0, 1], got {self.fair_hold}")
        if not 0 < self.speculative_min_gain <= 1:
            raise ValueError("speculative_min_gain must be in (0, 1]")
        if self.no_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step, or it would wait forever.
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
