"""Iteration-level scheduling (vLLM V1 style): no prefill or decode phases, each
request's `num_computed_tokens` is pushed towards its known tokens under a token
budget, and requests join and leave the batch at every step.

The loop is the seed's; each feature is a component called at a named seam, with a
null variant when the feature is off, so the loop never asks whether one is on:
- `self.drafts` (speculative.py): draft slots for decodes, rollback of rejected ones;
- `self.transfers` (kv_transfers.py): KV beyond the pool, around the KV connector;
- LoRA is one admission rule, the step's `AdapterSeats` (adapter_seats.py);
- `self.policy_step` (policy_step.py): the policy, its shadow and the step-cost model;
  once a step a decision (decision.py: the waiting order, shed, defer, a prefill
  budget, chunk caps), checked there; the null decision of fcfs and priority changes
  nothing.

The rule of this file: a feature adds a component and a seam, not a branch or an
attribute here."""

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from flagstop.scheduler_svc.core.adapter_seats import AdapterSeats
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.decision import PolicyView
from flagstop.scheduler_svc.core.encoder_cache import encoder_cache
from flagstop.scheduler_svc.core.kv_cache_manager import (
    NO_NEW_BLOCKS,
    ComputedBlocks,
    KVCacheManager,
)
from flagstop.scheduler_svc.core.kv_connector import KVConnector
from flagstop.scheduler_svc.core.kv_events import NO_KV_EVENTS, KVEventLog, NoKVEvents
from flagstop.scheduler_svc.core.kv_groups import KVCacheGroup
from flagstop.scheduler_svc.core.kv_transfers import kv_transfers
from flagstop.scheduler_svc.core.limits import RequestRejected, check_admissible
from flagstop.scheduler_svc.core.output import (
    OwnerOutputs,
    SchedulerOutput,
    StepOutcome,
)
from flagstop.scheduler_svc.core.policy import SchedulingPolicy, policy_for
from flagstop.scheduler_svc.core.policy_step import PolicyStep
from flagstop.scheduler_svc.core.request import (
    FINISH_REASON,
    FINISHED_ERROR,
    FINISHED_LENGTH,
    FINISHED_STOPPED,
    FINISHED_TRANSFERRED,
    PREEMPTED,
    RUNNING,
    WAITING_FOR_REMOTE_KVS,
    Request,
    RequestStatus,
    Retention,
)
from flagstop.scheduler_svc.core.speculative import draft_budget
from flagstop.scheduler_svc.core.stats import LoadFigures, SchedulerStats, make_load, make_stats
from flagstop.scheduler_svc.core.step import Step

