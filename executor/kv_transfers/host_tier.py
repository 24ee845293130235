"""The host-memory tier of the prefix cache, executor side: the bytes, and the copies
the scheduler's plan asks for (the index and the policy are the scheduler's:
scheduler_svc/core/host_tier_connector.py).

Every KV cache tensor of a rank (each layer's K and V, a draft model's too) has its
block dimension first, so one slot of the tier is the concatenation of one block's
bytes of each: a slot holds a block whole, in any dtype (FP8 included), and under
tensor parallelism each rank keeps its own shard in its own tier, at the same slots.

- Saves run in the step that computes the blocks, after its forward: a block saved
  there is still the request's, so no later step can have reused it.
- Loads run on a copy thread, off the step loop, into blocks the scheduler reserved
  for them and no forward touches until the load is reported; they finish in the
  order they started (one thread), so the ranks agree on how many finished with one
  all-reduce(min) of a count (SGLang's HiCache agrees on hit lengths the same way).
  A copy that raises is a bug, not a miss: the step fails, and with it the executor,
  and the scheduler recomputes its requests on the next one.
"""

import asyncio
import contextlib
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flagstop.executor.kv_transfers.base import NoLeases
from flagstop.executor.parallel import TensorParallel
from flagstop.scheduler_svc.core.kv_connector import KVConnectorMetadata, KVTransferResult

log = logging.getLogger("flagstop.executor")


class HostTier(NoLeases):
    """A KVWorker (executor/kv_transfers/base.py)."""

    def __init__(
        self, caches: list[torch.Tensor], num_slots: int, tp: TensorParallel,
        path: str | None = None,
    ) -> None:  # fmt: skip
        """caches: the rank's KV tensors, [num_blocks, ...] each; num_slots: the host
        blocks it holds."""
        self.tp = tp
        self.num_host_blocks = num_slots
        # Each cache as [num_blocks, its bytes a block], and where it sits in a slot.
        self.views = [c.view(torch.uint8).view(c.shape[0], -1) for c in caches]
        widths = [v.shape[1] for v in self.views]
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.slot_bytes = sum(widths)
        self.host = self._allocate(num_slots * self.slot_bytes, path, caches[0].device)
        self.host = self.host.view(num_slots, self.slot_bytes)
        self.device = caches[0].device
        # The loads' copies run on their own stream, beside the forwards (CUDA).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self.loads: deque[tuple[str, Future]] = deque()  # started, not yet reported

    @staticmethod
    def _allocate(num_bytes: int, path: str | None, device: torch.device) -> torch.Tensor:
        if path is not None:
            # A shared mapping of the file: the OS pages it in and out, as a disk tier.
            return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        """Copy blocks this step computed into their slots."""
        if not meta.save_block_ids:
            return
        ids = torch.tensor(meta.save_block_ids, device=self.device)
        rows = torch.tensor(meta.save_slots)
        for view, offset in zip(self.views, self.offsets, strict=True):
            self.host[rows, offset : offset + view.shape[1]] = view[ids].cpu()

    def start(self, meta: KVConnectorMetadata) -> None:
        """The loads, copied while the forward runs."""
        for load in meta.loads:
            job = self.copier.submit(self._load, load.block_ids, load.source_ids)
            self.loads.append((load.req_id, job))

    @torch.inference_mode()
    def _load(self, block_ids: list[int], slots: list[int]) -> None:
        rows, stream = torch.tensor(slots), self.stream
        # Every device op of the copy on the side stream, the index tensor's too (made
        # on another stream, the copies could read it before it is written).
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            ids = torch.tensor(block_ids, device=self.device)
            for view, offset in zip(self.views, self.offsets, strict=True):
                part = self.host[rows, offset : offset + view.shape[1]]
                view[ids] = part.to(self.device, non_blocking=True)
        if stream is not None:
            stream.synchronize()

    async def wait(self, timeout_s: float) -> None:
        if self.loads:
            # asyncio.wait, not wait_for: a timeout must not cancel the copy.
            await asyncio.wait([asyncio.wrap_future(self.loads[0][1])], timeout=timeout_s)

    def finished(self) -> KVTransferResult:
        """The requests whose loads finished on every rank (each rank calls this at the
        same point of the same step)."""
        if not self.loads:
            return KVTransferResult()
        num_done = 0
        for _, job in self.loads:
            if not job.done():
                break
            num_done += 1
        num_done = self.tp.min_over_ranks(num_done)
        finished = []
        for _ in range(num_done):
            req_id, job = self.loads.popleft()
            job.result()  # raises what the copy raised
            finished.append(req_id)
        return KVTransferResult(finished)

    def reset(self) -> None:
        """Wait out every load (a new scheduler stream: its blocks are the new one's)."""
        for _, job in self.loads:
            try:
                job.result()
            except Exception:
                log.exception("a host-tier load failed while draining")
        self.loads.clear()
