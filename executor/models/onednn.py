"""oneDNN's prepacked linear for the CPU path.

Each weight is reordered once, at load, into the blocked layout oneDNN's GEMM kernels
read, instead of MKL's sgemm re-blocking it on every call: 1.2-3.4x per GEMM on a
2-core AMD EPYC (768 -> 6144: 1.6 -> 0.46 ms at 1 row, 3.1 -> 1.1 ms at 16 rows,
39 -> 24 ms at 512 rows), and the GEMMs are 50-75 % of a CPU step. The same op
torch.compile's CPU backend emits for a frozen model's linears, without the compile.

Small weights stay on F.linear: oneDNN's call costs some 70-90 µs here whatever the
size, which MKL's small GEMMs do not (out x in = 8 x 256: 4.7 µs F.linear, 76 µs
packed; 512 x 256: 27 vs 89 µs at 1 row, 116 vs 142 at 16; 1536 x 256: 74 vs 108 at 1
row, 235 vs 135 at 4). A Mixture-of-Experts layer runs two GEMMs per expert a token
chose, so its small experts and its router would pay that overhead many times a step.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear that runs on a prepacked copy of its weight once pack() gave it one."""

    packed: torch.Tensor | None = None
    lora = None  # its adapters' slots, with --max-loras (executor/lora/layers.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, with_bias=True)
        return out if self.lora is None else self.lora.add(x, out)

    def matmul(self, x: torch.Tensor, with_bias: bool = False) -> torch.Tensor:
        """x [rows, in_features] times the weight (plus the bias if asked)."""
        bias = self.bias if with_bias else None
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return matmul(x, self.packed, bias)


def matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None):
    """x [rows, in] times a weight reorder() packed (plus the bias)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    return out[:rows]


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] in the blocked layout oneDNN's GEMMs read."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def padded_rows(rows: int) -> int:
    """Row counts above 16 rounded up to 8 steps a doubling (at most 12.5 % more rows).
    oneDNN builds a primitive per (weight shape, row count), 1-3 ms and some 30 KB each,
    and keeps 1024; a step's row count is anything up to the token budget, so exact
    counts kept building them and grew the executor by 30 MB a thousand requests."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# Weights of fewer elements than this stay on F.linear (the measurements above).
PACK_MIN_ELEMENTS = 1 << 18


def pack(model: nn.Module, shared: set[int], min_elements: int | None = None) -> int:
    """Prepack every Linear of the model of at least min_elements weights (and every
    module with a prepack(): the experts of an MoE layer; default PACK_MIN_ELEMENTS); its
    own weight is then dropped (the packed copy
    replaces it) unless its id is in `shared` (a tied embedding still reads it). Checked
    against F.linear on the first layer: a torch without a working op keeps F.linear.
    Returns how many were packed."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or not _works(linears[0]):
        return 0
    min_elements = PACK_MIN_ELEMENTS if min_elements is None else min_elements
    linears = [m for m in linears if m.weight.numel() >= min_elements]
    for module in linears:
        with torch.no_grad():
            module.packed = reorder(module.weight)
        if id(module.weight) not in shared:
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    for module in model.modules():  # a Mixture-of-Experts layer's stacked experts
        if hasattr(module, "prepack"):
            module.prepack(min_elements)
    return len(linears)


def _works(module: Linear) -> bool:
    x = torch.randn(3, module.in_features, dtype=module.weight.dtype)
    try:
        with torch.no_grad():
            got = matmul(x, reorder(module.weight))
    except RuntimeError as error:
        log.warning("oneDNN's packed linear is unusable here, keeping F.linear: %s", error)
        return False
    return torch.allclose(got, F.linear(x, module.weight), rtol=1e-4, atol=1e-4)
