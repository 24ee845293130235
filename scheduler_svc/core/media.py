"""An image in a prompt as the scheduler and the executor know it (vLLM's
PlaceholderRange with its mm_hash): its content hash, the prompt positions of its
placeholder tokens, and its patch grid. The pixels never ride a step: they reach the
executor once, by hash, ahead of the request (docs/multimodal.md)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MediaPlaceholder:
    hash: bytes  # the image's content hash with the processor settings that shaped it
    offset: int  # its first placeholder token's position in the prompt
    length: int  # its placeholder tokens: the embeddings its encoder forward gives
    grid: tuple[int, int, int]  # its patch grid (temporal, height, width): positions

    @property
    def end(self) -> int:
        return self.offset + self.length


def media_from_proto(items) -> tuple[MediaPlaceholder, ...]:
    """generation_pb2.MediaPlaceholder messages as the core's, by prompt position."""
    media = (MediaPlaceholder(m.hash, m.offset, m.length, tuple(m.grid)) for m in items)
    return tuple(sorted(media, key=lambda m: m.offset))


def media_to_proto(media: tuple[MediaPlaceholder, ...], out) -> None:
    """Into a repeated generation_pb2.MediaPlaceholder field."""
    for m in media:
        out.add(hash=m.hash, offset=m.offset, length=m.length, grid=m.grid)
