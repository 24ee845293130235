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
from dataclasses import dataclass, field

# A new request's acceptance estimate, before any of its drafts was verified.
SPEC_PRIOR_ACCEPTANCE = 0.8
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

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified draft, the bonus token included (vLLM's AL)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
