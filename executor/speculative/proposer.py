"""What fills the scheduler's draft slots: a Proposer sees the persistent batch's
requests come and go, proposes each step's drafts on rank 0 (the one place drafts
are decided: under tensor parallelism the other ranks take them from it), and hears
what verification kept."""

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from flagstop.executor.input_batch import InputBatch
from flagstop.executor.speculative.config import SpeculativeConfig
from flagstop.executor.speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from flagstop.executor.step_inputs import StepInputs


class Proposer(Protocol):
    # A draft model's own KV cache, on the target's blocks: its bytes a block, its
    # tensors (every KV tensor a transfer moves), and where it is made.
    block_bytes: int
    kv_caches: list

    def allocate(self, num_blocks: int) -> None:
        """Its cache, once the target's pool is sized."""

    def add(self, req_id: str, row: int, batch: InputBatch) -> None:
        """A request took a row (new, or resumed with its outputs so far)."""

    def remove(self, req_id: str) -> None:
        """It left the batch (finished or preempted)."""

    def propose(
        self, batch: InputBatch, rows: np.ndarray, slots: np.ndarray
    ) -> tuple[list[np.ndarray], torch.Tensor | None]:
        """Up to slots[i] drafts for each rows[i] (the tokens after its known ones),
        and their draft distributions ([sum, V]) when drafting samples."""

    def verified(
        self, batch: InputBatch, rows: np.ndarray, num_known: np.ndarray, num_sampled: np.ndarray
    ) -> None:
        """After the step: rows[i] had num_known[i] tokens and took num_sampled[i]."""

    def computed(self, batch: InputBatch, inputs: "StepInputs") -> None:
        """After the step (once verified): its inputs and the forward's final hidden
        states (inputs.hidden), for a drafter that reads the target's (mtp)."""

    def reset(self) -> None:
        """A new scheduler stream: no request is left."""


class NoProposer:
    """Proposes nothing and holds nothing: a rank other than 0 (it takes rank 0's
    drafts), and the base of the proposers without a cache of their own."""

    block_bytes = 0
    kv_caches: tuple = ()

    def allocate(self, num_blocks: int) -> None:
        pass

    def add(self, req_id: str, row: int, batch: InputBatch) -> None:
        pass

    def remove(self, req_id: str) -> None:
        pass

    def propose(self, batch, rows, slots):
        return [np.zeros(0, np.int64) for _ in range(len(rows))], None

    def verified(self, batch, rows, num_known, num_sampled) -> None:
        pass

    def computed(self, batch, inputs) -> None:
        pass

    def reset(self) -> None:
        pass


class NgramProposer(NoProposer):
    """Prompt lookup (executor/speculative/ngram.py): stateless."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch, rows, slots):
        drafts = [
            propose_ngram(batch.token_ids[row, : batch.num_tokens[row]], int(k),
                          self.min_n, self.max_n).astype(np.int64)
            for row, k in zip(rows.tolist(), slots.tolist(), strict=True)
        ]  # fmt: skip
        return drafts, None
