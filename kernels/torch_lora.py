"""LoRA's low-rank products for a batch of several adapters, on the CPU (and the twin
of kernels/triton_lora.py): every token that runs an adapter gets x @ A.T @ B.T of its
adapter's slot added to the base layer's output. The adapter tokens are gathered once;
a decode step's short segments run every adapter at once (padded, in bmm's), longer
ones a shrink and an expand GEMM per adapter (S-LoRA's grouping).

The slots' weights (executor/lora/layers.py): a [S, P * R, in] (each of the P packed
parts' A, R rows each, zero-padded past the adapter's rank) and b [S, out, R] (each
part's B rows where that part's outputs are, scaling folded in); parts: per packed
part (first output row, rows). mapping: executor/lora/mapping.py's LoRAMapping."""

import torch


def lora_add(x, out, a, b, parts, mapping) -> None:
    """out [T, out] += each adapter token's low-rank product (in place)."""
    rows = x.index_select(0, mapping.sorted_tokens)
    if mapping.padded is not None:
        delta = _batched(rows, a, b, parts, mapping.padded)
    else:
        delta = _grouped(rows, a, b, parts, mapping.bounds, out.shape[1])
    out.index_add_(0, mapping.sorted_tokens, delta.to(out.dtype))


def _batched(rows, a, b, parts, padded) -> torch.Tensor:
    """Every adapter at once: the segments padded to one length, one bmm to shrink and
    one per part to expand (a decode step's many short segments: a GEMM pair per
    adapter would cost more in calls than in arithmetic)."""
    index, slots, real = padded
    r = b.shape[2]
    y = torch.bmm(rows[index], a[slots].transpose(1, 2))  # [G, L, P * R]
    b_slots = b[slots]
    delta = torch.cat([torch.bmm(y[:, :, p * r : (p + 1) * r],
                                 b_slots[:, first : first + count].transpose(1, 2))
                       for p, (first, count) in enumerate(parts)], dim=2)  # fmt: skip
    return delta.flatten(0, 1)[real]


def _grouped(rows, a, b, parts, bounds, width: int) -> torch.Tensor:
    r = b.shape[2]
    delta = torch.empty(len(rows), width, dtype=rows.dtype, device=rows.device)
    for slot, start, end in bounds:
        y = rows[start:end] @ a[slot].T  # [n, P * R]
        for p, (first, count) in enumerate(parts):
            b_part = b[slot, first : first + count]
            delta[start:end, first : first + count] = y[:, p * r : (p + 1) * r] @ b_part.T
    return delta
