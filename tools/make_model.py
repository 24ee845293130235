"""Write the embedded default model: a seeded random-weight Llama checkpoint with a
locally trained byte-level BPE tokenizer, in the normal Hugging Face layout; with
--arch, a Mixture-of-Experts one (Qwen3-MoE or Mixtral) of the same size class, for
tests and benches of the sparse path, or one of mixed attention (Gemma 3: sliding-window
layers beside full ones), gpt-oss (sinks, YaRN, biased experts), DeepSeek-V3 (latent
attention, its routing), GLM-4.5 (V3's MoE under GQA with partial rotary), Qwen3-Next
(gated DeltaNet layers) or Granite (the Llama block with its multipliers).

    python -m tools.make_model [--size nano|tiny|small]
                               [--arch llama|qwen3_moe|mixtral|gemma3|gpt_oss|
                                       deepseek_v3|glm4_moe|qwen3_next|granite]
                               [--out DIR] [--seed N] [--thinking] [--harmony]

The default initialisation (std 0.02) makes greedy continuations collapse into short
loops, which a broken KV cache can still reproduce; the 2-D weights are therefore drawn
WEIGHT_SCALE times wider (std 0.02 x 6), which gives long non-repeating continuations
and wide top-1/top-2 logit gaps: a discriminating test subject."""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

WEIGHT_SCALE = 6.0
VOCAB_SIZE = 512
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# A plain chat template, so that the embedded model serves /v1/chat/completions: each
# message as <|role|> and its text, then the assistant's turn. Loaded by transformers
# (and so by the router) from chat_template.jinja, like any checkpoint's own. Tools
# as Hermes and Qwen templates write them (the router's --tool-call-parser hermes):
# their signatures in <tools>, an assistant's calls as <tool_call>{"name", "arguments"}
# </tool_call>, a tool's reply in <tool_response>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\\nYou may call these tools:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nTo call one, write <tool_call>{"name": NAME, "arguments": '
    "ARGS}</tool_call>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|tool|>\\n<tool_response>' + message['content'] + '</tool_response>\\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}</tool_call>' }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# --thinking: the model writes its reasoning between <think> and </think> (added tokens,
# not special ones, as Qwen3's are), and its template takes Qwen3's switch: with
# enable_thinking false it writes an empty reasoning block after the assistant's turn
# opens, so that the model answers at once. Served with --reasoning-parser qwen3.
THINK, END_THINK = "<think>", "</think>"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|assistant|>\\n' }}{% endif %}",
    "{{ '<|assistant|>\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
)

SIZES = {
    # For a 201,088-token vocabulary (gpt-oss' own, --harmony): its embeddings and head
    # are most of the model, 26M parameters at this width.
    "nano": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}

# Mixture-of-Experts variants: 8 experts of a quarter of the dense MLP's size, 2 a token
# (about the active share of Qwen3-30B-A3B's 128 of 768 and top-8).
ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "use_sliding_window": False},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "use_sliding_window": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "sliding_window": None},
    # Gemma 3 (text): local layers of a 64-token window, every sixth global (the last
    # of 4 at tiny), each with its RoPE base; sandwich and q/k norms (Gemma's 1 + w).
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "sliding_window": 64, "hidden_activation": "gelu_pytorch_tanh",
               "rope_parameters": {"full_attention": {"rope_type": "default",
                                                      "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10_000.0}}},
    # gpt-oss: 128-token window layers alternating with full ones, sinks, attention
    # biases, YaRN; 8 experts top-2 with biases and the clamped SwiGLU, stacked.
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0,
                                    "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False,  # 2048 = 32 x 64 positions
                                    "original_max_position_embeddings": 64}},
    # DeepSeek-V3's shape (docs/mla.md): latent attention (a query rank, a latent of
    # kv_lora_rank and a shared rotated key, interleaved), the first layer dense, then
    # 8 experts top-2 in 4 groups of which 2 are chosen, sigmoid scores with a
    # correction bias, one shared expert, routed_scaling_factor 2.5.
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "rope_interleave": True, "n_group": 4, "topk_group": 2,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "first_k_dense_replace": 1, "n_shared_experts": 1,
                    "num_nextn_predict_layers": 1, "head_dim": 16},  # transformers': rope's
    # GLM-4.5's: V3's MoE (one group) under GQA with half the head rotated, q/k norms
    # and q/k/v biases.
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                 "use_qk_norm": True, "attention_bias": True, "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                 "first_k_dense_replace": 1, "n_shared_experts": 1,
                 "num_nextn_predict_layers": 0,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5}},
    # Qwen3-Next's (docs/recurrent.md): gated DeltaNet layers, every fourth full
    # attention (gated, a quarter of each head rotated, (1 + w) norms), 8 experts top-2
    # with a gated shared expert in every layer.
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                   "full_attention_interval": 4, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.25}},
    # IBM Granite's: the Llama block with its four multipliers (docs/models.md).
    "granite": {"architectures": ["GraniteForCausalLM"], "model_type": "granite",
                "embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
                "residual_multiplier": 0.22, "logits_scaling": 8.0},
}  # fmt: skip
# Vision-language models (tools/make_vision_model.py: made by transformers' classes).
VISION_ARCHS = ("qwen2_5_vl", "qwen3_vl", "gemma3_vl")
# Pooling models (tools/make_pooling_model.py).
POOLING_ARCHS = ("qwen3_embedding", "qwen3_classifier", "qwen2_classifier", "llama_classifier",
                 "qwen3_reranker")  # fmt: skip
