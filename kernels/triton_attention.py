"""Triton kernels for the paged KV cache, twins of kernels/torch_attention.py (same
signatures). Layout: kv_cache_shape() = [num_blocks, block_size, num_kv_heads, head_dim],
token-major (a stored token is one contiguous row); the torch twins read head-major
blocks, the tests hand them a transposed copy.

A window layer's loop starts at its first query's window, so the blocks wholly before
it (a window group's null block) are never read; a sink is one more logit in the
softmax's denominator, added where the output is normalised; a soft cap bounds each
score before the softmax (Gemma 2).

Imported only when the triton backend is chosen; on a CPU they run under
TRITON_INTERPRET=1, which is how the tests hold them to their torch twins."""

import torch
import triton
import triton.language as tl

# The triton backend's experts', LoRA and quantized kernels (a backend has torch_attention's
# functions).
from flagstop.kernels import triton_mla as mla  # noqa: F401 (latent attention's)
from flagstop.kernels.triton_common import dot as _dot
from flagstop.kernels.triton_lora import lora_add  # noqa: F401
from flagstop.kernels.triton_moe import fused_moe  # noqa: F401
from flagstop.kernels.triton_quant import int4_linear, w8_linear  # noqa: F401

# Tokens of context one decode program reduces before the partial results are merged
# (flash-decoding): long contexts spread over more programs than there are sequences.
DECODE_PARTITION = 512


def gdn():
    """The backend's gated delta rule: flash-linear-attention's kernels (kernels/
    fla_gdn.py), imported only by a model with gated DeltaNet layers."""
    from flagstop.kernels import fla_gdn

    return fla_gdn


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


