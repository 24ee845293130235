"""Tiny random-weight pooling checkpoints (docs/pooling.md), laid out as the real ones:

- qwen3_embedding: Qwen3-Embedding's. A bare Qwen3Model backbone (no LM head, its
  tensors without the "model." prefix) with sentence-transformers' modules: last-token
  pooling, then normalization; the instruction prompt of its queries in
  config_sentence_transformers.json; Matryoshka sizes (is_matryoshka). Written from
  tools/make_model.py's Qwen3 weights, with no sentence-transformers installed;
  sentence-transformers reads them back as its own (tests/test_pooling.py compares).
- qwen3_classifier, qwen2_classifier, llama_classifier: transformers'
  ForSequenceClassification of each family, three sentiment classes.
- qwen3_reranker: Qwen3-Reranker's, a Qwen3ForCausalLM with tied embeddings whose
  vocabulary has "yes" and "no" (the embedded one gains them); served as a scorer with
  RERANKER_OVERRIDES (--hf-overrides, as vLLM serves it).

The last two kinds are made by transformers' own classes, as tools/make_vision_model.py
makes its models: seeded random weights, the 2-D ones WEIGHT_SCALE times wider."""

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tools.make_model import SIZES, WEIGHT_SCALE, embedded_vocabulary, write_json, write_model

# Qwen3-Embedding's query instruction (its documents take none).
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer " \
               "the query\nQuery:"  # fmt: skip


# A classifier's classes; the families' transformers classes (config, model).
SENTIMENTS = ("negative", "neutral", "positive")
CLASSIFIERS = {
    "qwen3_classifier": ("Qwen3Config", "Qwen3ForSequenceClassification"),
    "qwen2_classifier": ("Qwen2Config", "Qwen2ForSequenceClassification"),
    "llama_classifier": ("LlamaConfig", "LlamaForSequenceClassification"),
}
RERANKER = "qwen3_reranker"
ARCHS = ("qwen3_embedding", *CLASSIFIERS, RERANKER)
# How vLLM, and flagstop, serve Qwen3-Reranker: its LM head's "no" and "yes" rows
# become one score, sigmoid(yes - no).
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# Qwen3-Reranker's prompt (its model card's): the query part, then the document's.
RERANK_PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements '
                 'based on the Query and the Instruct provided. Note that the answer can '
                 'only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')  # fmt: skip
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank_query(query: str) -> str:
    return f"{RERANK_PREFIX}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n"


def rerank_document(document: str) -> str:
    return f"<Document>: {document}{RERANK_SUFFIX}"


def write_pooling_model(out: Path, size: str = "tiny", seed: int = 0,
                        arch: str = "qwen3_embedding") -> Path:  # fmt: skip
    if arch in CLASSIFIERS or arch == RERANKER:
        return _write_transformers_model(out, size, seed, arch)
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


def _write_transformers_model(out: Path, size: str, seed: int, arch: str) -> Path:
    """A classifier or the reranker, by transformers' classes, with the embedded
    vocabulary (the reranker's with "yes" and "no")."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = embedded_vocabulary()
    if arch == RERANKER:
        vocab.tokenizer.add_tokens(["yes", "no"])
    config_class, model_class = CLASSIFIERS.get(arch, ("Qwen3Config", "Qwen3ForCausalLM"))
    dims = SIZES[size]
    fields = dict(
        vocab_size=vocab.tokenizer.get_vocab_size(), **dims,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        max_position_embeddings=2048, rms_norm_eps=1e-5, **vocab.ids(),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=arch == RERANKER,  # as Qwen3-Reranker-0.6B's
    )  # fmt: skip
    if arch in CLASSIFIERS:
        fields |= {"id2label": dict(enumerate(SENTIMENTS)),
                   "label2id": {name: i for i, name in enumerate(SENTIMENTS)}}  # fmt: skip
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(WEIGHT_SCALE)
            else:  # norms off their init (a misload shows)
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    _write_vocabulary(out, vocab)
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def _write_vocabulary(out: Path, vocab) -> None:
    vocab.tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "generation_config.json", vocab.ids())
    write_json(out / "special_tokens_map.json", vocab.special)
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False, **vocab.special,
    })  # fmt: skip
