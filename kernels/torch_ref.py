"""Torch reference kernels: the CPU path and the oracle for the Triton kernels.

Cache layout, per layer: k_cache and v_cache of [num_blocks, block_size, num_kv_heads,
head_dim]. A token at position p of a request lives in slot
block_table[p // block_size] * block_size + p % block_size, so one token's heads are
contiguous (one row copy to store) and a block is a contiguous tile to read.
"""

import torch
import torch.nn.functional as F

from flagstop.utils import cdiv


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] into the caches; slot -1 = padding."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[num_seqs, max_len, num_kv_heads, head_dim] read through the block tables."""
    num_seqs, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = cdiv(max_len, block_size)
    block_ids = block_tables[:, :num_blocks].long().clamp(min=0).flatten()
    # index_select: about twice as fast as advanced indexing on the CPU.
    blocks = cache.index_select(0, block_ids)
    return blocks.view(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :max_len]


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, attending to its seq_len cached tokens (its own
    included). query [num_seqs, num_heads, head_dim] -> same shape."""
    max_len = int(seq_lens.max())
    k = gather_kv(k_cache, block_tables, max_len).transpose(1, 2)
    v = gather_kv(v_cache, block_tables, max_len).transpose(1, 2)
    visible = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2).float(),
        k.float(),
        v.float(),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2).to(query.dtype)


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention: sequence i's queries are query[query_start_loc[i]:
    query_start_loc[i+1]], the LAST tokens of its seq_lens[i] cached tokens (earlier
    ones are cached context: chunked prefill, prefix hits). query [T, H, D] -> same."""
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        num_context = seq_len - (end - start)
        k = gather_kv(k_cache, block_tables[i : i + 1], seq_len)[0].transpose(0, 1)
        v = gather_kv(v_cache, block_tables[i : i + 1], seq_len)[0].transpose(0, 1)
        # 4-D inputs: SDPA's fused CPU kernels only take batched ones (about 4x faster).
        out[start:end] = (
            F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1)[None].float(),
                k[None].float(),
                v[None].float(),
                attn_mask=_causal_mask(num_context, seq_len, query.device),
                is_causal=num_context == 0,
                scale=scale,
                enable_gqa=True,
            )[0]
            .transpose(0, 1)
            .to(query.dtype)
        )
    return out


def _causal_mask(num_context: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Query j (at position num_context + j) sees keys 0..num_context + j. None without
    context: SDPA's own is_causal is the same mask and takes the fast kernels."""
    if num_context == 0:
        return None
    key_pos = torch.arange(seq_len, device=device)
    query_pos = torch.arange(num_context, seq_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]
