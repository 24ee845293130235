"""Which adapter each token of a step runs: built once a step on the host from each
token's slot (-1: the base model alone) and read by every LoRA layer's kernels."""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoRAMapping:
    """The step's tokens that run an adapter, sorted by slot (stable: a request's
    tokens stay in order), as segments of one slot each. The torch kernels slice the
    segments on the host (bounds); the Triton kernels read the same on the device."""

    sorted_tokens: torch.Tensor  # [N] int64: token indices, grouped by slot
    bounds: list[tuple[int, int, int]]  # per segment (slot, start, end) in sorted_tokens
    seg_starts: torch.Tensor  # [G + 1] int32
    seg_slots: torch.Tensor  # [G] int32
    max_seg_len: int
    # The segments padded to one length, when that wastes little (a decode step's):
    # [G, L] rows of sorted_tokens (0 where padded), their slots [G], and which padded
    # rows are real [G * L]. The torch kernels then batch the adapters in two bmm's.
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, token_slots: np.ndarray, device: torch.device) -> "LoRAMapping | None":
        """None when no token runs an adapter (the layers then add nothing)."""
        tokens = np.flatnonzero(token_slots >= 0)
        if not len(tokens):
            return None
        order = tokens[np.argsort(token_slots[tokens], kind="stable")]
        slots = token_slots[order]
        starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
        ends = np.r_[starts[1:], len(order)]
        bounds = list(zip(slots[starts].tolist(), starts.tolist(), ends.tolist(), strict=True))
        seg_starts = np.r_[starts, len(order)].astype(np.int32)

        def t(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

        lengths = ends - starts
        padded = None
        if len(starts) > 1 and len(starts) * lengths.max() <= 2 * len(order):
            offsets = np.arange(lengths.max())
            real = offsets[None, :] < lengths[:, None]
            rows = np.where(real, starts[:, None] + offsets[None, :], 0)
            padded = (t(rows.astype(np.int64)), t(slots[starts].astype(np.int64)),
                      t(real.reshape(-1)))  # fmt: skip
        return cls(t(order.astype(np.int64)), bounds, t(seg_starts),
                   t(slots[starts].astype(np.int32)), int(lengths.max()), padded)  # fmt: skip
