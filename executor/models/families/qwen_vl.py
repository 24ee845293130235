"""Qwen2.5-VL: Qwen2's decoder (q/k/v biased) under multimodal RoPE, reading images
through its vision tower (window attention, a 2x2 patch merger). Qwen3-VL: Qwen3's
decoder (q/k norms) under interleaved multimodal RoPE, its tower's DeepStack features
added to the image tokens after the first layers (docs/multimodal.md)."""

from flagstop.executor.models.families.family import Architecture, VisionLayout

QWEN2_5_VL = VisionLayout(
    tower="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl."
    "Qwen2_5_VisionTransformerPretrainedModel",
    weights=("visual",),
    mrope=True,
)
QWEN3_VL = VisionLayout(
    tower="transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel",
    weights=("visual",),
    mrope=True,
    mrope_section=(24, 20, 20),
    mrope_interleaved=True,
    deepstack=True,
)

ARCHITECTURES = (
    Architecture("Qwen2_5_VLForConditionalGeneration", qkv_bias=True, vision=QWEN2_5_VL),
    Architecture("Qwen3VLForConditionalGeneration", qk_norm=True, vision=QWEN3_VL),
)