DEEPSEEK_LAYOUT = ("deepseek_v3", "glm4_moe")  # routed + shared experts, first layer dense
GEMMA_PATTERN = 6  # a global layer after every 5 local ones
NUM_EXPERTS, EXPERTS_PER_TOKEN = 8, 2


def default_out(size: str, arch: str) -> Path:
    return Path("models") / (f"flagstop-{size}" + ("" if arch == "llama" else f"-{arch}"))


# Training text for the tokenizer: plain English about the product, so that prompts in
# tests and demos tokenize into a realistic mix of merged and single-byte tokens.
CORPUS = """\
A continuous batching server keeps the accelerator busy by letting requests join and
leave the running batch at every decoding step. The scheduler owns the waiting and
running queues, the token budget of each step and the accounting of key and value
cache blocks. When the cache runs out of blocks, the newest request is preempted: its
blocks are freed and it is computed again later from its prompt and its tokens so far.
Prefix caching lets requests that share a system prompt reuse the blocks that hold it.
The router tokenizes prompts, validates parameters, queues requests and streams text
back to every client as soon as each token is sampled. The executor runs one flattened
forward pass per step over prefill chunks and decodes, writes keys and values into a
paged cache by slot mapping, and samples the next token of every request.
Once upon a time, a small model learned to count: one, two, three, four, five, six,
seven, eight, nine, ten. It wrote poems about the sea, the wind and the mountains, and
it answered questions: What is the capital of France? Paris. How many days are in a
week? Seven. Numbers like 2026, 3.14159 and 1,000,000 appear in text; so do symbols
such as (parentheses), [brackets], {braces}, "quotes", 'apostrophes', and e-mail
addresses like hello@example.com or paths like /usr/local/bin/python3.
"""


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Llama-style: the tokenizer adds BOS in front of every prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def model_config(size: str, vocab: "Vocabulary", arch: str = "llama") -> dict:
    dims = SIZES[size]
    return {
        "vocab_size": vocab.tokenizer.get_vocab_size(),
        **dims,
        **moe_fields(arch, dims["intermediate_size"] // 4),
        **gemma_fields(arch, dims),
        **latent_fields(arch, dims),
        "head_dim": dims["hidden_size"] // dims["num_attention_heads"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        **({} if arch in ("gemma3", "gpt_oss") else {"hidden_act": "silu", "rope_theta": 10000.0}),
        **({"attention_bias": False} if arch != "glm4_moe" else {}),
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **vocab.ids(),
        "torch_dtype": "float32",
        **ARCHS[arch],  # last: an architecture's own fields win
    }


def gemma_fields(arch: str, dims: dict) -> dict:
    """Gemma 3's and gpt-oss' layer types (and Gemma's query scale)."""
    if arch == "gpt_oss":
        n = dims["num_hidden_layers"]
        return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(n)]}  # fmt: skip
    if arch != "gemma3":
        return {}
    n = dims["num_hidden_layers"]
    pattern = min(GEMMA_PATTERN, n)
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return {"layer_types": types, "query_pre_attn_scalar": dims["hidden_size"]
            // dims["num_attention_heads"]}  # fmt: skip


def latent_fields(arch: str, dims: dict) -> dict:
    """DeepSeek-V3's latent attention at the size: the latent a quarter of the hidden
    size (V3: 512 of 7168, with 128 heads), a rotated key of 16, heads of 32 + 16."""
    if arch != "deepseek_v3":
        return {}
    h = dims["hidden_size"]
    return {"q_lora_rank": 3 * h // 8, "kv_lora_rank": h // 4, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32,
            "num_key_value_heads": dims["num_attention_heads"]}  # fmt: skip


def moe_fields(arch: str, expert_size: int) -> dict:
    if arch in DEEPSEEK_LAYOUT:
        return {"n_routed_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
                "moe_intermediate_size": expert_size}  # fmt: skip
    if arch in ("qwen3_moe", "qwen3_next"):
        shared = {"shared_expert_intermediate_size": expert_size} if arch == "qwen3_next" else {}
        return {"num_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
                "moe_intermediate_size": expert_size, **shared}  # fmt: skip
    if arch in ("mixtral", "gpt_oss"):  # their intermediate_size is each expert's
        return {"num_local_experts": NUM_EXPERTS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
                "intermediate_size": expert_size}  # fmt: skip
    return {}


def mlp_shapes(config: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors: dense, or a router and its experts (Qwen's names, or
    Mixtral's block_sparse_moe w1/w3/w2)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    arch = config["model_type"]
    layer = int(prefix.split(".")[2])
    dense = ("llama", "qwen3", "gemma3_text", "granite")
    if arch in dense or layer < config.get("first_k_dense_replace", 0):
        return {f"{prefix}mlp.{n}_proj.weight": s for n, s in
                (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}  # fmt: skip
    if arch == "gpt_oss":  # stacked, gate and up interleaved; a biased router
        e, b, x = NUM_EXPERTS, f"{prefix}mlp.", f"{prefix}mlp.experts."
        return {f"{b}router.weight": (e, h), f"{b}router.bias": (e,),
                f"{x}gate_up_proj": (e, h, 2 * i), f"{x}gate_up_proj_bias": (e, 2 * i),
                f"{x}down_proj": (e, i, h), f"{x}down_proj_bias": (e, h)}  # fmt: skip
    if arch == "mixtral":
        block, names = f"{prefix}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj")
        i = config["moe_intermediate_size"]
    shapes = {f"{block}gate.weight": (NUM_EXPERTS, h)}
    if arch == "qwen3_next":  # a shared expert, scaled by its sigmoid gate
        shapes |= {
            f"{block}shared_expert.{n}.weight": s
            for n, s in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))
        }
        shapes[f"{block}shared_expert_gate.weight"] = (1, h)
    if arch in DEEPSEEK_LAYOUT:  # the routing's correction bias, the shared experts
        shared = i * config["n_shared_experts"]
        shapes[f"{block}gate.e_score_correction_bias"] = (NUM_EXPERTS,)
        shapes |= {
            f"{block}shared_experts.{n}.weight": s
            for n, s in (
                ("gate_proj", (shared, h)),
                ("up_proj", (shared, h)),
                ("down_proj", (h, shared)),
            )
        }
    for e in range(NUM_EXPERTS):
        for name, shape in zip(names, ((i, h), (i, h), (h, i)), strict=True):
            shapes[f"{block}experts.{e}.{name}.weight"] = shape
    return shapes


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, v = config["hidden_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            **mixer_shapes(config, p, n),
            **mlp_shapes(config, p),
        }  # fmt: skip
        if config["model_type"] == "glm4_moe":  # biased q/k/v
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,)
                       for n, size in (("q", q), ("k", kv), ("v", kv))}  # fmt: skip
        if config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text", "glm4_moe"):  # q/k norm
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if config["model_type"] == "gpt_oss":  # biased attention, sinks
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,)
                       for n, size in (("q", q), ("k", kv), ("v", kv), ("o", h))}  # fmt: skip
            shapes[p + "self_attn.sinks"] = (config["num_attention_heads"],)
        if config["model_type"] == "gemma3_text":  # the MLP's sandwich
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,),
                       p + "post_feedforward_layernorm.weight": (h,)}  # fmt: skip
    if config.get("num_nextn_predict_layers"):  # DeepSeek's prediction layer, after the rest
        shapes |= prediction_layer_shapes(config)
    return shapes


