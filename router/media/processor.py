"""A vision-language model's processor in the router: transformers' processor class
for the model (its image processor read from the checkpoint's
preprocessor_config.json, the router's tokenizer), which resizes, normalises and cuts
each image into patches and expands each image placeholder of the prompt into one
token per embedding. Each image is then named by a content hash of its pixels as the
processor made them together with the settings that made them, the key of the
encoder cache and of every KV block that covers it.

The Qwen-VL processors hold a video processor too, which needs torchvision; no
torchvision build loads beside the pinned CPU torch, so the processor is built
without one (images only; a video part is refused)."""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.server import MAX_MEDIA_BYTES
from flagstop.v1 import generation_pb2


@dataclass(slots=True)
class Processed:
    token_ids: list[int]
    media: list[generation_pb2.MediaPlaceholder]
    media_data: list[generation_pb2.MediaData]


def vision_config(model_dir: str) -> dict | None:
    """config.json's, for a vision-language checkpoint (None: text only)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if "vision_config" in config else None


def _processor_class(model_type: str):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    base = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    class ImagesOnly(base):  # transformers' class, its video processor left out
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImagesOnly


class MediaProcessor:
    def __init__(self, model_dir: str, tokenizer, max_pixels: int) -> None:
        from PIL import Image
        from transformers import AutoImageProcessor

        config = vision_config(model_dir)
        assert config is not None
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        processor_class = _processor_class(config["model_type"])
        kwargs = {"video_processor": None} if "video_processor" in \
            processor_class.get_attributes() else {}  # fmt: skip
        if "mm_tokens_per_image" in config:  # Gemma 3's fixed count a placeholder expands to
            kwargs["image_seq_length"] = config["mm_tokens_per_image"]
        self.processor = processor_class(image_processor=self.image_processor,
                                         tokenizer=tokenizer, **kwargs)  # fmt: skip
        self.image_token_id = config.get("image_token_id", config.get("image_token_index"))
        self.patch_size = config["vision_config"].get("patch_size", 14)
        self.max_pixels = max_pixels
        Image.MAX_IMAGE_PIXELS = None  # max_pixels is checked before decoding
        settings = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        self.settings_digest = hashlib.sha256(settings.encode()).digest()

    def process(self, text: str, images: list[bytes], where: list[str],
                add_special_tokens: bool, dtype: str = "float32") -> Processed:  # fmt: skip
        """The prompt's tokens with each image's placeholders expanded, each image's
        placeholder range and hash, and its pixels in dtype (the executor's: what
        its tower casts them to anyway). Raises RequestRejected naming the image
        (where[i]) and what is wrong."""
        opened = [self._open(data, w) for data, w in zip(images, where, strict=True)]
        keys = [self._hash(image) for image in opened]
        try:
            out = self.processor(text=[text], images=opened, return_tensors="np",
                                 add_special_tokens=add_special_tokens)  # fmt: skip
        except ValueError as e:  # placeholders and images that do not pair up
            raise RequestRejected(f"the prompt's image placeholders and its {len(images)} "
                                  f"images do not match: {e}", "messages") from None  # fmt: skip
        token_ids = out["input_ids"][0].tolist()
        pixels, grids = self._per_image(out)
        ranges = self._placeholder_ranges(token_ids)
        if len(ranges) != len(grids):
            raise RequestRejected(f"{len(ranges)} image placeholders for {len(grids)} images",
                                  "messages")  # fmt: skip
        media, data = [], []
        for (offset, length), rows, grid, key in zip(ranges, pixels, grids, keys, strict=True):
            media.append(generation_pb2.MediaPlaceholder(hash=key, offset=offset, length=length,
                                                         grid=grid))  # fmt: skip
            data.append(
                generation_pb2.MediaData(
                    hash=key,
                    pixel_values=as_bytes(rows, dtype),
                    shape=rows.shape,
                    dtype=dtype,
                    grid=grid,
                )
            )
        if (num_bytes := sum(len(d.pixel_values) for d in data)) > MAX_MEDIA_BYTES:
            raise RequestRejected(f"the images' pixels come to {num_bytes >> 20} MiB, more "
                                  f"than the {MAX_MEDIA_BYTES >> 20} MiB a request carries; "
                                  "send smaller images", where[-1])  # fmt: skip
        return Processed(token_ids, media, data)

    def _per_image(self, out) -> tuple[list[np.ndarray], list[list[int]]]:
        """Each image's pixels and patch grid (temporal, height, width): Qwen-VL's
        patches of all images in one array, by their grids; or one fixed-size image
        a row (Gemma 3's)."""
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if "image_grid_thw" not in out:
            p = self.patch_size
            return list(pixels), [[1, x.shape[-2] // p, x.shape[-1] // p] for x in pixels]
        grids = out["image_grid_thw"].tolist()
        cuts = np.cumsum([int(np.prod(g)) for g in grids])[:-1]
        return np.split(pixels, cuts), grids

    def _open(self, data: bytes, where: str):
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > self.max_pixels:
                raise RequestRejected(f"{where}: the image is {image.width}x{image.height}, "
                                      f"more than --media-max-pixels {self.max_pixels}",
                                      where)  # fmt: skip
            image.load()  # a truncated or corrupt image fails here, not in the processor
            return image
        except UnidentifiedImageError:
            raise RequestRejected(f"{where}: not an image this server reads (PNG, JPEG, "
                                  "WebP, GIF, BMP)", where) from None  # fmt: skip
        except (OSError, SyntaxError, ValueError) as e:
            if isinstance(e, RequestRejected):
                raise
            raise RequestRejected(f"{where}: the image does not decode: {e}", where) from None

    def _placeholder_ranges(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(offset, length) of each run of the image token, in order."""
        is_image = np.asarray(token_ids) == self.image_token_id
        edges = np.flatnonzero(np.diff(np.concatenate(([0], is_image.astype(np.int8), [0]))))
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]

    def _hash(self, image) -> bytes:
        """The decoded image's (its mode, size, palette and pixels) with the
        processor's settings: what its pixels are a function of. An eighth of the
        bytes of the float32 patches (a still image's are doubled in time), and as
        safe: two inputs that differ never share a hash (bench/multimodal_bench.py)."""
        digest = hashlib.sha256(self.settings_digest)
        digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
        if (palette := image.getpalette()) is not None:
            digest.update(bytes(palette))
        digest.update(image.tobytes())
        return digest.digest()


def as_bytes(pixels: np.ndarray, dtype: str) -> bytes:
    """float32 pixels in dtype (float32, float16, or bfloat16 rounded to nearest even,
    as torch casts them), as bytes."""
    if dtype == "float32":
        return pixels.tobytes()
    if dtype == "float16":
        return pixels.astype(np.float16).tobytes()
    bits = pixels.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
