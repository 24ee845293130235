"""The sparse MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and DeepSeek's layout: a
replicated router picks each token's top-k experts (routing.py); this rank's experts
(all, a slice of each, or whole ones under expert parallelism: executor/parallel.py)
compute their tokens' rows, and one all-reduce sums the ranks' parts with the shared
experts'.

Two kernels run the experts: on the torch backend, tokens grouped by expert with one
GEMM pair per expert that has tokens (torch_moe.grouped_experts), on oneDNN's
prepacked weights on the CPU; on the triton backend, the fused grouped-GEMM kernel
(kernels/triton_moe.py)."""

from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from flagstop.executor.models import onednn
from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.config_sections import MoeConfig
from flagstop.executor.models.expert_routing import Routing
from flagstop.executor.models.families.family import MoeLayout
from flagstop.executor.models.layers import silu_and_mul
from flagstop.executor.models.linear import QuantLinear, make_linear
from flagstop.executor.models.onednn import Linear
from flagstop.executor.models.quantization import LinearScheme
from flagstop.executor.parallel import TensorParallel
from flagstop.kernels import torch_attention, torch_moe

FusedMoe = Callable[..., torch.Tensor]  # torch_moe.fused_moe's signature


def select_experts(
    routing: Routing, logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from the router's logits [T, E] by
    the model's rule (routing.py)."""
    logits = logits.float()
    if routing.plain:
        weights, ids = torch.topk(logits.softmax(dim=-1), top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True) if routing.renormalize else weights), ids
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias if routing.corrected and bias is not None else scores
    if routing.topk_method != "greedy":
        choice = _limit_groups(routing, choice)
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


def _limit_groups(routing: Routing, choice: torch.Tensor) -> torch.Tensor:
    """The choice with the experts outside the topk_group best groups masked out:
    -inf under noaux_tc (biased scores may be negative), 0 under V2's softmax rule
    (transformers' value: a zero ties only another masked expert)."""
    groups = choice.view(choice.shape[0], routing.n_group, -1)
    if routing.corrected:
        rank = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(-1)
    else:
        rank = groups.max(dim=-1).values
    best = torch.topk(rank, routing.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
    fill = float("-inf") if routing.corrected else 0.0
    return groups.masked_fill(~keep.unsqueeze(-1), fill).view_as(choice)


class Experts(nn.Module):
    """This rank's experts, stacked as the fused kernel reads them: w13 [E, 2I, H]
    (each expert's gate rows, then its up rows, as the dense MLP packs them) and
    w2 [E, H, I], for experts first_expert .. first_expert + E - 1; I is this rank's
    slice of the expert's inner size (all of it under expert parallelism)."""

    def __init__(
        self, first_expert: int, num_experts: int, hidden: int, inner: int,
        moe: MoeConfig | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.first_expert, self.num_experts = first_expert, num_experts
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner))
        # gpt-oss: biases (w13's gate part, then its up part) and the clamped SwiGLU.
        self.w13_bias = self.w2_bias = None
        self.act_and_mul = torch_moe.silu_mul
        if moe is not None and moe.biased:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * inner))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden))
        if moe is not None and moe.swiglu_limit:
            self.act_and_mul = torch_moe.clamped_swiglu(moe.swiglu_alpha, moe.swiglu_limit)
        self.fused: FusedMoe = torch_moe.fused_moe
        # oneDNN's prepacked copies, one (w13, w2) pair per expert (prepack()).
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(self, x, topk_weights, topk_ids) -> torch.Tensor:
        if self.packed is None:
            return self.fused(x, self.w13, self.w2, topk_weights, topk_ids, self.first_expert,
                              self.w13_bias, self.w2_bias, self.act_and_mul)  # fmt: skip
        return torch_moe.grouped_experts(x, topk_weights, topk_ids, self.first_expert,
                                         self.num_experts, self._packed_mlp)  # fmt: skip

    def _packed_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.packed[expert]
        return onednn.matmul(silu_and_mul(onednn.matmul(rows, w13)), w2)

    def prepack(self, min_elements: int) -> None:
        """The CPU path's weights: each expert's pair reordered once for oneDNN (as
        a Linear is, onednn.py), the stacked copies dropped; not for experts too small
        to pay for it (their smaller matrix under min_elements), nor for another kernel
        than torch's: it reads the stacked ones."""
        if self.fused is not torch_moe.fused_moe or self.w2[0].numel() < min_elements:
            return
        if self.w13_bias is not None or self.act_and_mul is not torch_moe.silu_mul:
            return  # the packed path runs plain SiLU experts without biases
        with torch.no_grad():
            self.packed = [(onednn.reorder(self.w13[e]), onednn.reorder(self.w2[e]))
                           for e in range(self.num_experts)]  # fmt: skip
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)


