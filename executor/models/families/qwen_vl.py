"""Qwen2.5-VL: Qwen2's decoder (q/k/v biased) under multimodal RoPE, reading images
through its vision tower (window attention, a 2x2 patch merger; docs/multimodal.md)."""

from flagstop.executor.models.families.family import Architecture, VisionLayout

QWEN2_5_VL = VisionLayout(
    tower_module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    tower_class="Qwen2_5_VisionTransformerPretrainedModel",
)

ARCHITECTURES = (
    Architecture("Qwen2_5_VLForConditionalGeneration", qkv_bias=True, vision=QWEN2_5_VL),
)
