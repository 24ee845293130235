from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ExecutorConfig:
    model: str
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    block_size: int = 16
    # KV capacity: an explicit block count wins; else bytes (CPU) or a fraction of the
    # GPU memory measured after a warm-up forward (CUDA).
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on the CPU
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
