"""The on-disk layouts of quantized linear weights, turned into the one layout flagstop
holds (and the kernels read), every tensor with output rows first:

- 8-bit (`kind` int8 or fp8): `weight` [out, in] int8 or float8_e4m3fn; `weight_scale`
  float32 [out, G]: one scale per row and `group` input columns (G = 1: per channel or
  per tensor; block scales are repeated down their block's rows, which costs 4 bytes per
  group of columns a row but lets tensor parallelism cut rows anywhere).
- int4: `qweight` int32 [out, ceil(in / 8)], column 8w + j in bits 4j..4j+3 of word w,
  unsigned (0..15); `scales` float32 [out, G]; `zeros` uint8 [out, G], unsigned (8 for a
  symmetric format): w = (q - zero) * scale.
- static activations: `input_scale` float32 [1].

Each reader takes the tensors of one layer by their checkpoint suffix. Dequantization
(torch_attention.dequantize_*) is bitwise the formats' own: compressed-tensors' decompressor
and transformers' FP8 dequantizer compute (q - zero) * scale in the scales' dtype, and
so does flagstop on float32 scales.
"""

import torch

from flagstop.executor.models.quantization import LinearScheme

# AutoAWQ packs output columns 8w + ORDER[j] into nibble j of word w.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The checkpoint suffixes of each on-disk layout: what the loader gathers per layer.
SUFFIXES = {
    "fp8-block": ("weight", "weight_scale_inv"),
    "fp8-tensor": ("weight", "weight_scale", "input_scale"),
    "ct-int": ("weight", "weight_scale", "weight_zero_point", "input_scale"),
    "ct-float": ("weight", "weight_scale", "weight_zero_point", "input_scale"),
    "ct-pack": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}


def complete(scheme: LinearScheme, t: dict[str, torch.Tensor]) -> bool:
    """Whether a layer's tensors are all there (the optional ones aside)."""
    need = {"fp8-block": 2, "fp8-tensor": 2, "ct-int": 2, "ct-float": 2, "ct-pack": 2,
            "gptq": 3, "awq": 3}[scheme.layout]  # fmt: skip
    required = set(SUFFIXES[scheme.layout][:need])
    if scheme.layout == "ct-pack":
        required |= {"weight_shape"} | (set() if scheme.symmetric else {"weight_zero_point"})
    if scheme.act is not None and scheme.act.static:
        required.add("input_scale")
    return required <= t.keys()


