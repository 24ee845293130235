"""Tiny random-weight pooling checkpoints (docs/pooling.md), laid out as the real ones:

- qwen3_embedding: Qwen3-Embedding's. A bare Qwen3Model backbone (no LM head, its
  tensors without the "model." prefix) with sentence-transformers' modules: last-token
  pooling, then normalization; the instruction prompt of its queries in
  config_sentence_transformers.json; Matryoshka sizes (is_matryoshka).

Written from tools/make_model.py's Qwen3 weights, deterministically, with no
sentence-transformers installed; sentence-transformers reads them back as its own
(tests/test_pooling.py compares with it)."""

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tools.make_model import write_json, write_model

# Qwen3-Embedding's query instruction (its documents take none).
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer " \
               "the query\nQuery:"  # fmt: skip


def write_pooling_model(out: Path, size: str = "tiny", seed: int = 0,
                        arch: str = "qwen3_embedding") -> Path:  # fmt: skip
    write_model(out, size, seed, arch="qwen3")
    weights = load_file(str(out / "model.safetensors"))
    backbone = {name.removeprefix("model."): tensor for name, tensor in weights.items()
                if name != "lm_head.weight"}  # fmt: skip
    save_file(backbone, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config |= {"architectures": ["Qwen3Model"], "is_matryoshka": True}
    _sentence_transformers(out, config["hidden_size"])
    write_json(out / "config.json", config)  # last: it marks a complete checkpoint
    for path in out.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return out


def _sentence_transformers(out: Path, hidden_size: int) -> None:
    """The modules sentence-transformers 6 saves for Transformer, Pooling, Normalize."""
    package = "sentence_transformers"
    write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": f"{package}.base.modules.transformer."
         "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{package}.sentence_transformer."
         "modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{package}.base.modules."
         "normalize.Normalize"},
    ])  # fmt: skip
    (out / "1_Pooling").mkdir(exist_ok=True)
    write_json(out / "1_Pooling" / "config.json", {
        "embedding_dimension": hidden_size, "pooling_mode": "lasttoken", "include_prompt": True,
    })  # fmt: skip
    (out / "2_Normalize").mkdir(exist_ok=True)
    write_json(out / "2_Normalize" / "config.json", {
        "module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding",
    })  # fmt: skip
    write_json(out / "sentence_bert_config.json", {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward",
                                     "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings",
    })  # fmt: skip
    write_json(out / "config_sentence_transformers.json", {
        "model_type": "SentenceTransformer", "default_prompt_name": None,
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "similarity_fn_name": "cosine",
    })  # fmt: skip
