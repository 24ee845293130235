"""LoRA's low-rank products on the GPU, Punica's segmented gather matmuls (SGMV):
twin of kernels/torch_lora.py (same signature and slot layout). The step's adapter
tokens come sorted by slot (executor/lora/mapping.py); each program takes a tile of
one segment's tokens, gathers their rows of x by index inside the kernel, and
multiplies by that segment's slot:

- shrink: y [N, P * R] = x[tokens] @ a[slot].T, float32;
- expand, per packed part: out[tokens, part] += y[:, part's R] @ b[slot, part].T,
  a read-add-write of rows no other program touches.

Both are one kernel (_sgmv_kernel), told where its rows come from and go. A decode
step is the same with one-token segments (Punica's BGMV case). On a CPU it runs under
TRITON_INTERPRET=1, which is how the tests hold it to the twin."""

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _sgmv_kernel(
    inp, w, out, sorted_tokens, seg_starts, seg_slots, N, K, in_first, w_first, out_first,
    stride_in, stride_ws, stride_wn, stride_out,
    GATHER_IN: tl.constexpr, SCATTER_ADD: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[rows, out_first + n] (+)= inp[rows, in_first + k] . w[slot, w_first + n, k] for
    this program's tile of one segment (its slot's weights). GATHER_IN: the input rows
    are the segment's tokens (x), else its sorted positions (y); SCATTER_ADD: the output
    rows are the tokens, added to (out), else the sorted positions, stored (y)."""
    g = tl.program_id(0)
    start, end = tl.load(seg_starts + g), tl.load(seg_starts + g + 1)
    slot = tl.load(seg_slots + g)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < end
    tokens = tl.load(sorted_tokens + rows, mask=valid, other=0)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = tokens if GATHER_IN else rows
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        tile_in = tl.load(inp + in_rows[:, None] * stride_in + in_first + k[None, :],
                          mask=valid[:, None] & (k[None, :] < K), other=0.0)  # fmt: skip
        tile_w = tl.load(w + slot * stride_ws + (w_first + cols[None, :]) * stride_wn + k[:, None],
                         mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(tile_in.to(tl.float32), tile_w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tile_in.to(tile_w.dtype), tile_w)
    out_rows = tokens if SCATTER_ADD else rows
    where = out + out_rows[:, None] * stride_out + out_first + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < N)
    if SCATTER_ADD:  # rows no other program touches: a plain read-add-write
        acc += tl.load(where, mask=mask, other=0.0).to(tl.float32)
    tl.store(where, acc.to(out.dtype.element_ty), mask=mask)


def lora_add(x, out, a, b, parts, mapping) -> None:
    """See torch_lora.lora_add."""
    x = x.contiguous()
    num_rows, width, rank = mapping.sorted_tokens.numel(), a.shape[1], b.shape[2]
    y = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    segments = (len(mapping.bounds), triton.cdiv(mapping.max_seg_len, BLOCK_M))
    index = (mapping.sorted_tokens, mapping.seg_starts, mapping.seg_slots)
    blocks = dict(IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    # shrink: y = x[tokens] @ a[slot].T, into the sorted positions
    _sgmv_kernel[(*segments, triton.cdiv(width, BLOCK_N))](
        x, a, y, *index, width, x.shape[1], 0, 0, 0,
        x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        GATHER_IN=True, SCATTER_ADD=False, BLOCK_K=BLOCK_K, **blocks,
    )  # fmt: skip
    for p, (first, count) in enumerate(parts):  # expand: out[tokens, part] += y_p @ b_p.T
        _sgmv_kernel[(*segments, triton.cdiv(count, BLOCK_N))](
            y, b, out, *index, count, rank, p * rank, first, first,
            y.stride(0), b.stride(0), b.stride(1), out.stride(0),
            GATHER_IN=False, SCATTER_ADD=True, BLOCK_K=16, **blocks,
        )  # fmt: skip
