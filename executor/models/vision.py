"""A vision-language model's image side on the executor: its vision tower (the
transformers module the family names, run as it is: an image's tower forward has no
KV cache and no batch to page, so the library's own is the token-exact one), and the
multimodal RoPE positions of a prompt with images (docs/multimodal.md)."""

import importlib
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flagstop.executor.models.config_sections import VisionConfig
from flagstop.scheduler_svc.core.media import MediaPlaceholder

# The tower's tensors in a checkpoint: `visual.*` (the published layout) or
# `model.visual.*` (transformers 5's in-memory one).
TOWER = re.compile(r"^(?:model\.)?visual\.(.+)$")


class VisionTower(nn.Module):
    """The family's vision tower: pixels (the processor's patches) in, one embedding
    per placeholder token out, an image at a time."""

    def __init__(self, vision: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        module = importlib.import_module(vision.layout.tower_module)
        tower_class = getattr(module, vision.layout.tower_class)
        config = tower_class.config_class(**vision.tower_config)
        config._attn_implementation = "sdpa"
        with torch.device(device):
            self.tower = tower_class._from_config(config, dtype=dtype).eval()
        self.dtype = dtype

    def load(self, model_dir: str | Path) -> None:
        state = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if (m := TOWER.match(name)) is not None:
                        state[m[1]] = f.get_tensor(name)
        missing, unexpected = self.tower.load_state_dict(state, strict=False)
        missing = [m for m in missing if "inv_freq" not in m]
        if missing or unexpected:
            raise ValueError(f"vision tower: checkpoint lacks {missing[:3]}, "
                             f"has unexpected {unexpected[:3]}")  # fmt: skip

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, hidden], each row followed by
        its DeepStack features (hidden each) where the tower gives them."""
        grid_thw = torch.tensor([list(grid)], device=pixel_values.device)
        out = self.tower(pixel_values.to(self.dtype), grid_thw=grid_thw)
        deepstack = getattr(out, "deepstack_features", None) or []
        return torch.cat([out.pooler_output, *deepstack], dim=-1) if deepstack else \
            out.pooler_output  # fmt: skip


def mrope_positions(
    num_tokens: int, media: Sequence[MediaPlaceholder], merge: int
) -> tuple[torch.Tensor, int]:
    """Qwen-VL's (temporal, height, width) positions [3, num_tokens] of a prompt and
    its delta (a later token's three positions are its index + delta): text counts on
    from the last position; an image's tokens take its grid's coordinates from where
    the text stopped, and the text after it resumes past its largest side."""
    pieces, position, index = [], 0, 0
    for item in sorted(media, key=lambda m: m.offset):
        if item.offset > index:
            pieces.append(torch.arange(item.offset - index).expand(3, -1) + position)
            position += item.offset - index
        t, h, w = item.grid[0], item.grid[1] // merge, item.grid[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)  # fmt: skip
        pieces.append(grid + position)
        position += max(h, w)
        index = item.offset + item.length
    if num_tokens > index:
        pieces.append(torch.arange(num_tokens - index).expand(3, -1) + position)
        position += num_tokens - index
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions, position - num_tokens
