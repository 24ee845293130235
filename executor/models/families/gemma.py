"""Gemma 2 and 3: GemmaStyle (sandwich norms of (1 + w), the scaled embedding, a
tanh-GELU MLP, query_pre_attn_scalar, the window layers' own RoPE, Gemma 2's
soft-capping); Gemma 3 adds per-head q/k RMSNorm."""

from flagstop.executor.models.families.family import Architecture

ARCHITECTURES = (
    Architecture("Gemma2ForCausalLM", gemma=True),
    Architecture("Gemma3ForCausalLM", gemma=True, qk_norm=True),
)
