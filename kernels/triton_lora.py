"""LoRA's low-rank products on the GPU, Punica's segmented gather matmuls (SGMV):
twin of kernels/torch_lora.py (same signature and slot layout). The step's adapter
tokens come sorted by slot (executor/lora/mapping.py); each program takes a tile of
one segment's tokens, gathers their rows of x by index inside the kernel, and
multiplies by that segment's slot:

- shrink: y [N, P * R] = x[tokens] @ a[slot].T, float32;
- expand, per packed part: out[tokens, part] += y[:, part's R] @ b[slot, part].T,
  a read-add-write of rows no other program touches.

A decode step is the same kernel with one-token segments (Punica's BGMV case). On a
CPU they run under TRITON_INTERPRET=1, which is how the tests hold them to the twin."""

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _segment_rows(sorted_tokens, seg_starts, seg_slots, BLOCK_M: tl.constexpr):
    """This program's rows of the sorted tokens, which are valid, their token indices,
    and the segment's slot."""
    g = tl.program_id(0)
    start, end = tl.load(seg_starts + g), tl.load(seg_starts + g + 1)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < end
    tokens = tl.load(sorted_tokens + rows, mask=valid, other=0)
    return rows, valid, tokens, tl.load(seg_slots + g)


@triton.jit
def _shrink_kernel(
    x, a, y, sorted_tokens, seg_starts, seg_slots, N, K,
    stride_xm, stride_as, stride_an, stride_ym, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows, valid, tokens, slot = _segment_rows(sorted_tokens, seg_starts, seg_slots, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        tile_x = tl.load(x + tokens[:, None] * stride_xm + k[None, :],
                         mask=valid[:, None] & (k[None, :] < K), other=0.0)  # fmt: skip
        tile_a = tl.load(a + slot * stride_as + cols[None, :] * stride_an + k[:, None],
                         mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(tile_x, tile_a, input_precision="ieee")
        else:
            acc += tl.dot(tile_x, tile_a.to(tile_x.dtype))
    out = y + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc, mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _expand_kernel(
    y, b, out, sorted_tokens, seg_starts, seg_slots, first, count, y_first, R,
    stride_ym, stride_bs, stride_bn, stride_om, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows, valid, tokens, slot = _segment_rows(sorted_tokens, seg_starts, seg_slots, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        k = k0 + ks
        tile_y = tl.load(y + rows[:, None] * stride_ym + y_first + k[None, :],
                         mask=valid[:, None] & (k[None, :] < R), other=0.0)  # fmt: skip
        tile_b = tl.load(b + slot * stride_bs + (first + cols[None, :]) * stride_bn + k[:, None],
                         mask=(cols[None, :] < count) & (k[:, None] < R), other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(tile_y, tile_b, input_precision="ieee")
        else:
            acc += tl.dot(tile_y.to(tile_b.dtype), tile_b)
    where = out + tokens[:, None] * stride_om + first + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < count)
    current = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (current.to(tl.float32) + acc).to(out.dtype.element_ty), mask=mask)


def lora_add(x, out, a, b, parts, mapping) -> None:
    """See torch_lora.lora_add."""
    x = x.contiguous()
    num_rows, width, rank = mapping.sorted_tokens.numel(), a.shape[1], b.shape[2]
    y = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    segments = (len(mapping.bounds), triton.cdiv(mapping.max_seg_len, BLOCK_M))
    ieee = x.dtype == torch.float32
    index = (mapping.sorted_tokens, mapping.seg_starts, mapping.seg_slots)
    _shrink_kernel[(*segments, triton.cdiv(width, BLOCK_N))](
        x, a, y, *index, width, x.shape[1], x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    for p, (first, count) in enumerate(parts):
        _expand_kernel[(*segments, triton.cdiv(count, BLOCK_N))](
            y, b, out, *index, first, count, p * rank, rank, y.stride(0), b.stride(0),
            b.stride(1), out.stride(0), IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=16,
        )  # fmt: skip
