"""The router's media component: a request's images fetched, counted against
--limit-mm-per-prompt and processed (off the event loop) into its prompt tokens,
placeholders and pixels. TextOnlyMedia, a text-only model's, refuses images."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from flagstop.router.media.fetch import FetchLimits, ImageFetcher
from flagstop.router.media.processor import MediaProcessor, Processed, vision_config
from flagstop.scheduler_svc.core.limits import RequestRejected


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image as a request names it: a URL (data:, http(s):, file:) or its bytes,
    and where in the request it is (the refusal names it)."""

    where: str
    url: str = ""
    data: bytes = b""


class TextOnlyMedia:
    accepts_images = False

    async def process(self, text: str, images: Sequence[ImageRef], add_special_tokens: bool,
                      dtype: str = "") -> Processed | None:  # fmt: skip
        if images:
            raise RequestRejected(f"{images[0].where}: this model reads no images; send "
                                  "text only, or serve a vision-language model",
                                  images[0].where)  # fmt: skip
        return None

    async def close(self) -> None:
        pass


class ImageMedia:
    accepts_images = True

    def __init__(self, processor: MediaProcessor, fetcher: ImageFetcher, limit: int) -> None:
        self.processor, self.fetcher, self.limit = processor, fetcher, limit

    async def process(self, text: str, images: Sequence[ImageRef], add_special_tokens: bool,
                      dtype: str = "") -> Processed | None:  # fmt: skip
        """The prompt with its images, their pixels in dtype (the executor's; ""
        float32); None: it has none. Raises RequestRejected."""
        if not images:
            return None
        if len(images) > self.limit:
            raise RequestRejected(
                f"{len(images)} images in one prompt, more than "
                f"--limit-mm-per-prompt's {self.limit}",
                images[-1].where,
            )
        data = [await self._bytes(ref) for ref in images]
        where = [ref.where for ref in images]
        # Off the loop: resizing a 4-megapixel image takes tens of milliseconds.
        return await asyncio.to_thread(self.processor.process, text, data, where,
                                       add_special_tokens, dtype or "float32")  # fmt: skip

    async def _bytes(self, ref: ImageRef) -> bytes:
        if ref.data:
            self.fetcher.check_size(len(ref.data), ref.where)
            return ref.data
        return await self.fetcher.bytes_of(ref.url, ref.where)

    async def close(self) -> None:
        await self.fetcher.close()


def router_media(settings, tokenizer) -> ImageMedia | TextOnlyMedia:
    """The model directory's: images for a vision-language checkpoint."""
    if vision_config(settings.model) is None:
        return TextOnlyMedia()
    local = Path(settings.allowed_local_media_path) if settings.allowed_local_media_path else None
    fetcher = ImageFetcher(FetchLimits(settings.media_max_bytes, settings.media_fetch_timeout_s,
                                       local))  # fmt: skip
    processor = MediaProcessor(settings.model, tokenizer, settings.media_max_pixels)
    return ImageMedia(processor, fetcher, settings.limit_mm_per_prompt.get("image", 0))
