"""The checkpoint tensors that are not one plain weight each: quantized layers (read
whole by layer, turned into flagstop's layout by quant_formats, then cut to this
rank's slice), an FP8 KV cache's scales, and gpt-oss' stacked experts (MXFP4 or not)."""

import re

import torch

from flagstop.executor.models import linear, quant_formats
from flagstop.executor.models.config import ConfigError
from flagstop.executor.models.decoder import Decoder
from flagstop.executor.models.moe import QuantExperts
from flagstop.executor.models.sharding import (
    Target,
    copy_part,
    packed_offset,
    parts,
    rank_slice,
    target,
)

# gpt-oss stacks each layer's experts in one tensor: gate_up_proj [E, H, 2I] with the
# gate and up columns interleaved, down_proj [E, I, H], and their biases.
STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# The same in MXFP4: [E, rows, G, 16] blocks and [E, rows, G] scales, rows the
# transpose's (gate_up: 2I, interleaved; down: H).
MXFP4 = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$"
)


# An FP8 KV cache's scales as compressed-tensors writes them (kv_cache_scheme): per
# tensor [1] or per head [KVH, 1, 1]; used when --kv-cache-dtype fp8.
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def take_kv_scale(model: Decoder, layer: int, which: str, scale: torch.Tensor) -> None:
    first, count = model.tp.shard.kv_heads(model.config.num_kv_heads)
    scale = scale.float().flatten()
    scale = scale.expand(count) if scale.numel() == 1 else scale[first : first + count]
    scales = model.checkpoint_kv_scales.setdefault(layer, torch.ones(2, count))
    scales["kv".index(which)] = scale


class QuantizedLayers:
    """A quantized layer's checkpoint tensors, gathered by layer (a layer is read whole,
    turned into flagstop's layout by quant_formats, then this rank's slice kept: the
    packed formats cannot be cut before they are unpacked) and loaded once complete."""

    def __init__(self, model: Decoder, params: dict, loaded: set[Target]) -> None:
        self.config, self.shard = model.config, model.tp.shard
        self.params, self.loaded = params, loaded
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.done: set[str] = set()
        quantized = [m for m in model.modules() if isinstance(m, linear.QuantLinear | QuantExperts)]
        self.schemes = {layer: m.scheme for m in quantized for layer in m.layers}
        # Other ranks' experts: skipped by name, never read.
        self.foreign = {layer for m in quantized for layer in getattr(m, "foreign", ())}
        self.first_expert = model.tp.shard.experts(model.config.moe.num_experts)[0] \
            if model.config.moe else 0  # fmt: skip

    def take(self, f, hf_name: str) -> bool:
        """Whether the tensor is a quantized layer's (then read and kept)."""
        layer, _, suffix = hf_name.rpartition(".")
        if layer in self.foreign:
            return True
        scheme = self.schemes.get(layer)
        if scheme is None or suffix not in quant_formats.SUFFIXES[scheme.layout]:
            return False
        if layer not in self.done:
            self.pending.setdefault(layer, {})[suffix] = f.get_tensor(hf_name)
        return True

    def load_complete(self) -> None:
        for layer, tensors in list(self.pending.items()):
            scheme = self.schemes[layer]
            if quant_formats.complete(scheme, tensors):
                self._load(layer, quant_formats.read_layer(scheme, tensors, layer))
                del self.pending[layer]
                self.done.add(layer)

    def check_none_left(self) -> None:
        if missing := self.schemes.keys() - self.done - self.pending.keys():
            raise ValueError(f"checkpoint lacks the quantized layer {min(missing)}")
        if self.pending:
            layer, tensors = next(iter(self.pending.items()))
            raise ValueError(f"{layer}: only {sorted(tensors)} of its quantized tensors found")

    def _load(self, layer: str, tensors: dict[str, torch.Tensor]) -> None:
        t = target(layer + ".weight", self.config.mla is not None)
        if t.expert is not None:  # an expert's: our stacked w13_* / w2_*, its local index
            t = Target(t.name, t.part, t.expert - self.first_expert)
            name_of = f"{t.name}_{{}}".format
        else:
            name_of = f"{t.name.removesuffix('.weight')}.{{}}".format
        region = rank_slice(t, self.config, self.shard)
        columns = (
            tensors["weight"].shape[1] if "weight" in tensors else tensors["qweight"].shape[1] * 8
        )
        for suffix, tensor in tensors.items():
            part = Target(name_of(suffix), t.part, t.expert)
            param = self.params[part.name]
            if suffix == "input_scale":  # q, k and v share one: the largest (as vLLM)
                dest = param if t.expert is None else param[t.expert]
                with torch.no_grad():
                    dest.copy_(torch.maximum(dest, tensor))
            else:
                piece = quantized_slice(tensor, region, columns, part.name)
                copy_part(param, piece, part, packed_offset(t, self.config, self.shard))
            self.loaded.add(part)


def quantized_slice(tensor: torch.Tensor, region, columns: int, name: str) -> torch.Tensor:
    """This rank's part of a tensor in flagstop's quantized layout (rows: outputs; its
    columns: the weight's `columns` inputs, packed or grouped): the region is the
    weight's, in its [out, in] elements. A per-row scale (one column) is kept whole."""
    if region is None:
        return tensor
    dim, start, length = region
    if dim == 0:
        return tensor[start : start + length]
    if tensor.shape[1] == 1:
        return tensor
    per_column = -(-columns // tensor.shape[1])  # inputs a stored column covers
    if start % per_column or length % per_column:
        raise ConfigError(
            f"{name}: tensor parallelism splits its {columns} inputs at {start}, which is "
            f"not a multiple of its {per_column}-input groups; use fewer ranks"
        )
    return tensor[:, start // per_column : (start + length) // per_column]


def dequantized(f, name: str, experts: slice, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of an MXFP4 expert tensor, in the layout of its unquantized
    twin ([E, in, out])."""
    if f"{name}_scales" not in f.keys():  # noqa: SIM118 (safe_open is not a dict)
        raise ValueError(f"{name}_blocks without {name}_scales in the same file")
    blocks = f.get_slice(f"{name}_blocks")[experts]
    scales = f.get_slice(f"{name}_scales")[experts]
    return quant_formats.dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)


def take_stacked(model: Decoder, params: dict, match, tensor: torch.Tensor) -> set:
    """A gpt-oss expert tensor of this rank's experts (the loader reads only those) in
    our layout: w13 [E, 2I, H] with the gate rows, then the up rows; w2 [E, H, I];
    this rank's slice of their inner size."""
    layer, which, bias = match[1], match[2], bool(match[3])
    config, shard = model.config, model.tp.shard
    count = shard.experts(config.moe.num_experts)[1]
    start, length = shard.expert_inner(config.moe.intermediate_size)
    if which == "gate_up_proj":
        gate_up = tensor if bias else tensor.transpose(1, 2)  # [E, 2I(, H)], interleaved
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        ours = torch.cat((gate[:, start : start + length], up[:, start : start + length]), 1)
        name = f"layers.{layer}.mlp.experts.w13" + ("_bias" if bias else "")
    elif bias:  # added once: on the first rank of a sliced inner size
        ours = tensor if start == 0 or shard.expert_parallel else torch.zeros_like(tensor)
        name = f"layers.{layer}.mlp.experts.w2_bias"
    else:
        ours = tensor.transpose(1, 2)[:, :, start : start + length]
        name = f"layers.{layer}.mlp.experts.w2"
    param = params[name]
    if param.shape != ours.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(ours.shape)}, model {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(ours)
    return {Target(name, part, e) for part in parts(name) for e in range(count)}
