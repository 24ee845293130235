"""How an architecture differs from the Llama decoder, declared: each family's file
lists its architectures as `Architecture`s, and ModelConfig.from_hf reads the
declaration into config sections that the one decoder (decoder.py) runs. Nothing
outside a family's file asks which architecture a model is.

A declaration, not a decoder subclass per family: the families share all but a few
switches and config sections (17 architectures, one forward), and a declaration
keeps each switch named once where a reader of the family finds it."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """How a family's config and checkpoint spell its experts (MoeConfig.from_hf)."""

    # The config fields of the expert count and each expert's inner size.
    experts_field: str = "num_experts"
    experts_alias: str = "num_local_experts"  # transformers writes either for Qwen's
    inner_field: str = "moe_intermediate_size"
    # Every layer sparse (else Qwen's rule: mlp_only_layers, decoder_sparse_step).
    every_layer_sparse: bool = False
    # Renormalise the top-k weights always, or by norm_topk_prob with this default.
    always_renormalize: bool = False
    renormalize_default: bool = False
    # A shared expert every token takes, of shared_expert_intermediate_size.
    shared_expert: bool = False
    # gpt-oss: biased router and experts, the clamped SwiGLU.
    clamped_swiglu: bool = False
    # The checkpoint's expert names (gate, up, down) and the sparse block's name.
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    block_name: str = "mlp"
    # DeepSeek's layout (shared experts ungated, dense leading layers), by the version
    # of its routing (routing.py); 0: not DeepSeek's.
    deepseek_version: int = 0


def no_overrides(hf: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # the Hugging Face architecture (config.json's "architectures")
    # q/k/v always biased; otherwise the config's attention_bias biases q/k/v and o.
    qkv_bias: bool = False
    qk_norm: bool = False  # a per-head RMSNorm of queries and keys
    moe: MoeLayout | None = None
    latent: bool = False  # latent attention (MlaConfig)
    rope_interleave: bool = False  # latent attention's rotary dims in (even, odd) pairs
    sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    gemma: bool = False  # Gemma's block (GemmaStyle)
    # Gated DeltaNet layers (RecurrentConfig); True: projections packed by key head.
    recurrent: bool | None = None
    # Scalar multipliers on the embedding, attention, residual branches and logits
    # (Multipliers: Granite's).
    multipliers: bool = False
    # A vision-language model: its text under text_config, images by its tower.
    vision: "VisionLayout | None" = None
    # ModelConfig fields a config of the family sets its own way: hf -> {field: value}.
    overrides: Callable[[dict[str, Any]], dict[str, Any]] = no_overrides


# Qwen-MoE's layout, the default of a MoeConfig built by hand.
QWEN_MOE = MoeLayout()


@dataclass(frozen=True, slots=True)
class VisionLayout:
    """A vision-language family: its image encoder (transformers' own modules,
    models/vision.py), its positions and how its image tokens attend."""

    # The tower's transformers class (module.Class), built from vision_config; and the
    # checkpoint's names of its modules: the tower's, then the projector's.
    tower: str
    weights: tuple[str, ...]
    # A projector after the tower (Gemma 3's), built from the whole model's config
    # (model_config: its transformers class); "": the tower's output is the embedding.
    projector: str = ""
    model_config: str = ""
    # An image's tokens attend to each other both ways (Gemma 3): a prefill chunk never
    # cuts an image, and each of its tokens sees the whole image.
    bidirectional: bool = False
    # Multimodal RoPE (Qwen-VL): each rotary dimension pair turns by one of (temporal,
    # height, width) positions, by the text config's mrope_section (this default when
    # it has none): the sections one after another (Qwen2.5-VL), or interleaved
    # t, h, w, t, h, w ... with the rest temporal (Qwen3-VL).
    mrope: bool = False
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # DeepStack (Qwen3-VL): the tower's features of some of its blocks are added to the
    # image tokens' hidden states after the first decoder layers, one a layer.
    deepstack: bool = False