def mixer_shapes(config: dict, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """A layer's attention (latent, or Qwen3-Next's gated: q_proj twice the heads) or
    gated DeltaNet tensors (Qwen3-Next's names)."""
    h, d = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    if "kv_lora_rank" in config:
        return latent_shapes(config, p)
    if config["model_type"] != "qwen3_next":
        return {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
    if (layer + 1) % config["full_attention_interval"] == 0:
        a = p + "self_attn."
        return {a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h),
                a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
                a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}  # fmt: skip
    keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    heads = config["linear_num_value_heads"]
    values = heads * config["linear_value_head_dim"]
    a = p + "linear_attn."
    return {a + "in_proj_qkvz.weight": (2 * keys + 2 * values, h),
            a + "in_proj_ba.weight": (2 * heads, h),
            a + "conv1d.weight": (2 * keys + values, 1, config["linear_conv_kernel_dim"]),
            a + "dt_bias": (heads,), a + "A_log": (heads,),
            a + "norm.weight": (config["linear_value_head_dim"],),
            a + "out_proj.weight": (h, values)}  # fmt: skip


def prediction_layer_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """model.layers.{num_hidden_layers}: a decoder layer (sparse, latent) with enorm,
    hnorm, eh_proj, shared_head and its own embedding (DeepSeek-V3's layout; the
    speculative method mtp drafts with it)."""
    h, v, n = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    p = f"model.layers.{n}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            **latent_shapes(config, p), **mlp_shapes(config, p),
            p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
            p + "shared_head.norm.weight": (h,), p + "shared_head.head.weight": (v, h),
            p + "embed_tokens.weight": (v, h)}  # fmt: skip


