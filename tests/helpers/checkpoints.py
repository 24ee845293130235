"""Small random checkpoints of each supported architecture, written with transformers
itself so that its own model is the reference for ours."""

import random
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    Glm4MoeConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from tools.make_model import WEIGHT_SCALE, write_model

if TYPE_CHECKING:
    from tests.helpers.executor_harness import Harness

COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=1,
)

VARIANTS = {
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    # For tensor parallelism: a vocabulary that 2 ranks split only with padding, tied
    # embeddings (the LM head is the embedding's shard), and one KV head (replicated).
    "qwen2-tied-odd-vocab": lambda: Qwen2Config(
        **{**COMMON, "vocab_size": 509}, tie_word_embeddings=True
    ),
    "llama-1kv": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 1}),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=48),
    # Granite: the four multipliers away from 1 (the family's whole difference).
    "granite": lambda: GraniteConfig(
        **COMMON,
        embedding_multiplier=6.0,
        attention_multiplier=0.125,
        residual_multiplier=0.5,
        logits_scaling=4.0,
    ),
    "llama3-rope-tied": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
# Mixture-of-Experts: top-k renormalised (Mixtral); a shared expert with its sigmoid
# gate, top-k as is, an odd vocabulary (Qwen2-MoE); a dense layer among sparse ones
# and a renormalised odd top-k (Qwen3-MoE); one KV head, every other layer sparse.
MOE_VARIANTS = {
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **{**COMMON, "vocab_size": 509}, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=96,
    ),
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, num_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "qwen3-moe-1kv": lambda: Qwen3MoeConfig(
        **{**COMMON, "num_key_value_heads": 1}, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, decoder_sparse_step=2,
    ),
}  # fmt: skip
VARIANTS |= MOE_VARIANTS
# Sliding windows of 8 tokens, shorter than the tests' prompts so that they matter:
# every layer (Mistral: one window group), and Qwen2's rule (layers from
# max_window_layers on: a full group and a window group).
WINDOW_VARIANTS = {
    "mistral-window": lambda: MistralConfig(**COMMON, sliding_window=8),
    "qwen2-window": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1),
    # Gemma 3 (text): two local layers to one global, their own RoPE bases, a query
    # scale that is not head_dim's, sandwich norms, qk norms, the scaled embedding.
    # Untied: a tied random embedding, scaled by sqrt(hidden), makes greedy collapse.
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 6}, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=24, sliding_window_pattern=3,
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=False,
    ),
    # Gemma 2: Gemma 3's block without q/k norms, one RoPE base, and soft caps low
    # enough to bend the random model's scores and logits.
    "gemma2": lambda: Gemma2Config(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        architectures=["Gemma2ForCausalLM"], tie_word_embeddings=False,
    ),
    # gpt-oss: window and full layers alternating, sinks, q/k/v/o biases, YaRN, and 4
    # experts top-2 with router and expert biases and the clamped SwiGLU (stacked
    # gate_up_proj, interleaved).
    "gpt-oss": lambda: GptOssConfig(
        **{**COMMON, "intermediate_size": 64}, head_dim=32, sliding_window=8,
        num_local_experts=4, num_experts_per_tok=2, architectures=["GptOssForCausalLM"],
    ),
}  # fmt: skip
VARIANTS |= WINDOW_VARIANTS
# DeepSeek's layout: latent attention (queries through a low rank or not, interleaved
# rotary, YaRN with its mscale) and its MoE (sigmoid noaux_tc in groups with the
# correction bias, V2's softmax group-limited greedy, shared experts, the first layer
# dense); GLM-4.5's is V3's MoE under GQA with partial rotary, q/k norms and biases.
_LATENT = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}  # Kimi-K2's shape of it
DEEPSEEK_VARIANTS = {
    "deepseek-v3": lambda: DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, **_LATENT,
        q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
    ),
    "deepseek-v2": lambda: DeepseekV2Config(
        **{**COMMON, "num_key_value_heads": 4}, **_LATENT, q_lora_rank=None,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5,
    ),
    # Kimi-K2: one group of many experts, a longer context by YaRN, non-interleaved here.
    "kimi-k2": lambda: DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, **_LATENT, q_lora_rank=48,
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rope_parameters=_YARN, rope_interleave=False,
    ),
    "glm4-moe": lambda: Glm4MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5,
    ),
}  # fmt: skip
VARIANTS |= DEEPSEEK_VARIANTS

# Gated DeltaNet layers beside gated full attention (three to one, transformers' default
# full_attention_interval 4), Gemma-style norms, partial rotary; states small enough
# that a 4-token block's page holds one (kv_cache.block_size_for keeps 4).
_RECURRENT = dict(
    **{**COMMON, "num_hidden_layers": 4},
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
RECURRENT_VARIANTS = {
    "qwen3-next": lambda: Qwen3NextConfig(
        **_RECURRENT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[1],
    ),
    "qwen3.5": lambda: Qwen3_5TextConfig(**_RECURRENT),
    "qwen3.5-moe": lambda: Qwen3_5MoeTextConfig(
        **_RECURRENT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
}  # fmt: skip
VARIANTS |= RECURRENT_VARIANTS


def write_checkpoint(name: str, out: Path) -> Path:
    if name == "llama":
        return write_model(out, "tiny", seed=0)
    return write_config(VARIANTS[name](), out)


def write_config(config, out: Path) -> Path:
    """A random checkpoint of a transformers config (the tests' weight scales)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            # Wide weights and random biases/norms: see tools/make_model.py.
            if param.dim() >= 2:  # MoE experts are stacked 3-D in transformers
                param.normal_(0, 0.02 * WEIGHT_SCALE)
            else:
                param.copy_(
                    1.0 + 0.1 * torch.randn_like(param)
                    if param.mean() > 0.5
                    else 0.1 * torch.randn_like(param)
                )
    model.save_pretrained(out)
    return out


def load_reference(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


# Greedy outputs by reference model, then (prompt, length): the fault tests compare
# the same long workloads against the same session-wide reference, at ~4 s of
# transformers decoding (8 s of CPU on 2 cores) per 8 streams when recomputed.
_GREEDY: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def reference_generate(reference, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers generate(), greedy, exactly max_new_tokens (EOS ignored)."""
    outputs = _GREEDY.setdefault(reference, {})
    key = (tuple(token_ids), max_new_tokens)
    if key not in outputs:
        outputs[key] = _generate(reference, token_ids, max_new_tokens)
    return list(outputs[key])


@torch.no_grad()
def _generate(reference, token_ids: list[int], max_new_tokens: int) -> list[int]:
    # eos_token_id=None would fall back to the model's own; an empty list means none.
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2, eos_token_id=[]
    )
    device = next(reference.parameters()).device
    out = reference.generate(
        torch.tensor([token_ids], device=device),
        attention_mask=torch.ones(1, len(token_ids), dtype=torch.long, device=device),
        generation_config=config,
    )
    return out[0, len(token_ids) :].tolist()


TOL = 1e-4  # logits against transformers, fp32


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, 512) for _ in range(length - 1)]


@torch.no_grad()
def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([token_ids])).logits[0, -1].float()


def assert_matches(reference, harness: "Harness", logits: dict[str, torch.Tensor]) -> None:
    assert logits, "nothing sampled"
    for req_id, got in logits.items():
        tokens = harness.requests[req_id].token_ids[:-1]  # before the token just appended
        torch.testing.assert_close(got, reference_logits(reference, tokens), atol=TOL, rtol=0)
