"""Images on the executor, the runner's media component (docs/multimodal.md): the
pixels each image's PrepareMedia brought (by content hash, a bounded store), the
encoder cache of embeddings (the scheduler's accounting decides what is computed and
what is dropped: scheduler_svc/core/encoder_cache.py), and per request in the batch
its placeholders and multimodal RoPE positions. At each step it runs the encoder on
the plan's images, then gives the forward its positions and the embeddings of the
placeholder tokens the step computes, sliced from the cache. A text-only model's
component, TextOnly, does nothing."""

import logging
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from flagstop.executor.attention import AttentionMetadata
from flagstop.executor.input_batch import InputBatch
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.decoder import TEXT_ONLY, InputEmbeds
from flagstop.executor.models.vision import VisionTower, mrope_positions
from flagstop.executor.step_inputs import StepInputs
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.output import SchedulerOutput

log = logging.getLogger("flagstop.executor")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MediaError(ValueError):
    """Pixels the executor refuses (INVALID_ARGUMENT, one line)."""


@dataclass(slots=True)
class Pixels:
    values: torch.Tensor  # the processor's patches, on the host
    grid: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


def pixels_from_bytes(data: bytes, shape: list[int], dtype: str, grid: list[int]) -> Pixels:
    if dtype not in DTYPES:
        raise MediaError(f"pixel dtype {dtype!r}: one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    expected = int(np.prod(shape)) * torch_dtype.itemsize
    if len(data) != expected or len(grid) != 3 or not 2 <= len(shape) <= 3:
        raise MediaError(f"pixels of {len(data)} bytes do not match shape {list(shape)} "
                         f"of {dtype} and grid {list(grid)}")  # fmt: skip
    with warnings.catch_warnings():  # read only: the message's bytes, never written
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(data, dtype=torch_dtype).view(*shape)
    return Pixels(values, (grid[0], grid[1], grid[2]))


@dataclass(slots=True)
class RequestMedia:
    media: tuple[MediaPlaceholder, ...]
    # Under multimodal RoPE: [3, prompt tokens], and a later token's (index + delta);
    # None: plain positions.
    positions: np.ndarray | None
    delta: int


class TextOnly:
    """A text-only model's media component: nothing to encode, plain positions."""

    def put(self, key: bytes, pixels: Pixels) -> None:
        raise MediaError("this model reads no images; serve a vision-language model")

    def apply(self, plan: SchedulerOutput, batch: InputBatch) -> None:
        pass

    def inputs(self, batch: InputBatch, inputs: StepInputs) -> tuple[torch.Tensor, InputEmbeds]:
        return inputs.positions, TEXT_ONLY


class ImageEmbeds(InputEmbeds):
    """A step's image embeddings at their flattened token indices: [tokens, hidden],
    or with DeepStack [tokens, hidden x (1 + layers)], a layer's features after the
    embeddings."""

    def __init__(self, indices: torch.Tensor, values: torch.Tensor, hidden: int) -> None:
        self.indices, self.values, self.hidden = indices, values, hidden
        self.num_deepstack = values.shape[1] // hidden - 1

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, self.indices, self.values[:, : self.hidden].to(x.dtype))

    def after_layer(self, index: int, x: torch.Tensor, residual: torch.Tensor):
        """DeepStack: layer index's features added to the image tokens' hidden states
        (the residual stream x + residual, added in transformers' order, carried on as
        the residual, x zero)."""
        if index >= self.num_deepstack:
            return x, residual
        hidden = x + residual
        start = (index + 1) * self.hidden
        features = self.values[:, start : start + self.hidden].to(x.dtype)
        hidden[self.indices] = hidden[self.indices] + features
        return torch.zeros_like(hidden), hidden


