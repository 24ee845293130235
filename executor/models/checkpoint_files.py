"""A checkpoint's tensor files, opened alike: safetensors (safe_open), or, where a
directory has none, PyTorch's pytorch_model*.bin (EAGLE-3's original heads ship
that way), mapped (weights only) and served as safe_open serves a file: keys,
get_tensor, get_slice."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """Its *.safetensors, else its pytorch_model*.bin; none: an empty list."""
    model_dir = Path(model_dir)
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("pytorch_model*.bin"))


@contextmanager
def open_checkpoint(file: Path) -> Iterator:
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            yield f
    else:
        # Mapped, not read: listing its names (the drafters do) costs nothing.
        yield StateDict(torch.load(file, map_location="cpu", weights_only=True, mmap=True))


class StateDict:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> "TensorSlice":
        return TensorSlice(self.tensors[name])


class TensorSlice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]
