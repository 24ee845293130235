"""LoRA's low-rank products for a batch of several adapters, on the CPU (and the twin
of kernels/triton_lora.py): every token that runs an adapter gets x @ A.T @ B.T of its
adapter's slot added to the base layer's output, grouped by adapter (one shrink and one
expand GEMM per adapter in the step, S-LoRA's gathered layout).

The slots' weights (executor/lora/layers.py): a [S, P * R, in] (each of the P packed
parts' A, R rows each, zero-padded past the adapter's rank) and b [S, out, R] (each
part's B rows where that part's outputs are, scaling folded in); parts: per packed
part (first output row, rows). mapping: executor/lora/mapping.py's LoRAMapping."""

import torch


def lora_add(x, out, a, b, parts, mapping) -> None:
    """out [T, out] += each adapter token's low-rank product (in place)."""
    r = b.shape[2]
    rows = x.index_select(0, mapping.sorted_tokens)
    delta = torch.empty(len(rows), out.shape[1], dtype=out.dtype, device=out.device)
    for slot, start, end in mapping.bounds:
        y = rows[start:end] @ a[slot].T  # [n, P * R]
        for p, (first, count) in enumerate(parts):
            b_part = b[slot, first : first + count]
            delta[start:end, first : first + count] = y[:, p * r : (p + 1) * r] @ b_part.T
    out.index_add_(0, mapping.sorted_tokens, delta)
