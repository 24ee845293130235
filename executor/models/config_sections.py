"""The config sections a family may add to the Llama decoder's ModelConfig, read from
a Hugging Face config.json as the family's declaration says (families/): the sparse
MLP (MoeConfig), latent attention (MlaConfig), recurrent layers (RecurrentConfig),
Gemma's block (GemmaStyle) and Granite's multipliers (Multipliers). Torch-free."""

import math
from dataclasses import dataclass
from typing import Any

from flagstop.executor.models.expert_routing import Routing
from flagstop.executor.models.families.family import QWEN_MOE, MoeLayout, VisionLayout
from flagstop.executor.models.quantization import ConfigError

# Routing fields of the other MoE families with the value that means "the plain softmax
# top-k they run": a config of theirs that sets one otherwise names a scheme we do not know.
PLAIN_ROUTING = {
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """The sparse MLP of a Mixture-of-Experts model: each token's top_k of num_experts
    experts by its `routing` (expert_routing.py: the softmax top-k, renormalised or not, or
    DeepSeek's rules), their outputs weighted by the chosen weights, plus shared experts
    every token takes (Qwen2-MoE's scaled by its own sigmoid gate, DeepSeek's not)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    routing: Routing  # how the router's logits choose and weigh (expert_routing.py)
    shared_expert_intermediate_size: int  # 0: none
    sparse_layers: tuple[bool, ...]  # per layer: sparse, or a dense MLP
    # gpt-oss: the router and the experts have biases, and the experts' activation is
    # the clamped SwiGLU (gate clamped above at limit, up to +-limit, gate * sigmoid(
    # alpha * gate) * (up + 1)); swiglu_limit 0: SiLU(gate) * up.
    biased: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    # DeepSeek's shared experts are ungated (Qwen2-MoE scales its one by a sigmoid gate).
    shared_expert_gated: bool = True
    # How the family's checkpoint names its experts.
    layout: MoeLayout = QWEN_MOE

    @classmethod
    def from_hf(cls, layout: MoeLayout, hf: dict[str, Any], num_layers: int) -> "MoeConfig":
        """The experts as the family's layout (families/) names them in hf."""
        if layout.deepseek_version:
            return cls.deepseek(layout, hf, num_layers)
        for name, plain in PLAIN_ROUTING.items():
            if hf.get(name, plain) != plain:
                raise ConfigError(
                    f"{name}={hf[name]!r}: an MoE routing scheme flagstop does not run "
                    f"(it runs softmax top-k, {name}={plain!r})"
                )
        renormalize = layout.always_renormalize or bool(
            hf.get("norm_topk_prob", layout.renormalize_default)
        )
        num_experts = _field(hf, layout.experts_field, layout.experts_alias)
        top_k = _field(hf, "num_experts_per_tok")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok={top_k}: must be 1..{num_experts} experts")
        swiglu = layout.clamped_swiglu
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=_field(hf, layout.inner_field),
            # gpt-oss: softmax over the top-k logits, the same as renormalising.
            routing=Routing(renormalize=renormalize),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0)
            if layout.shared_expert else 0,
            sparse_layers=_sparse_layers(layout, hf, num_layers),
            biased=swiglu,
            swiglu_alpha=hf.get("swiglu_alpha", 1.702) if swiglu else 0.0,
            swiglu_limit=hf.get("swiglu_limit", 7.0) if swiglu else 0.0,
            layout=layout,
        )  # fmt: skip

    @classmethod
    def deepseek(cls, layout: MoeLayout, hf: dict[str, Any], num_layers: int) -> "MoeConfig":
        """DeepSeek-V2/V3's layout (GLM-4.5 and Kimi-K2 share V3's): n_routed_experts
        routed by expert_routing.py's rule, n_shared_experts ungated ones of moe_intermediate_size
        each (fused into one), the first first_k_dense_replace layers dense and then every
        moe_layer_freq-th sparse (vLLM's rule; transformers' is freq 1)."""
        num_experts, top_k = _field(hf, "n_routed_experts"), _field(hf, "num_experts_per_tok")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok={top_k}: must be 1..{num_experts} experts")
        inner = _field(hf, "moe_intermediate_size")
        first_dense = hf.get("first_k_dense_replace") or 0
        freq = _field(hf, "moe_layer_freq") if "moe_layer_freq" in hf else 1
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=inner,
            routing=Routing.deepseek(hf, version=layout.deepseek_version),
            shared_expert_intermediate_size=inner * (hf.get("n_shared_experts") or 0),
            sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
            shared_expert_gated=False,
            layout=layout,
        )


