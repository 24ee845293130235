"""The model's linear layers: one factory, `make_linear`, that gives a layer its
checkpoint's scheme (executor/models/quantization.py): the model's dtype (oneDNN-packed
on the CPU, onednn.py) or weights held quantized (QuantLinear), each column-parallel or
row-parallel (RowParallel: input features split over the ranks)."""

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.onednn import Linear
from flagstop.executor.models.quantization import LinearScheme
from flagstop.executor.parallel import TensorParallel
from flagstop.kernels import torch_attention

if TYPE_CHECKING:
    from flagstop.executor.lora.layers import LoRALayer


class RowParallel:
    """Input features split over the ranks: each rank's partial product is summed by
    one all-reduce, and the bias, held whole, is added once after it."""

    tp: TensorParallel
    bias: torch.Tensor | None

    lora: "LoRALayer | None"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return with_lora(self, x, self.matmul(x, with_bias=True))
        out = self.tp.all_reduce(with_lora(self, x, self.matmul(x)))
        return out if self.bias is None else out + self.bias


def with_lora(layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out plus the layer's adapters' low-rank products (executor/lora/layers.py)."""
    return out if layer.lora is None else layer.lora.add(x, out)


class RowParallelLinear(RowParallel, Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized in memory (quant_formats.py's layout):
    8-bit `weight` and `weight_scale` (plus `input_scale` for static activations), or
    int4 `qweight`, `scales` and `zeros`. Its tensors are made by materialize(), after
    the model is cast to its dtype, so that they keep their formats' dtypes."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: LinearScheme,
                 layers: tuple[str, ...]) -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.layers = layers  # the checkpoint's layers packed in it (q, k, v; gate, up)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernels: ModuleType = torch_attention
        self.lora: LoRALayer | None = None  # its adapters' slots, with --max-loras

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each tensor's (shape, dtype) at this rank's sizes."""
        out, columns, s = self.out_features, self.in_features, self.scheme
        groups = -(-columns // s.group) if s.group else 1
        if s.kind == "int4":
            return {"qweight": ((out, -(-columns // 8)), torch.int32),
                    "scales": ((out, groups), torch.float32),
                    "zeros": ((out, groups), torch.uint8)}  # fmt: skip
        dtype = torch.float8_e4m3fn if s.kind == "fp8" else torch.int8
        tensors = {
            "weight": ((out, columns), dtype),
            "weight_scale": ((out, groups), torch.float32),
        }
        if s.act is not None and s.act.static:
            tensors["input_scale"] = ((1,), torch.float32)
        return tensors

    def materialize(self, device: torch.device) -> None:
        for name, (shape, dtype) in self.layout().items():
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_lora(self, x, self.matmul(x, with_bias=True))

    def matmul(self, x: torch.Tensor, with_bias: bool = False) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if self.scheme.kind == "int4":
            return self.kernels.int4_linear(x, self.qweight, self.scales, self.zeros, bias)
        input_scale = getattr(self, "input_scale", None)
        return self.kernels.w8_linear(x, self.weight, self.weight_scale, self.scheme.act,
                                      input_scale, bias)  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in float32, as the format's decompressor gives it."""
        if self.scheme.kind == "int4":
            return torch_attention.dequantize_int4(self.qweight, self.scales, self.zeros,
                                             self.in_features)  # fmt: skip
        return torch_attention.dequantize_w8(self.weight, self.weight_scale)

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class QuantRowParallelLinear(RowParallel, QuantLinear):
    def __init__(self, in_features, out_features, bias, scheme, layers, tp: TensorParallel):
        super().__init__(in_features, out_features, bias, scheme, layers)
        self.tp = tp


def make_linear(
    config: ModelConfig,
    layers: tuple[str, ...],
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """The linear layer packing the checkpoint's `layers` (q, k and v in one; gate and
    up in one), row-parallel over `tp` when given; they must share one scheme."""
    quant = config.quant
    schemes = {quant.scheme_for(layer) if quant else None for layer in layers}
    if len(schemes) > 1:
        raise ConfigError(f"{', '.join(layers)}: packed into one matmul, they need one scheme")
    scheme = schemes.pop()
    if scheme is None:
        return Linear(in_features, out_features, bias=bias) if tp is None else \
            RowParallelLinear(in_features, out_features, bias, tp)  # fmt: skip
    if tp is None:
        return QuantLinear(in_features, out_features, bias, scheme, layers)
    return QuantRowParallelLinear(in_features, out_features, bias, scheme, layers, tp)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every quantized layer (and quantized experts) its tensors."""
    for module in model.modules():
        if hasattr(module, "materialize"):
            module.materialize(device)
