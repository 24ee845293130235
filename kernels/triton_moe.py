"""The fused Mixture-of-Experts kernel for the GPU, twin of torch_moe.fused_moe (same
signature), after vLLM's fused_moe: the (token, choice) pairs are sorted by expert
and each expert's run padded to a multiple of BLOCK_M (align_by_expert), so that a
block of BLOCK_M rows belongs to one expert; then one grouped-GEMM launch computes
gate_up for every block of every expert, and a second one down, the routing weight
applied in its epilogue. No host sync: the grid covers the most blocks the padding
can produce, and blocks past the padded end exit at once.

Imported only on the triton backend; on a CPU it runs under TRITON_INTERPRET=1,
which is how the tests hold it to its torch twin."""

import torch
import triton
import triton.language as tl

from flagstop.kernels.torch_moe import local_expert_ids, silu_mul

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


def align_by_expert(topk_ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int):
    """(sorted_ids, block_experts, num_padded): sorted_ids [the most padded rows] the
    flat pair indices t * k + j by local expert, each expert's run padded to block_m
    with T * k (a row no block writes); block_experts the local expert of each block
    of block_m rows (-1 past the end); num_padded [1] the padded rows in use."""
    num_pairs = topk_ids.numel()
    local = local_expert_ids(topk_ids, first_expert, num_experts)
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    order = torch.argsort(local, stable=True)
    expert_of = local[order]
    start = torch.cumsum(counts, 0) - counts  # of each expert's run in `order`
    inside = expert_of < num_experts
    expert_of = expert_of.clamp(max=num_experts - 1)
    rank_in_run = torch.arange(num_pairs, device=local.device) - start[expert_of]
    position = torch.where(inside, padded_start[expert_of] + rank_in_run, -1)
    max_rows = num_pairs + num_experts * (block_m - 1)
    sorted_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=local.device)
    # Pairs of other ranks' experts land in the extra last row, which no block reads.
    sorted_ids[torch.where(inside, position, max_rows)] = order.to(torch.int32)
    num_blocks = triton.cdiv(max_rows, block_m)
    blocks = torch.arange(num_blocks, device=local.device) * block_m
    block_experts = torch.searchsorted(torch.cumsum(padded, 0), blocks, right=True)
    block_experts = torch.where(blocks < padded.sum(), block_experts, -1).to(torch.int32)
    return sorted_ids[:max_rows], block_experts, padded.sum().view(1).to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a, b, c, topk_weights, sorted_ids, block_experts, num_padded,
    N, K, num_pairs, a_row_div,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[pair] = a[pair // a_row_div] @ b[expert].T (times the pair's weight) for the
    BLOCK_M pairs of one block, one BLOCK_N slice of N."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_rows = a + (pairs // a_row_div)[:, None] * stride_am
    b_cols = b + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        tile_a = tl.load(a_rows + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0)
        tile_b = tl.load(b_cols + k[:, None] * stride_bk,
                         mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(tile_a, tile_b, input_precision="ieee")
        else:
            acc += tl.dot(tile_a, tile_b)
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights + pairs, mask=valid, other=0.0)[:, None]
    out = c + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _grouped_gemm(a, b, c, weights, aligned, top_k: int, a_row_div: int) -> None:
    sorted_ids, block_experts, num_padded = aligned
    grid = (len(block_experts), triton.cdiv(b.shape[1], BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_experts, num_padded,
        b.shape[1], b.shape[2], c.shape[0], a_row_div,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act_and_mul=silu_mul,
) -> torch.Tensor:
    """See torch_moe.fused_moe: [T, H] in x's dtype. Biases are added around the
    grouped GEMMs, by each pair's expert (a pair of another rank's expert gets none)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    aligned = align_by_expert(topk_ids, first_expert, num_experts, BLOCK_M)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, aligned, top_k, a_row_div=top_k)
    weights = topk_weights.to(torch.float32).contiguous().flatten()
    local = ours = None
    if w13_bias is not None or w2_bias is not None:
        local = local_expert_ids(topk_ids, first_expert, num_experts)
        ours = (local < num_experts).unsqueeze(1)
        local = local.clamp(max=num_experts - 1)
    if w13_bias is not None:
        gate_up += w13_bias[local].to(x.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = act_and_mul(gate, up).contiguous()
    # Zeros: a pair of another rank's expert adds nothing to its token's sum.
    down = torch.zeros(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden, w2, down, weights, aligned, top_k, a_row_div=1)
    if w2_bias is not None:  # the kernel weighted its products: the bias is weighted too
        down += (w2_bias[local] * weights.unsqueeze(1) * ours).to(x.dtype)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
