"""The host-memory tier of the prefix cache, executor side: the bytes, and the copies
the scheduler's plan asks for (the index and the policy are the scheduler's:
scheduler_svc/core/host_tier.py).

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

import contextlib
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flagstop.executor.parallel import TensorParallel
from flagstop.scheduler_svc.core.kv_connector import KVLoad

log = logging.getLogger("flagstop.executor")
# A step with nothing to compute waits this long for a load before answering: the
# scheduler's only news of a load is a step result, and an idle engine would
# otherwise poll in a busy loop.
POLL_WAIT_S = 0.005


class HostTier:
    def __init__(
        self, caches: list[torch.Tensor], num_slots: int, tp: TensorParallel,
        path: str | None = None,
    ) -> None:  # fmt: skip
        """caches: the rank's KV tensors, [num_blocks, ...] each."""
        self.tp = tp
        self.num_slots = num_slots
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

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy blocks this step computed into their slots (after the forward)."""
        ids = torch.tensor(block_ids, device=self.device)
        rows = torch.tensor(slots)
        for view, offset in zip(self.views, self.offsets, strict=True):
            self.host[rows, offset : offset + view.shape[1]] = view[ids].cpu()

    def start_loads(self, loads: list[KVLoad]) -> None:
        for load in loads:
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

    def finished_loads(self, wait: bool = False) -> list[str]:
        """The requests whose loads finished on every rank (each rank calls this at the
        same point of the same step). wait: give the oldest a moment first."""
        if not self.loads:
            return []
        if wait:
            with contextlib.suppress(TimeoutError):
                self.loads[0][1].result(timeout=POLL_WAIT_S)
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
        return finished

    def drain(self) -> None:
        """Wait out every load (a new scheduler stream: its blocks are the new one's)."""
        for _, job in self.loads:
            try:
                job.result()
            except Exception:
                log.exception("a host-tier load failed while draining")
        self.loads.clear()