def latent_shapes(config: dict, p: str) -> dict[str, tuple[int, ...]]:
    """A latent attention layer's tensors (DeepSeek-V3's names)."""
    h, heads, a = config["hidden_size"], config["num_attention_heads"], p + "self_attn."
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = (config[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    return {a + "q_a_proj.weight": (q_rank, h), a + "q_a_layernorm.weight": (q_rank,),
            a + "q_b_proj.weight": (heads * (nope + rope), q_rank),
            a + "kv_a_proj_with_mqa.weight": (kv_rank + rope, h),
            a + "kv_a_layernorm.weight": (kv_rank,),
            a + "kv_b_proj.weight": (heads * (nope + v), kv_rank),
            a + "o_proj.weight": (h, heads * v)}  # fmt: skip


def random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    # One generator per tensor, seeded by its name's rank: the same checkpoint on every
    # machine, whatever the order in which tensors are created.
    weights = {}
    for index, (name, shape) in enumerate(sorted(tensor_shapes(config).items())):
        generator = torch.Generator().manual_seed(seed * 100_003 + index)
        noise = torch.randn(shape, generator=generator)
        # Norm weights around 1 (not exactly 1) so that a misloaded norm shows; biases
        # and sinks around 0.
        if len(shape) >= 2:
            weights[name] = noise * 0.02 * WEIGHT_SCALE
        elif name.endswith(("bias", "sinks")):
            weights[name] = 0.1 * noise
        else:
            weights[name] = 1.0 + 0.1 * noise
    return weights


@dataclass(slots=True)
class Vocabulary:
    """A checkpoint's tokenizer and what its configs say of it."""

    tokenizer: Tokenizer
    special: dict[str, str]  # bos_token, eos_token, pad_token
    ends: list[str]  # the tokens that end a turn: generation_config's eos_token_id
    template: str | None  # the chat template (None: the model has its own format)

    def ids(self) -> dict[str, int | list[int]]:
        ids: dict[str, int | list[int]] = {
            f"{name.removesuffix('_token')}_token_id": self.tokenizer.token_to_id(text)
            for name, text in self.special.items()
        }
        ends = [self.tokenizer.token_to_id(text) for text in self.ends]
        ids["eos_token_id"] = ends[0] if len(ends) == 1 else ends
        return ids


def embedded_vocabulary(thinking: bool = False) -> Vocabulary:
    tokenizer = train_tokenizer()
    if thinking:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t in (THINK, END_THINK)])  # fmt: skip
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    return Vocabulary(tokenizer, special, [EOS], THINKING_TEMPLATE if thinking else CHAT_TEMPLATE)


