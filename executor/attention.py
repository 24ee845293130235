"""Attention over the paged KV cache for one flattened step.

The batch is laid out decodes first (one token each), then prefill chunks, so that each
kind runs as one kernel call. A backend is a kernels module with the functions (and
signatures) of kernels/torch_attention.py; its kv_cache_shape() says how the model runner
lays out the cache it reads."""

import os
from dataclasses import dataclass, field
from types import ModuleType

import torch

from flagstop.kernels import torch_attention


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] cached + new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    # Per prefill token, the last key position it sees, where some see past their own
    # (an image's tokens see the whole image: Gemma 3's bidirectional images); None:
    # causal, each its own position.
    prefill_key_limits: torch.Tensor | None = None
    # The decode rows and the prefill rows, cut once a step: every layer passes the same
    # tensors, so a backend may keep what it derives from them for the other layers.
    decode: tuple[torch.Tensor, torch.Tensor] = field(init=False)  # block tables, seq lens
    prefill: tuple[torch.Tensor, ...] = field(init=False)  # ... and query_start_loc

    def __post_init__(self) -> None:
        n = self.num_decodes
        self.decode = (self.block_tables[:n], self.seq_lens[:n])
        self.prefill = (self.block_tables[n:], self.query_start_loc[n:] - n, self.seq_lens[n:])


def attention_backend(name: str, device: torch.device) -> ModuleType:
    """The kernels module for a backend name: `torch` (kernels/torch_attention.py, the CPU
    path) or `triton` (kernels/triton_attention.py, imported only when chosen)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return torch_attention
    if name != "triton":
        raise ValueError(f"unknown attention backend {name!r}: auto, torch or triton")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs CUDA (or TRITON_INTERPRET=1, for tests)")
    from flagstop.kernels import triton_attention

    return triton_attention


def paged_attention(
    backend: ModuleType,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    fp8_scales: "FP8Scales | None" = None,
    band: "Band | None" = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]: store the new K/V, then
    attend to everything cached (the new tokens included; a window layer's band of
    it). fp8_scales: an FP8 cache's (see fp8_cache)."""
    if fp8_scales is not None:
        return fp8_cache(backend, query, key, value, kv_cache, meta, scale, fp8_scales, band)
    k_cache, v_cache = kv_cache
    backend.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    n = meta.num_decodes
    decode, prefill = backend.paged_attention_decode, backend.paged_attention_prefill
    kwargs = {} if band is None else {"window": band.window, "sinks": band.sinks,
                                      "softcap": band.softcap}  # fmt: skip
    if n == query.shape[0]:
        return decode(query, k_cache, v_cache, *meta.decode, scale, **kwargs)
    out = torch.empty_like(query)
    if n:
        out[:n] = decode(query[:n], k_cache, v_cache, *meta.decode, scale, **kwargs)
    block_tables, query_start_loc, seq_lens = meta.prefill
    if meta.prefill_key_limits is not None:
        kwargs["key_limits"] = meta.prefill_key_limits
    out[n:] = prefill(query[n:], k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                      **kwargs)  # fmt: skip
    return out


@dataclass(slots=True, frozen=True)
class Band:
    """What a layer's queries see beyond causality: a sliding window (0: all keys),
    per-head sink logits (gpt-oss; None: none), and the scores' soft cap (Gemma 2:
    cap * tanh(score / cap); 0: none). A layer without any passes None and the
    backends take their plain kernels."""

    window: int = 0
    sinks: torch.Tensor | None = None
    softcap: float = 0.0

    @classmethod
    def of(cls, window: int, sinks: torch.Tensor | None, softcap: float = 0.0) -> "Band | None":
        if window or sinks is not None or softcap:
            return cls(window, sinks, softcap)
        return None


FP8 = torch.float8_e4m3fn


@dataclass(slots=True, frozen=True)
class FP8Scales:
    """An FP8 cache's per-KV-head scales, shaped once to broadcast over [T, heads, D]:
    K and V are divided by theirs into the cache; the query is multiplied by K's and
    the output by V's, repeated over each KV head's query heads."""

    key: torch.Tensor  # [1, KVH, 1]
    value: torch.Tensor
    query: torch.Tensor  # [1, H, 1]
    output: torch.Tensor

    @classmethod
    def of(cls, kv_scale: torch.Tensor, num_heads: int) -> "FP8Scales":
        """kv_scale [2, KVH] float32: K's row, then V's."""
        group = num_heads // kv_scale.shape[1]
        k, v = (s[None, :, None] for s in kv_scale)
        return cls(k, v, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def fp8_cache(backend, query, key, value, kv_cache, meta, scale, scales: FP8Scales, band=None):
    """Attention on an e4m3 cache holding K / k_scale and V / v_scale (per KV head). The
    kernels read it as plain values: softmax(q . (s_k k)) = softmax((s_k q) . k) and
    sum p (s_v v) = s_v sum p v, so the query is scaled before and the output after,
    and the kernels need no scales. K and V are quantized here (torch's conversion
    saturates at +-448) for either backend, so both hold the same bytes."""
    key = (key.float() / scales.key).to(FP8)
    value = (value.float() / scales.value).to(FP8)
    scaled = (query.float() * scales.query).to(query.dtype)
    out = paged_attention(backend, scaled, key, value, kv_cache, meta, scale, band=band)
    return (out.float() * scales.output).to(query.dtype)
