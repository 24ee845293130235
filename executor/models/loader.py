"""Load Hugging Face `*.safetensors` weights into our packed modules by HF names. Under
tensor parallelism each rank reads only its own slice of each tensor (safetensors'
get_slice reads the bytes of the slice, never the whole tensor)."""

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open
from torch import nn

from flagstop.executor.models import linear, onednn, quant_formats
from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.models.llama import LlamaForCausalLM
from flagstop.executor.models.moe import QuantExperts
from flagstop.executor.parallel import SINGLE, Shard, TensorParallel
from flagstop.kernels import torch_attention

# HF name fragment -> (our module, index of the part inside the packed tensor)
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}
# Latent attention's q_proj (DeepSeek-V2 without q_lora_rank) is its own, not packed.
MLA_OWN = ("self_attn.q_proj",)
VOCAB = ("embed_tokens.weight", "lm_head.weight")
# An expert's tensor, Qwen's names and Mixtral's (w1 gate, w3 up, w2 down), after
# Mixtral's block_sparse_moe is renamed mlp -> (our stacked tensor, part).
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
EXPERT_PARTS = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", None), "w2": ("w2", None),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """Where a checkpoint tensor goes: our parameter, the part of it (a packed
    tensor's), and for an expert's tensor the expert (its global index)."""

    name: str
    part: int | None = None
    expert: int | None = None


# gpt-oss stacks each layer's experts in one tensor: gate_up_proj [E, H, 2I] with the
# gate and up columns interleaved, down_proj [E, I, H], and their biases.
STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
# The same in MXFP4: [E, rows, G, 16] blocks and [E, rows, G] scales, rows the
# transpose's (gate_up: 2I, interleaved; down: H).
MXFP4 = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$"
)


def target(hf_name: str, mla: bool = False) -> Target:
    """mla: the model's attention is latent (its projections are not packed)."""
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    name = name.replace(".mlp.router.", ".mlp.gate.")  # gpt-oss' router
    # DeepSeek's router bias is the block's (moe.py), not the gate Linear's; its
    # n_shared_experts are one fused shared expert (moe.py's SharedExpert).
    name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
    name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    if match := EXPERT.match(name):
        if match[3] not in EXPERT_PARTS:
            raise ValueError(f"unexpected expert tensor {hf_name!r}")
        ours, part = EXPERT_PARTS[match[3]]
        return Target(f"{match[1]}.{ours}", part, int(match[2]))
    for hf, (ours, part) in PACKED.items():
        if f".{hf}." in name and not (mla and hf in MLA_OWN):
            return Target(name.replace(hf, ours), part)
    return Target(name)


def inner_size(name: str, c: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first, length) of this rank's slice of an MLP's inner size: a dense MLP's, the
    shared expert's or each routed expert's."""
    if ".experts." in name:
        return shard.expert_inner(c.moe.intermediate_size)
    if "shared_expert." in name:
        return shard.split(c.moe.shared_expert_intermediate_size)
    return shard.split(c.intermediate_size)


def rank_slice(t: Target, c: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, length) of the checkpoint tensor this rank holds; None: all of it."""
    d, name = c.head_dim, t.name
    if c.mla is not None and (region := _latent_slice(name, c, shard)) is not None:
        return region
    if ".linear_attn." in name:
        return _recurrent_slice(name, c, shard)
    if "qkv_proj" in name:
        if t.part == 0:  # a gated attention's q_proj: each head's query, then its gate
            first, count = shard.heads(c.num_heads)
            q = d * (2 if c.attention_gated else 1)
            return 0, first * q, count * q
        first, count = shard.kv_heads(c.num_kv_heads)
        return 0, first * d, count * d
    if "gate_up_proj" in name or name.endswith(".w13"):
        return (0, *inner_size(name, c, shard))
    if name.endswith("o_proj.weight"):
        first, count = shard.heads(c.num_heads)
        return 1, first * d, count * d
    if name.endswith("down_proj.weight") or name.endswith(".w2"):
        return (1, *inner_size(name, c, shard))
    if name in VOCAB:
        first, rows = shard.vocab(c.vocab_size)
        return 0, first, max(0, min(rows, c.vocab_size - first))
    if name.endswith("self_attn.sinks"):  # one per query head
        return (0, *shard.heads(c.num_heads))
    return None


def _recurrent_slice(name: str, c: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """A gated DeltaNet layer's tensors split by head: Qwen3-Next's projections packed by
    key head, Qwen3.5's z, b and a by value head, out_proj's columns by value head. The
    convolution and Qwen3.5's in_proj_qkv hold q, k and v as three slices: read whole,
    they are cut by the layer (gdn.py's after_load)."""
    linear = c.linear
    assert linear is not None
    group = linear.num_v_heads // linear.num_k_heads
    first_k, num_k = shard.split(linear.num_k_heads)
    first_v, num_v = shard.split(linear.num_v_heads)
    per_key = {"in_proj_qkvz.": 2 * linear.head_k_dim + 2 * group * linear.head_v_dim,
               "in_proj_ba.": 2 * group}  # fmt: skip
    for part, rows in per_key.items():
        if part in name:
            return 0, first_k * rows, num_k * rows
    per_value = {"in_proj_z.": linear.head_v_dim, "in_proj_b.": 1, "in_proj_a.": 1,
                 ".dt_bias": 1, ".A_log": 1}  # fmt: skip
    for part, rows in per_value.items():
        if part in name:
            return 0, first_v * rows, num_v * rows
    if "out_proj." in name:
        return 1, first_v * linear.head_v_dim, num_v * linear.head_v_dim
    return None


def _latent_slice(name: str, c: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """Latent attention's head-split tensors: the query's and kv_b_proj's rows, and
    o_proj's columns, of this rank's heads (the a-projections are whole on every rank)."""
    first, count = shard.heads(c.num_heads)
    mla, per_head = c.mla, None
    if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight")):
        per_head, dim = mla.nope_dim + mla.rope_dim, 0
    elif name.endswith("kv_b_proj.weight"):
        per_head, dim = mla.nope_dim + mla.v_head_dim, 0
    elif name.endswith("o_proj.weight"):
        per_head, dim = mla.v_head_dim, 1
    return None if per_head is None else (dim, first * per_head, count * per_head)


def packed_offset(t: Target, c: ModelConfig, shard: Shard) -> int:
    """Where a part starts in our packed tensor (rows)."""
    if not t.part:
        return 0
    if "gate_up_proj" in t.name or t.name.endswith(".w13"):
        return inner_size(t.name, c, shard)[1]
    q, kv = shard.heads(c.num_heads)[1] * c.head_dim, shard.kv_heads(c.num_kv_heads)[1] * c.head_dim
    return q * (2 if c.attention_gated else 1) + (t.part - 1) * kv


def read(f, hf_name: str, region: tuple[int, int, int] | None, full_rows: int | None):
    """The region of a tensor; full_rows: how many rows the whole tensor must have."""
    if region is None:
        return f.get_tensor(hf_name)
    piece = f.get_slice(hf_name)
    if full_rows is not None and piece.get_shape()[0] != full_rows:
        raise ValueError(f"{hf_name}: {piece.get_shape()[0]} rows, the vocabulary has {full_rows}")
    dim, start, length = region
    return piece[start : start + length] if dim == 0 else piece[:, start : start + length]


# A decoder layer's tensors by its index: those at num_hidden_layers and beyond are
# multi-token-prediction layers (DeepSeek's, GLM-4.5's), as are Qwen3-Next's and
# Qwen3.5's `mtp.*`: the main model skips them (as transformers does) and the `mtp`
# drafter loads them (executor/spec/mtp.py).
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# The name a checkpoint tensor loads as in a model (its HF form), None: not this model's.
Names = Callable[[str], str | None]


def main_layers(num_layers: int) -> Names:
    """The main model's tensors: every one but the prediction layers'."""

    def name(hf_name: str) -> str | None:
        if hf_name.startswith("mtp."):
            return None
        return hf_name if (m := LAYER.match(hf_name)) is None or int(m[1]) < num_layers else None

    return name


class Renamed:
    """A safetensors file's tensors under the names `names` gives them (those it
    gives none left out), read as safe_open reads them."""

    def __init__(self, f, names: Names) -> None:
        self.f = f
        self.stored = {ours: n for n in f.keys() if (ours := names(n)) is not None}  # noqa: SIM118

    def keys(self) -> list[str]:
        return list(self.stored)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.f.get_tensor(self.stored[name])

    def get_slice(self, name: str):
        return self.f.get_slice(self.stored[name])


def load_weights(model: nn.Module, model_dir: str | Path, names: Names | None = None) -> None:
    """names: which checkpoint tensors are this model's, and as what (default: the main
    model's, as they are)."""
    names = names or main_layers(model.config.num_layers)
    params = dict(model.named_parameters())
    config, shard = model.config, model.tp.shard
    first_expert, num_experts = shard.experts(config.moe.num_experts) if config.moe else (0, 0)
    loaded: set[Target] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    quantized = QuantizedLayers(model, params, loaded)
    for file in files:
        with safe_open(str(file), framework="pt") as stored:
            f = Renamed(stored, names)
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                if quantized.take(f, hf_name):
                    continue
                if (kv := KV_SCALE.match(hf_name)) is not None:
                    _take_kv_scale(model, int(kv[1]), kv[2], f.get_tensor(hf_name))
                    continue
                if (stacked := STACKED.match(hf_name)) is not None:
                    tensor = f.get_slice(hf_name)[first_expert : first_expert + num_experts]
                    loaded |= _take_stacked(model, params, stacked, tensor)
                    continue
                if (mx := MXFP4.match(hf_name)) is not None:
                    if mx[2] == "blocks":  # with its scales, from the same file
                        experts = slice(first_expert, first_expert + num_experts)
                        tensor = _dequantized(f, mx[1], experts, model.norm.weight.dtype)
                        loaded |= _take_stacked(model, params, STACKED.match(mx[1]), tensor)
                    continue
                t = target(hf_name, config.mla is not None)
                if t.name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if t.name not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} in {file.name}")
                if t.expert is not None:  # another rank's expert: never read
                    if not first_expert <= t.expert < first_expert + num_experts:
                        continue
                    t = Target(t.name, t.part, t.expert - first_expert)
                rows = config.vocab_size if t.name in VOCAB else None
                tensor = read(f, hf_name, rank_slice(t, config, shard), rows)
                _copy(params[t.name], tensor, t, packed_offset(t, config, shard))
                loaded.add(t)
        quantized.load_complete()
    quantized.check_none_left()
    _check_complete(model, params, loaded, num_experts)


# An FP8 KV cache's scales as compressed-tensors writes them (kv_cache_scheme): per
# tensor [1] or per head [KVH, 1, 1]; used when --kv-cache-dtype fp8.
KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def _take_kv_scale(model: LlamaForCausalLM, layer: int, which: str, scale: torch.Tensor) -> None:
    first, count = model.tp.shard.kv_heads(model.config.num_kv_heads)
    scale = scale.float().flatten()
    scale = scale.expand(count) if scale.numel() == 1 else scale[first : first + count]
    scales = model.checkpoint_kv_scales.setdefault(layer, torch.ones(2, count))
    scales["kv".index(which)] = scale


class QuantizedLayers:
    """A quantized layer's checkpoint tensors, gathered by layer (a layer is read whole,
    turned into flagstop's layout by quant_formats, then this rank's slice kept: the
    packed formats cannot be cut before they are unpacked) and loaded once complete."""

    def __init__(self, model: LlamaForCausalLM, params: dict, loaded: set[Target]) -> None:
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
                _copy(param, piece, part, packed_offset(t, self.config, self.shard))
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


def _dequantized(f, name: str, experts: slice, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of an MXFP4 expert tensor, in the layout of its unquantized
    twin ([E, in, out])."""
    if f"{name}_scales" not in f.keys():  # noqa: SIM118 (safe_open is not a dict)
        raise ValueError(f"{name}_blocks without {name}_scales in the same file")
    blocks = f.get_slice(f"{name}_blocks")[experts]
    scales = f.get_slice(f"{name}_scales")[experts]
    return quant_formats.dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)


def _take_stacked(model: LlamaForCausalLM, params: dict, match, tensor: torch.Tensor) -> set:
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
    return {Target(name, part, e) for part in _parts(name) for e in range(count)}


def _copy(param: nn.Parameter, tensor: torch.Tensor, t: Target, offset: int) -> None:
    with torch.no_grad():
        target = param if t.expert is None else param[t.expert]
        if t.name in VOCAB:
            param.zero_()  # rows past the vocabulary pad it to a multiple of the ranks
            target = param[: tensor.shape[0]]
        elif t.part is not None:
            target = target[offset : offset + tensor.shape[0]]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{t.name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        target.copy_(tensor)


def _parts(name: str) -> tuple[int | None, ...]:
    if "qkv_proj." in name:
        return 0, 1, 2
    if "gate_up_proj." in name or ".w13" in name:
        return 0, 1
    return (None,)


def _check_complete(model: LlamaForCausalLM, params: dict, loaded: set[Target], num_experts: int):
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        experts = range(num_experts) if ".experts." in name else (None,)
        expected |= {Target(name, part, e) for part in _parts(name) for e in experts}
    missing = sorted(expected - loaded, key=str)
    if missing:
        shown = [f"{t.name}#{t.part}" + (f" of expert {t.expert}" if t.expert is not None else "")
                 for t in missing[:3]]  # fmt: skip
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {shown}")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    backend: ModuleType = torch_attention,
) -> LlamaForCausalLM:
    """The model on `backend`'s kernels (attention's, and the experts' with it)."""
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    model = build(model, model_dir, dtype, device, backend)
    for table in model.rotary_tables:
        table.build(device)
    return model


def build(
    model: nn.Module, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
    backend: ModuleType, names: Names | None = None,
) -> nn.Module:  # fmt: skip
    """A model made on meta, given its weights (those `names` takes) on `device`."""
    # Built and cast on meta, so no memory is spent on a random init the checkpoint
    # overwrites; quantized layers get their tensors after the cast (their dtypes).
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():  # DeepSeek's routing bias stays float32 (moe.py)
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    linear.materialize(model, device)
    model.tie_weights()  # to_empty gives the tied parameters separate storage
    load_weights(model, model_dir, names)
    for module in model.modules():  # what layers derive from their weights (mla.py)
        if hasattr(module, "after_load"):
            module.after_load(dtype)
    model = model.eval()
    model.set_attention_backend(backend)  # before packing: the experts pack for torch's
    if onednn.usable(device, dtype):
        onednn.pack(model, shared={id(p) for p in model.shared_weights()})
    return model
