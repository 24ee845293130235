"""A rank's paged KV cache: the bytes of a block, its tensors, and how many blocks it
gets: --num-blocks, else --kv-cache-bytes on the CPU, and on CUDA what a warm-up
forward of the largest step leaves under --gpu-memory-utilization (vLLM's
profiling)."""

from collections.abc import Callable, Sequence

import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.decoder import KVCache
from flagstop.scheduler_svc.core.kv_groups import (
    LINEAR_ATTENTION,
    KVCacheGroup,
    KVLayer,
    group_size,
    layer_slots,
)
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.utils import cdiv


def block_bytes(
    layers: Sequence[KVLayer], groups: Sequence[KVCacheGroup], block_size: int
) -> int:  # fmt: skip
    """A block's bytes on one rank: a group's layers' (one group: every layer;
    kv_groups.py), each its KVLayer's bytes a token (K and V, or a latent)."""
    return group_size(groups) * max(x.kv_bytes_per_token for x in layers) * block_size


def block_size_for(mc: ModelConfig, layers: Sequence[KVLayer], block_size: int,
                   tp_size: int) -> int:  # fmt: skip
    """The block size the cache runs: block_size, or with recurrent layers the smallest
    multiple of it whose page (a full-attention layer's K and V of its tokens, on one
    rank) holds one layer's state (kv_groups.py; vLLM raises the attention block size
    of a hybrid model the same way)."""
    if LINEAR_ATTENTION not in mc.layer_types:
        return block_size
    page = max(x.kv_bytes_per_token for x in layers) * block_size
    return block_size * cdiv(mc.recurrent.state_bytes(tp_size), page)


def layer_shapes(backend, mc: ModelConfig, num_kv_heads: int, num_blocks: int,
                 block_size: int) -> list[tuple[int, ...]]:  # fmt: skip
    """A layer's cache tensors in the backend's layout: K and V, or one latent cache."""
    if mc.mla is not None:
        return [backend.mla.latent_cache_shape(num_blocks, block_size, mc.mla.latent_width)]
    return [backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, mc.head_dim)] * 2


def allocate(
    backend, mc: ModelConfig, groups: Sequence[KVCacheGroup], num_kv_heads: int,
    num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
) -> tuple[list[KVCache], list[KVCache]]:  # fmt: skip
    """A layer's tensors (layer_shapes) for each of a group's size, zeroed, and every
    layer's: layer j of each group shares tuple j (a block id belongs to one group at a
    time). Returns (the tuples, the layers' tuples)."""
    shapes = layer_shapes(backend, mc, num_kv_heads, num_blocks, block_size)

    def zeros() -> KVCache:
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)

    pairs = [zeros() for _ in range(group_size(groups))]
    return pairs, [pairs[slot] for _, slot in layer_slots(groups, mc.num_layers)]


def num_blocks(
    config: ExecutorConfig, device: torch.device, bytes_a_block: int,
    warm_up: Callable[[int], int],
) -> int:  # fmt: skip
    """The blocks this rank can hold. warm_up(num_tokens) runs the largest step once,
    on a cache just big enough for it, and returns that cache's bytes (CUDA only)."""
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type != "cuda":
        return max(1, config.kv_cache_bytes // bytes_a_block)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    kv_bytes = warm_up(config.max_num_batched_tokens)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # Other processes and the CUDA context; the weights are in the peak below.
    used_elsewhere = total - free - torch.cuda.memory_reserved()
    peak_without_kv = torch.cuda.max_memory_allocated() - kv_bytes
    budget = total * config.gpu_memory_utilization - used_elsewhere - peak_without_kv
    if budget < bytes_a_block:
        raise RuntimeError(
            f"no room for the KV cache at gpu_memory_utilization="
            f"{config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
        )
    return int(budget // bytes_a_block)


def warmup_plan(
    num_tokens: int, block_size: int, vocab_size: int, sampling_params, num_groups: int = 1
) -> SchedulerOutput:
    """One request of num_tokens prompt tokens, prefilled whole (every group on the
    same blocks: the warm-up's values are never read)."""
    token_ids = [i % vocab_size for i in range(num_tokens)]
    blocks = [b for b in range(cdiv(num_tokens, block_size)) for _ in range(num_groups)]
    request = NewRequestData("warmup", token_ids, num_tokens, sampling_params, blocks)
    return SchedulerOutput(
        scheduled_new_reqs=[request], num_scheduled_tokens={"warmup": num_tokens}
    )