__all__ = ["RequestRejected", "Scheduler", "SchedulerStats"]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: SchedulingPolicy | None = None,
        connector: KVConnector | None = None,
        kv_groups: Sequence[KVCacheGroup] | None = None,
        clock: Callable[[], float] = time.time,
        kv_events: KVEventLog | NoKVEvents = NO_KV_EVENTS,
    ) -> None:
        """kv_groups: the executor's layers as KV cache groups (kv_groups.py); None:
        one full-attention group. clock: the time requests' arrival_time is in (the
        router's wall clock; a replay's virtual one). kv_events: told of every block
        the prefix cache gains and loses (kv_events.py; the shell publishes them)."""
        self.config = config
        self.kv_events = kv_events
        self.kv_groups = kv_groups
        policy = policy or policy_for(config)
        self.policy_step = PolicyStep(policy, self._policy_view, self._refuse, self._retain)
        self.drafts = draft_budget(config)
        self.encoder = encoder_cache(config)
        self.transfers = kv_transfers(connector)
        self.block_size = config.block_size  # read per token
        self.clock = clock
        self._new_pool(num_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting = policy.new_waiting_queue()
        # Oldest first: they are served first and the FCFS victim is popped from the end.
        self.running: list[Request] = []
        # Finished since the last plan while the executor still holds them.
        self.finished_req_ids: set[str] = set()
        self.step_id = 0
        self.num_preemptions = 0

    def _new_pool(self, num_blocks: int) -> None:
        """An empty pool of num_blocks, and the longest sequence it holds (the model's
        limit or the whole pool)."""
        config = self.config
        self.kv = KVCacheManager(num_blocks, config.block_size, not config.no_prefix_caching,
                                 self.kv_groups, config.retention_share, self.clock,
                                 self.kv_events)  # fmt: skip
        self.transfers.watch(self.kv)
        self.kv_capacity_tokens = self.kv.max_num_tokens(config.max_num_batched_tokens)
        self.max_model_len = min(config.max_model_len, self.kv_capacity_tokens)

    # -- requests in -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        config = self.config
        check_admissible(request, config.max_model_len, self.kv_capacity_tokens, config.max_loras)
        self.encoder.check(request)
        self._retain(request, request.retention)
        request.set_limits(self.max_model_len)
        self.transfers.on_add(request)
        self.kv.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _retain(self, request: Request, retention: Retention | None) -> None:
        """Its retention from now on, within the operator's bounds: a ttl cut to
        --max-retention-s (the router cut a client's already, and said so; a direct
        client's or a policy's is cut here), none where --retention-share is 0."""
        config = self.config
        if retention is not None and retention.ttl_s > config.max_retention_s:
            retention = replace(retention, ttl_s=config.max_retention_s)
        request.retention = retention if config.retention_share else None

    def abort(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Idempotent: unknown or already finished ids are ignored. A request whose
        step is in flight is freed now; its late token is dropped on arrival."""
        unique_ids = dict.fromkeys(request_ids)
        found = [r for rid in unique_ids if (r := self.requests.get(rid)) is not None]
        queued_ids = {r.request_id for r in found if not self._finish(r, status)}
        if found:
            self._drop_finished(queued_ids)

    def reset_executor(self, num_blocks: int | None = None, num_host_blocks: int = 0) -> None:
        """The executor was lost, and the KV cache with it: every request starts over
        by recompute (prompt + the tokens it already has), its steps in flight are
        forgotten, and the pool, sized by the new executor (None: the same size),
        begins empty; so does whatever the connector kept beyond it (num_host_blocks:
        the new executor's)."""
        # Loading or loaded, their blocks died with it: back to the head of the queue.
        for request in reversed(self.transfers.reset(num_host_blocks)):
            request.status = request.resume_status()
            self.waiting.prepend(request)
        # Oldest first back at the head of the queue, in the order they ran.
        for request in reversed(self.running):
            request.status = PREEMPTED
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.prepend(request)
        self.running = []
        for request in self.requests.values():
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
        prefix_stats = self.kv.prefix_stats
        self.kv_events.cleared()
        self._new_pool(num_blocks or self.kv.pool.num_blocks)
        self.kv.prefix_stats = prefix_stats
        # The new executor starts from an empty batch: nothing of the old to drop.
        self.finished_req_ids = set()
        self.drafts.reset()
        self.encoder = encoder_cache(self.config)

    # -- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = Step.of(self.config.max_num_batched_tokens, self.policy_step.decide(),
                       self.encoder.budget)  # fmt: skip
        self._schedule_riders(step)
        self.drafts.add_slots(step, self.kv, self.step_id)
        # Admitting while we had to preempt would only hand the freed blocks to a
        # newcomer and preempt again next step (thrashing).
        if not step.preempted_req_ids:
            step.seats = AdapterSeats.of(self.running, self.config.max_loras)
            self._schedule_loaded(step)
            self._schedule_waiting(step)
        self._drop_an_idle_hold(step)
        plan = self._make_output(step)
        self.policy_step.observe(plan, self.requests)
        self.transfers.attach(plan, self.kv)
        return plan

    def _policy_view(self) -> PolicyView:
        pool = self.kv.pool
        return PolicyView(self.clock(), self.waiting, self.running, pool.num_free_blocks,
                          pool.num_usable_blocks, self.block_size,
                          self.config.max_num_batched_tokens, self.policy_step.cost,
                          self._prefix_hit_tokens, self.config.max_num_seqs)  # fmt: skip

    def _prefix_hit_tokens(self, request: Request) -> int:
        if request.skip_prefix_cache:
            return 0
        return self.num_prefix_hit_blocks(request) * self.block_size

    def set_policy(self, policy: SchedulingPolicy) -> None:
        """Swap the live policy between steps (the next step is its)."""
        self.waiting = self.policy_step.swap(policy, self.waiting)

    def _schedule_riders(self, step: Step) -> None:
        """The running pass over the running requests the policy did not hold out of
        this step: held ones keep their blocks and their place, and are no victims."""
        if not step.hold:
            self._schedule_running(step)
            return
        running = self.running
        self.running = [r for r in running if r.request_id not in step.hold]
        self._schedule_running(step)
        self.running = [r for r in running if r.status == RUNNING]  # less the preempted

    def _drop_an_idle_hold(self, step: Step) -> None:
        """A hold that left the step empty (the request it was for could not be
        admitted: no seat, no blocks) is dropped and the held requests ride: no policy
        idles the engine while work it may run waits."""
        if step.hold and not step.num_scheduled_tokens:
            step.hold = frozenset()
            self._schedule_running(step)
            self.drafts.add_slots(step, self.kv, self.step_id)

    def _schedule_running(self, step: Step) -> None:
        # Running requests go first: they already hold KV blocks, and finishing them
        # is what frees the blocks that waiting requests need. Per running request per
        # step: its rule is inlined, the step's fields bound once, and a decode within
        # its slots skips the KV manager (with _append_plain: -26 % a step at 1024
        # decodes, 1.88 -> 1.39 µs a request, bench/scheduler_bench.py).
        running, i = self.running, 0
        threshold = self.config.long_prefill_token_threshold
        scheduled, running_reqs = step.num_scheduled_tokens, step.running_reqs
        running_new_block_ids, token_budget = step.running_new_block_ids, step.token_budget
        while i < len(running) and token_budget > 0:
            request = running[i]
            # Its new tokens: up to its known tokens and those in flight
            # (num_tokens_with_spec), within the budget and the long-prefill cap; none
            # once the token in flight ends it (computing another would be waste).
            num_tokens = len(request.all_token_ids) + request.num_output_placeholders
            num_new = num_tokens - request.num_computed_tokens
            if num_tokens >= request.max_num_tokens:
                num_new = 0
            elif num_new > 1:
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > token_budget:
                    num_new = token_budget
                if num_new > 1:  # a prefill (or recompute) chunk: the policy's caps apply
                    num_new = step.cap_prefill(request.request_id, num_new)
                    num_new = self.encoder.chunk(request, request.num_computed_tokens,
                                                 num_new, step)  # fmt: skip
            if num_new == 0:
                i += 1
                continue
            if request.num_computed_tokens + num_new <= request.num_ready_kv_slots:
                block_ids = NO_NEW_BLOCKS  # a decode within its slots (the common case)
            else:
                step.token_budget = token_budget  # preemption gives victims' tokens back
                block_ids, i = self._allocate_running(request, num_new, step, i)
                token_budget = step.token_budget
                if block_ids is None:
                    return  # it was the victim itself
            scheduled[request.request_id] = num_new
            running_reqs.append(request)
            running_new_block_ids.append(block_ids)
            token_budget -= num_new
            if num_new > 1:
                step.prefill_budget -= num_new
            i += 1
        step.token_budget = token_budget

    def _allocate_running(
        self, request: Request, num_new: int, step: Step, i: int
    ) -> tuple[Sequence[int] | None, int]:
        """Slots for running[i]'s num_new tokens, preempting the policy's victims until
        they fit: (its new block ids, its index now), or (None, _) when it was the
        victim itself."""
        running = self.running
        block_ids = self.kv.allocate_slots(request, num_new)
        while block_ids is None:
            victim_index = self.policy_step.policy.select_victim(running)
            victim = running.pop(victim_index)
            step.unschedule(victim)
            self._preempt(victim, step)
            if victim is request:
                return None, i
            if victim_index < i:
                i -= 1
            block_ids = self.kv.allocate_slots(request, num_new)
        return block_ids, i

    def _preempt(self, request: Request, step: Step) -> None:
        # Recompute, not swap: the blocks go back now and the request later
        # recomputes prompt + outputs (cheap while its prefix stays cached).
        self.kv.free(request.request_id, request.num_computed_tokens, request.retention)
        self.drafts.forget(request.request_id)
        self.encoder.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        step.preempted_req_ids.add(request.request_id)

    def _schedule_loaded(self, step: Step) -> None:
        """Requests whose KV arrived hold their blocks, and were admitted when their
        load started: they take seats before anyone waiting (else a request the pool
        cannot hold would stall them and the blocks they hold: vLLM #57841)."""
        loaded, passed = self.transfers.loaded, []
        while loaded and self._has_room(step):
            request = loaded.popleft()
            if not step.seats.admits(request):
                passed.append(request)
                continue
            num_new = self._num_prefill_tokens(request, request.num_computed_tokens, step)
            if num_new is None:
                loaded.appendleft(request)
                break
            self.kv.allocate_slots(request, num_new)  # within the blocks it reserved
            self._admit(request, request.num_computed_tokens, num_new, step)
        loaded.extendleft(reversed(passed))

    def _schedule_waiting(self, step: Step) -> None:
        # Waiting requests of an adapter that has no slot left this step, or that the
        # policy deferred, wait aside, in order, without holding up the others (vLLM's
        # skipped_waiting).
        skipped = []
        while self.waiting and self._has_room(step):
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token still in flight: resume once it is known
            admissible = request.request_id not in step.defer and step.seats.admits(request)
            found = self._find_computed(request) if admissible else None
            if found is None:
                skipped.append(self.waiting.pop())
                continue
            hits, num_cached, num_external = found
            if num_external and self.transfers.start_load(self.kv, request, hits, num_cached,
                                                          num_external):  # fmt: skip
                self.waiting.pop()
                continue
            if num_external and not self._idle():
                break  # its load waits for blocks that running requests will free
            # (A load takes the whole prompt's blocks in every group, a window group's
            # too: one the idle pool cannot hold is computed instead.)
            num_new = self._num_prefill_tokens(request, num_cached, step)
            if (
                num_new is None
                or not self._fits(request, hits)
                or (self.kv.allocate_slots(request, num_new, hits) is None)
            ):
                break  # head-of-line blocking keeps FCFS fair
            self.waiting.pop()
            self.transfers.nothing_to_load(request)
            self._admit(request, num_cached, num_new, step)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _idle(self) -> bool:
        """Nothing holds blocks that it will free: no request running or loading."""
        transfers = self.transfers
        return not (self.running or transfers.loading or transfers.loaded)

    def _has_room(self, step: Step) -> bool:
        return (step.token_budget > 0 and step.prefill_budget > 0
                and len(self.running) < self.config.max_num_seqs)  # fmt: skip

    def _fits(self, request: Request, hits: ComputedBlocks | None) -> bool:
        """--reserve-full-isl (the default): the pool could hold it whole."""
        config = self.config
        return not config.reserve_full_isl or self.kv.can_hold(
            request, hits, config.max_num_batched_tokens
        )

    def _num_prefill_tokens(self, request: Request, num_cached: int, step: Step) -> int | None:
        """This step's chunk of the request's prefill; None: it does not fit whole
        (--no-chunked-prefill) and must wait."""
        num_new = request.num_tokens - num_cached
        config = self.config
        if config.no_chunked_prefill:
            fits = num_new <= min(step.token_budget, step.cap_prefill(request.request_id, num_new))
            fits = fits and self.encoder.chunk(request, num_cached, num_new, step) == num_new
            return num_new if fits else None
        num_new = min(num_new, config.long_prefill_token_threshold or num_new, step.token_budget)
        num_new = step.cap_prefill(request.request_id, num_new)
        return self.encoder.chunk(request, num_cached, num_new, step) or None

    def _find_computed(self, request: Request) -> tuple[ComputedBlocks | None, int, int] | None:
        """(local hits, tokens they cover, tokens the connector can load), or None
        while the connector asks for time."""
        if request.skip_prefix_cache:
            return None, 0, 0
        hits = self.kv.get_computed_blocks(request)
        num_cached = len(hits) * self.block_size
        num_external = self.transfers.num_loadable(request, num_cached)
        return None if num_external is None else (hits, num_cached, num_external)

    def _admit(self, request: Request, num_cached: int, num_new: int, step: Step) -> None:
        step.seats.take(request)
        self.kv.prefix_stats.record(request.num_tokens, num_cached - request.num_loaded_tokens)
        self.transfers.on_admit(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        step.admitted_reqs.append(request)
        self.running.append(request)
        step.num_scheduled_tokens[request.request_id] = num_new
        step.token_budget -= num_new
        step.prefill_budget -= num_new

    def _make_output(self, step: Step) -> SchedulerOutput:
        output = step.plan(self.step_id, self.finished_req_ids, self.drafts.take_trimmed(),
                           self.kv.block_ids)  # fmt: skip
        for request in step.admitted_reqs:
            request.status = RUNNING
        # In num_scheduled_tokens order: running first, then admitted.
        output.num_context_tokens = step.advance(output.sampling_requests,
                                                 output.pooling_requests)  # fmt: skip
        output.encoder_frees = self.encoder.take_frees()
        self.finished_req_ids = set()
        self.step_id += 1
        return output

    # -- results in --------------------------------------------------------------

    def update_from_output(
        self, plan: SchedulerOutput, outcome: StepOutcome
    ) -> dict[str, OwnerOutputs]:
        """Apply one step's outcome: its tokens (a negative id marks a request the
        executor failed: it ends with an error, the rest of the batch goes on; every
        stop rule is applied at each token, so nothing past a stop is emitted), then
        the transfers that ended. Returns new tokens and finish reasons by owner."""
        outcome.check(plan)
        sampling, token_ids = plan.sampling_requests, outcome.token_ids
        outputs: dict[str, OwnerOutputs] = {}
        ended: list[tuple[Request, RequestStatus]] = []
        if not outcome.num_sampled_tokens:  # the plain path: a token per request
            self._append_plain(sampling, token_ids, outputs, ended)
        else:  # with drafts: their rollback settled first, a request's tokens in turn
            for request, tokens in self.drafts.settle_step(plan, outcome, self.kv):
                out = outputs.get(request.owner) or outputs.setdefault(request.owner,
                                                                       OwnerOutputs())  # fmt: skip
                for token_id in tokens:
                    if (status := self._append_token(request, token_id, out)) is not None:
                        ended.append((request, status))
                        break  # nothing past a stop
        if plan.pooling_requests:
            self._pooled(plan.pooling_requests, outcome.pooled, outputs, ended)
        if ended:
            self._end(ended, outputs)
        self.transfers.update(self.kv, outcome.transfers)
        return outputs

    @staticmethod
    def _pooled(
        pooling: list[Request], pooled: Sequence[bytes], outputs: dict[str, OwnerOutputs],
        ended: list[tuple[Request, RequestStatus]],
    ) -> None:  # fmt: skip
        """Each pooling request's pooled output ends it (empty: the executor failed it)."""
        for request, data in zip(pooling, pooled, strict=True):
            if request.status.is_finished:
                continue  # aborted while this step was in flight
            out = outputs.get(request.owner) or outputs.setdefault(request.owner, OwnerOutputs())
            if data:
                out.pooled[request.request_id] = data
            ended.append((request, FINISHED_STOPPED if data else FINISHED_ERROR))

    def _append_plain(
        self, sampling: list[Request], token_ids: Sequence[int],
        outputs: dict[str, OwnerOutputs], ended: list[tuple[Request, RequestStatus]],
    ) -> None:  # fmt: skip
        """A token per sampling request. A token no rule reads (not the first, no full
        block, no stop id, not the last) is appended here; the others by _append_token,
        where the rules are (per request per step: -5 % of update_from_output at 1024
        decodes, measured alternating both in one process)."""
        append, block_size, owner = self._append_token, self.block_size, None
        for request, token_id in zip(sampling, token_ids, strict=True):
            if request.status.is_finished:
                continue  # finished or aborted while this step was in flight
            request.num_output_placeholders -= 1
            if request.owner != owner:  # mostly one router: one lookup a step
                owner = request.owner
                out = outputs.get(owner) or outputs.setdefault(owner, OwnerOutputs())
                append_id, append_token_id = out.req_ids.append, out.new_token_ids.append
            tokens = request.all_token_ids
            num_tokens = len(tokens) + 1
            if (
                num_tokens % block_size and num_tokens < request.max_num_tokens
                and num_tokens != request.num_prompt_tokens + 1
                and token_id >= 0 and token_id not in request.stop_ids
            ):  # fmt: skip
                tokens.append(token_id)
                append_id(request.request_id)
                append_token_id(token_id)
            elif (status := append(request, token_id, out)) is not None:
                ended.append((request, status))

    def _end(self, ended: list[tuple[Request, RequestStatus]], outputs) -> None:
        queued_ids = set()
        for request, status in ended:
            out = outputs[request.owner]
            out.finished[request.request_id] = FINISH_REASON[status]
            out.num_cached_tokens.append(max(0, request.num_cached_tokens))
            if not self._finish(request, status):
                queued_ids.add(request.request_id)  # preempted: its late token ended it
            if status == FINISHED_TRANSFERRED and request.kv_handoff is not None:
                out.kv_transfers[request.request_id] = request.kv_handoff
        self._drop_finished(queued_ids)

    def _append_token(
        self, request: Request, token_id: int, out: OwnerOutputs
    ) -> RequestStatus | None:
        """One new token of a request; the status it ends with, or None."""
        if token_id < 0:
            return FINISHED_ERROR
        tokens = request.all_token_ids
        tokens.append(token_id)
        num_tokens = len(tokens)
        if num_tokens % self.block_size == 0:
            self.kv.update_block_hashes(request)
        if num_tokens == request.num_prompt_tokens + 1:
            request.first_token_time = self.clock()
        out.req_ids.append(request.request_id)
        out.new_token_ids.append(token_id)
        if token_id in request.stop_ids and (
            num_tokens - request.num_prompt_tokens >= request.stop.min_tokens
        ):
            return FINISHED_STOPPED
        if num_tokens >= request.max_num_tokens:
            return FINISHED_TRANSFERRED if request.do_remote_decode else FINISHED_LENGTH
        return None

    def _refuse(self, request: Request) -> None:
        """A waiting request the policy shed: freed here, out of the queue there."""
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> bool:
        """Free the request (or hold its blocks for a transfer still using them); the
        caller takes it out of the queues. Returns whether it was running (else it
        sits in the waiting queue)."""
        was_loading = request.status == WAITING_FOR_REMOTE_KVS
        was_running = request.status == RUNNING
        if was_running:
            # The executor still holds it; preempted ones were already dropped there.
            self.finished_req_ids.add(request.request_id)
        request.status = status
        if not self.transfers.finish(self.kv, request, was_loading):
            self.kv.free(request.request_id, retention=request.retention)
        self.encoder.free(request)
        del self.requests[request.request_id]
        return was_running

    def _drop_finished(self, queued_ids: set[str]) -> None:
        # One pass per step over the running list, not a list.remove per request.
        self.running = [r for r in self.running if not r.status.is_finished]
        if queued_ids:
            self.waiting.remove_all(queued_ids)
            self.transfers.drop_queued(queued_ids)

    # -- introspection -----------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Requests, or transfers whose blocks wait to be freed."""
        return bool(self.requests) or self.transfers.has_pending()

    def owner_of(self, request_id: str) -> str | None:
        request = self.requests.get(request_id)
        return None if request is None else request.owner

    def lora_requests(self) -> list[Request]:
        """The requests that run a LoRA adapter."""
        return [r for r in self.requests.values() if r.lora_name]

    def request_ids_by_owner(self) -> dict[str, list[str]]:
        by_owner: dict[str, list[str]] = {}
        for request in self.requests.values():
            by_owner.setdefault(request.owner, []).append(request.request_id)
        return by_owner

    @property
    def num_free_blocks(self) -> int:
        return self.kv.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """The blocks requests can hold (a window group's null block is not one)."""
        return self.kv.pool.num_usable_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage()

    def num_prefix_hit_blocks(self, request: Request) -> int:
        """Full blocks of the request's known tokens already in the prefix cache."""
        return len(self.kv.get_computed_blocks(request))

    def load(self) -> LoadFigures:
        """What the replica's load report says of the core (each step)."""
        return make_load(self)

    def stats(self) -> SchedulerStats:
        return make_stats(self)
