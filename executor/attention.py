"""Attention over the paged KV cache for one flattened step.

The batch is laid out decodes first (one token each), then prefill chunks, so that each
kind runs as one kernel call. Backends share the signature of kernels/torch_ref.py."""

from dataclasses import dataclass

import torch

from kernels import torch_ref


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] cached + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int  # the first num_decodes sequences have exactly one new token


class TorchAttentionBackend:
    """The reference path (CPU, and the oracle for the Triton kernels)."""

    name = "torch"
    store_kv = staticmethod(torch_ref.store_kv)
    decode = staticmethod(torch_ref.paged_attention_decode)
    prefill = staticmethod(torch_ref.paged_attention_prefill)


def paged_attention(
    backend: type[TorchAttentionBackend],
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
    if n == query.shape[0]:
        return backend.decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(query)
    if n:
        out[:n] = backend.decode(
            query[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale
        )
    out[n:] = backend.prefill(
        query[n:],
        k_cache,
        v_cache,
        meta.block_tables[n:],
        meta.query_start_loc[n:] - n,
        meta.seq_lens[n:],
        scale,
    )
    return out
