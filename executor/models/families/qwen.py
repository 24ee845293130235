"""Qwen2 (q/k/v always biased) and Qwen3 (per-head q/k RMSNorm), and their
Mixture-of-Experts kin: Qwen2-MoE (a shared expert behind a sigmoid gate; its q/k/v
bias is the config's qkv_bias) and Qwen3-MoE."""

from flagstop.executor.models.families.family import Architecture, MoeLayout

ARCHITECTURES = (
    Architecture("Qwen2ForCausalLM", qkv_bias=True),
    Architecture("Qwen3ForCausalLM", qk_norm=True),
    Architecture("Qwen2MoeForCausalLM", qkv_bias=True, moe=MoeLayout(shared_expert=True),
                 overrides=lambda hf: {"qkv_bias": hf.get("qkv_bias", True)
                                       or hf.get("attention_bias", False)}),
    Architecture("Qwen3MoeForCausalLM", qk_norm=True, moe=MoeLayout()),
)  # fmt: skip
