"""A policy's answer for one step, and what it sees to give it.

The loop asks its policy once a step (`decide`) at one seam, before it schedules
anything; beside the order of the waiting queue the answer may shed requests
(refused with a reason, the client told to retry later), defer some (not admitted
this step), cap the step's prefill tokens and each request's chunk, and set what
a request's prefix is kept for once it ends (docs/sessions.md). The null
answer, NO_DECISION, changes nothing: FCFS and priority give it."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.request import Request, Retention
from flagstop.scheduler_svc.core.step_cost import StepCostModel

UNLIMITED = 1 << 30


@dataclass(slots=True, frozen=True)
class StepDecision:
    # Waiting request ids, first to admit first (the rest behind, by arrival); None:
    # the queue's order stands.
    admission_order: Sequence[str] | None = None
    # Waiting requests refused now: request id -> why (the client's message).
    shed: dict[str, str] = field(default_factory=dict)
    # Waiting request ids not to admit this step.
    defer: frozenset[str] = frozenset()
    # Prefill (and recompute) tokens this step at most, over every request.
    prefill_budget: int = UNLIMITED
    # Request id -> its chunk this step at most.
    chunk_caps: dict[str, int] = field(default_factory=dict)
    # Running request ids that sit this step out (they keep their KV blocks).
    hold: frozenset[str] = frozenset()
    # Request id (waiting or running) -> the retention its prefix gets once it ends
    # (None: none, whatever it asked): applied once, as the policy decides it.
    retain: dict[str, Retention | None] = field(default_factory=dict)


NO_DECISION = StepDecision()


@dataclass(slots=True)
class PolicyView:
    """What a policy sees of the scheduler each step (the core's own objects: a
    built-in policy reads them, the remote one sends a snapshot of them)."""

    now: float
    waiting: Sequence[Request]
    running: Sequence[Request]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    token_budget: int
    cost: StepCostModel
    # Tokens of a request's prompt the prefix cache holds now (a lookup of each of its
    # blocks: a policy that asks per waiting request should remember the answer).
    prefix_hit_tokens: Callable[[Request], int]
    # Seats of the running batch (the scheduler's --max-num-seqs).
    max_num_seqs: int
