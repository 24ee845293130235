"""Whether a checkpoint is a pooling model, and how it pools (docs/pooling.md): from its
sentence-transformers modules (modules.json: a Pooling module, an optional Normalize),
or a bare backbone's architecture (Qwen3Model, LlamaModel: last-token pooling,
normalized, as vLLM pools decoder embedding models). Matryoshka sizes come from
config.json as vLLM reads them: `matryoshka_dimensions` (a list) or `is_matryoshka`
(any size up to the model's)."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flagstop.executor.models.quantization import ConfigError

# sentence-transformers' module types flagstop runs (by their class names: the
# packages moved them between releases).
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    tasks: tuple[str, ...]  # "embed"
    normalize: bool  # the embedding scaled to unit length (a Normalize module)
    embedding_size: int
    matryoshka_dimensions: tuple[int, ...] = ()
    matryoshka_any: bool = False


def pooling_config(model_dir: Path, hf: dict[str, Any], backbone: bool,
                   hidden_size: int) -> PoolingConfig | None:  # fmt: skip
    """backbone: config.json names a bare backbone (Qwen3Model), which pools."""
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
