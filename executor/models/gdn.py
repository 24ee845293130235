"""Qwen3-Next's (and Qwen3.5's) gated DeltaNet layer over a step's flattened tokens
(issue 52, in progress: no model runs it yet). Each sequence owns a recurrent state
slot: a convolution state [conv_dim, width - 1] and a delta-rule state [value heads,
dk, dv] per layer, addressed by the step's state slot of each sequence; decodes (one
token each) first, then prefill chunks, as attention lays a step out.

Per token: in_proj_qkvz gives, per key head, its query, key, and its group of value
heads' values and output gates z; in_proj_ba their write strengths b and decays a. The
query, key and value channels pass the causal depthwise convolution (SiLU), then the
gated delta rule (kernels/torch_gdn.py) with g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b); each value head's output is RMS-normed, times SiLU(z), and out_proj
maps them back."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flagstop.executor.models.onednn import Linear
from flagstop.kernels import torch_gdn


@dataclass(slots=True, frozen=True)
class GdnShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: queries, keys, values."""
        return 2 * self.key_dim + self.value_dim


@dataclass(slots=True)
class RecurrentMetadata:
    query_start_loc: list[int]  # [num_seqs + 1]: each sequence's tokens in the step
    state_slots: torch.Tensor  # [num_seqs] int64: each sequence's state slot
    num_decodes: int  # the first num_decodes sequences have one token each


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, shape: GdnShape, eps: float) -> None:
        super().__init__()
        self.shape, self.eps = shape, eps
        s = shape
        self.in_proj_qkvz = Linear(hidden_size, 2 * s.key_dim + 2 * s.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * s.num_v_heads, bias=False)
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [conv_dim, 1, width]
        self.conv1d.weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_width))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(s.head_v_dim))
        self.out_proj = Linear(s.value_dim, hidden_size, bias=False)

    def _split(self, x: torch.Tensor):
        """(the convolution's input [T, conv_dim], z [T, Hv, dv], b, a [T, Hv]) from the
        projections' per-key-head groups."""
        s, n = self.shape, x.shape[0]
        group = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, group * s.head_v_dim,
                                 group * s.head_v_dim], dim=-1)  # fmt: skip
        b, a = self.in_proj_ba(x).view(n, s.num_k_heads, -1).split([group, group], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return mixed, z.reshape(n, s.num_v_heads, s.head_v_dim), b.reshape(n, -1), \
            a.reshape(n, -1)  # fmt: skip

    def forward(
        self, x: torch.Tensor, meta: RecurrentMetadata, conv_states: torch.Tensor,
        delta_states: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] -> [T, hidden]; conv_states [slots, conv_dim, width - 1] and
        delta_states [slots, Hv, dk, dv] (float32) advanced in place for each sequence."""
        mixed, z, b, a = self._split(x)
        weight = self.conv1d.weight[:, 0]
        mixed = self._convolve(mixed, weight, meta, conv_states)
        s = self.shape
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q = q.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, 1)
        k = k.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, 1)
        q, k = torch_gdn.normalize(q, k)
        v = v.reshape(-1, s.num_v_heads, s.head_v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self._delta_rule(q, k, v, g, b.float().sigmoid(), meta, delta_states)
        return self.out_proj(self._gated_norm(out, z).flatten(1))

    @staticmethod
    def _convolve(mixed, weight, meta: RecurrentMetadata, states: torch.Tensor):
        n, starts, slots = meta.num_decodes, meta.query_start_loc, meta.state_slots
        out = torch.empty_like(mixed)
        if n:
            decoding = states[slots[:n]]
            out[:n] = torch_gdn.causal_conv_step(mixed[:n], weight, decoding)
            states[slots[:n]] = decoding
        for i in range(n, len(starts) - 1):
            rows, state = slice(starts[i], starts[i + 1]), states[int(slots[i])]
            out[rows] = torch_gdn.causal_conv(mixed[rows], weight, state)
        return out

    @staticmethod
    def _delta_rule(q, k, v, g, beta, meta: RecurrentMetadata, states: torch.Tensor):
        n, starts, slots = meta.num_decodes, meta.query_start_loc, meta.state_slots
        out = v.new_empty(v.shape, dtype=torch.float32)
        if n:
            decoding = states[slots[:n]]
            out[:n] = torch_gdn.recurrent(q[:n, None], k[:n, None], v[:n, None], g[:n, None],
                                          beta[:n, None], decoding)[:, 0]  # fmt: skip
            states[slots[:n]] = decoding
        for i in range(n, len(starts) - 1):
            rows, state = slice(starts[i], starts[i + 1]), states[int(slots[i])]
            out[rows] = torch_gdn.chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], state)
        return out

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each value head's output RMS-normed (its weight applied in the input's dtype),
        times SiLU(z) in float32 (transformers' Qwen3NextRMSNormGated)."""
        dtype = z.dtype
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * normed.to(dtype)
        return (normed * F.silu(z.float())).to(dtype)