def _field(hf: dict[str, Any], name: str, alias: str | None = None) -> int:
    """A positive int field (or its alias: transformers writes Qwen's num_experts as
    num_local_experts); its absence or a bad value names it."""
    value = hf.get(name)
    if value is None and alias:
        value = hf.get(alias)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r}: an MoE config needs a positive integer")
    return value


def _sparse_layers(layout: MoeLayout, hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Every layer, or Qwen's rule (transformers' Qwen2/3-MoE decoder layers): sparse
    unless listed in mlp_only_layers, and then only every decoder_sparse_step-th layer."""
    if layout.every_layer_sparse:
        return (True,) * num_layers
    step = _field(hf, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


@dataclass(slots=True, frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; executor/models/mla.py):
    queries through an optional low-rank q_lora_rank, keys and values from one latent
    of kv_lora_rank values per token plus one shared rotated key of rope_dim, which is
    all the cache holds; each head's key is [nope_dim from the latent, rope_dim] and its
    value v_head_dim. rope_interleave: the rotary dimensions are in (even, odd) pairs
    (V2 always; V3 by its config). scale: the softmax's, YaRN's mscale squared included."""

    q_lora_rank: int  # 0: a full-rank q_proj
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_head_dim: int
    rope_interleave: bool
    scale: float

    @property
    def latent_width(self) -> int:
        """What the cache holds per token: the latent, then the rotated key."""
        return self.kv_lora_rank + self.rope_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any], interleave: bool, rope: dict[str, Any]) -> "MlaConfig":
        """interleave: the family's rotary dimensions always in pairs (else the config's)."""
        nope, rope_dim = _positive(hf, "qk_nope_head_dim"), _positive(hf, "qk_rope_head_dim")
        scale = (nope + rope_dim) ** -0.5
        if rope.get("rope_type", rope.get("type", "default")) != "default" and (
            mscale := rope.get("mscale_all_dim")
        ):  # transformers' yarn_apply_mscale
            scale *= yarn_mscale(rope["factor"], mscale) ** 2
        return cls(
            q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=_positive(hf, "kv_lora_rank"),
            nope_dim=nope,
            rope_dim=rope_dim,
            v_head_dim=_positive(hf, "v_head_dim"),
            rope_interleave=interleave or bool(hf.get("rope_interleave", True)),
            scale=scale,
        )


def yarn_mscale(factor: float, k: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 k ln(factor)
    + 1 (1 without stretching); the rotary tables' attention factor and DeepSeek's softmax
    scale are made of it."""
    return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0


def _positive(hf: dict[str, Any], name: str) -> int:
    value = hf.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}={value!r}: latent attention needs a positive integer")
    return value


@dataclass(slots=True, frozen=True)
class RecurrentConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5; executor/models/gdn.py): per value
    head a state [head_k_dim, head_v_dim], the value heads in groups sharing a key
    head, and a causal convolution of conv_width over the queries', keys' and values'
    channels. per_key_head: the input projections packed by key head (Qwen3-Next's
    in_proj_qkvz and in_proj_ba) rather than one a part (Qwen3.5's in_proj_qkv, _z,
    _b, _a)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int
    per_key_head: bool = True

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys, values."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, tp_size: int = 1) -> int:
        """One layer's state on one rank of tp_size, float32: the delta rule's matrix
        per value head and the convolution's last conv_width - 1 inputs."""
        delta = self.num_v_heads * self.head_k_dim * self.head_v_dim
        return 4 * (delta + self.conv_dim * (self.conv_width - 1)) // tp_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any], per_key_head: bool) -> "RecurrentConfig":
        def positive(name: str) -> int:
            value = hf.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r}: gated DeltaNet needs a positive integer")
            return value

        config = cls(positive("linear_num_key_heads"), positive("linear_num_value_heads"),
                     positive("linear_key_head_dim"), positive("linear_value_head_dim"),
                     positive("linear_conv_kernel_dim"), per_key_head)  # fmt: skip
        if config.num_v_heads % config.num_k_heads:
            raise ConfigError(f"linear_num_value_heads={config.num_v_heads}: a multiple of "
                              f"linear_num_key_heads={config.num_k_heads}")  # fmt: skip
        return config


