"""Pooling requests' outputs (docs/pooling.md): a pooling model's request computes its
prompt and takes the final hidden state of its last token (last-token pooling, as
Qwen3-Embedding and decoder classifiers and rerankers do), which the step hands back
in place of a sampled token, as float32 little-endian bytes (empty for a request the
executor failed).

The model's pooler is a component chosen at load (build_pooler): an embedding
model's cuts and normalizes the hidden state, a classification model's applies its
head. A model that generates has NoPooler: the router never sends it a pooling
request."""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.loader import CLASSIFIER_HEAD
from flagstop.executor.models.pooling_config import ClassifierConfig
from flagstop.executor.models.quantization import ConfigError
from flagstop.executor.sampling_params import Pooling
from flagstop.executor.step_inputs import StepInputs

# Where a causal LM keeps its output head's rows: its own, else the tied embeddings
# (a bare backbone's without the prefix).
LM_HEAD = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")


class _Pooler:
    """The seam the model runner calls each step."""

    def outputs(self, batch: InputBatch, inputs: StepInputs) -> list[bytes]:
        """The step's pooling requests' outputs (most steps have none), from the hidden
        states of their last token."""
        if not len(rows := inputs.pooling_rows.tolist()):
            return []
        params = [batch.sampling_params[row].pooling for row in rows]
        failed = [row in batch.failed_rows for row in rows]
        return pooled_outputs(self, inputs.hidden, inputs.pool_indices, params, failed)


class NoPooler(_Pooler):
    """A model that generates: no request of it pools."""

    def pooled(self, last: torch.Tensor, params: list[Pooling]) -> list[bytes]:
        raise AssertionError("a pooling request reached a model that generates")


class EmbeddingPooler(_Pooler):
    """The hidden state itself: its first `dimensions` values (Matryoshka), then unit
    length where the request (else the model: its Normalize module) says."""

    def __init__(self, normalize: bool) -> None:
        self.normalize = normalize

    def pooled(self, last: torch.Tensor, params: list[Pooling]) -> list[bytes]:
        return [self._embed(vector, p) for vector, p in zip(last, params, strict=True)]

    def _embed(self, vector: torch.Tensor, p: Pooling) -> bytes:
        if p.dimensions:
            vector = vector[: p.dimensions]
        if self.normalize if p.normalize is None else p.normalize:
            vector = F.normalize(vector, dim=-1)
        return _bytes(vector)


class ClassifierPooler(_Pooler):
    """The classification head on the hidden state: a logit per class, then each
    class's probability (softmax over them; sigmoid for one class or a multi-label
    model) unless the request asks for the logits. In float32, whatever the model's
    dtype: the head is one small matrix."""

    def __init__(self, weight: torch.Tensor, multi_label: bool) -> None:
        self.weight = weight.float()  # [classes, hidden]
        self.multi_label = multi_label

    def pooled(self, last: torch.Tensor, params: list[Pooling]) -> list[bytes]:
        logits = last @ self.weight.T
        probs = logits.sigmoid() if self.multi_label else logits.softmax(-1)
        return [_bytes(p if param.activation else raw)
                for raw, p, param in zip(logits, probs, params, strict=True)]  # fmt: skip


Pooler = NoPooler | EmbeddingPooler | ClassifierPooler


def build_pooler(config: ModelConfig, model_dir: str | Path, device: torch.device) -> Pooler:
    """The model's pooler; a classifier's head read from its checkpoint whole (every
    rank's the same, whatever the split of the LM head). Raises ConfigError."""
    if (pooling := config.pooling) is None:
        return NoPooler()
    if (head := pooling.classifier) is None:
        return EmbeddingPooler(pooling.normalize)
    weight = classifier_weight(Path(model_dir), head, config.hidden_size)
    return ClassifierPooler(weight.to(device), head.multi_label)


def pooled_outputs(pooler: Pooler, hidden: torch.Tensor, indices: np.ndarray,
                   params: list[Pooling], failed: list[bool]) -> list[bytes]:  # fmt: skip
    """Per pooling request (the hidden states' row of its last token, its parameters,
    whether the executor failed it): its output, empty for a failed one."""
    last = hidden[torch.from_numpy(indices).to(hidden.device)].float()
    outputs = pooler.pooled(last, params)
    return [b"" if bad else out for out, bad in zip(outputs, failed, strict=True)]


def classifier_weight(model_dir: Path, head: ClassifierConfig, hidden_size: int) -> torch.Tensor:
    """[classes, hidden]: the checkpoint's score.weight, or the LM head's rows of the
    tokens the head is made from (their difference for Qwen3-Reranker's one score)."""
    if not head.from_tokens:
        weight = _tensor(model_dir, (CLASSIFIER_HEAD,))
    else:
        weight = _tensor(model_dir, LM_HEAD, _token_ids(model_dir, head.from_tokens))
        if head.token_difference:
            weight = (weight[1] - weight[0])[None]
    if tuple(weight.shape) != (len(head.labels), hidden_size):
        raise ConfigError(f"the classification head is {tuple(weight.shape)}, not "
                          f"{len(head.labels)} classes x {hidden_size}")  # fmt: skip
    return weight


def _token_ids(model_dir: Path, tokens: tuple[str, ...]) -> list[int]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in tokens]
    if None in ids:
        missing = tokens[ids.index(None)]
        raise ConfigError(f"classifier_from_token: {missing!r} is not one token of the "
                          "model's vocabulary")  # fmt: skip
    return ids


def _tensor(model_dir: Path, names: tuple[str, ...], rows: list[int] | None = None
            ) -> torch.Tensor:  # fmt: skip
    """The first of `names` the checkpoint's safetensors files hold (only those rows
    of it: a vocabulary's head is read a row at a time)."""
    found: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found |= {name: file for name in f.keys() if name in names}  # noqa: SIM118
    if not (name := next((n for n in names if n in found), None)):
        raise ConfigError(f"the checkpoint has no {' or '.join(names)} for the "
                          "classification head")  # fmt: skip
    with safe_open(str(found[name]), framework="pt") as f:
        if rows is None:
            return f.get_tensor(name)
        stored = f.get_slice(name)
        return torch.cat([stored[row : row + 1] for row in rows])


def _bytes(vector: torch.Tensor) -> bytes:
    return vector.cpu().numpy().astype("<f4").tobytes()
