"""What the scheduler hands out: the step plan, `SchedulerOutput`, a diff for the
executor's persistent batch (the executor runs this same type, converted from its
protobuf twin on the wire), and each step's new tokens, grouped by the router that
owns the requests."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flagstop.scheduler_svc.core.kv_connector import (
    NO_TRANSFERS,
    KVConnectorMetadata,
    KVHandoff,
    KVTransferResult,
)
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.request import FinishReason, Request


@dataclass(slots=True)
class NewRequestData:
    """A request the executor does not hold: sent once, in full. Also used for a
    resumed request, whose token ids then include its outputs so far."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    # Opaque to the scheduler (the router's validated parameters, passed through);
    # the executor's conversion makes them its own SamplingParams.
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int = 0  # prefix-cache hits: already in the KV cache
    lora_name: str = ""  # the LoRA adapter it runs ("": the base model alone)
    media: tuple[MediaPlaceholder, ...] = ()  # its images' hashes and placeholders
    pools: bool = False  # a pooling request: pooled at its prompt's end, never sampled

    @classmethod
    def from_request(
        cls, request: Request, token_ids: list[int], block_ids: list[int]
    ) -> "NewRequestData":
        return cls(request.request_id, token_ids, request.num_prompt_tokens,
                   request.sampling_params, block_ids, request.num_computed_tokens,
                   request.lora_name, request.media, request.pools)  # fmt: skip


@dataclass(slots=True)
class CachedRequestData:
    """Requests the executor already holds, column by column: a decode costs an id,
    a counter and (once every block_size tokens) a block id."""

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int = 0
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_resumed_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Tokens to compute this step per request, in batch order. A request samples a
    # token when its chunk reaches the end of its known tokens (the executor's tokens
    # include the ones it sampled in steps we have not seen the outputs of yet).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Scheduler-side only: the scheduled requests' tokens in the KV cache once the step
    # ran (what its attention reads; the step-cost model's second term).
    num_context_tokens: int = 0
    # To drop from the persistent batch before this step runs.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Scheduler-side only: the requests that sample this step, in batch order; the
    # executor returns one token for each, in this order. (The executor finds them
    # from its own token counts and leaves this empty.)
    sampling_requests: list[Request] = field(default_factory=list)
    # Scheduler-side only: the pooling requests whose prompt ends this step, in batch
    # order; the executor returns a pooled output for each, in this order.
    pooling_requests: list[Request] = field(default_factory=list)
    # Speculative decoding: the draft slots of the decodes that have some (counted in
    # num_scheduled_tokens), and the block tables to cut before this step's new blocks
    # (rejected drafts gave back the blocks past their request's tokens).
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    trimmed_blocks: dict[str, int] = field(default_factory=dict)
    # KV connector: this step's loads and saves (None: no connector), and whether
    # transfers are under way that the result should report on.
    kv_connector: KVConnectorMetadata | None = None
    poll_kv_transfers: bool = False
    # The encoder's: images to run before this step's forward (their embeddings go
    # into the encoder cache), and cached embeddings to drop (encoder_cache.py).
    encoder_inputs: list[bytes] = field(default_factory=list)
    encoder_frees: list[bytes] = field(default_factory=list)
    # Scheduler-side only: their embedding tokens (the step-cost model's last term).
    num_encoder_tokens: int = 0

    @property
    def polls_only(self) -> bool:
        """Nothing to compute, only transfers under way to ask after."""
        return self.poll_kv_transfers and not self.num_scheduled_tokens

    @property
    def is_empty(self) -> bool:
        return not (
            self.num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids
            or self.trimmed_blocks or self.kv_connector or self.poll_kv_transfers
            or self.encoder_frees
        )  # fmt: skip


@dataclass(slots=True)
class StepOutcome:
    """What came back of one step: a token per sampling request of the plan, in plan
    order; with drafts, num_sampled_tokens[i] of them (1 + its accepted drafts) for
    request i, which was proposed num_draft_tokens[i]; and the transfers the executor's
    connector finished or failed since. (The executor's SampleOutput is one.)"""

    token_ids: Sequence[int]
    num_sampled_tokens: Sequence[int] = ()
    num_draft_tokens: Sequence[int] = ()
    transfers: KVTransferResult = NO_TRANSFERS
    # A pooled output per pooling request of the plan, in plan order (float32 bytes;
    # empty: the executor failed that request).
    pooled: Sequence[bytes] = ()

    def check(self, plan: "SchedulerOutput") -> None:
        """Raises ValueError when its tokens cannot be the plan's sampling requests', or
        its pooled outputs the pooling requests'."""
        sampling, counts = plan.sampling_requests, self.num_sampled_tokens
        expected = sum(counts) if counts else len(sampling)
        if len(self.token_ids) != expected or (counts and len(counts) != len(sampling)):
            raise ValueError(f"step {plan.step_id}: {len(self.token_ids)} sampled tokens for "
                             f"{len(sampling)} sampling requests")  # fmt: skip
        if len(self.pooled) != len(plan.pooling_requests):
            raise ValueError(f"step {plan.step_id}: {len(self.pooled)} pooled outputs for "
                             f"{len(plan.pooling_requests)} pooling requests")  # fmt: skip


@dataclass(slots=True)
class OwnerOutputs:
    """One step's new tokens for every request of one owner (router), column by column."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)
    finished: dict[str, FinishReason] = field(default_factory=dict)
    num_cached_tokens: list[int] = field(default_factory=list)  # per finished entry
    # Requests handed off (FinishReason.TRANSFER): where their KV waits.
    kv_transfers: dict[str, KVHandoff] = field(default_factory=dict)
    # Pooling requests that ended: their pooled outputs (float32 bytes).
    pooled: dict[str, bytes] = field(default_factory=dict)