class FormatError(ValueError):
    """A checkpoint tensor that does not have its format's layout: names the tensor."""


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Values of `bits` (4 or 8) packed low bits first along `dim` of an int32 tensor,
    unsigned, as uint8, the packed dimension 32 / bits times as long."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.movedim(dim, -1).unsqueeze(-1)
    values = (words >> shifts) & ((1 << bits) - 1)
    values = values.flatten(-2).to(torch.uint8)
    assert values.shape[-1] == packed.shape[dim] * per_word
    return values.movedim(-1, dim)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [rows, cols] into int32 words along the columns (cols padded
    to a multiple of 8), column 8w + j in nibble j of word w."""
    rows, cols = values.shape
    padded = torch.zeros(rows, -(-cols // 8) * 8, dtype=torch.int32, device=values.device)
    padded[:, :cols] = values.to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    words = padded.view(rows, -1, 8) << shifts
    return words.sum(-1, dtype=torch.int32)


def row_scales(scale: torch.Tensor, out: int, block_rows: int = 1) -> torch.Tensor:
    """A scale tensor as [out, G] float32: one per tensor, per row ([out, 1]) or per
    row block of `block_rows`."""
    scale = scale.float().reshape(scale.shape[0] if scale.dim() else 1, -1)
    if scale.shape[0] == 1 and out != 1:
        return scale.expand(out, -1).contiguous()
    if block_rows > 1:
        scale = scale.repeat_interleave(block_rows, dim=0)
    if scale.shape[0] < out:
        raise FormatError(f"{scale.shape[0]} rows of scales for {out} rows")
    return scale[:out].contiguous()


def read_layer(scheme: LinearScheme, t: dict[str, torch.Tensor], name: str):
    """One layer's checkpoint tensors (by suffix) in flagstop's layout."""
    readers = {"fp8-block": _fp8_block, "fp8-tensor": _eight_bit, "ct-int": _eight_bit,
               "ct-float": _eight_bit, "ct-pack": _ct_pack, "gptq": _gptq, "awq": _awq}  # fmt: skip
    try:
        return readers[scheme.layout](scheme, t)
    except KeyError as missing:
        raise FormatError(f"{name}: no {missing} tensor, which {scheme.layout} has") from None
    except FormatError as error:
        raise FormatError(f"{name}: {error}") from None


def _eight_bit(scheme: LinearScheme, t: dict[str, torch.Tensor]):
    weight = t["weight"]
    want = torch.float8_e4m3fn if scheme.kind == "fp8" else torch.int8
    if weight.dtype != want:
        raise FormatError(f"weight is {weight.dtype}, {scheme.layout} stores {want}")
    zero = t.get("weight_zero_point")
    if zero is not None and zero.float().abs().max() > 0:
        raise FormatError("8-bit weights with zero points (asymmetric) are not run")
    block = scheme.block[0] if scheme.block else 1
    out = {"weight": weight, "weight_scale": row_scales(t["weight_scale"], weight.shape[0], block)}
    if scheme.act is not None and scheme.act.static:
        out["input_scale"] = t["input_scale"].float().reshape(1)
    return out


def _fp8_block(scheme: LinearScheme, t: dict[str, torch.Tensor]):
    weight, scale_inv = t["weight"], t["weight_scale_inv"]
    if weight.dtype != torch.float8_e4m3fn:
        raise FormatError(f"weight is {weight.dtype}, fp8 stores float8_e4m3fn")
    # "scale_inv" is the dequantization scale (w = q * scale_inv), DeepSeek's name.
    return {
        "weight": weight,
        "weight_scale": row_scales(scale_inv, weight.shape[0], scheme.block[0]),
    }


def _ct_pack(scheme: LinearScheme, t: dict[str, torch.Tensor]):
    rows, cols = (int(v) for v in t["weight_shape"])
    scales = row_scales(t["weight_scale"], rows)
    values = unpack_int32(t["weight_packed"], scheme.bits, dim=1)[:, :cols]
    if scheme.bits == 8:  # W8A16: unpacked once, held as int8
        weight = (values.to(torch.int16) - 128).to(torch.int8)
        return {"weight": weight, "weight_scale": scales}
    if scheme.symmetric:
        zeros = torch.full_like(scales, 8, dtype=torch.uint8)
    else:  # packed along the rows, signed: + 8 to the unsigned range
        zeros = unpack_int32(t["weight_zero_point"], 4, dim=0)[:rows]
    return {"qweight": pack_int4(values), "scales": scales, "zeros": zeros}


def _gptq(scheme: LinearScheme, t: dict[str, torch.Tensor]):
    """qweight [in / 8, out] packed along the inputs, scales [G, out], qzeros [G, out / 8]
    packed along the outputs, stored minus one in GPTQ's v1 format."""
    qweight, scales = t["qweight"], t["scales"]
    cols, rows = qweight.shape[0] * 8, qweight.shape[1]
    if (g_idx := t.get("g_idx")) is not None:
        group = scheme.group or cols
        if not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group):
            raise FormatError("g_idx is not in column order (desc_act): not run")
    zeros = unpack_int32(t["qzeros"], 4, dim=1)[:, :rows].to(torch.int16) + scheme.gptq_zero_offset
    if scheme.symmetric and not torch.all(zeros == 8):
        raise FormatError("sym=true but zero points other than 8")
    return {"qweight": qweight.t().contiguous(), "scales": row_scales(scales.t(), rows),
            "zeros": zeros.to(torch.uint8).t().contiguous()}  # fmt: skip


def _awq(scheme: LinearScheme, t: dict[str, torch.Tensor]):
    """qweight [in, out / 8] and qzeros [G, out / 8] packed along the outputs in AWQ's
    order, scales [G, out]."""
    natural = [AWQ_ORDER.index(j) for j in range(8)]  # nibble holding column j

    def columns(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1).unflatten(1, (-1, 8))
        return values[:, :, natural].flatten(1)

    values = columns(t["qweight"]).t()  # [out, in]
    return {"qweight": pack_int4(values), "scales": row_scales(t["scales"].t(), values.shape[0]),
            "zeros": columns(t["qzeros"]).t().contiguous()}  # fmt: skip


# MXFP4 (OCP microscaling, gpt-oss' experts): e2m1 values, two a byte (low nibble
# first), 32 to a block with one shared power-of-two scale (e8m0, bias 127).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype, the
    values transformers' dequantizer (integrations/mxfp4.py) gives: the e2m1 value of
    each nibble, times 2 ** (scale - 127) by ldexp (exact: a value has 2 mantissa bits)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, half = blocks.shape
    values = torch.empty(*prefix, groups, 2 * half, dtype=dtype, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127, out=values)
    return values.reshape(*prefix, groups * 2 * half)