@dataclass(slots=True, frozen=True)
class GemmaStyle:
    """Where Gemma 2 and 3 leave the Llama block: norms of (1 + w) around both the
    attention and the MLP (pre and post: "sandwich"), the embedding scaled by
    sqrt(hidden_size), a tanh-GELU MLP, queries scaled by query_pre_attn_scalar, the
    window layers' RoPE (Gemma 3: their own base, rope_parameters["sliding_attention"];
    Gemma 2: the global one), and Gemma 2's soft-capping: cap * tanh(x / cap) of the
    attention scores and of the final logits (0: none)."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    local_rope_scaling: dict[str, Any] | None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], local_rope: dict[str, Any]) -> "GemmaStyle":
        """local_rope: the window layers' RoPE parameters."""
        if (act := hf.get("hidden_activation", "gelu_pytorch_tanh")) != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation={act!r}: Gemma's MLP runs gelu_pytorch_tanh")
        rope_type = local_rope.get("rope_type", "default")
        theta = local_rope.get("rope_theta", hf.get("rope_local_base_freq", hf.get("rope_theta")))
        return cls(
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            local_rope_theta=theta or 10000.0,
            local_rope_scaling=None if rope_type == "default" else dict(local_rope),
            attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
            final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0),
        )


@dataclass(slots=True, frozen=True)
class Multipliers:
    """Granite's scalars on the Llama block: the embedding times embedding, the softmax
    scale attention (instead of head_dim ** -0.5), each residual branch (attention's
    and the MLP's output) times residual before it joins, the logits divided by
    logits."""

    embedding: float
    attention: float
    residual: float
    logits: float

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Multipliers":
        return cls(float(hf.get("embedding_multiplier", 1.0)),
                   float(hf.get("attention_multiplier", 1.0)),
                   float(hf.get("residual_multiplier", 1.0)),
                   float(hf.get("logits_scaling", 1.0)))  # fmt: skip


@dataclass(slots=True, frozen=True)
class VisionConfig:
    """A vision-language model's image side: its placeholder token, how its tower
    merges patches into embeddings, its multimodal RoPE sections, and the tower's own
    config (vision_config, which transformers' tower class reads)."""

    layout: VisionLayout
    image_token_id: int
    spatial_merge_size: int
    # Pairs of rotary dimensions per position (temporal, height, width), one section
    # after another or interleaved (the family's layout says).
    mrope_section: tuple[int, ...]
    tower_config: dict[str, Any]
    num_deepstack_layers: int = 0  # DeepStack: the first layers that add tower features
    model_config: dict[str, Any] | None = None  # the whole config.json (a projector's)

    @classmethod
    def from_hf(cls, layout: VisionLayout, hf: dict[str, Any], rope: dict[str, Any]
                ) -> "VisionConfig":  # fmt: skip
        tower = hf.get("vision_config") or {}
        section = tuple(rope.get("mrope_section") or layout.mrope_section) if layout.mrope else ()
        if layout.mrope and len(section) != 3:
            raise ConfigError(f"rope_parameters.mrope_section={section!r}: multimodal RoPE "
                              "takes three sections (temporal, height, width)")  # fmt: skip
        deepstack = len(tower.get("deepstack_visual_indexes") or ()) if layout.deepstack else 0
        image_token_id = hf.get("image_token_id", hf.get("image_token_index"))
        return cls(layout, image_token_id, tower.get("spatial_merge_size", 2), section,
                   tower, deepstack, hf)  # fmt: skip


def language_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's language model as a text model's config: its
    text_config's fields over the top level's (which keeps the architecture and the
    image token ids), but the top level's tie_word_embeddings, which is the model's
    (transformers writes the text config's default beside it)."""
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    tied = {"tie_word_embeddings": top["tie_word_embeddings"]} \
        if "tie_word_embeddings" in top else {}  # fmt: skip
    return top | hf.get("text_config", {}) | tied