@triton.jit
def _store_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    stride_key,
    stride_value,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW
        k = tl.load(key + token * stride_key + cols, mask=mask)
        v = tl.load(value + token * stride_value + cols, mask=mask)
        tl.store(k_cache + slot * ROW + cols, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + slot * ROW + cols, v.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    row = num_kv_heads * head_dim
    key, value = key.reshape(num_tokens, row), value.reshape(num_tokens, row)
    assert key.stride(1) == 1 and value.stride(1) == 1 and k_cache.is_contiguous()
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


@triton.jit
def _kv_offsets(
    block_tables, seq, block_start, kv_head, stride_bt, stride_cache_block, stride_cache_token,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Offsets of one KV head's rows of the cache block holding block_start."""
    block = tl.load(block_tables + seq * stride_bt + block_start // BLOCK_SIZE).to(tl.int64)
    rows = block * stride_cache_block + tl.arange(0, BLOCK_SIZE)[:, None] * stride_cache_token
    return rows + kv_head * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _attend_block(
    q, k_cache, v_cache, kv_offsets, visible, scale, m, l, acc, IEEE: tl.constexpr,  # noqa: E741
    softcap=0.0, HAS_SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """One KV block into an online softmax: returns the updated running max m, sum l
    and unnormalised output acc of the query rows. With a soft cap (Gemma 2), the
    scores are cap * tanh(s / cap) (tanh as 2 sigmoid(2x) - 1)."""
    # An FP8 cache's values in the query's dtype (a no-op for a cache in it).
    k = tl.load(k_cache + kv_offsets).to(q.dtype)
    v = tl.load(v_cache + kv_offsets).to(q.dtype)
    s = _dot(q, tl.trans(k), IEEE) * scale
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf: guard exp(-inf - -inf).
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
    p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
    acc = acc * alpha[:, None] + _dot(p, v, IEEE)
    return m_new, l, acc


@triton.jit
def _decode_partition_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    partial_max,
    partial_sum,
    partial_out,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_bt,
    stride_cache_block,
    stride_cache_token,
    num_partitions,
    window,
    softcap,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One sequence, one KV head (its GROUP query heads), one partition of the context:
    an online softmax over the partition's blocks, left unnormalised for the merge.
    With a window, only the last window keys (a partition before them is empty)."""
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    start = part * PARTITION
    first_key = 0
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
        start = tl.maximum(start, first_key // BLOCK_SIZE * BLOCK_SIZE)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    q = tl.load(
        query + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=rows[:, None] < GROUP,
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for block_start in range(start, tl.minimum(part * PARTITION + PARTITION, seq_len), BLOCK_SIZE):
        kv_offsets = _kv_offsets(
            block_tables,
            seq,
            block_start,
            kv_head,
            stride_bt,
            stride_cache_block,
            stride_cache_token,
            HEAD_DIM,
            BLOCK_SIZE,
        )
        key_pos = (block_start + offsets)[None, :]
        visible = (key_pos < seq_len) & (key_pos >= first_key)
        m, l, acc = _attend_block(  # noqa: E741
            q, k_cache, v_cache, kv_offsets, visible, scale, m, l, acc, IEEE, softcap, HAS_SOFTCAP
        )
    out_row = (seq * tl.num_programs(1) * GROUP + heads) * num_partitions + part
    tl.store(partial_max + out_row, m, mask=rows < GROUP)
    tl.store(partial_sum + out_row, l, mask=rows < GROUP)
    tl.store(
        partial_out + out_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=rows[:, None] < GROUP
    )


@triton.jit
def _decode_merge_kernel(
    partial_max,
    partial_sum,
    partial_out,
    out,
    seq_lens,
    sinks,
    stride_out_seq,
    stride_out_head,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    used = tl.cdiv(tl.load(seq_lens + seq), PARTITION)
    parts = tl.arange(0, PARTS_PAD)
    base = (seq * tl.num_programs(1) + head) * num_partitions
    valid = parts < used
    m = tl.load(partial_max + base + parts, mask=valid, other=float("-inf"))
    l = tl.load(partial_sum + base + parts, mask=valid, other=0.0)  # noqa: E741
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:  # one more logit in the denominator, with no value
        sink = tl.load(sinks + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    # Partitions before a window saw nothing (m = -inf): their weight is 0.
    weights = tl.where(valid & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        partial_out + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    denominator = tl.sum(l * weights, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - m_max)
    result = tl.sum(acc * weights[:, None], axis=0) / denominator
    tl.store(
        out + seq * stride_out_seq + head * stride_out_head + dims, result.to(out.dtype.element_ty)
    )


def paged_attention_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, window=0, sinks=None, softcap=0.0
):
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_partitions = triton.cdiv(int(seq_lens.max()), DECODE_PARTITION)
    partial_shape = (num_seqs, num_heads, num_partitions)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=query.device)
    ieee = query.dtype == torch.float32
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        partial_max,
        partial_sum,
        partial_out,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        num_partitions,
        window,
        float(softcap),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PARTITION=DECODE_PARTITION,
        IEEE=ieee,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=bool(softcap),
    )
    out = torch.empty_like(query)
    _decode_merge_kernel[(num_seqs, num_heads)](
        partial_max,
        partial_sum,
        partial_out,
        out,
        seq_lens,
        seq_lens if sinks is None else sinks,  # not read without sinks
        out.stride(0),
        out.stride(1),
        num_partitions,
        HEAD_DIM=head_dim,
        PARTITION=DECODE_PARTITION,
        PARTS_PAD=max(2, triton.next_power_of_2(num_partitions)),
        HAS_SINKS=sinks is not None,
    )
    return out


@triton.jit
def _prefill_kernel(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    out,
    sinks,
    key_limits,
    scale,
    window,
    softcap,
    stride_q_token,
    stride_q_head,
    stride_bt,
    stride_cache_block,
    stride_cache_token,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
):
    """BLOCK_M queries of one sequence and one head against its cached context and
    the new tokens, causally or up to each query's key limit (and within the window),
    one KV block at a time."""
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens + seq)
        num_context = seq_len - q_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        q_offsets = (
            (q_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
        )
        q = tl.load(query + q_offsets, mask=rows[:, None] < q_len, other=0.0)
        query_pos = num_context + rows
        kv_head = head // GROUP
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        offsets = tl.arange(0, BLOCK_SIZE)
        # Causality: no query of this tile sees past its last query's position.
        kv_end = tl.minimum(seq_len, num_context + (tile + 1) * BLOCK_M)
        limits = query_pos
        if HAS_LIMITS:  # an image's tokens see to its end: any key of the sequence
            limits = tl.load(key_limits + q_start + rows, mask=rows < q_len, other=0)
            kv_end = seq_len
        kv_start = 0
        if HAS_WINDOW:  # nor before its first query's window
            kv_start = tl.maximum(num_context + tile * BLOCK_M - window + 1, 0)
            kv_start = kv_start // BLOCK_SIZE * BLOCK_SIZE
        for block_start in range(kv_start, kv_end, BLOCK_SIZE):
            kv_offsets = _kv_offsets(
                block_tables,
                seq,
                block_start,
                kv_head,
                stride_bt,
                stride_cache_block,
                stride_cache_token,
                HEAD_DIM,
                BLOCK_SIZE,
            )
            key_pos = block_start + offsets
            visible = (key_pos[None, :] <= limits[:, None]) & (key_pos[None, :] < seq_len)
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
            m, l, acc = _attend_block(  # noqa: E741
                q, k_cache, v_cache, kv_offsets, visible, scale, m, l, acc, IEEE, softcap,
                HAS_SOFTCAP,
            )  # fmt: skip
        if HAS_SINKS:  # one more logit in the denominator, with no value
            l += tl.exp(tl.load(sinks + head).to(tl.float32) - m)  # noqa: E741
        result = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out + q_offsets, result.to(out.dtype.element_ty), mask=rows[:, None] < q_len)


def paged_attention_prefill(
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window=0, sinks=None,
    softcap=0.0, key_limits=None,
):  # fmt: skip
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = 16 if max_q_len <= 16 else 64
    # 4 warps hold a 64 x 128 tile's accumulator and scores only by spilling registers
    # (ptxas for sm_90a: ~490 bytes a thread at bf16, block size 32; tools/compile_sm90.py);
    # 8 warps hold it in 182 registers, no spill.
    num_warps = 8 if block_m * head_dim >= 64 * 128 else 4
    out = torch.empty_like(query)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_q_len, block_m))](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        seq_lens if sinks is None else sinks,  # not read without sinks
        seq_lens if key_limits is None else key_limits,  # not read without limits
        scale,
        window,
        float(softcap),
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        IEEE=query.dtype == torch.float32,
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
        HAS_SOFTCAP=bool(softcap),
        HAS_LIMITS=key_limits is not None,
        num_warps=num_warps,
    )
    return out
