"""Triton GEMMs of the quantized linear layers, twins of kernels/torch_quant.py (same
signatures, same layout: executor/models/quant_formats.py):

- `w8_linear`: 8-bit weights (e4m3 or int8) with scales per row and group of inputs.
  With quantized activations (FP8 block-scaled, W8A8) both operands go to the tensor
  cores as 8-bit values and each BLOCK_K step's partial product is scaled by the
  activation's and the weight's scale of that group (vLLM's w8a8 block GEMM, with a
  scale per weight row instead of per 128 rows); weight-only, the weight tile is cast to
  the input's dtype (exact: int8 and e4m3 fit bf16) and scaled the same way.
- `int4_linear` (W4A16): each int4 tile unpacked from its words, (q - zero) * scale of
  its group, then one dot with the 16-bit input tile: the weight never exists whole in
  16 bits.

A BLOCK_K step must not straddle a group: groups that are not a multiple of BLOCK_K
(nor the whole row) fall back to the torch kernels. On a CPU they run under
TRITON_INTERPRET=1, which is how the tests hold them to their twins."""

import torch
import triton
import triton.language as tl

from flagstop.kernels import torch_quant

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


def _group(scale: torch.Tensor, columns: int) -> int:
    """Inputs per scale column (the whole row for a per-row or per-tensor scale)."""
    return columns if scale.shape[1] == 1 else -(-columns // scale.shape[1])


def _fits(columns: int, *scales: torch.Tensor) -> bool:
    return all((g := _group(s, columns)) == columns or g % BLOCK_K == 0 for s in scales)


@triton.jit
def _input_tile(a, rows, k, stride_am, M, K):
    """The [BLOCK_M, BLOCK_K] tile of the input at rows, columns k (zeros outside)."""
    mask = (rows[:, None] < M) & (k[None, :] < K)
    return tl.load(a + rows[:, None] * stride_am + k[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(c, acc, rows, cols, stride_cm, M, N):
    out = c + rows[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _w8_gemm_kernel(
    a, a_scale, b, b_scale, c, M, N, K, a_group, b_group,
    stride_am, stride_as, stride_bn, stride_bs, stride_cm,
    A_QUANTIZED: tl.constexpr, INT_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c = (a * a_scale) @ (b * b_scale).T, the scales constant over a BLOCK_K step."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        tile_a = _input_tile(a, rows, k, stride_am, M, K)
        tile_b = tl.load(b + cols[None, :] * stride_bn + k[:, None],
                         mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)  # fmt: skip
        if A_QUANTIZED:
            if INT_DOT:
                part = tl.dot(tile_a, tile_b, out_dtype=tl.int32).to(tl.float32)
            else:
                part = tl.dot(tile_a, tile_b, out_dtype=tl.float32)
            sa = tl.load(a_scale + rows * stride_as + k0 // a_group, mask=rows < M, other=0.0)
            part = part * sa[:, None]
        elif IEEE:  # float32 inputs: no TF32 rounding on the GPU
            part = tl.dot(tile_a, tile_b.to(tile_a.dtype), input_precision="ieee")
        else:
            part = tl.dot(tile_a, tile_b.to(tile_a.dtype), out_dtype=tl.float32)
        sb = tl.load(b_scale + cols * stride_bs + k0 // b_group, mask=cols < N, other=0.0)
        acc += part * sb[None, :]
    _store_tile(c, acc, rows, cols, stride_cm, M, N)


def w8_linear(x, weight, weight_scale, act, input_scale, bias=None) -> torch.Tensor:
    """See torch_quant.w8_linear."""
    columns = x.shape[1]
    if act is not None:
        a, a_scale = torch_quant.quantize_act(x, act, input_scale)
    else:
        a, a_scale = x, weight_scale[:, :1]  # a_scale unread
    if not _fits(columns, weight_scale, a_scale) or (act and a.dtype != weight.dtype):
        return torch_quant.w8_linear(x, weight, weight_scale, act, input_scale, bias)
    a, a_scale = a.contiguous(), a_scale.contiguous().float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(weight.shape[0], BLOCK_N))
    _w8_gemm_kernel[grid](
        a, a_scale, weight, weight_scale, out, x.shape[0], weight.shape[0], columns,
        _group(a_scale, columns), _group(weight_scale, columns),
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        A_QUANTIZED=act is not None, INT_DOT=weight.dtype == torch.int8,
        IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out if bias is None else out + bias


@triton.jit
def _int4_gemm_kernel(
    a, qweight, scales, zeros, c, M, N, K, group,
    stride_am, stride_qn, stride_sn, stride_cm, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c = a @ ((q - zero) * scale).T, q unpacked tile by tile from its int32 words."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        tile_a = _input_tile(a, rows, k, stride_am, M, K)
        word_of = qweight + cols[None, :] * stride_qn + (k // 8)[:, None]
        words = tl.load(word_of, mask=(cols[None, :] < N) & (k[:, None] < K), other=0)
        q = (words >> ((k % 8) * 4)[:, None]) & 0xF
        g = k0 // group
        scale = tl.load(scales + cols * stride_sn + g, mask=cols < N, other=0.0)
        zero = tl.load(zeros + cols * stride_sn + g, mask=cols < N, other=0)
        w = (q.to(tl.float32) - zero.to(tl.float32)[None, :]) * scale[None, :]
        if IEEE:
            acc += tl.dot(tile_a, w.to(tile_a.dtype), input_precision="ieee")
        else:
            acc += tl.dot(tile_a, w.to(tile_a.dtype))
    _store_tile(c, acc, rows, cols, stride_cm, M, N)


def int4_linear(x, qweight, scales, zeros, bias=None) -> torch.Tensor:
    """See torch_quant.int4_linear."""
    columns = x.shape[1]
    if not _fits(columns, scales):
        return torch_quant.int4_linear(x, qweight, scales, zeros, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(qweight.shape[0], BLOCK_N))
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, out, x.shape[0], qweight.shape[0], columns,
        _group(scales, columns), x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        IEEE=x.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out if bias is None else out + bias
