"""Torch kernels of the quantized linear layers (executor/models/quant_formats.py's
layout): the CPU path and the Triton kernels' twins. The weights stay quantized in
memory; each call dequantizes one layer's weight into a float32 scratch, group by group
exactly as the formats' own decompressors do, and runs one GEMM on it. Activations are
quantized first where the scheme says so (per token, per group or with the static
scale), to the values the format's GPU kernels multiply."""

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest e4m3 value
# Half of int8's range (-128..127), compressed-tensors' divisor for a symmetric scale.
INT8_HALF_RANGE = 127.5
FP8 = torch.float8_e4m3fn

# Byte -> value tables: one lookup a byte (an embedding gather) instead of torch's e4m3
# -> float32 conversion, which runs element by element on the CPU (1M values: 3.3 vs
# 10.4 ms), or shifts and masks over the int4 words. Little-endian bytes: byte b of a
# word holds its nibbles 2b (low) and 2b + 1.
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()[:, None]
_NIBBLE_VALUES = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], 1).float()


def _lookup(table: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """Each byte of `data` through a [256, n] table: [..., bytes * n] float32."""
    values = F.embedding(data.view(torch.uint8).int(), table.to(data.device))
    return values.flatten(-2)


def fp8_to_float(values: torch.Tensor) -> torch.Tensor:
    """e4m3 values as float32, the same shape."""
    return _lookup(_E4M3_VALUES, values)


def _grouped(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
    """(values - zero) * scale, by groups of columns, in the scales' dtype (float32)."""
    rows, columns = values.shape
    groups = scale.shape[1]
    group = -(-columns // groups)
    w = fp8_to_float(values) if values.dtype == FP8 else values.to(scale.dtype)
    if groups * group != columns:
        w = F.pad(w, (0, groups * group - columns))
    w = w.view(rows, groups, group)
    if zero is not None:
        w = w - zero.to(scale.dtype).unsqueeze(-1)
    return (w * scale.unsqueeze(-1)).view(rows, -1)[:, :columns]


def dequantize_w8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """int8 or e4m3 weights [out, in] times their scales [out, G], float32."""
    return _grouped(weight, weight_scale, None)


def unpack_int4(qweight: torch.Tensor, columns: int) -> torch.Tensor:
    """[out, ceil(in / 8)] int32 words as [out, in] float32 values 0..15 (nibble j of
    word w is column 8w + j)."""
    return _lookup(_NIBBLE_VALUES, qweight.contiguous())[:, :columns]


def dequantize_int4(qweight, scales, zeros, columns: int) -> torch.Tensor:
    """(q - zero) * scale, float32 [out, in]."""
    return _grouped(unpack_int4(qweight, columns), scales, zeros)


def quantize_act(x: torch.Tensor, act, input_scale: torch.Tensor | None):
    """x [T, in] (act: quantization.ActScheme) as (values of act.kind, scales [T, G]
    float32): per token (G = 1), per group of columns, or the static scale; symmetric,
    as compressed-tensors quantizes (an int8 scale is amax / 127.5, the values rounded
    and clamped to -128..127)."""
    qmax = FP8_MAX if act.kind == "fp8" else INT8_HALF_RANGE
    xf = x.float()
    if act.static:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    elif act.group:
        amax = xf.unflatten(-1, (-1, act.group)).abs().amax(-1)
        scale = amax.clamp(min=1e-10) / qmax
    else:
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / qmax
    group = x.shape[1] // scale.shape[1]
    scaled = (xf.view(x.shape[0], scale.shape[1], group) / scale.unsqueeze(-1)).flatten(1)
    if act.kind == "fp8":
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    return scaled.round().clamp(-128, 127).to(torch.int8), scale


def dequantize_act(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _grouped(values, scale, None)


def w8_linear(x, weight, weight_scale, act, input_scale, bias=None) -> torch.Tensor:
    """x [T, in] times an 8-bit weight [out, in] (int8 or e4m3) with scales [out, G];
    the input quantized first by `act` (None: weight-only)."""
    if act is not None:
        x = dequantize_act(*quantize_act(x, act, input_scale)).to(x.dtype)
    return F.linear(x, dequantize_w8(weight, weight_scale).to(x.dtype), bias)


def int4_linear(x, qweight, scales, zeros, bias=None) -> torch.Tensor:
    """x [T, in] times an int4 weight (W4A16: the input stays in its dtype)."""
    weight = dequantize_int4(qweight, scales, zeros, x.shape[1])
    return F.linear(x, weight.to(x.dtype), bias)