class QuantExperts(nn.Module):
    """This rank's experts with their weights held quantized (quant_formats.py's layout,
    stacked by expert): w13_* (gate rows, then up rows) and w2_*, e.g. w13_weight
    [E, 2I, H] and w13_weight_scale [E, 2I, G], or w13_qweight [E, 2I, H / 8]. Tokens are
    grouped by expert (torch_moe.grouped_experts) and each expert's two GEMMs run on the
    backend's quantized linear kernels. Like QuantLinear, its tensors are made by
    materialize(), after the model's cast."""

    def __init__(self, first_expert: int, num_experts: int, hidden: int, inner: int,
                 scheme: LinearScheme, layers: set[str], foreign: set[str]) -> None:  # fmt: skip
        super().__init__()
        self.first_expert, self.num_experts, self.scheme = first_expert, num_experts, scheme
        # The checkpoint layers of this rank's experts, and of the other ranks' (never read).
        self.layers, self.foreign = layers, foreign
        self.shapes = {"w13": (2 * inner, hidden), "w2": (hidden, inner)}
        self.kernels: ModuleType = torch_attention  # set_attention_backend's

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for which, (rows, columns) in self.shapes.items():
            layer = QuantLinear(columns, rows, False, self.scheme, ())
            for name, (shape, dtype) in layer.layout().items():
                out[f"{which}_{name}"] = ((self.num_experts, *shape), dtype)
        return out

    def materialize(self, device: torch.device) -> None:
        for name, (shape, dtype) in self.layout().items():
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def forward(self, x, topk_weights, topk_ids) -> torch.Tensor:
        return torch_moe.grouped_experts(x, topk_weights, topk_ids, self.first_expert,
                                         self.num_experts, self._expert_mlp)  # fmt: skip

    def _expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self._matmul("w2", expert, silu_and_mul(self._matmul("w13", expert, rows)))

    def _matmul(self, which: str, e: int, x: torch.Tensor) -> torch.Tensor:
        def p(name: str) -> torch.Tensor:
            return getattr(self, f"{which}_{name}")[e]

        if self.scheme.kind == "int4":
            return self.kernels.int4_linear(x, p("qweight"), p("scales"), p("zeros"))
        act = self.scheme.act
        static = p("input_scale") if act is not None and act.static else None
        return self.kernels.w8_linear(x, p("weight"), p("weight_scale"), act, static)

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())


def expert_layers(prefix: str, layout: MoeLayout, first: int, count: int) -> set[str]:
    """The checkpoint layer names of experts first .. first + count - 1, as the family's
    layout names them (the loader's target() maps them to our stacked tensors)."""
    block = prefix.replace(".mlp", f".{layout.block_name}")
    return {f"{block}.experts.{first + e}.{hf}" for e in range(count)
            for hf in layout.expert_names}  # fmt: skip


def make_experts(config: ModelConfig, tp: TensorParallel, prefix: str) -> nn.Module:
    """The experts of a sparse layer: quantized when the checkpoint's experts are (one
    scheme for all of them)."""
    moe = config.moe
    first, count = tp.shard.experts(moe.num_experts)
    inner = tp.shard.expert_inner(moe.intermediate_size)[1]
    everyone = expert_layers(prefix, moe.layout, 0, moe.num_experts)
    quant = config.quant
    schemes = {quant.scheme_for(layer) if quant else None for layer in everyone}
    if len(schemes) > 1:
        raise ConfigError(f"{prefix}.experts: quantized with more than one scheme (or partly)")
    if (scheme := schemes.pop()) is None:
        return Experts(first, count, config.hidden_size, inner, moe)
    layers = expert_layers(prefix, moe.layout, first, count)
    return QuantExperts(first, count, config.hidden_size, inner, scheme, layers, everyone - layers)


class SharedExpert(nn.Module):
    """Qwen2-MoE's expert that every token takes: a dense MLP, sliced over the ranks
    like one, whose partial sum joins the routed experts' before the layer's one
    all-reduce (so its down projection does not reduce)."""

    def __init__(self, config: ModelConfig, inner: int, prefix: str) -> None:
        super().__init__()
        hidden, names = config.hidden_size, (f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = make_linear(config, names, hidden, 2 * inner, False)
        self.down_proj = make_linear(config, (f"{prefix}.down_proj",), inner, hidden, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        assert moe is not None
        self.tp, self.top_k, self.routing = tp, moe.top_k, moe.routing
        # The router, on every rank (quantization tools leave it, and the gates, alone);
        # gpt-oss names it router, with a bias.
        self.gate = Linear(hidden, moe.num_experts, bias=moe.biased)
        self.experts = make_experts(config, tp, prefix)
        self.shared_expert = self.shared_expert_gate = None
        if shared := moe.shared_expert_intermediate_size:
            inner = tp.shard.split(shared)[1]
            name = "shared_expert" if moe.shared_expert_gated else "shared_experts"  # DeepSeek's
            self.shared_expert = SharedExpert(config, inner, f"{prefix}.{name}")
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden, 1, bias=False)
        # DeepSeek-V3's per-expert bias on the choice (noaux_tc), float32 as transformers
        # keeps it: rounded to bf16 it would choose other experts, so it is to be loaded
        # after the model's cast.
        self.e_score_correction_bias = None
        if self.routing.corrected:
            bias = torch.zeros(moe.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.num_experts = moe.num_experts
        # Rank 0: the (token, expert) pairs each expert took since take_expert_tokens()
        # last read them, on the device (made on first use: the model is built on meta).
        self.expert_tokens: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out += self.shared_expert(x)
        return self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): the model's routing over the
        router's logits in float32, as transformers computes it (the same ties)."""
        weights, ids = select_experts(self.routing, self.gate(x), self.top_k,
                                      self.e_score_correction_bias)  # fmt: skip
        if self.tp.rank == 0:
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
            before = self.expert_tokens
            self.expert_tokens = counts if before is None else before + counts
        return weights, ids

    def take_expert_tokens(self) -> torch.Tensor | None:
        counts, self.expert_tokens = self.expert_tokens, None
        return counts
