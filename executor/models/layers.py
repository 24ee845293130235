import math

import torch
import torch.nn.functional as F
from torch import nn

from flagstop.executor.models.config_sections import yarn_mscale


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: add it first and return (normed, new residual), the fused
        pattern of a pre-norm block."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: the weight is an offset from 1, applied in float32 before the cast
    (transformers' Gemma3RMSNorm; Llama's casts first)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / theta**exponents
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}: default, linear, llama3 and yarn are")


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are scaled by: YaRN's attention factor (0.1 ln(factor) + 1
    unless the config gives one), 1 otherwise."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if (given := scaling.get("attention_factor")) is not None:
        return float(given)
    factor, mscale, mscale_all = (scaling.get(k) for k in ("factor", "mscale", "mscale_all_dim"))
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict):
    # YaRN (transformers' _compute_yarn_parameters): frequencies that rotate fewer than
    # beta_slow times over the original length are interpolated (divided by factor),
    # those over beta_fast kept, a linear ramp between; truncate rounds the bounds.
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


Rope = tuple[torch.Tensor, torch.Tensor]  # a step's (cos, sin) rows


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the whole head: the cos/sin tables, which stay float32
    whatever the model's dtype (plain attributes, not buffers, so .to(dtype) leaves
    them); apply_rotary() rotates with a step's rows of them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)
        self.max_positions = max_positions
        self.build(torch.get_default_device())

    def build(self, device: torch.device) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, self.inv_freq.to(device))
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            self.cos, self.sin = self.cos * self.attention_factor, self.sin * self.attention_factor

    def lookup(self, positions: torch.Tensor) -> Rope:
        """The step's (cos, sin) rows [T, 1, D/2], looked up once for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen-VL): a step's positions are [3, T] (temporal, height,
    width), and rotary pair i turns by the position of its section (sections: pairs
    per position, transformers' mrope_section; one after another, or interleaved t,
    h, w, t, h, w ... with the pairs past 3 x a section temporal). Text's three
    positions are equal, where this is plain RoPE; 1-D positions are looked up as such."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 sections: tuple[int, ...], interleaved: bool = False) -> None:  # fmt: skip
        self.sections, self.interleaved = sections, interleaved
        super().__init__(head_dim, max_positions, theta, scaling)

    def build(self, device: torch.device) -> None:
        super().build(device)
        sections = self.section_of_each_pair(len(self.inv_freq))
        self.section_of_pair = torch.tensor(sections, device=device)
        self.pairs = torch.arange(len(sections), device=device)

    def section_of_each_pair(self, num_pairs: int) -> list[int]:
        if not self.interleaved:
            return [s for s, n in enumerate(self.sections) for _ in range(n)]
        return [i % 3 if i % 3 and i < 3 * self.sections[i % 3] else 0 for i in range(num_pairs)]

    def lookup(self, positions: torch.Tensor) -> Rope:
        if positions.dim() == 1:
            return super().lookup(positions)
        cos, sin = self.cos[positions], self.sin[positions]  # [3, T, D/2]
        pick = (self.section_of_pair, slice(None), self.pairs)  # -> [D/2, T]
        return cos[pick].T.unsqueeze(1), sin[pick].T.unsqueeze(1)


def apply_rotary(rope: Rope, q: torch.Tensor, k: torch.Tensor):
    """q [T, H, D], k [T, KVH, D] rotated, returned in their own dtype: their first
    rotary dimensions (the table's: all of D but under partial rotary, GLM-4.5's)."""
    cos, sin = rope
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary pairs (x0, x1), (x2, x3) ... as rotate-half's halves (x0, x2,
    ..., x1, x3, ...): rotating that is rotating the pairs, the dimensions permuted, the
    same for queries and keys, so their dot products are unchanged (transformers'
    apply_rotary_pos_emb_interleave returns this order too)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
