import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flagstop.executor.models.quantization import ConfigError, QuantConfig
from flagstop.executor.models.routing import Routing
from flagstop.scheduler_svc.core.kv_groups import (
    ATTENTION_TYPES,
    FULL_ATTENTION,
    LATENT_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LayerSpec,
)

# architecture -> (q/k/v always biased, per-head q/k RMSNorm, MoE family or None);
# otherwise the config's attention_bias applies to q/k/v and o alike. The MoE
# families' attention is the dense one's.
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False, None),
    "MistralForCausalLM": (False, False, None),
    "Qwen2ForCausalLM": (True, False, None),
    "Qwen3ForCausalLM": (False, True, None),
    "MixtralForCausalLM": (False, False, "mixtral"),
    "Qwen2MoeForCausalLM": (True, False, "qwen2_moe"),
    "Qwen3MoeForCausalLM": (False, True, "qwen3_moe"),
    "Gemma2ForCausalLM": (False, False, None),  # and GemmaStyle, with soft-capping
    "Gemma3ForCausalLM": (False, True, None),  # and GemmaStyle
    "GptOssForCausalLM": (False, False, "gpt_oss"),  # and attention sinks
    # DeepSeek's layout: latent attention (MlaConfig) and its MoE; GLM-4.5 runs V3's MoE
    # under GQA with partial rotary (its q/k/v bias is attention_bias, o unbiased).
    "DeepseekV2ForCausalLM": (False, False, "deepseek_v2"),
    "DeepseekV3ForCausalLM": (False, False, "deepseek_v3"),
    "Glm4MoeForCausalLM": (False, False, "deepseek_v3"),
    # Gated DeltaNet layers beside gated full attention (LinearAttentionConfig).
    "Qwen3NextForCausalLM": (False, True, "qwen3_next"),
    "Qwen3_5ForCausalLM": (False, True, None),
    "Qwen3_5MoeForCausalLM": (False, True, "qwen3_next"),
}
# Recurrent models: the architecture -> whether its projections are packed by key head
# (Qwen3-Next's in_proj_qkvz and in_proj_ba) rather than one a part (Qwen3.5's).
LINEAR = {"Qwen3NextForCausalLM": True, "Qwen3_5ForCausalLM": False,
          "Qwen3_5MoeForCausalLM": False}  # fmt: skip
