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


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class VisionTower(nn.Module):
    """The family's image encoder: transformers' modules its layout names, under the
    checkpoint's names for them (its tower; a projector where it has one), one image
    at a time: the processor's pixels in, an embedding per placeholder token out."""

    def __init__(self, vision: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        layout = vision.layout
        tower_class = _class(layout.tower)
        config = tower_class.config_class(**vision.tower_config)
        config._attn_implementation = "sdpa"
        parts = {}
        with torch.device(device):
            parts[layout.weights[0]] = tower_class._from_config(config, dtype=dtype)
            if layout.projector:  # built from the whole model's config (its sizes)
                whole = _class(layout.model_config)(**vision.model_config)
                parts[layout.weights[1]] = _class(layout.projector)(whole).to(dtype)
        self.parts = nn.ModuleDict(parts).eval()
        self.layout, self.dtype = layout, dtype
        # A tensor's name in the checkpoint (model. first or not; Gemma 3's older
        # tower under .vision_model) -> its name here.
        names = "|".join(layout.weights)
        self.pattern = re.compile(rf"^(?:model\.)?({names})\.(?:vision_model\.)?(.+)$")

    def load(self, model_dir: str | Path) -> None:
        state = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if (m := self.pattern.match(name)) is not None:
                        state[f"{m[1]}.{m[2]}"] = f.get_tensor(name)
        missing, unexpected = self.parts.load_state_dict(state, strict=False)
        missing = [m for m in missing if "inv_freq" not in m]
        if missing or unexpected:
            raise ValueError(f"vision tower: checkpoint lacks {missing[:3]}, "
                             f"has unexpected {unexpected[:3]}")  # fmt: skip

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, hidden], each row followed by
        its DeepStack features (hidden each) where the tower gives them."""
        tower = self.parts[self.layout.weights[0]]
        pixel_values = pixel_values.to(self.dtype)
        if self.layout.projector:  # a fixed-size image: its patches' states, projected
            states = tower(pixel_values=pixel_values[None]).last_hidden_state
            return self.parts[self.layout.weights[1]](states)[0]
        grid_thw = torch.tensor([list(grid)], device=pixel_values.device)
        out = tower(pixel_values, grid_thw=grid_thw)
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
