"""The persistent batch: every request the executor holds, kept between steps in
preallocated arrays (one row per request), so that a step's diff from the scheduler
is a few bytes per request and input preparation is vectorised."""

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.utils import cdiv


class BatchDesync(RuntimeError):
    """The scheduler's view and ours disagree: the executor must be reset."""


class ScheduledRows(NamedTuple):
    """A step's requests in plan order, by row: tokens to compute (drafts not counted),
    sequence lengths after the step, which of them sample (indices into rows), their
    draft slots, and which pooling requests end their prompt (indices into rows)."""

    rows: np.ndarray
    num_scheduled: np.ndarray
    seq_lens: np.ndarray
    samples: np.ndarray
    slots: np.ndarray
    pooled: np.ndarray


class InputBatch:
    """Bookkeeping only (numpy): the model runner turns it into a forward's tensors
    (executor/step_inputs.py), the simulator into its tokens."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
        speculative: bool = False, num_groups: int = 1, recurrent_groups: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        """speculative: the scheduler may count drafts of steps in flight as computed
        before their rejection is known: its num_computed_tokens may run ahead.
        num_groups: KV cache groups, each with its block table (kv_groups.py), of which
        recurrent_groups hold states (their step metadata is a RecurrentMetadata)."""
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.speculative = speculative
        self.block_size, self.vocab_size = block_size, vocab_size
        # int32: at long max_model_len this table is the batch's largest allocation.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        # Per KV cache group (block_table: the first group's, full attention if any),
        # all of one length: a plan's ids come position-major, a group's each.
        self.num_groups, self.recurrent_groups = num_groups, recurrent_groups
        self.block_tables = [np.zeros((max_num_reqs, cdiv(max_model_len, block_size)), np.int32)
                             for _ in range(num_groups)]  # fmt: skip
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, np.int64)
        # Sampling parameters by row, so that a step gathers them instead of looping
        # over requests; the rare per-request work (seeds, min_tokens) reads the params.
        self.sampling_params: list[SamplingParams] = [SamplingParams()] * max_num_reqs
        self.temperature = np.zeros(max_num_reqs, np.float32)
        self.top_p = np.ones(max_num_reqs, np.float32)
        self.top_k = np.zeros(max_num_reqs, np.int64)  # vocab_size where off
        self.min_tokens = np.zeros(max_num_reqs, np.int64)
        self.seeded = np.zeros(max_num_reqs, np.bool_)
        self.num_logprobs = np.full(max_num_reqs, -1, np.int64)  # -1: none asked
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, np.int64)
        self.penalized = np.zeros(max_num_reqs, np.bool_)  # any of the three penalties
        self.biased = np.zeros(max_num_reqs, np.bool_)
        self.min_p = np.zeros(max_num_reqs, np.float32)
        self.pools = np.zeros(max_num_reqs, np.bool_)  # pooling requests' rows
        self.lora_names: list[str | None] = [None] * max_num_reqs  # None: the base model
        # Rows whose request failed here (a grammar that did not compile, an adapter
        # not loaded): they still run (the batch goes on), their tokens are -1, and
        # the scheduler ends them with an error.
        self.failed_rows: set[int] = set()
        self.req_rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    # -- the diff --------------------------------------------------------------

    def apply(self, plan: SchedulerOutput) -> None:
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            row = self.req_rows.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
                self.failed_rows.discard(row)
        for req_id, num_blocks in plan.trimmed_blocks.items():
            row = self.req_rows.get(req_id)
            if row is not None:
                self.num_blocks[row] = min(self.num_blocks[row], num_blocks)
        for data in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            self._add(data)
        cached = plan.scheduled_cached_reqs
        for req_id, num_computed, new_block_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            row = self._row(req_id)
            ours = self.num_computed_tokens[row]
            if ours != num_computed and not (self.speculative and ours < num_computed):
                raise BatchDesync(
                    f"{req_id}: scheduler says {num_computed} computed tokens, "
                    f"executor has {self.num_computed_tokens[row]}"
                )
            if new_block_ids:
                self._append_blocks(row, new_block_ids)

    def _add(self, data: NewRequestData) -> None:
        if data.req_id in self.req_rows:
            raise BatchDesync(f"{data.req_id} is already in the batch")
        if not self.free_rows:
            raise BatchDesync(f"more than {self.max_num_reqs} requests in the batch")
        num_tokens = len(data.token_ids)
        # Room for the token it samples (a pooling request samples none).
        if num_tokens > self.max_model_len - (0 if data.pools else 1):
            raise BatchDesync(
                f"{data.req_id}: {num_tokens} tokens, max_model_len {self.max_model_len}"
            )
        row = self.free_rows.pop()
        self.req_rows[data.req_id] = row
        self.token_ids[row, :num_tokens] = data.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, data.block_ids)
        self._set_sampling(row, data.sampling_params or SamplingParams())
        self.lora_names[row] = data.lora_name or None

    def _set_sampling(self, row: int, p: SamplingParams) -> None:
        self.sampling_params[row] = p
        self.temperature[row], self.top_p[row] = p.temperature, p.top_p
        self.top_k[row] = p.top_k if p.top_k > 0 else self.vocab_size
        self.min_tokens[row] = p.min_tokens if p.stop_token_ids else 0
        self.seeded[row] = p.seed is not None and p.temperature > 0
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.penalized[row], self.biased[row] = p.has_penalties, bool(p.logit_bias)
        self.min_p[row] = p.min_p
        self.pools[row] = p.pooling is not None

    def _append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        start, n = self.num_blocks[row], len(block_ids) // self.num_groups
        if self.num_groups == 1:
            self.block_table[row, start : start + n] = block_ids
        else:
            for g, table in enumerate(self.block_tables):
                table[row, start : start + n] = block_ids[g :: self.num_groups]
        self.num_blocks[row] = start + n

    def _row(self, req_id: str) -> int:
        row = self.req_rows.get(req_id)
        if row is None:
            raise BatchDesync(f"{req_id} is not in the batch")
        return row

    # -- one step ----------------------------------------------------------------

    def scheduled_rows(self, plan: SchedulerOutput) -> ScheduledRows:
        """The plan's requests by row: a request samples when this step reaches the
        end of its known tokens, and one with draft slots then verifies up to that
        many drafts after them. Positions are ours: the scheduler's count may include
        drafts rejected since."""
        rows = np.fromiter((self._row(r) for r in plan.num_scheduled_tokens), np.int64)
        num_scheduled = np.fromiter(plan.num_scheduled_tokens.values(), np.int64, len(rows))
        slots = np.zeros(len(rows), np.int64)
        if plan.num_draft_slots:
            drafts = plan.num_draft_slots
            slots = np.fromiter((drafts.get(r, 0) for r in plan.num_scheduled_tokens),
                                np.int64, len(rows))  # fmt: skip
            num_scheduled = num_scheduled - slots
        seq_lens = self.num_computed_tokens[rows] + num_scheduled
        if (seq_lens > self.num_tokens[rows]).any() or (num_scheduled < 1).any():
            raise BatchDesync("a request is scheduled past its known tokens")
        if (seq_lens > self.num_blocks[rows] * self.block_size).any():
            raise BatchDesync("a request is scheduled past its blocks")
        ends, pools = seq_lens == self.num_tokens[rows], self.pools[rows]
        samples, pooled = np.flatnonzero(ends & ~pools), np.flatnonzero(ends & pools)
        if slots.any() and slots[np.setdiff1d(np.arange(len(rows)), samples)].any():
            raise BatchDesync("draft slots for a request that does not sample")
        return ScheduledRows(rows, num_scheduled, seq_lens, samples, slots, pooled)

    def fail_tokens(self, sampling_rows: np.ndarray, token_ids: list[int]) -> list[int]:
        """The step's tokens (one per entry of sampling_rows) with the failed rows' -1."""
        return [-1 if row in self.failed_rows else token
                for row, token in zip(sampling_rows.tolist(), token_ids, strict=True)]  # fmt: skip

    def advance(
        self, rows: np.ndarray, num_scheduled: np.ndarray, sampling_rows: np.ndarray,
        sampled_token_ids: list[int], num_sampled: list[int] | None = None,
    ) -> None:  # fmt: skip
        """After the step: the scheduled tokens are computed, the sampled ones known.
        With drafts, sampling row i took num_sampled[i] tokens (its accepted drafts,
        computed in the step, then one more)."""
        self.num_computed_tokens[rows] += num_scheduled
        if num_sampled is None:
            self.token_ids[sampling_rows, self.num_tokens[sampling_rows]] = sampled_token_ids
            self.num_tokens[sampling_rows] += 1
            return
        counts = np.asarray(num_sampled, np.int64)
        token_rows = np.repeat(sampling_rows, counts)
        offsets = np.arange(len(token_rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.token_ids[token_rows, self.num_tokens[token_rows] + offsets] = sampled_token_ids
        self.num_computed_tokens[sampling_rows] += counts - 1
        self.num_tokens[sampling_rows] += counts
