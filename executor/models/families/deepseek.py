"""DeepSeek-V2 and V3 (and Kimi-K2, a V3): latent attention (MlaConfig; V2's rotary
dimensions always interleaved, V3's by its config) and DeepSeek's MoE layout, routed
by the version's rule (routing.py)."""

from flagstop.executor.models.families.family import Architecture, MoeLayout

ARCHITECTURES = (
    Architecture("DeepseekV2ForCausalLM", latent=True, rope_interleave=True,
                 moe=MoeLayout(deepseek_version=2)),
    Architecture("DeepseekV3ForCausalLM", latent=True, moe=MoeLayout(deepseek_version=3)),
)  # fmt: skip
