"""Qwen3-Next and Qwen3.5: gated DeltaNet layers (RecurrentConfig) beside gated full
attention, every norm (1 + w), per-head q/k RMSNorm. Qwen3-Next packs its recurrent
projections by key head, Qwen3.5 keeps one a part; the MoE ones have a gated shared
expert and always renormalise (Qwen3.5-MoE's config has no norm_topk_prob)."""

from flagstop.executor.models.families.family import Architecture, MoeLayout

QWEN3_NEXT_MOE = MoeLayout(shared_expert=True, renormalize_default=True)

ARCHITECTURES = (
    Architecture("Qwen3NextForCausalLM", qk_norm=True, recurrent=True, moe=QWEN3_NEXT_MOE),
    Architecture("Qwen3_5ForCausalLM", qk_norm=True, recurrent=False),
    Architecture("Qwen3_5MoeForCausalLM", qk_norm=True, recurrent=False, moe=QWEN3_NEXT_MOE),
)
