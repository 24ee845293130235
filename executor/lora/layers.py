"""The model's LoRA layers: each targetable linear layer (q/k/v packed, o, gate/up
packed, down) gets a LoRALayer of max_loras slots, whose low-rank products its forward
adds to the base output (linear.py: before a row-parallel layer's all-reduce, so that
the ranks' partial products sum with the base's). Slots hold this rank's share:
column-parallel layers keep A whole and B's rows of the rank's outputs; row-parallel
ones A's columns of the rank's inputs and B whole (sharding.rank_slice, the base
weights' own rule)."""

from dataclasses import dataclass, field
from types import ModuleType

import torch

from flagstop.executor.lora.adapter import LoRAAdapter, base_shape
from flagstop.executor.lora.mapping import LoRAMapping
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.sharding import Target, rank_slice
from flagstop.executor.parallel import Shard
from flagstop.kernels import torch_attention

# Our packed module -> the PEFT modules packed in it, in row order.
PACKED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
          "self_attn.o_proj": ("o_proj",), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
          "mlp.down_proj": ("down_proj",)}  # fmt: skip
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(slots=True)
class LoRAState:
    """Shared by every LoRA layer: this step's mapping (None: no adapter token) and
    the kernels that apply it (the attention backend's)."""

    mapping: LoRAMapping | None = None
    kernels: ModuleType = field(default=torch_attention)


class LoRALayer:
    """One linear layer's slots: a [S, P * R, in] and b [S, out, R] at this rank's
    sizes, R the padded max rank; parts: (first output row, rows) of each packed part."""

    def __init__(self, state: LoRAState, parts: list[tuple[int, int]], in_features: int,
                 max_loras: int, rank: int, dtype, device) -> None:  # fmt: skip
        self.state, self.parts, self.rank = state, parts, rank
        out_features = sum(count for _, count in parts)
        self.a = torch.zeros(max_loras, len(parts) * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, rank, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.state.mapping is not None:
            self.state.kernels.lora_add(x, out, self.a, self.b, self.parts, self.state.mapping)
        return out

    def load(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Each part's (A [r, in], B [rows, r]) at this rank's share, or None (the
        adapter leaves that part alone)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        r = self.rank
        for p, ((first, count), piece) in enumerate(zip(self.parts, pieces, strict=True)):
            if piece is not None:
                a, b = piece
                self.a[slot, p * r : p * r + a.shape[0]] = a
                self.b[slot, first : first + count, : b.shape[1]] = b


def padded_rank(max_rank: int) -> int:
    """Slots' rank: a multiple of 16, the tensor cores' smallest dot."""
    return -(-max_rank // 16) * 16


def attach(model, max_loras: int, max_rank: int) -> tuple[LoRAState, dict]:
    """Give every dense layer's linear modules their LoRA slots (the modules' forward
    then adds them: module.lora): their shared state, and (layer, module) -> LoRALayer."""
    state, layers = LoRAState(kernels=model.layers[0].self_attn.backend), {}
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    for i, block in enumerate(model.layers):
        for module, names in PACKED.items():
            linear = _linear(block, module)
            if linear is None:
                continue  # a sparse layer's MLP: no LoRA on experts
            parts = _local_parts(module, names, i, model.config, model.tp.shard)
            linear.lora = LoRALayer(state, parts, linear.in_features, max_loras,
                                    padded_rank(max_rank), dtype, device)  # fmt: skip
            layers[i, module] = linear.lora
    return state, layers


def _linear(block, module: str):
    parent, name = module.split(".")
    return getattr(getattr(block, parent), name, None)


def _local_parts(module, names, layer, config: ModelConfig, shard: Shard):
    """(first, rows) of each part in this rank's packed output."""
    if module in ROW_PARALLEL:
        return [(0, base_shape(names[0], config)[0])]
    parts, first = [], 0
    for p in range(len(names)):
        _, _, rows = rank_slice(_target(module, layer, p, len(names)), config, shard)
        parts.append((first, rows))
        first += rows
    return parts


def _target(module: str, layer: int, part: int, num_parts: int) -> Target:
    return Target(f"layers.{layer}.{module}.weight", part if num_parts > 1 else None)


def shard_adapter(adapter: LoRAAdapter, layers: dict[tuple[int, str], LoRALayer],
                  config: ModelConfig, shard: Shard) -> dict[tuple[int, str], list]:  # fmt: skip
    """The adapter's pieces for each LoRA layer at this rank's share (LoRALayer.load's
    argument), for the layers it touches."""
    out = {}
    for layer, module in layers:
        names = PACKED[module]
        pieces = [adapter.weights.get((layer, name)) for name in names]
        if not any(pieces):
            continue
        for p, piece in enumerate(pieces):
            if piece is not None:
                pieces[p] = _slice(piece, module, layer, p, len(names), config, shard)
        out[layer, module] = pieces
    return out


def _slice(piece, module, layer, part, num_parts, config, shard):
    a, b = piece
    region = rank_slice(_target(module, layer, part, num_parts), config, shard)
    if region is None:
        return a, b
    dim, start, length = region
    if dim == 0:  # column-parallel: this rank's output rows of B
        return a, b[start : start + length]
    return a[:, start : start + length], b  # row-parallel: its input columns of A
