"""Triton kernels of latent attention (DeepSeek-V2/V3), twins of kernels/torch_mla.py
(same signatures, same cache layout: [num_blocks, block_size, kv_lora_rank + rope_dim],
one latent and one rotated key per token).

- Decode, absorbed: the query folded through W_uk (one GEMM, torch's) scores the
  latents directly; one program per (sequence, group of heads) walks the context in
  tiles with an online softmax and keeps its heads' context in latent space; W_uv
  (another GEMM) turns it into the values' space. Every head reads the same latents,
  so a program serves BLOCK_H heads from one load of each tile (the MQA shape that
  makes absorbed decode memory-cheap).
- Prefill, expanded: the sequences' latents gathered once and up-projected by
  kv_b_proj's halves (GEMMs), then a varlen causal attention over them whose keys
  (nope + rope dims) and values (v_head_dim) differ in width.

On a CPU they run under TRITON_INTERPRET=1 (tests/test_mla.py holds them to the twins);
tools/compile_sm90.py compiles their launches for the H200."""

import torch
import triton
import triton.language as tl

from flagstop.kernels.torch_mla import latent_cache_shape, store_latent  # noqa: F401
from flagstop.kernels.triton_common import dot, online_softmax

# Heads one decode program serves (tl.dot needs 16 rows), and context tokens a tile.
# At DeepSeek-V3's sizes (rank 512; keys of 192) 8 warps share the accumulators:
# compiled for sm_90a with 4, the bf16 decode spilled 88 bytes at 255 registers.
BLOCK_H = 16
BLOCK_N = 32
# Queries and keys a prefill tile.
PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 32


