"""Tensor parallelism inside the model: which slice of each weight a rank holds, and
the collectives of its forward (torch.distributed: NCCL on CUDA, gloo on the CPU).

A rank of N holds: its N-th of the query heads (column-parallel q/k/v), of the KV
heads (or one KV head, replicated, when N > the model's KV heads), of the MLP's inner
size (column-parallel gate/up), of the padded vocabulary (embedding and LM head); the
row-parallel o_proj and down_proj end in one all-reduce each, the embedding in one,
and the LM head's logits are gathered to rank 0, which samples. With N = 1 nothing
is split and no collective runs: the single-process path is the same code.

A Mixture-of-Experts layer's experts are sliced like the MLP (each rank holds its
N-th of every expert's inner size), or, with expert parallelism, placed whole (each
rank holds N-th of the experts); either way the router is replicated, every rank
routes every token identically, and one all-reduce per layer sums the ranks' parts."""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flagstop.utils import cdiv

if TYPE_CHECKING:
    from flagstop.executor.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Shard:
    """The slices one rank of `size` holds."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def heads(self, num_heads: int) -> tuple[int, int]:
        """(first head, heads) of the query heads."""
        per = num_heads // self.size
        return self.rank * per, per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads): split while there are enough, else one each, the
        ranks of a query-head group sharing (replicating) its KV head."""
        if self.size <= num_kv_heads:
            per = num_kv_heads // self.size
            return self.rank * per, per
        return self.rank * num_kv_heads // self.size, 1

    def split(self, size: int) -> tuple[int, int]:
        per = size // self.size
        return self.rank * per, per

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first expert, experts) this rank runs: all of them unless expert-parallel."""
        return self.split(num_experts) if self.expert_parallel else (0, num_experts)

    def expert_inner(self, size: int) -> tuple[int, int]:
        """(first, length) of each expert's inner size: whole under expert parallelism."""
        return (0, size) if self.expert_parallel else self.split(size)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the vocabulary padded to a multiple of the ranks."""
        per = cdiv(vocab_size, self.size)
        return self.rank * per, per


def check_divisible(c: "ModelConfig", size: int, expert_parallel: bool = False) -> str:
    """Why the model cannot be split `size` ways, or "" when it can."""
    if expert_parallel and c.moe is None:
        return f"--expert-parallel: {c.architecture} has no experts"
    if c.num_heads % size:
        return f"{c.num_heads} attention heads do not split into {size} ranks"
    if c.num_kv_heads % size and size % c.num_kv_heads:
        return f"{c.num_kv_heads} KV heads neither split into nor divide {size} ranks"
    if c.recurrent is not None and c.recurrent.num_k_heads % size:
        return (f"linear_num_key_heads={c.recurrent.num_k_heads} (gated DeltaNet) does not "
                f"split into {size} ranks")  # fmt: skip
    moe = c.moe
    if (moe is None or not all(moe.sparse_layers)) and c.intermediate_size % size:
        return f"the MLP size {c.intermediate_size} does not split into {size} ranks"
    if moe is None:
        return ""
    if expert_parallel and moe.num_experts % size:
        return f"num_experts={moe.num_experts} does not split into {size} ranks (--expert-parallel)"
    if not expert_parallel and moe.intermediate_size % size:
        return (f"the experts' size {moe.intermediate_size} does not split into {size} ranks "
                "(--expert-parallel places whole experts instead)")  # fmt: skip
    if moe.shared_expert_intermediate_size % size:
        return (f"shared_expert_intermediate_size={moe.shared_expert_intermediate_size} "
                f"does not split into {size} ranks")  # fmt: skip
    return ""


@dataclass(slots=True)
class TensorParallel:
    """The collectives of a forward. `device_group` carries activations (NCCL on CUDA,
    gloo on the CPU); `cpu_group` (gloo) carries control messages."""

    shard: Shard = field(default_factory=Shard)
    device_group: object = None
    cpu_group: object = None
    store: object = None  # the group's rendezvous store (torch.distributed.Store)
    # Time spent in collectives, for the benchmark (perf_counter seconds).
    collective_s: float = 0.0

    @property
    def size(self) -> int:
        return self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard.size > 1:
            started = time.perf_counter()
            dist.all_reduce(x, group=self.device_group)
            self.collective_s += time.perf_counter() - started
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """x of every rank concatenated along the last dim on rank 0; None elsewhere."""
        if self.shard.size == 1:
            return x
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.device_group)
        self.collective_s += time.perf_counter() - started
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_over_ranks(self, value: int) -> int:
        return self.mins_over_ranks([value])[0]

    def mins_over_ranks(self, values: list[int]) -> list[int]:
        """Each value's least over the ranks (every rank passes as many)."""
        if self.shard.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t.tolist()


SINGLE = TensorParallel()
