"""Whether a checkpoint is a pooling model, and how it pools (docs/pooling.md).

An embedding model: from its sentence-transformers modules (modules.json: a Pooling
module, an optional Normalize), or a bare backbone's architecture (Qwen3Model,
LlamaModel: last-token pooling, normalized, as vLLM pools decoder embedding models).
Matryoshka sizes come from config.json as vLLM reads them: `matryoshka_dimensions` (a
list) or `is_matryoshka` (any size up to the model's).

A classification model: a sequence classifier's architecture (Qwen3ForSequenceClassification:
its `score` head on the last token), or a causal LM's head cut to some tokens'
rows by vLLM's config fields (`classifier_from_token`; with
`is_original_qwen3_reranker`, "yes" minus "no": Qwen3-Reranker's one score)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flagstop.executor.models.quantization import ConfigError

# sentence-transformers' module types flagstop runs (by their class names: the
# packages moved them between releases).
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    """Where a classification model's head comes from, and its classes."""

    labels: tuple[str, ...]  # by index
    # sigmoid per class (one class, or a multi-label model); else softmax over them
    multi_label: bool
    # The causal LM head's rows of these tokens (none: the checkpoint's score.weight),
    # and whether the head is their second minus their first (Qwen3-Reranker's).
    from_tokens: tuple[str, ...] = ()
    token_difference: bool = False


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    tasks: tuple[str, ...]  # "embed"; "classify" (and "score": one class)
    normalize: bool  # the embedding scaled to unit length (a Normalize module)
    embedding_size: int
    matryoshka_dimensions: tuple[int, ...] = ()
    matryoshka_any: bool = False
    classifier: ClassifierConfig | None = None  # a classification model's


def pooling_config(model_dir: Path, hf: dict[str, Any], backbone: bool, classifier: bool,
                   hidden_size: int) -> PoolingConfig | None:  # fmt: skip
    """backbone: config.json names a bare backbone (Qwen3Model), which pools;
    classifier: a sequence classifier (Qwen3ForSequenceClassification)."""
    if classifier:
        head = classifier_config(hf)
        tasks = ("classify", "score") if len(head.labels) == 1 else ("classify",)
        return PoolingConfig(tasks, False, hidden_size, classifier=head)
    modules = model_dir / "modules.json"
    if modules.exists():
        normalize = _sentence_transformers(model_dir, json.loads(modules.read_text()))
    elif backbone:
        normalize = True
    else:
        return None
    listed = tuple(sorted(hf.get("matryoshka_dimensions") or ()))
    return PoolingConfig(("embed",), normalize, hidden_size, listed,
                         bool(hf.get("is_matryoshka")) and not listed)  # fmt: skip


def _sentence_transformers(model_dir: Path, modules: list[dict]) -> bool:
    """Whether its modules normalize. Raises ConfigError for a pipeline flagstop does
    not run exactly (another pooling mode, a Dense projection)."""
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if unknown := [k for k in kinds if k not in (TRANSFORMER, POOLING, NORMALIZE)]:
        raise ConfigError(f"modules.json: sentence-transformers module {unknown[0]!r} is not "
                          "one flagstop runs (Transformer, Pooling, Normalize)")  # fmt: skip
    if POOLING not in kinds:
        raise ConfigError("modules.json lists no Pooling module: nothing says how to pool")
    path = modules[kinds.index(POOLING)]["path"]
    config = json.loads((model_dir / path / "config.json").read_text())
    mode = config.get("pooling_mode") or next(
        (k.removeprefix("pooling_mode_") for k, v in config.items()
         if k.startswith("pooling_mode_") and v is True), None)  # fmt: skip
    if mode not in ("lasttoken", "last_token"):
        raise ConfigError(f"{path}/config.json: pooling mode {mode!r}; flagstop pools the "
                          "last token (decoder embedding models)")  # fmt: skip
    return NORMALIZE in kinds


def classifier_config(hf: dict[str, Any]) -> ClassifierConfig:
    """A sequence classifier's classes (id2label, else num_labels as LABEL_i) and head."""
    tokens = tuple(hf.get("classifier_from_token") or ())
    difference = bool(hf.get("is_original_qwen3_reranker"))
    if difference and len(tokens) != 2:
        raise ConfigError("is_original_qwen3_reranker needs classifier_from_token to name "
                          f"two tokens (no, yes), not {list(tokens)}")  # fmt: skip
    num_labels = 1 if difference else len(tokens) or hf.get("num_labels") or len(
        hf.get("id2label") or {}) or 2  # transformers' default  # fmt: skip
    names = {int(k): v for k, v in (hf.get("id2label") or {}).items()}
    labels = tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels))
    multi = num_labels == 1 or hf.get("problem_type") == "multi_label_classification"
    return ClassifierConfig(labels, multi, tokens, difference)
