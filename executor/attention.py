"""Attention over the paged KV cache for one flattened step.

The batch is laid out decodes first (one token each), then prefill chunks, so that each
kind runs as one kernel call. A backend is a kernels module with the functions (and
signatures) of kernels/torch_ref.py."""

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from flagstop.kernels import torch_ref


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] cached + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int  # the first num_decodes sequences have exactly one new token


def attention_backend(name: str, device: torch.device) -> ModuleType:
    """The kernels module for a backend name: `torch` (kernels/torch_ref.py, the CPU
    path) or `triton` (kernels/triton_attention.py, imported only when chosen)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return torch_ref
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}: auto, torch or triton")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs CUDA (or TRITON_INTERPRET=1, for tests)")
    from flagstop.kernels import triton_attention

    return triton_attention


def paged_attention(
    backend: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]: store the new K/V, then
    attend to everything cached (the new tokens included)."""
    k_cache, v_cache = kv_cache
    backend.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    n = meta.num_decodes
    decode, prefill = backend.paged_attention_decode, backend.paged_attention_prefill
    if n == query.shape[0]:
        return decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(query)
    if n:
        out[:n] = decode(
            query[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale
        )
    out[n:] = prefill(
        query[n:],
        k_cache,
        v_cache,
        meta.block_tables[n:],
        meta.query_start_loc[n:] - n,
        meta.seq_lens[n:],
        scale,
    )
    return out