@triton.jit
def _mla_decode_kernel(
    q_latent, q_pe, cache, block_tables, seq_lens, out, scale,
    stride_ql_seq, stride_ql_head, stride_qp_seq, stride_qp_head, stride_table,
    stride_cache_block, stride_out_seq, stride_out_head, num_heads,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    r, p = tl.arange(0, RANK_PAD), tl.arange(0, ROPE_PAD)
    ql = tl.load(q_latent + seq * stride_ql_seq + heads[:, None] * stride_ql_head + r[None, :],
                 mask=head_ok[:, None] & (r < RANK)[None, :], other=0.0)  # fmt: skip
    qp = tl.load(q_pe + seq * stride_qp_seq + heads[:, None] * stride_qp_head + p[None, :],
                 mask=head_ok[:, None] & (p < ROPE)[None, :], other=0.0)  # fmt: skip
    length = tl.load(seq_lens + seq)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)  # noqa: E741
    acc = tl.zeros((BLOCK_H, RANK_PAD), tl.float32)
    for start in range(0, length, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < length
        block = tl.load(block_tables + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * (RANK + ROPE)
        c = tl.load(cache + row[:, None] + r[None, :],
                    mask=valid[:, None] & (r < RANK)[None, :], other=0.0)  # fmt: skip
        k_pe = tl.load(cache + row[:, None] + RANK + p[None, :],
                       mask=valid[:, None] & (p < ROPE)[None, :], other=0.0)  # fmt: skip
        c = c.to(ql.dtype)
        s = (dot(ql, tl.trans(c), IEEE) + dot(qp, tl.trans(k_pe.to(qp.dtype)), IEEE)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m, l, acc = online_softmax(s, c, m, l, acc, IEEE)  # noqa: E741
    tl.store(out + seq * stride_out_seq + heads[:, None] * stride_out_head + r[None, :],
             acc / l[:, None], mask=head_ok[:, None] & (r < RANK)[None, :])  # fmt: skip


def mla_decode(q_nope, q_pe, cache, block_tables, seq_lens, w_uk, w_uv, scale):
    """torch_mla.mla_decode's contract: [B, H, v_dim]."""
    num_seqs, num_heads, _ = q_nope.shape
    rank, rope = w_uk.shape[-1], q_pe.shape[-1]
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk.to(q_nope.dtype)).contiguous()
    context = torch.empty((num_seqs, num_heads, rank), dtype=torch.float32, device=q_nope.device)
    _mla_decode_kernel[(num_seqs, triton.cdiv(num_heads, BLOCK_H))](
        q_latent, q_pe, cache, block_tables, seq_lens, context, scale,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        block_tables.stride(0), cache.stride(0), context.stride(0), context.stride(1),
        num_heads, RANK=rank, ROPE=rope, RANK_PAD=triton.next_power_of_2(rank),
        ROPE_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        BLOCK_SIZE=cache.shape[1], IEEE=q_nope.dtype == torch.float32,
        num_warps=8 if rank >= 256 else 4,
    )  # fmt: skip
    return torch.einsum("bhr,hvr->bhv", context.to(q_nope.dtype), w_uv.to(q_nope.dtype))


@triton.jit
def _mla_prefill_kernel(
    query, key, value, out, query_start_loc, kv_start_loc, seq_lens, scale,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_out_tok, stride_out_head,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, QK_PAD: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_first = tl.load(query_start_loc + seq)
    num_queries = tl.load(query_start_loc + seq + 1) - q_first
    if tile * BLOCK_M >= num_queries:
        return
    length, kv_first = tl.load(seq_lens + seq), tl.load(kv_start_loc + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_queries
    query_pos = length - num_queries + rows
    d, e = tl.arange(0, QK_PAD), tl.arange(0, V_PAD)
    q = tl.load(query + (q_first + rows)[:, None] * stride_q_tok + head * stride_q_head
                + d[None, :], mask=row_ok[:, None] & (d < QK_DIM)[None, :], other=0.0)  # fmt: skip
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)  # noqa: E741
    acc = tl.zeros((BLOCK_M, V_PAD), tl.float32)
    last = length - num_queries + tl.minimum(num_queries, (tile + 1) * BLOCK_M)  # causal end
    for start in range(0, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < length
        k = tl.load(
            key + (kv_first + pos)[:, None] * stride_k_tok + head * stride_k_head + d[None, :],
            mask=valid[:, None] & (d < QK_DIM)[None, :],
            other=0.0,
        )
        v = tl.load(
            value + (kv_first + pos)[:, None] * stride_v_tok + head * stride_v_head + e[None, :],
            mask=valid[:, None] & (e < V_DIM)[None, :],
            other=0.0,
        )
        s = dot(q, tl.trans(k), IEEE) * scale
        seen = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        s = tl.where(seen, s, float("-inf"))
        m, l, acc = online_softmax(s, v, m, l, acc, IEEE)  # noqa: E741
    tl.store(out + (q_first + rows)[:, None] * stride_out_tok + head * stride_out_head
             + e[None, :], (acc / l[:, None]).to(out.dtype.element_ty),
             mask=row_ok[:, None] & (e < V_DIM)[None, :])  # fmt: skip


def _gathered_latents(cache, block_tables, seq_lens) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cached latents back to back [sum(seq_lens), width], and where
    each sequence's start [S]."""
    block_size, device = cache.shape[1], cache.device
    lengths = seq_lens.long()
    starts = torch.cumsum(lengths, 0) - lengths
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    pos = torch.arange(int(lengths.sum()), device=device) - starts[owner]
    slots = block_tables[owner, pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, cache.shape[-1])[slots], starts


def mla_prefill(q_nope, q_pe, cache, block_tables, query_start_loc, seq_lens, w_uk, w_uv, scale):
    """torch_mla.mla_prefill's contract: [T, H, v_dim]."""
    num_tokens, num_heads, _ = q_nope.shape
    rank, v_dim, dtype = w_uk.shape[-1], w_uv.shape[1], q_nope.dtype
    latents, kv_start = _gathered_latents(cache, block_tables, seq_lens)
    latents = latents.to(dtype)
    c, k_pe = latents[:, :rank], latents[:, rank:]
    k_nope = torch.einsum("nr,hkr->nhk", c, w_uk.to(dtype))
    key = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)
    value = torch.einsum("nr,hvr->nhv", c, w_uv.to(dtype)).contiguous()
    query = torch.cat((q_nope, q_pe), dim=-1)
    out = q_nope.new_empty(num_tokens, num_heads, v_dim)
    qk_dim = query.shape[-1]
    most = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (len(seq_lens), num_heads, triton.cdiv(most, PREFILL_BLOCK_M))
    _mla_prefill_kernel[grid](
        query, key, value, out, query_start_loc, kv_start, seq_lens, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), out.stride(0), out.stride(1), QK_DIM=qk_dim, V_DIM=v_dim,
        QK_PAD=max(16, triton.next_power_of_2(qk_dim)),
        V_PAD=max(16, triton.next_power_of_2(v_dim)), BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=PREFILL_BLOCK_N, IEEE=dtype == torch.float32,
        num_warps=8 if qk_dim > 128 else 4,
    )  # fmt: skip
    return out
