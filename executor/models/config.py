"""A model's shape as the executor runs it, read from a Hugging Face config.json: the
Llama decoder's fields, and the sections its family's declaration adds
(config_sections.py, families/)."""

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flagstop.executor.models.config_sections import (
    GemmaStyle,
    MlaConfig,
    MoeConfig,
    Multipliers,
    RecurrentConfig,
    VisionConfig,
    language_fields,
)
from flagstop.executor.models.families import ARCHITECTURES, Architecture
from flagstop.executor.models.pooling_config import PoolingConfig, pooling_config
from flagstop.executor.models.quantization import ConfigError, QuantConfig
from flagstop.scheduler_svc.core.kv_groups import (
    ATTENTION_TYPES,
    FULL_ATTENTION,
    LATENT_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    KVLayer,
)


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
    recurrent: RecurrentConfig | None = None
    multipliers: Multipliers | None = None  # Granite's scalars (None: all 1)
    vision: VisionConfig | None = None  # a vision-language model's images (None: text)
    # A pooling model's (embeddings: docs/pooling.md); None: a model that generates.
    pooling: PoolingConfig | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path,
                        overrides: dict[str, Any] | None = None) -> "ModelConfig":  # fmt: skip
        """overrides: config.json's fields replaced (--hf-overrides)."""
        hf = json.loads((Path(model_dir) / "config.json").read_text()) | (overrides or {})
        # generation_config.json's EOS ids win: chat models list their turn-end there.
        generation = Path(model_dir) / "generation_config.json"
        generation_config = json.loads(generation.read_text()) if generation.exists() else {}
        config = cls.from_hf(hf, generation_config.get("eos_token_id"))
        name = _architecture_name(hf)
        pooling = pooling_config(Path(model_dir), hf, name in BACKBONES, name in CLASSIFIERS,
                                 config.hidden_size)  # fmt: skip
        return config if pooling is None else replace(config, pooling=pooling)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos: int | list[int] | None = None) -> "ModelConfig":
        arch = _architecture(hf)
        if arch.vision is not None:
            top, hf = hf, language_fields(hf)
        if (act := hf.get("hidden_act", "silu")) != "silu":
            raise ConfigError(f"hidden_act={act!r}: flagstop's MLPs run silu")
        num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        rope, local_rope = _rope_parameters(hf)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_len = hf.get("max_position_embeddings", 2048)
        layer_types, window = _layer_types(hf, num_layers, arch.recurrent is not None)
        if eos is None:
            eos = hf.get("eos_token_id")
        mla = MlaConfig.from_hf(hf, arch.rope_interleave, rope) if arch.latent else None
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        fields = dict(
            architecture=arch.name,
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
            qkv_bias=arch.qkv_bias or hf.get("attention_bias", False),
            o_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=arch.qk_norm,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
            quant=QuantConfig.from_hf(hf),
            max_model_len=max_len,
            layer_types=layer_types,
            sliding_window=window,
            attention_sinks=arch.sinks,
            mla=mla,
            rotary_dim=mla.rope_dim if mla else int(head_dim * partial),
        )
        vision = {} if arch.vision is None else \
            {"vision": VisionConfig.from_hf(arch.vision, top, rope)}  # fmt: skip
        return cls(**fields | _sections(arch, hf, num_layers, local_rope) | vision
                   | arch.overrides(hf))  # fmt: skip

    @property
    def attention_gated(self) -> bool:
        """Whether full attention's output is gated per head (the recurrent Qwens')."""
        return self.recurrent is not None

    def kv_layers(
        self, num_kv_heads: int, kv_dtype_bytes: int, all_full: bool = False
    ) -> list[KVLayer]:
        """Each layer as the KV cache holds it (num_kv_heads: one rank's); all_full: as
        full attention (--disable-hybrid-kv-cache-manager: one group)."""
        if self.mla is not None:  # one latent and one rotated key per token, every rank
            latent = KVLayer(LATENT_ATTENTION, kv_bytes_per_token=self.mla.latent_width
                               * kv_dtype_bytes)  # fmt: skip
            return [latent] * self.num_layers
        kv_bytes = 2 * num_kv_heads * self.head_dim * kv_dtype_bytes
        if self.recurrent is not None:  # a state per request: no bytes a token (kv_groups.py)
            if all_full:
                raise ConfigError("--disable-hybrid-kv-cache-manager: this model's "
                                  "linear_attention layers keep a state, not KV a token; "
                                  "serve it with the hybrid manager")  # fmt: skip
            return [KVLayer(t, kv_bytes_per_token=kv_bytes if t == FULL_ATTENTION else 0)
                    for t in self.layer_types]  # fmt: skip
        return [KVLayer(t, self.sliding_window if t == SLIDING_ATTENTION else 0,
                          self.attention_sinks, kv_bytes)
                if not all_full else KVLayer(sinks=self.attention_sinks,
                                               kv_bytes_per_token=kv_bytes)
                for t in self.layer_types]  # fmt: skip


# A bare backbone (transformers' Qwen3Model, LlamaModel: an embedding model's
# checkpoint) runs its family's decoder without the LM head.
BACKBONES = {
    name.removesuffix("ForCausalLM") + "Model": name
    for name, arch in ARCHITECTURES.items()
    if name.endswith("ForCausalLM") and arch.vision is None
}
# A sequence classifier (Qwen3ForSequenceClassification): its family's decoder, then a
# classification head on the last token (executor/pooler.py).
CLASSIFIERS = {
    name.removesuffix("ForCausalLM") + "ForSequenceClassification": name
    for name, arch in ARCHITECTURES.items()
    if name.endswith("ForCausalLM") and arch.vision is None
}


def _architecture_name(hf: dict[str, Any]) -> str:
    return (hf.get("architectures") or ["?"])[0]


def _architecture(hf: dict[str, Any]) -> Architecture:
    architecture = _architecture_name(hf)
    architecture = BACKBONES.get(architecture) or CLASSIFIERS.get(architecture, architecture)
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]


def _rope_parameters(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the full-attention layers' RoPE parameters, the window layers'): by layer type
    (Gemma 3's), or one for every layer."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    local_rope = rope.get(SLIDING_ATTENTION) or rope.get(FULL_ATTENTION, rope)
    return rope.get(FULL_ATTENTION, rope), local_rope


def _sections(
    arch: Architecture, hf: dict[str, Any], num_layers: int, local_rope: dict[str, Any]
) -> dict[str, Any]:
    """The config sections the family declares (None: the Llama decoder's own way)."""
    return dict(
        moe=MoeConfig.from_hf(arch.moe, hf, num_layers) if arch.moe else None,
        gemma=GemmaStyle.from_hf(hf, local_rope) if arch.gemma else None,
        recurrent=RecurrentConfig.from_hf(hf, arch.recurrent)
        if arch.recurrent is not None else None,
        multipliers=Multipliers.from_hf(hf) if arch.multipliers else None,
    )  # fmt: skip
