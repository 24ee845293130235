"""Where each checkpoint tensor goes in our modules, and which slice of it a rank of
tensor parallelism holds: Hugging Face names to our packed parameters (q/k/v and
gate/up packed, experts stacked), and per tensor the (dim, start, length) region this
rank reads. The loader (loader.py) and the quantized layers' (quantized_load.py) both
place tensors through it."""

import re
from dataclasses import dataclass

import torch
from torch import nn

from flagstop.executor.models.config import ModelConfig
from flagstop.executor.parallel import Shard

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
    rc = c.recurrent
    assert rc is not None
    group = rc.num_v_heads // rc.num_k_heads
    first_k, num_k = shard.split(rc.num_k_heads)
    first_v, num_v = shard.split(rc.num_v_heads)
    per_key = {"in_proj_qkvz.": 2 * rc.head_k_dim + 2 * group * rc.head_v_dim,
               "in_proj_ba.": 2 * group}  # fmt: skip
    for part, rows in per_key.items():
        if part in name:
            return 0, first_k * rows, num_k * rows
    per_value = {"in_proj_z.": rc.head_v_dim, "in_proj_b.": 1, "in_proj_a.": 1,
                 ".dt_bias": 1, ".A_log": 1}  # fmt: skip
    for part, rows in per_value.items():
        if part in name:
            return 0, first_v * rows, num_v * rows
    if "out_proj." in name:
        return 1, first_v * rc.head_v_dim, num_v * rc.head_v_dim
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


def copy_part(param: nn.Parameter, tensor: torch.Tensor, t: Target, offset: int) -> None:
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


def parts(name: str) -> tuple[int | None, ...]:
    if "qkv_proj." in name:
        return 0, 1, 2
    if "gate_up_proj." in name or ".w13" in name:
        return 0, 1
    return (None,)
