import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# architecture -> (q/k/v always biased, per-head q/k RMSNorm); otherwise the
# config's attention_bias applies to q/k/v and o alike.
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # Sliding-window attention is not implemented: a window caps the usable length.
    max_model_len: int

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        # generation_config.json's EOS ids win: chat models list their turn-end there.
        generation = Path(model_dir) / "generation_config.json"
        generation_config = json.loads(generation.read_text()) if generation.exists() else {}
        return cls.from_hf(hf, generation_config.get("eos_token_id"))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos: int | list[int] | None = None) -> "ModelConfig":
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = ARCHITECTURES[architecture]
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_len = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if eos is None:
            eos = hf.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_len,
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            qkv_bias=qkv_bias or hf.get("attention_bias", False),
            o_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=qk_norm,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
            max_model_len=min(max_len, window) if window else max_len,
        )
