"""Images drawn in the tests with Pillow, a vision-language checkpoint and its
processor, and transformers' greedy tokens on them (the oracle)."""

import base64
import io
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def data_url(image: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(image).decode()}"


def drawn(seed: int, width: int = 100, height: int = 70, fmt: str = "PNG") -> bytes:
    """A picture: noise under a few shapes of seeded colours."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y = int(rng.integers(0, width // 2)), int(rng.integers(0, height // 2))
        draw.ellipse((x, y, x + width // 3, y + height // 3),
                     fill=tuple(int(c) for c in rng.integers(0, 256, 3)))  # fmt: skip
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


@cache
def processor(model_dir: Path):
    from transformers import PreTrainedTokenizerFast

    from flagstop.router.media.processor import MediaProcessor

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return MediaProcessor(str(model_dir), tokenizer, 1 << 24)


class VisionReference:
    """transformers' generate() on the checkpoint, with the same processor."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForImageTextToText

        self.model_dir = model_dir
        self.model = AutoModelForImageTextToText.from_pretrained(
            str(model_dir), dtype=torch.float32).eval()  # fmt: skip

    def greedy(self, text: str, images: list[bytes], max_new_tokens: int) -> list[int]:
        import torch

        opened = [Image.open(io.BytesIO(data)) for data in images]
        inputs = processor(self.model_dir).processor(
            text=[text], images=opened or None, return_tensors="pt", add_special_tokens=False
        )
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()
