"""One step's plan while the scheduler builds it: what the core loop and the feature
components it calls (drafts, KV transfers) all write to. A floor below them all, so
that none imports the scheduler."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.adapter_seats import AdapterSeats
from flagstop.scheduler_svc.core.decision import UNLIMITED, StepDecision
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.output import CachedRequestData, NewRequestData, SchedulerOutput
from flagstop.scheduler_svc.core.request import PREEMPTED, Request


@dataclass(slots=True)
class Step:
    token_budget: int
    # The policy's: prefill (and recompute) tokens left this step, each request's cap.
    prefill_budget: int = UNLIMITED
    chunk_caps: dict[str, int] = field(default_factory=dict)
    # Waiting request ids the policy deferred this step.
    defer: frozenset[str] = frozenset()
    # Running request ids the policy held out of this step.
    hold: frozenset[str] = frozenset()
    # The LoRA adapters the batch runs, counted before admission (schedule()).
    seats: AdapterSeats = field(default_factory=lambda: AdapterSeats(0))
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    running_reqs: list[Request] = field(default_factory=list)
    running_new_block_ids: list[Sequence[int]] = field(default_factory=list)
    # Admitted from the waiting queue, in order: new ones and resumed ones.
    admitted_reqs: list[Request] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_draft_slots: dict[str, int] = field(default_factory=dict)
    # The encoder's: embedding tokens it may still compute this step, and the images
    # it computes (encoder_cache.py).
    encoder_budget: int = 0
    encoder_inputs: list[MediaPlaceholder] = field(default_factory=list)

    @classmethod
    def of(cls, token_budget: int, decision: StepDecision, encoder_budget: int = 0) -> "Step":
        return cls(
            token_budget,
            decision.prefill_budget,
            decision.chunk_caps,
            decision.defer,
            decision.hold,
            encoder_budget=encoder_budget,
        )

    def cap_prefill(self, request_id: str, num_tokens: int) -> int:
        """A prefill chunk of num_tokens as the policy's budget and cap allow."""
        cap = self.chunk_caps.get(request_id, num_tokens) if self.chunk_caps else num_tokens
        return min(num_tokens, cap, self.prefill_budget)

    def unschedule(self, request: Request) -> None:
        """A request scheduled earlier in this step became a preemption victim (only
        the priority policy picks one that was): give its tokens back."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        index = self.running_reqs.index(request)
        del self.running_reqs[index], self.running_new_block_ids[index]
        self.num_draft_slots.pop(request.request_id, None)
        self.token_budget += num_tokens
        if num_tokens > 1:
            self.prefill_budget += num_tokens

    def advance(self, sampling: list[Request], pooling: list[Request]) -> int:
        """Advance the scheduled requests, running then admitted (the plan's order);
        those that reach their end sample: appended to `sampling` (a pooling request
        pools instead, with no token in flight: to `pooling`). Returns the step's
        context tokens.

        Advanced at schedule time, not on output, so that the next step can be
        planned while this one runs: a chunked prefill continues, and a request whose
        chunk reaches its end holds a placeholder for the token in flight. Drafts are
        counted as if all were accepted (vLLM's optimistic advance): the result rolls
        back what was rejected."""
        num_scheduled_tokens, drafts = self.num_scheduled_tokens, self.num_draft_slots
        num_context = 0
        for requests in (self.running_reqs, self.admitted_reqs):
            for request in requests:
                request.num_computed_tokens += num_scheduled_tokens[request.request_id]
                num_context += request.num_computed_tokens
                num_drafts = drafts.get(request.request_id, 0) if drafts else 0
                if request.num_computed_tokens - num_drafts == (
                    len(request.all_token_ids) + request.num_output_placeholders  # with spec
                ):
                    if request.pools:
                        pooling.append(request)
                        continue
                    request.num_output_placeholders += 1 + num_drafts
                    sampling.append(request)
        return num_context

    def plan(
        self, step_id: int, finished_req_ids: set[str], trimmed_blocks: dict[str, int],
        block_ids: Callable[[str], list[int]],
    ) -> SchedulerOutput:  # fmt: skip
        """The plan, a diff for the executor's persistent batch: admitted requests in
        full (a resumed one with its outputs so far), running ones by id and counters.
        Its sampling requests are the core's to fill in."""
        new_reqs, resumed_reqs = [], []
        for request in self.admitted_reqs:
            blocks = block_ids(request.request_id)
            if request.status == PREEMPTED:
                tokens = list(request.all_token_ids)
                resumed_reqs.append(NewRequestData.from_request(request, tokens, blocks))
            else:
                tokens = request.prompt_token_ids
                new_reqs.append(NewRequestData.from_request(request, tokens, blocks))
        running = self.running_reqs
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_resumed_reqs=resumed_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in running],
                num_computed_tokens=[r.num_computed_tokens for r in running],
                new_block_ids=self.running_new_block_ids,
            ),
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            sampling_requests=[],
            num_draft_slots=self.num_draft_slots,
            trimmed_blocks=trimmed_blocks,
            encoder_inputs=[m.hash for m in self.encoder_inputs],
            num_encoder_tokens=sum(m.length for m in self.encoder_inputs),
        )
