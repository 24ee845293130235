"""GLM-4.5: DeepSeek-V3's MoE under grouped-query attention with partial rotary; its
q/k norm is the config's use_qk_norm, q/k/v biased by attention_bias, o never."""

from flagstop.executor.models.families.family import Architecture, MoeLayout


def _glm_overrides(hf: dict) -> dict:
    return {"qk_norm": bool(hf.get("use_qk_norm")),
            "qkv_bias": hf.get("attention_bias", False), "o_bias": False}  # fmt: skip


ARCHITECTURES = (
    Architecture("Glm4MoeForCausalLM", moe=MoeLayout(deepseek_version=3),
                 overrides=_glm_overrides),
)  # fmt: skip
