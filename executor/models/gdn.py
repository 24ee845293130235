"""Qwen3-Next's and Qwen3.5's gated DeltaNet layer over a step's flattened tokens, its
states in the paged KV cache (kv_groups.py: a recurrent group's block holds the state
after its request's tokens up to that block's end, or up to the last computed one).

Per token: the input projections give, per key head, its query and key, and its group
of value heads' values, output gates z, write strengths b and decays a (Qwen3-Next
packs them by key head in in_proj_qkvz and in_proj_ba; Qwen3.5 has one projection a
part). The query, key and value channels pass the causal depthwise convolution
(SiLU), then the gated delta rule (kernels/torch_gdn.py) with g = -exp(A_log)
softplus(a + dt_bias) and beta = sigmoid(b); each value head's output is RMS-normed,
times SiLU(z), and out_proj maps them back (summed over the ranks: each holds its
value heads)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.config_sections import RecurrentConfig
from flagstop.executor.models.linear import make_linear
from flagstop.executor.parallel import TensorParallel
from flagstop.kernels import torch_gdn


@dataclass(slots=True)
class RecurrentMetadata:
    """One recurrent group's part of a step (step_inputs.py), sequences in attention
    order (decodes first). A state is read from src_blocks (-1: a first chunk, zeros)
    and written, for a decode, to decode_blocks; for a longer sequence after each of
    its snapshots' token counts, to snapshot_blocks (-1: kept for a verification to
    choose, a sequence with drafts: `drafts`)."""

    query_start_loc: list[int]  # [num_seqs + 1]
    num_decodes: int
    src_blocks: torch.Tensor  # [num_seqs] int64
    decode_blocks: torch.Tensor  # [num_decodes] int64
    snapshots: list[list[int]]  # per longer sequence: token counts, its last one last
    snapshot_blocks: torch.Tensor  # [all snapshots] int64, in the snapshots' order
    # Per sequence with drafts: (its index, its sampling row, tokens computed before the
    # step, the block of the state after 1 + a tokens for a = 0 .. drafts).
    drafts: list[tuple[int, int, int, list[int]]]


class StatePages:
    """A layer's states in a recurrent group's blocks: each block's page is the K page
    then the V page of the layer slot's tensors (the bytes a full-attention layer keeps
    for block_size tokens), and holds the delta rule's matrix then the convolution's
    window, float32."""

    def __init__(self, kv_cache: tuple[torch.Tensor, ...], delta_shape, conv_shape) -> None:
        self.delta_shape, self.conv_shape = delta_shape, conv_shape
        self.num_delta = delta_shape.numel()
        self.num_bytes = 4 * (self.num_delta + conv_shape.numel())
        k, v = (t.view(t.shape[0], -1).view(torch.uint8) for t in kv_cache)
        self.num_in_k = min(self.num_bytes, k.shape[1])
        assert self.num_bytes <= k.shape[1] + v.shape[1], "a state larger than a block's page"
        self.k, self.v = k[:, : self.num_in_k], v[:, : self.num_bytes - self.num_in_k]

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(delta states [n, ...], conv states [n, ...]) of blocks; zeros where -1."""
        ids = blocks.clamp(min=0)
        raw = torch.cat((self.k[ids], self.v[ids]), dim=1).view(torch.float32)
        raw = raw.masked_fill((blocks < 0)[:, None], 0.0)
        n = len(blocks)
        return raw[:, : self.num_delta].view(n, *self.delta_shape), \
            raw[:, self.num_delta :].view(n, *self.conv_shape)  # fmt: skip

    def write(self, blocks: torch.Tensor, delta: torch.Tensor, conv: torch.Tensor) -> None:
        n = len(blocks)
        if not n:
            return
        raw = torch.cat((delta.reshape(n, -1), conv.reshape(n, -1).float()), 1)
        raw = raw.view(torch.uint8)
        self.k[blocks] = raw[:, : self.num_in_k]
        self.v[blocks] = raw[:, self.num_in_k :]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        full = config.recurrent
        assert full is not None
        size = tp.size
        # This rank's key heads and their value heads.
        self.full, self.eps = full, config.rms_norm_eps
        self.shape = s = RecurrentConfig(full.num_k_heads // size, full.num_v_heads // size,
                                               full.head_k_dim, full.head_v_dim, full.conv_width,
                                               full.per_key_head)  # fmt: skip
        self.rank, self.size = tp.rank, size
        hidden = config.hidden_size

        def linear(name: str, rows: int):
            return make_linear(config, (f"{prefix}.{name}",), hidden, rows, False)

        if s.per_key_head:
            self.in_proj_qkvz = linear("in_proj_qkvz", 2 * s.key_dim + 2 * s.value_dim)
            self.in_proj_ba = linear("in_proj_ba", 2 * s.num_v_heads)
        else:  # loaded whole (q, k and v are three slices of it), cut in after_load
            self.in_proj_qkv = linear("in_proj_qkv", full.conv_dim)
            self.in_proj_z = linear("in_proj_z", s.value_dim)
            self.in_proj_b = linear("in_proj_b", s.num_v_heads)
            self.in_proj_a = linear("in_proj_a", s.num_v_heads)
        self.conv1d = nn.Module()  # the checkpoint's [conv_dim, 1, width], cut in after_load
        self.conv1d.weight = nn.Parameter(torch.empty(full.conv_dim, 1, s.conv_width))
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(s.head_v_dim))
        self.out_proj = make_linear(config, (f"{prefix}.out_proj",), s.value_dim, hidden, False,
                                    tp)  # fmt: skip
        self.kernels = torch_gdn  # the backend's gated delta rule (use_backend)
        # A verification's per-token states, until accept() learns what it kept.
        self.pending: list[tuple[StatePages, int, int, list[int], torch.Tensor,
                                 torch.Tensor]] = []  # fmt: skip

    def channels(self) -> torch.Tensor:
        """This rank's convolution channels: its key heads' queries and keys, its value
        heads' values, of the whole layer's q | k | v."""
        full, s = self.full, self.shape
        parts = [(0, full.key_dim, s.key_dim), (full.key_dim, full.key_dim, s.key_dim),
                 (2 * full.key_dim, full.value_dim, s.value_dim)]  # fmt: skip
        return torch.cat([torch.arange(start + self.rank * n, start + (self.rank + 1) * n)
                          for start, _, n in parts])  # fmt: skip

    def after_load(self, dtype: torch.dtype) -> None:
        if self.size == 1:
            return
        mine = self.channels()
        self.conv1d.weight = nn.Parameter(self.conv1d.weight.data[mine], requires_grad=False)
        if not self.shape.per_key_head:
            proj = self.in_proj_qkv
            proj.weight = nn.Parameter(proj.weight.data[mine], requires_grad=False)
            proj.out_features = len(mine)

    def _split(self, x: torch.Tensor):
        """(the convolution's input [T, conv_dim], z [T, Hv, dv], b, a [T, Hv])."""
        s, n = self.shape, x.shape[0]
        if not s.per_key_head:
            z = self.in_proj_z(x).view(n, s.num_v_heads, s.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        group = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, group * s.head_v_dim,
                                 group * s.head_v_dim], dim=-1)  # fmt: skip
        b, a = self.in_proj_ba(x).view(n, s.num_k_heads, -1).split([group, group], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return mixed, z.reshape(n, s.num_v_heads, s.head_v_dim), b.reshape(n, -1), \
            a.reshape(n, -1)  # fmt: skip

    def pages(self, kv_cache) -> StatePages:
        s = self.shape
        return StatePages(kv_cache, torch.Size((s.num_v_heads, s.head_k_dim, s.head_v_dim)),
                          torch.Size((s.conv_dim, s.conv_width - 1)))  # fmt: skip

    def forward(self, ropes, x: torch.Tensor, kv_cache, meta: RecurrentMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; each sequence's state read from its block and
        written back where meta says."""
        # The last verification was accepted before this step (advance runs first); a
        # batch reset since must not leave its states to be written into reused blocks.
        self.pending.clear()
        pages = self.pages(kv_cache)
        delta_states, conv_states = pages.read(meta.src_blocks)
        mixed, z, b, a = self._split(x)
        mixed, conv_snaps = self._convolve(mixed, meta, conv_states)
        s = self.shape
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q = q.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, 1)
        k = k.reshape(-1, s.num_k_heads, s.head_k_dim).repeat_interleave(group, 1)
        q, k = torch_gdn.normalize(q, k)
        v = v.reshape(-1, s.num_v_heads, s.head_v_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out, delta_snaps = self._delta_rule(q, k, v, g, b.float().sigmoid(), meta, delta_states)
        self._store(pages, meta, delta_states, conv_states, delta_snaps, conv_snaps)
        return self.out_proj(self._gated_norm(out, z).flatten(1))

    def _convolve(self, mixed, meta: RecurrentMetadata, states: torch.Tensor):
        """The convolution's outputs, and per longer sequence its window after each
        snapshot's tokens [snapshots, C, width - 1]."""
        n, starts = meta.num_decodes, meta.query_start_loc
        weight = self.conv1d.weight[:, 0]
        out, snaps = torch.empty_like(mixed), []
        if n:
            out[:n] = torch_gdn.causal_conv_step(mixed[:n], weight, states[:n])
        for i, counts in zip(range(n, len(starts) - 1), meta.snapshots, strict=True):
            rows = mixed[starts[i] : starts[i + 1]]
            before = states[i].to(rows.dtype, copy=True).transpose(0, 1)  # [width - 1, C]
            out[starts[i] : starts[i + 1]] = torch_gdn.causal_conv(rows, weight, states[i])
            history = torch.cat((before, rows))  # the inputs, oldest first
            width = before.shape[0]
            snaps.append(torch.stack([history[c : c + width].transpose(0, 1) for c in counts]))
        return out, snaps

    def _delta_rule(self, q, k, v, g, beta, meta: RecurrentMetadata, states: torch.Tensor):
        """The delta rule's outputs, and per longer sequence its state after each
        snapshot's tokens [snapshots, Hv, dk, dv]."""
        n, starts = meta.num_decodes, meta.query_start_loc
        out, snaps = v.new_empty(v.shape, dtype=torch.float32), []
        if n:
            out[:n] = self.kernels.recurrent(q[:n, None], k[:n, None], v[:n, None], g[:n, None],
                                          beta[:n, None], states[:n])[:, 0]  # fmt: skip
        for i, counts in zip(range(n, len(starts) - 1), meta.snapshots, strict=True):
            state, done, taken = states[i], 0, []
            for count in counts:
                rows = slice(starts[i] + done, starts[i] + count)
                out[rows] = self.kernels.chunked(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                              state)  # fmt: skip
                taken.append(state.clone())
                done = count
            snaps.append(torch.stack(taken))
        return out, snaps

    def _store(self, pages: StatePages, meta: RecurrentMetadata, delta_states, conv_states,
               delta_snaps, conv_snaps) -> None:  # fmt: skip
        n = meta.num_decodes
        if n:
            pages.write(meta.decode_blocks, delta_states[:n], conv_states[:n])
        blocks = meta.snapshot_blocks
        if len(blocks):
            now = blocks >= 0
            pages.write(blocks[now], torch.cat(delta_snaps)[now], torch.cat(conv_snaps)[now])
        for i, row, computed, targets in meta.drafts:
            self.pending.append((pages, row, computed, targets, delta_snaps[i - n],
                                 conv_snaps[i - n]))  # fmt: skip

    def accept(self, num_sampled: list[int], block_size: int) -> None:
        """The last verification kept num_sampled[row] tokens of each sequence with
        drafts (1 + the accepted drafts): its state after them goes to their last one's
        block, and the state at each block end they passed to that block."""
        for pages, row, computed, targets, deltas, convs in self.pending:
            kept = num_sampled[row]
            chosen = [t for t in range(kept) if t == kept - 1 or (computed + t + 1) % block_size
                      == 0]  # fmt: skip
            pages.write(torch.tensor([targets[t] for t in chosen]), deltas[chosen], convs[chosen])
        self.pending.clear()

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each value head's output RMS-normed (its weight applied in the input's dtype),
        times SiLU(z) in float32 (transformers' Qwen3NextRMSNormGated)."""
        dtype = z.dtype
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * normed.to(dtype)
        return (normed * F.silu(z.float())).to(dtype)