def harmony_vocabulary() -> Vocabulary:
    """gpt-oss' own tokenizer (o200k_harmony: 201,088 ids), so that openai-harmony's
    token ids are the model's; no chat template (the router renders harmony with
    --reasoning-parser openai_gptoss). Needs the o200k_base vocabulary
    (tools/harmony_vocab.py fetches it)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    from flagstop.router.openai.harmony_vocab import use_vocab
    from tools.harmony_vocab import ensure_vocab
    from tools.o200k_tokenizer import NUM_TOKENS, o200k_harmony

    vocab_dir = use_vocab(ensure_vocab())
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    first_special = NUM_TOKENS - 1090  # 199998, <|startoftext|>
    specials = {i: encoding.decode([i]) for i in range(first_special, NUM_TOKENS)}
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
               "pad_token": "<|endoftext|>"}  # fmt: skip
    ends = ["<|return|>", "<|endoftext|>", "<|call|>"]  # gpt-oss' generation_config
    return Vocabulary(o200k_harmony(vocab_dir, specials), special, ends, None)


def write_model(
    out: Path, size: str = "tiny", seed: int = 0, arch: str = "llama", thinking: bool = False,
    harmony: bool = False, overrides: dict | None = None,
) -> Path:  # fmt: skip
    """overrides: config fields over the architecture's (a bench's variant of it)."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = harmony_vocabulary() if harmony else embedded_vocabulary(thinking)
    config = {**model_config(size, vocab, arch), **(overrides or {})}
    save_file(
        random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    vocab.tokenizer.save(str(out / "tokenizer.json"))
    ids = vocab.ids()
    write_json(out / "generation_config.json", ids)
    write_json(out / "special_tokens_map.json", vocab.special)
    if vocab.template is not None:
        (out / "chat_template.jinja").write_text(vocab.template + "\n")
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 2048,
            "clean_up_tokenization_spaces": False,
            **vocab.special,
        },
    )
    # Last: its presence is what marks a complete checkpoint (make model's target).
    write_json(out / "config.json", config)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; other users (containers) read it too
    return out


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.make_model", description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--arch", choices=sorted([*ARCHS, *VISION_ARCHS, *POOLING_ARCHS]),
                        default="llama")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="default: models/flagstop-SIZE[-ARCH]"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--thinking",
        action="store_true",
        help="a thinking model: <think> tokens and Qwen3's enable_thinking",
    )
    parser.add_argument(
        "--harmony",
        action="store_true",
        help="gpt_oss: gpt-oss' own tokenizer (o200k_harmony), for harmony",
    )
    parser.add_argument("--if-missing", action="store_true", help="keep a complete model as is")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    out = args.out or default_out(args.size, args.arch)
    if args.if_missing and (out / "config.json").exists():
        print(f"{out} is there")
        return
    if args.arch in VISION_ARCHS:
        from tools.make_vision_model import write_vision_model

        model = write_vision_model(out, args.size, args.seed, arch=args.arch)
    elif args.arch in POOLING_ARCHS:
        from tools.make_pooling_model import write_pooling_model

        model = write_pooling_model(out, args.size, args.seed, arch=args.arch)
    else:
        model = write_model(out, args.size, args.seed, args.arch, args.thinking, args.harmony)
    print(f"wrote {model}")


if __name__ == "__main__":
    main()
