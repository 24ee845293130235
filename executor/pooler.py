"""Pooling requests' outputs (docs/pooling.md): a pooling model's request computes its
prompt and takes the final hidden state of its last token (last-token pooling, as
Qwen3-Embedding and decoder classifiers and rerankers do), which the step hands back
in place of a sampled token."""

import numpy as np
import torch
import torch.nn.functional as F

from flagstop.executor.sampling_params import Pooling


def pooled_outputs(hidden: torch.Tensor, indices: np.ndarray, params: list[Pooling],
                   failed: list[bool], normalize: bool) -> list[bytes]:  # fmt: skip
    """Per pooling request (the hidden states' row of its last token, its parameters,
    whether the executor failed it): its output as float32 little-endian bytes, empty
    for a failed one. normalize: the model's own, where a request says nothing."""
    last = hidden[torch.from_numpy(indices).to(hidden.device)].float()
    return [b"" if bad else _embed(vector, p, normalize) for vector, p, bad in
            zip(last, params, failed, strict=True)]  # fmt: skip


def _embed(vector: torch.Tensor, p: Pooling, normalize: bool) -> bytes:
    """The embedding: its first `dimensions` values (Matryoshka), then unit length."""
    if p.dimensions:
        vector = vector[: p.dimensions]
    if normalize if p.normalize is None else p.normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.cpu().numpy().astype("<f4").tobytes()
