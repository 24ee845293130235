"""An EAGLE-3 draft head for a target checkpoint (docs/speculative.md), in the
original EAGLE-3 layout: config.json of a one-layer LlamaForCausalLMEagle3 with the
target's sizes and `eagle_config.eagle_aux_hidden_state_layer_ids`, and
model.safetensors with the layer under `midlayer.` (its q/k/v reading twice the
hidden size, its hidden_norm), fc (3 x hidden -> hidden), norm, lm_head over a draft
vocabulary of half the target's, d2t and t2d, and its own embed_tokens (a copy of the
target's). --layout speculators writes the same weights as the speculators library
lays an Eagle3Speculator out (its config's transformer_layer_config and
speculators_config, the layer under `layers.0.`). --layout eagle1 writes an EAGLE-1
head instead (write_eagle1_head; the speculative method `eagle`).

    python -m tools.make_eagle_head --target models/flagstop-tiny --out DIR
        [--layout speculators|eagle1] [--small-target DIR]

Its weights are seeded random, WEIGHT_SCALE times wider as make_model's: a head for
loading and lossless tests, whose drafts are rarely accepted. The draft vocabulary
is every other target token (d2t[i] = i: draft i is target 2i)."""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tools.make_model import WEIGHT_SCALE, write_json, write_model


def aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high: vLLM's default for a Llama target (2, L/2, L-3), or in a
    target too small for three of those the first, middle and last layers' inputs."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return sorted({0, num_layers // 2, num_layers - 1})


def write_eagle_head(target: Path, out: Path, seed: int = 0, layout: str = "eagle",
                     own_embed: bool = True) -> Path:  # fmt: skip
    """A random head for `target` in `layout`; own_embed: with a copy of the target's
    embedding (published heads come both ways)."""
    config = json.loads((target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inner, layers = config["intermediate_size"], aux_layers(config["num_hidden_layers"])
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02 * WEIGHT_SCALE

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=g)

    draft_vocab = vocab // 2
    p = "midlayer."
    tensors = {
        p + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(inner, hidden),
        p + "mlp.up_proj.weight": rand(inner, hidden),
        p + "mlp.down_proj.weight": rand(hidden, inner),
        p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        "fc.weight": rand(hidden, len(layers) * hidden), "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, hidden),
        "embed_tokens.weight": load_file(target / "model.safetensors")[
            "model.embed_tokens.weight"].clone(),
        "d2t": torch.arange(draft_vocab),
        "t2d": torch.arange(vocab) % 2 == 0,
    }  # fmt: skip
    if not own_embed:
        del tensors["embed_tokens.weight"]
    write_head(out, tensors, head_config(config, draft_vocab, layers, target, layout), layout)
    return out


# The embedded model's architecture at a quarter of its width, with Llama 3's RoPE base:
# the target of the heads in tests/data/eagle3 (small, since they are committed).
SMALL_TARGET = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 32, "rope_theta": 500000.0}  # fmt: skip

# The target's config fields a head's layer config keeps.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "vocab_size", "bos_token_id", "eos_token_id", "hidden_act")  # fmt: skip


def layer_fields(target_config: dict) -> dict:
    """The target's fields a head's layer keeps; its RoPE base where the target keeps
    it in rope_parameters (the head's own RoPE is plain)."""
    fields = {k: target_config[k] for k in LAYER_FIELDS if k in target_config}
    rope = target_config.get("rope_parameters") or {}
    return {"rope_theta": rope.get("rope_theta", 10000.0)} | fields


def head_config(target_config: dict, draft_vocab: int, layers: list[int], target: Path,
                layout: str) -> dict:  # fmt: skip
    """config.json of a head in the layout: the original (a one-layer Llama with
    eagle_config) or speculators' (Eagle3Speculator)."""
    layer = {**layer_fields(target_config),
             "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
             "num_hidden_layers": 1, "tie_word_embeddings": False}  # fmt: skip
    if layout == "eagle":
        return {**layer, "draft_vocab_size": draft_vocab,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers,
                                 "use_aux_hidden_state": True}}  # fmt: skip
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": draft_vocab, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layers,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": str(target),
                         "architectures": target_config["architectures"]},
        },
    }  # fmt: skip


def write_head(out: Path, tensors: dict, config: dict, layout: str) -> None:
    """The tensors (the original layout's names) and config.json, in the layout."""
    if layout == "speculators":
        tensors = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)


def write_eagle1_head(target: Path, out: Path, seed: int = 0, own_embed: bool = False) -> Path:
    """A random EAGLE-1 head for `target`, as SafeAILab's are written: config.json of
    a one-layer Llama, pytorch_model.bin with fc (and its bias) over [embedding,
    state] and the layer under `layers.0.` without an input norm."""
    config = json.loads((target / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02 * WEIGHT_SCALE

    p = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden),
        p + "self_attn.q_proj.weight": rand(q, hidden),
        p + "self_attn.k_proj.weight": rand(kv, hidden),
        p + "self_attn.v_proj.weight": rand(kv, hidden),
        p + "self_attn.o_proj.weight": rand(hidden, q),
        p + "mlp.gate_proj.weight": rand(inner, hidden),
        p + "mlp.up_proj.weight": rand(inner, hidden),
        p + "mlp.down_proj.weight": rand(hidden, inner),
        p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
    }  # fmt: skip
    if own_embed:
        tensors["embed_tokens.weight"] = load_file(target / "model.safetensors")[
            "model.embed_tokens.weight"].clone()  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, out / "pytorch_model.bin")
    write_json(out / "config.json", {**layer_fields(config),
                                     "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                     "num_hidden_layers": 1})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.make_eagle_head", description=__doc__)
    parser.add_argument("--target", type=Path, default=Path("models/flagstop-tiny"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=("eagle", "speculators", "eagle1"), default="eagle",
                        help="eagle1: an EAGLE-1 head (method eagle)")  # fmt: skip
    parser.add_argument("--small-target", type=Path, help="write a SMALL_TARGET there first")
    args = parser.parse_args()
    target = args.target
    if args.small_target:
        target = write_model(args.small_target, overrides=SMALL_TARGET)
    if args.layout == "eagle1":
        print(f"wrote {write_eagle1_head(target, args.out, args.seed)}")
    else:
        print(f"wrote {write_eagle_head(target, args.out, args.seed, args.layout)}")


if __name__ == "__main__":
    main()