class Images:
    """A vision-language model's media component."""

    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, store_bytes: int) -> None:  # fmt: skip
        assert config.vision is not None
        self.tower = VisionTower(config.vision, dtype, device)
        self.tower.load(model_dir)
        self.layout = config.vision.layout
        self.merge = config.vision.spatial_merge_size
        self.hidden = config.hidden_size
        self.device, self.store_bytes = device, store_bytes
        self.pixels: OrderedDict[bytes, Pixels] = OrderedDict()  # least recently put first
        self.num_pixel_bytes = 0
        self.embeddings: dict[bytes, torch.Tensor] = {}
        self.requests: dict[str, RequestMedia] = {}

    def put(self, key: bytes, pixels: Pixels) -> None:
        """An image's pixels, until an encoder step needs them; the store keeps the
        most recent --media-store-bytes (a request whose image left it before its
        encoder step fails, the log naming the flag)."""
        if (old := self.pixels.pop(key, None)) is not None:
            self.num_pixel_bytes -= old.nbytes
        self.pixels[key] = pixels
        self.num_pixel_bytes += pixels.nbytes
        while self.num_pixel_bytes > self.store_bytes and len(self.pixels) > 1:
            self.num_pixel_bytes -= self.pixels.popitem(last=False)[1].nbytes

    def apply(self, plan: SchedulerOutput, batch: InputBatch) -> None:
        """The plan's new requests' placeholders and positions, its frees, and its
        encoder work (before the forward that reads it)."""
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self.requests.pop(req_id, None)
        for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            if data.media:
                self.requests[data.req_id] = self._request(data.media, data.num_prompt_tokens)
        for key in plan.encoder_frees:
            self.embeddings.pop(key, None)
        for key in plan.encoder_inputs:
            pixels = self.pixels.get(key)
            if pixels is None:  # its requests' rows fail when their chunk reaches it
                log.error("image %s left the pixel store before its encoder step: its "
                          "requests fail (raise --media-store-bytes)", key.hex()[:12])  # fmt: skip
                continue
            self.embeddings[key] = self.tower.encode(pixels.values.to(self.device), pixels.grid)

    def _request(self, media: tuple[MediaPlaceholder, ...], num_prompt_tokens: int):
        if not self.layout.mrope:
            return RequestMedia(media, None, 0)
        positions, delta = mrope_positions(num_prompt_tokens, media, self.merge)
        return RequestMedia(media, positions.numpy(), delta)

    def inputs(self, batch: InputBatch, inputs: StepInputs) -> tuple[torch.Tensor, InputEmbeds]:
        """The step's positions ([3, T] under multimodal RoPE once any of its requests
        has images) and its placeholder tokens' embeddings; with bidirectional images,
        each attention group's key limits."""
        token_rows, positions = inputs.token_rows, inputs.token_positions
        rows = {batch.req_rows[r]: m for r, m in self.requests.items() if r in batch.req_rows}
        rows = {row: m for row, m in rows.items() if (token_rows == row).any()}
        if not rows:
            return inputs.positions, TEXT_ONLY
        out = np.broadcast_to(positions, (3, len(positions))).copy()
        limits = positions.copy() if self.layout.bidirectional else None
        indices, values = [], []
        for row, media in rows.items():
            where = np.nonzero(token_rows == row)[0]
            if media.positions is not None:
                self._positions(media, positions[where], where, out)
            self._embeds(batch, row, media, positions[where], where, indices, values, limits)
        device_positions = inputs.positions if not self.layout.mrope else \
            torch.from_numpy(out).to(self.device, non_blocking=True)  # fmt: skip
        if limits is not None:
            self._key_limits(inputs, limits)
        if not indices:
            return device_positions, TEXT_ONLY
        index = torch.from_numpy(np.concatenate(indices)).to(self.device)
        return device_positions, ImageEmbeds(index, torch.cat(values), self.hidden)

    def _key_limits(self, inputs: StepInputs, limits: np.ndarray) -> None:
        """Each attention group's prefill tokens' key limits (after the decodes)."""
        for meta in inputs.attention:
            if isinstance(meta, AttentionMetadata):
                prefill = limits[meta.num_decodes :].astype(np.int32)
                meta.prefill_key_limits = torch.from_numpy(prefill).to(self.device)

    @staticmethod
    def _positions(media: RequestMedia, pos: np.ndarray, where: np.ndarray, out: np.ndarray):
        in_prompt = pos < media.positions.shape[1]
        out[:, where[in_prompt]] = media.positions[:, pos[in_prompt]]
        out[:, where[~in_prompt]] = pos[~in_prompt] + media.delta

    def _embeds(self, batch: InputBatch, row: int, media: RequestMedia, pos: np.ndarray,
                where: np.ndarray, indices: list, values: list,
                limits: np.ndarray | None) -> None:  # fmt: skip
        """The embeddings of the image tokens among a request's chunk (its tokens at
        flat indices `where`, positions `pos`); with bidirectional images each such
        token's key limit is its image's last token."""
        first, last = int(pos[0]), int(pos[-1]) + 1  # a chunk's positions are contiguous
        for item in media.media:
            lo, hi = max(first, item.offset), min(last, item.end)
            if lo >= hi:
                continue
            embeddings = self.embeddings.get(item.hash)
            if embeddings is None:  # its pixels left the store before its encoder step
                batch.failed_rows.add(row)
                continue
            indices.append(where[lo - first : hi - first])
            values.append(embeddings[lo - item.offset : hi - item.offset])
            if limits is not None:
                limits[where[lo - first : hi - first]] = item.end - 1