MLA = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
SINKS = {"GptOssForCausalLM"}
GEMMA = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
# MoE families with DeepSeek's layout, by the version of its routing (routing.py).
DEEPSEEK_FAMILIES = {"deepseek_v2": 2, "deepseek_v3": 3}
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
    experts by its `routing` (routing.py: the softmax top-k, renormalised or not, or
    DeepSeek's rules), their outputs weighted by the chosen weights, plus shared experts
    every token takes (Qwen2-MoE's scaled by its own sigmoid gate, DeepSeek's not)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    routing: Routing  # how the router's logits choose and weigh (routing.py)
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

    @classmethod
    def from_hf(cls, family: str, hf: dict[str, Any], num_layers: int) -> "MoeConfig":
        if family in DEEPSEEK_FAMILIES:
            return cls.deepseek(family, hf, num_layers)
        for name, plain in PLAIN_ROUTING.items():
            if hf.get(name, plain) != plain:
                raise ConfigError(
                    f"{name}={hf[name]!r}: an MoE routing scheme flagstop does not run "
                    f"(it runs softmax top-k, {name}={plain!r})"
                )
        local_first = family in ("mixtral", "gpt_oss")
        # Qwen3.5-MoE's config has no norm_topk_prob: it always renormalises.
        renormalize = hf.get("norm_topk_prob", family == "qwen3_next")
        num_experts = _field(
            hf,
            "num_local_experts" if local_first else "num_experts",
            "num_experts" if local_first else "num_local_experts",
        )
        top_k = _field(hf, "num_experts_per_tok")
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok={top_k}: must be 1..{num_experts} experts")
        gpt_oss = family == "gpt_oss"
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=_field(
                hf, "intermediate_size" if local_first else "moe_intermediate_size"),
            # gpt-oss: softmax over the top-k logits, the same as renormalising.
            routing=Routing(renormalize=local_first or bool(renormalize)),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0)
            if family in ("qwen2_moe", "qwen3_next") else 0,
            sparse_layers=_sparse_layers(family, hf, num_layers),
            biased=gpt_oss,
            swiglu_alpha=hf.get("swiglu_alpha", 1.702) if gpt_oss else 0.0,
            swiglu_limit=hf.get("swiglu_limit", 7.0) if gpt_oss else 0.0,
        )  # fmt: skip

    @classmethod
    def deepseek(cls, family: str, hf: dict[str, Any], num_layers: int) -> "MoeConfig":
        """DeepSeek-V2/V3's layout (GLM-4.5 and Kimi-K2 share V3's): n_routed_experts
        routed by routing.py's rule, n_shared_experts ungated ones of moe_intermediate_size
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
            routing=Routing.deepseek(hf, version=DEEPSEEK_FAMILIES[family]),
            shared_expert_intermediate_size=inner * (hf.get("n_shared_experts") or 0),
            sparse_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
            shared_expert_gated=False,
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


def _sparse_layers(family: str, hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen's rule (transformers' Qwen2/3-MoE decoder layers): sparse unless listed in
    mlp_only_layers, and then only every decoder_sparse_step-th layer."""
    if family in ("mixtral", "gpt_oss"):
        return (True,) * num_layers
    step = _field(hf, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _layer_types(hf: dict[str, Any], num_layers: int, recurrent: bool = False
                 ) -> tuple[tuple[str, ...], int]:  # fmt: skip
    """(each layer's attention type, the window) as transformers reads them: an
    explicit layer_types, else Qwen's rule (use_sliding_window, and then the layers
    from max_window_layers on), else Mistral's (a sliding_window: every layer).
    recurrent (Qwen3-Next, Qwen3.5): linear_attention layers but every
    full_attention_interval-th (transformers' default 4) unless layer_types says."""
    if recurrent:
        interval = hf.get("full_attention_interval", 4)
        types = hf.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(num_layers)]  # fmt: skip
        if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise ConfigError(f"layer_types={types!r}: full_attention or linear_attention "
                              f"per layer ({num_layers})")  # fmt: skip
        if FULL_ATTENTION not in types:
            raise ConfigError("layer_types: no full_attention layer; flagstop sizes a "
                              "recurrent layer's state by a full-attention layer's "
                              "block")  # fmt: skip
        return tuple(types), 0
    window = hf.get("sliding_window") or 0
    if not hf.get("use_sliding_window", True):
        window = 0
    if not isinstance(window, int) or window < 0:
        raise ConfigError(f"sliding_window={window!r}: a window is a positive number of tokens")
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 0) if "use_sliding_window" in hf else 0
        types = [SLIDING_ATTENTION if window and i >= first else FULL_ATTENTION
                 for i in range(num_layers)]  # fmt: skip
    if not window:
        types = [FULL_ATTENTION] * num_layers
    if len(types) != num_layers or not set(types) <= set(ATTENTION_TYPES):
        raise ConfigError(f"layer_types={types!r}: one of {ATTENTION_TYPES} per layer "
                          f"({num_layers})")  # fmt: skip
    return tuple(types), window if SLIDING_ATTENTION in types else 0


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
    def from_hf(cls, hf: dict[str, Any], architecture: str, rope: dict[str, Any]) -> "MlaConfig":
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
            rope_interleave=architecture == "DeepseekV2ForCausalLM"
            or bool(hf.get("rope_interleave", True)),
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
class LinearAttentionConfig:
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
    def from_hf(cls, hf: dict[str, Any], per_key_head: bool) -> "LinearAttentionConfig":
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
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None
    quant: QuantConfig | None  # quantized weights: the checkpoint's quantization_config
    max_model_len: int
    # Per layer, transformers' "full_attention" or "sliding_attention" (the window
    # layers' queries see sliding_window tokens, themselves included).
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    gemma: GemmaStyle | None = None  # None: the Llama block
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    mla: MlaConfig | None = None  # latent attention (then num_kv_heads is 1: the latent)
    # The leading dimensions of a head that RoPE rotates (GLM-4.5: half of them; latent
    # attention: its rope_dim); the rest pass through.
    rotary_dim: int = 0
    # Gated DeltaNet layers (their layer_types are linear_attention); with them the full
    # attention's output is gated (sigmoid of a second half of q_proj, per head) and
    # every norm is Gemma's (1 + w).
    linear: LinearAttentionConfig | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        # generation_config.json's EOS ids win: chat models list their turn-end there.
        generation = Path(model_dir) / "generation_config.json"
        generation_config = json.loads(generation.read_text()) if generation.exists() else {}
        return cls.from_hf(hf, generation_config.get("eos_token_id"))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos: int | list[int] | None = None) -> "ModelConfig":
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}"
            )
        qkv_bias, qk_norm, moe_family = ARCHITECTURES[architecture]
        if (act := hf.get("hidden_act", "silu")) != "silu":
            raise ConfigError(f"hidden_act={act!r}: flagstop's MLPs run silu")
        num_layers = hf["num_hidden_layers"]
        if moe_family == "qwen2_moe":  # Qwen2-MoE names its q/k/v bias qkv_bias
            qkv_bias = hf.get("qkv_bias", True)
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        # By layer type (Gemma 3's), or one for every layer.
        local_rope = rope.get(SLIDING_ATTENTION) or rope.get(FULL_ATTENTION, rope)
        rope = rope.get(FULL_ATTENTION, rope)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_len = hf.get("max_position_embeddings", 2048)
        layer_types, window = _layer_types(hf, num_layers, architecture in LINEAR)
        if eos is None:
            eos = hf.get("eos_token_id")
        quant = QuantConfig.from_hf(hf)
        mla = MlaConfig.from_hf(hf, architecture, rope) if architecture in MLA else None
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if architecture == "Glm4MoeForCausalLM":
            qk_norm, qkv_bias = bool(hf.get("use_qk_norm")), hf.get("attention_bias", False)
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 0,  # 0: every layer sparse
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=1 if mla else hf.get("num_key_value_heads") or num_heads,
            head_dim=mla.nope_dim + mla.rope_dim if mla else head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_len,
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            qkv_bias=qkv_bias or hf.get("attention_bias", False),
            o_bias=hf.get("attention_bias", False) and architecture != "Glm4MoeForCausalLM",
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=qk_norm,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
            moe=MoeConfig.from_hf(moe_family, hf, num_layers) if moe_family else None,
            quant=quant,
            max_model_len=max_len,
            layer_types=layer_types,
            sliding_window=window,
            gemma=GemmaStyle.from_hf(hf, local_rope) if architecture in GEMMA else None,
            attention_sinks=architecture in SINKS,
            mla=mla,
            rotary_dim=mla.rope_dim if mla else int(head_dim * partial),
            linear=LinearAttentionConfig.from_hf(hf, LINEAR[architecture])
            if architecture in LINEAR
            else None,
        )

    @property
    def attention_gated(self) -> bool:
        """Whether full attention's output is gated per head (the recurrent Qwens')."""
        return self.linear is not None

    def layer_specs(
        self, num_kv_heads: int, kv_dtype_bytes: int, all_full: bool = False
    ) -> list[LayerSpec]:
        """Each layer as the KV cache holds it (num_kv_heads: one rank's); all_full: as
        full attention (--disable-hybrid-kv-cache-manager: one group)."""
        if self.mla is not None:  # one latent and one rotated key per token, every rank
            latent = LayerSpec(LATENT_ATTENTION, kv_bytes_per_token=self.mla.latent_width
                               * kv_dtype_bytes)  # fmt: skip
            return [latent] * self.num_layers
        kv_bytes = 2 * num_kv_heads * self.head_dim * kv_dtype_bytes
        if self.linear is not None:  # a state per request: no bytes a token (kv_groups.py)
            if all_full:
                raise ConfigError("--disable-hybrid-kv-cache-manager: this model's "
                                  "linear_attention layers keep a state, not KV a token; "
                                  "serve it with the hybrid manager")  # fmt: skip
            return [LayerSpec(t, kv_bytes_per_token=kv_bytes if t == FULL_ATTENTION else 0)
                    for t in self.layer_types]  # fmt: skip
        return [LayerSpec(t, self.sliding_window if t == SLIDING_ATTENTION else 0,
                          self.attention_sinks, kv_bytes)
                if not all_full else LayerSpec(sinks=self.attention_sinks,
                                               kv_bytes_per_token=kv_bytes)
                for t in self.layer_types]  # fmt: skip
