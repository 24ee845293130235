"""Mixture-of-Experts in torch: the CPU path (tokens grouped by expert, a GEMM pair per
expert with tokens) and the oracle of the fused Triton kernel (triton_moe.py)."""

import torch
import torch.nn.functional as F


def local_expert_ids(topk_ids: torch.Tensor, first_expert: int, num_experts: int):
    """The flat choices as this rank's expert indices, those of other ranks' experts
    in a bucket num_experts past the last (so one bincount or sort leaves them apart)."""
    local = topk_ids.flatten().to(torch.int64) - first_expert
    return local.masked_fill((local < 0) | (local >= num_experts), num_experts)


def sort_by_expert(topk_ids: torch.Tensor, first_expert: int, num_experts: int):
    """Each (token, choice) pair of topk_ids [T, k] grouped by this rank's experts
    [first_expert, first_expert + num_experts): (order, counts), `order` the flat
    indices t * k + j sorted by expert (stable: in token order within an expert),
    `counts` the pairs of each local expert (a list: the loop over experts reads it
    once). Pairs routed to other ranks' experts are left out."""
    local = local_expert_ids(topk_ids, first_expert, num_experts)
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts].tolist()
    order = torch.argsort(local, stable=True)[: sum(counts)]
    return order, counts


def grouped_experts(x, topk_weights, topk_ids, first_expert, num_experts, expert_mlp):
    """The MoE layer's routed part on the CPU: tokens sorted by expert, one GEMM pair
    per expert that has tokens (expert_mlp(e, rows) -> rows), each output row scaled
    by its routing weight and scatter-added back to its token. [T, H] float of x's
    dtype; tokens routed only to other ranks' experts get zeros."""
    top_k = topk_ids.shape[1]
    order, counts = sort_by_expert(topk_ids, first_expert, num_experts)
    tokens = order // top_k
    rows = x[tokens]  # one gather; each expert's rows are then a contiguous slice
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(expert_mlp(expert, rows[start : start + count]))
            start += count
    out = torch.zeros_like(x)
    if outputs:
        weighted = torch.cat(outputs) * topk_weights.flatten()[order].unsqueeze(1)
        out.index_add_(0, tokens, weighted.to(x.dtype))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss' expert activation (transformers' GptOssExperts._apply_gate)."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


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
    """The routed experts of x [T, H]: w13 [E, 2I, H] (each expert's gate rows, then
    its up rows), w2 [E, H, I] for this rank's E experts from first_expert on, their
    biases (gpt-oss: [E, 2I], [E, H]) and activation act_and_mul(gate, up);
    topk_weights/topk_ids [T, k] the router's choices. Twin of triton_moe.fused_moe."""

    def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        b13 = None if w13_bias is None else w13_bias[e]
        gate, up = F.linear(rows, w13[e], b13).chunk(2, dim=-1)
        return F.linear(act_and_mul(gate, up), w2[e], None if w2_bias is None else w2_bias[e])

    return grouped_experts(x, topk_weights, topk_ids, first_expert, w13.shape[0], expert_mlp)
