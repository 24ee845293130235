"""Speculative decoding in the scheduler: how many draft slots a decode gets in a
step, and what the drafts achieved (vLLM's spec-decode counters).

The executor proposes the drafts (it alone knows the tokens of the steps in flight)
and verifies them; the scheduler budgets them. A decode gets up to k slots from the
token budget left once every running request has its own token, never at the cost
of a preemption, and k adapts:
- per request: draft j is verified only while its estimated chance of surviving,
  acceptance**j, is at least `speculative_min_gain`; a request whose drafts are not
  worth even one slot decodes plainly, and drafts one token every PROBE_INTERVAL
  steps (the same step for all: their verification rows cost one step in
  PROBE_INTERVAL, not a few rows in every step) so that its acceptance keeps being
  measured (text turns repetitive: code, quotes, a JSON echo);
- per batch: from `speculative_disable_batch_size` decodes on, the forward is
  compute-bound and verification rows cost as much as real ones, so no request
  drafts (k = 0 is the plain path: no draft, no extra row).
The thresholds are docs/speculative.md's measurements (bench/spec_bench.py)."""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager
from flagstop.scheduler_svc.core.output import SchedulerOutput, StepOutcome
from flagstop.scheduler_svc.core.request import RUNNING, Request
from flagstop.scheduler_svc.core.step import Step

# Weight of a step's acceptance in the running estimate.
ACCEPTANCE_EMA_WEIGHT = 0.3
# A request not worth drafting for still drafts one token in steps whose id is a
# multiple of this.
PROBE_INTERVAL = 16


def num_draft_slots(acceptance: float, max_k: int, min_gain: float) -> int:
    """The most drafts worth verifying at this acceptance (0..max_k)."""
    if acceptance >= 1.0:
        return max_k
    if acceptance < min_gain:
        return 0
    return min(max_k, int(math.log(min_gain) / math.log(acceptance)))


def updated_acceptance(acceptance: float, num_slots: int, num_accepted: int) -> float:
    rate = num_accepted / num_slots
    return acceptance + ACCEPTANCE_EMA_WEIGHT * (rate - acceptance)


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since start, as vLLM counts them: a draft is one request's proposal in
    one step (of num_draft_tokens tokens), accepted_per_pos[j] how often its token j
    was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_proposed:
            per_pos.extend([0] * (num_proposed - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1


class DraftBudget:
    """The scheduler's side of speculative decoding (k > 0): the draft slots each step
    gives its decodes, the rollback of what the executor rejected, and the counters.
    NoDrafts is the plain path's: the core calls both the same way."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.max_k = config.num_speculative_tokens
        self.min_gain = config.speculative_min_gain
        self.disable_batch_size = config.speculative_disable_batch_size
        self.stats = SpecDecodingStats()
        # Block tables cut since the last plan (rejected drafts), for the next one.
        self.trimmed_blocks: dict[str, int] = {}

    def add_slots(self, step: Step, kv: KVCacheManager, step_id: int) -> None:
        """Draft slots for the decodes, from the budget every running request already
        had its token of (so drafts never crowd a decode out), never at the cost of a
        preemption; capped at the request's last token (max_tokens, max_model_len)."""
        scheduled = step.num_scheduled_tokens
        decodes = [
            (i, r) for i, r in enumerate(step.running_reqs)
            if scheduled[r.request_id] == 1 and r.num_computed_tokens + 1 == r.num_tokens_with_spec
        ]  # fmt: skip
        if len(decodes) >= self.disable_batch_size:
            return
        # Requests not worth drafting for probe one slot, all in the same step: the
        # verification rows' cost stays in one step of PROBE_INTERVAL.
        probe = int(step_id % PROBE_INTERVAL == 0)
        for i, request in decodes:
            if step.token_budget <= 0:
                return
            k = min(self._cap(request), request.max_num_tokens - request.num_tokens_with_spec - 1,
                    step.token_budget, num_draft_slots(request.spec_acceptance, self.max_k,
                                                       self.min_gain) or probe)  # fmt: skip
            if k <= 0:
                continue
            block_ids = kv.allocate_slots(request, 1 + k)
            if block_ids is None:
                continue  # the pool is short: this decode goes without drafts
            if block_ids:
                step.running_new_block_ids[i] = [*step.running_new_block_ids[i], *block_ids]
            scheduled[request.request_id] = 1 + k
            step.num_draft_slots[request.request_id] = k
            step.token_budget -= k

    def _cap(self, request: Request) -> int:
        """GenerateRequest.num_speculative_tokens caps the engine's k."""
        cap = request.num_speculative_tokens
        return self.max_k if cap is None else min(self.max_k, cap)

    def settle(
        self, request: Request, kv: KVCacheManager, num_slots: int, num_proposed: int,
        num_accepted: int,
    ) -> None:  # fmt: skip
        """A verified step: roll back what was rejected (or never proposed) of the
        optimistic advance, give back the blocks past it, and measure acceptance."""
        num_rejected = num_slots - num_accepted
        if num_rejected and request.status == RUNNING:  # preempted: it starts over anyway
            request.num_computed_tokens -= num_rejected
            num_blocks = kv.trim(request, request.num_computed_tokens)
            if num_blocks is not None:
                self.trimmed_blocks[request.request_id] = num_blocks
        if num_proposed:
            self.stats.record(num_proposed, num_accepted)
        # What a slot bought: a slot the proposer left empty (no n-gram match) is
        # budget and a proposer's search spent for nothing, as a rejected draft is.
        request.spec_acceptance = updated_acceptance(
            request.spec_acceptance, num_slots, num_accepted
        )

    def settle_step(
        self, plan: SchedulerOutput, outcome: StepOutcome, kv: KVCacheManager
    ) -> Iterator[tuple[Request, Sequence[int]]]:
        """A verified step, request by request (plan order): each one still running and
        its tokens (1 + its accepted drafts), once the rest of its optimistic advance
        is rolled back."""
        counts, proposed = outcome.num_sampled_tokens, outcome.num_draft_tokens
        slots, start = plan.num_draft_slots, 0
        for i, request in enumerate(plan.sampling_requests):
            start += counts[i]
            if request.status.is_finished:
                continue  # finished or aborted while this step was in flight
            num_slots = slots.get(request.request_id, 0)
            request.num_output_placeholders -= 1 + num_slots
            if num_slots:
                num_proposed = proposed[i] if proposed else num_slots
                self.settle(request, kv, num_slots, num_proposed, counts[i] - 1)
            yield request, outcome.token_ids[start - counts[i] : start]

    def take_trimmed(self) -> dict[str, int]:
        """The cuts for the next plan (sent once)."""
        trimmed = self.trimmed_blocks
        if trimmed:
            self.trimmed_blocks = {}
        return trimmed

    def forget(self, request_id: str) -> None:
        """Preempted: its block table starts over, no cut to send."""
        self.trimmed_blocks.pop(request_id, None)

    def reset(self) -> None:
        """A new executor starts from an empty batch: nothing of the old to cut."""
        self.trimmed_blocks = {}


class NoDrafts(DraftBudget):
    """k = 0: no slot is ever given, so nothing is settled or cut."""

    def add_slots(self, step: Step, kv: KVCacheManager, step_id: int) -> None:
        return None


def draft_budget(config: SchedulerConfig) -> DraftBudget:
    return DraftBudget(config) if config.num_speculative_tokens else NoDrafts(config)
