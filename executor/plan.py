"""A step as the executor receives it: a diff against its persistent batch. The
scheduler core's SchedulerOutput has the same shape and is accepted as is."""

from collections.abc import Sequence
from dataclasses import dataclass, field

from executor.sampling import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request the executor does not hold (new, or resumed after preemption with
    its outputs so far in token_ids)."""

    req_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: Sequence[int]
    num_computed_tokens: int = 0  # prefix-cache hits: already in the KV cache


@dataclass(slots=True)
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[Sequence[int]] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_resumed_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    # Tokens to compute per request, in batch order; a request samples when this step
    # reaches the end of its known tokens, and tokens come back in this order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
