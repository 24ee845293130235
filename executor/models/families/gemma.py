"""Gemma 2 and 3: GemmaStyle (sandwich norms of (1 + w), the scaled embedding, a
tanh-GELU MLP, query_pre_attn_scalar, the window layers' own RoPE, Gemma 2's
soft-capping); Gemma 3 adds per-head q/k RMSNorm. Gemma 3's vision-language model
reads images through SigLIP and a projector (pooled to mm_tokens_per_image), an
image's tokens attending to each other both ways (docs/multimodal.md)."""

from flagstop.executor.models.families.family import Architecture, VisionLayout

GEMMA3_VISION = VisionLayout(
    tower="transformers.models.siglip.modeling_siglip.SiglipVisionModel",
    weights=("vision_tower", "multi_modal_projector"),
    projector="transformers.models.gemma3.modeling_gemma3.Gemma3MultiModalProjector",
    model_config="transformers.Gemma3Config",
    bidirectional=True,
)

ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", gemma=True),
    Architecture("Gemma3ForCausalLM", gemma=True, qk_norm=True),
    Architecture("Gemma3ForConditionalGeneration", gemma=True, qk_norm=True,
                 vision=GEMMA3_VISION),
)  # fmt: skip
