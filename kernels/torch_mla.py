"""Multi-head latent attention (DeepSeek-V2/V3) on a paged latent cache, the torch path
and the twin any Triton kernel is tested against.

The cache holds, per token, one compressed latent c (kv_lora_rank values, after
kv_a_layernorm) and one rotated key k_pe (qk_rope_head_dim values) shared by every head:
cache [num_blocks, block_size, kv_lora_rank + rope_dim], about a tenth of GQA's bytes.
Each head's key is [W_uk c, k_pe] and its value W_uv c, with W_uk [H, nope_dim, rank]
and W_uv [H, v_dim, rank] the halves of kv_b_proj.

Prefill runs the expanded form (the keys and values up-projected once per chunk: its
queries are many). Decode runs the absorbed form (DeepSeek-V2 paper, section 2.1.2;
vLLM's MLA backends): W_uk folds into the query (q_nope W_uk: one rank-sized query per
head) and W_uv into the output, so a decode step reads only the latent cache and never
expands the keys of the whole context. The two are the same sums in another order."""

import torch


def latent_cache_shape(num_blocks: int, block_size: int, width: int) -> tuple[int, ...]:
    """One layer's cache: [num_blocks, block_size, kv_lora_rank + rope_dim]."""
    return (num_blocks, block_size, width)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, rank + rope_dim] (c, then k_pe) into each token's slot; slot -1 (a
    padded row, as store_kv has them) is skipped."""
    keep = slot_mapping >= 0
    cache.view(-1, cache.shape[-1])[slot_mapping[keep]] = latent[keep].to(cache.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` cached latents, [length, rank + rope_dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def mla_prefill(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, w_uk: torch.Tensor,
    w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Expanded: q_nope [T, H, nope], q_pe [T, H, rope] of each sequence's last
    new tokens (query_start_loc [S + 1], seq_lens [S]: cached + new) -> [T, H, v_dim]."""
    rank = w_uk.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        length = int(seq_lens[s])
        latents = _gather(cache, block_tables[s], length).float()
        c, k_pe = latents[:, :rank], latents[:, rank:]
        k_nope = torch.einsum("sr,hnr->hsn", c, w_uk.float())
        v = torch.einsum("sr,hvr->hsv", c, w_uv.float())
        scores = torch.einsum("thn,hsn->hts", q_nope[start:end].float(), k_nope)
        scores += torch.einsum("thp,sp->hts", q_pe[start:end].float(), k_pe)
        out[start:end] = _attend(scores * scale, v, length).to(out.dtype)
    return out


def _attend(scores: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """scores [H, T, S] of the last T of S positions, causal -> [T, H, v_dim]."""
    num_queries = scores.shape[1]
    query_pos = torch.arange(length - num_queries, length, device=scores.device)
    future = torch.arange(length, device=scores.device)[None, :] > query_pos[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hts,hsv->thv", probs, v)


def mla_decode(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Absorbed: one new token per sequence, q_nope [B, H, nope], q_pe [B, H, rope]
    -> [B, H, v_dim], reading only the latents: the batch's gathered at once, padded to
    the longest and masked."""
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_uk.float())
    longest = int(seq_lens.max())
    blocks = block_tables[:, : -(-longest // cache.shape[1])].long()
    latents = cache[blocks].flatten(1, 2)[:, :longest].float()  # [B, S, rank + rope]
    c, k_pe = latents[..., :rank], latents[..., rank:]
    scores = torch.einsum("bhr,bsr->bhs", q_latent, c)
    scores += torch.einsum("bhp,bsp->bhs", q_pe.float(), k_pe)
    past = torch.arange(longest, device=cache.device)[None, :] >= seq_lens[:, None]
    probs = (scores * scale).masked_fill(past[:, None, :], float("-inf")).softmax(-1)
    context = torch.einsum("bhs,bsr->bhr", probs, c)  # still latent
    return torch.einsum("bhr,hvr->bhv", context, w_uv.float()).to(q_nope.dtype)
