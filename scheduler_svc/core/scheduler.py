"""Iteration-level scheduling (vLLM V1 style): no prefill or decode phases, each
request's `num_computed_tokens` is pushed towards its known tokens under a token
budget, and requests join and leave the batch at every step."""

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from flagstop.scheduler_svc.core.kv_connector import KVConnector, KVTransferResult
from flagstop.scheduler_svc.core.limits import (
    RequestRejected,
    check_request_length,
    stop_token_ids,
)
from flagstop.scheduler_svc.core.output import (
    CachedRequestData,
    NewRequestData,
    OwnerOutputs,
    SchedulerOutput,
)
from flagstop.scheduler_svc.core.policy import SchedulingPolicy, make_policy
from flagstop.scheduler_svc.core.request import FINISH_REASON, Request, RequestStatus
from flagstop.scheduler_svc.core.speculative import (
    PROBE_INTERVAL,
    SpecDecodingStats,
    num_draft_slots,
    updated_acceptance,
)
from flagstop.utils import cdiv

RUNNING, PREEMPTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED
WAITING, LOADING = RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
ERROR, TRANSFERRED = RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_TRANSFERRED


@dataclass(slots=True)
class SchedulerStats:
    step_id: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_loading_reqs: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_kv_leases: int = 0


@dataclass(slots=True)
class _Step:
    """The plan of one step while it is being built."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    running_reqs: list[Request] = field(default_factory=list)
    running_new_block_ids: list[Sequence[int]] = field(default_factory=list)
    # Admitted from the waiting queue, in order: new ones and resumed ones.
    admitted_reqs: list[Request] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_draft_slots: dict[str, int] = field(default_factory=dict)

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


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        policy: SchedulingPolicy | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.config = config
        self.policy = policy or make_policy(config.policy)
        self.connector = connector
        self.kv = self._new_kv(num_blocks)
        # The longest sequence this engine can hold: the model's limit or the whole pool.
        self.max_model_len = min(config.max_model_len, num_blocks * config.block_size)
        self.block_size = config.block_size  # read per token
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.new_waiting_queue()
        # Oldest first: they are served first and the FCFS victim is popped from the end.
        self.running: list[Request] = []
        # Finished since the last plan while the executor still holds them.
        self.finished_req_ids: set[str] = set()
        self.step_id = 0
        self.num_preemptions = 0
        # Block tables cut since the last plan (rejected drafts), for the next one.
        self.trimmed_blocks: dict[str, int] = {}
        self.spec_stats = SpecDecodingStats()
        # KV connector: requests whose KV is arriving (WAITING_FOR_REMOTE_KVS), and
        # the blocks of ended requests a transfer still uses (an abort mid-load, a
        # hand-off a decode replica reads), freed when the executor reports the
        # transfer done: by the id it reports (the request's for a load, the
        # hand-off's transfer id), the keys the blocks are held under, oldest first.
        # Held apart from the request's id, which may come back meanwhile (a
        # remainder resubmitted).
        self.loading: dict[str, Request] = {}
        self.loaded: deque[Request] = deque()  # arrived, holding blocks: seated first
        self.freeing: dict[str, list[str]] = {}
        self.num_held = 0  # keys handed out to held blocks
        self.leased: set[str] = set()  # of those, hand-offs' (a prefill replica's)
        self.external_stats = PrefixCacheStats()  # tokens asked of / loaded by it

    def _new_kv(self, num_blocks: int) -> KVCacheManager:
        config = self.config
        kv = KVCacheManager(num_blocks, config.block_size, not config.no_prefix_caching)
        if self.connector is not None:
            kv.newly_cached = []
        return kv

    # -- requests in -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_admissible(request)
        stop = request.stop
        request.max_num_tokens = self.max_model_len
        if stop.max_tokens is not None:
            request.max_num_tokens = min(
                request.num_prompt_tokens + stop.max_tokens, self.max_model_len
            )
        if request.max_spec_tokens is not None:
            request.max_spec_tokens = max(0, request.max_spec_tokens)
        request.stop_ids = stop_token_ids(
            stop.stop_token_ids, request.eos_token_ids, stop.ignore_eos
        )
        if request.do_remote_decode:
            self._cap_for_handoff(request)
        self.kv.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _cap_for_handoff(self, request: Request) -> None:
        """A prefill replica's request ends with its first token, handed off (unless
        that token ends it anyway); without a connector that hands off, it runs whole."""
        first_token_end = request.num_prompt_tokens + 1
        if self.connector is None or not self.connector.hands_off or (
            request.max_num_tokens <= first_token_end
        ):  # fmt: skip
            request.do_remote_decode = False
            return
        request.max_num_tokens = first_token_end

    def _check_admissible(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        check_request_length(
            request.num_prompt_tokens, request.stop.max_tokens, self.config.max_model_len,
            self.kv.pool.num_blocks * self.config.block_size,
        )  # fmt: skip
        if request.lora_name and not self.config.max_loras:
            raise RequestRejected(f"LoRA adapter {request.lora_name!r}: this engine serves "
                                  "none (start the executor with --max-loras)")  # fmt: skip
        if request.lora_name and not request.lora_id:
            # Keyed by name alone, its blocks would be hit after the name is loaded
            # again from other files: the service always resolves the identity.
            raise RequestRejected(f"LoRA adapter {request.lora_name!r}: no identity "
                                  "(lora_id) given")  # fmt: skip

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

    def abort_all(self) -> dict[str, list[str]]:
        """Fail every request (FINISHED_ERROR); returns their ids by owner."""
        by_owner = self.request_ids_by_owner()
        self.abort(list(self.requests), RequestStatus.FINISHED_ERROR)
        return by_owner

    def reset_executor(self, num_blocks: int | None = None, num_tier_slots: int = 0) -> None:
        """The executor was lost, and the KV cache with it: every request starts over
        by recompute (prompt + the tokens it already has), its steps in flight are
        forgotten, and the pool, sized by the new executor (None: the same size),
        begins empty; so does the connector's tier (num_tier_slots, the new one's)."""
        # Loading or loaded, their blocks died with it: back to the head of the queue.
        for request in reversed([*self.loaded, *self.loading.values()]):
            request.status = PREEMPTED if request.num_preemptions else WAITING
            self.waiting.prepend(request)
        self.loading, self.loaded, self.freeing, self.leased = {}, deque(), {}, set()
        if self.connector is not None:
            self.connector.reset(num_tier_slots)
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
        config, stats = self.config, self.kv.prefix_stats
        num_blocks = num_blocks or self.kv.pool.num_blocks
        self.kv = self._new_kv(num_blocks)
        self.kv.prefix_stats = stats
        self.max_model_len = min(config.max_model_len, num_blocks * config.block_size)
        # The new executor starts from an empty batch: nothing of the old to drop.
        self.finished_req_ids = set()
        self.trimmed_blocks = {}

    # -- one step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if self.config.num_speculative_tokens:
            self._schedule_drafts(step)
        # Admitting while we had to preempt would only hand the freed blocks to a
        # newcomer and preempt again next step (thrashing).
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        output = self._make_output(step)
        if self.connector is not None:
            # Told once the plan is final: a preemption victim's blocks are not saved.
            self.connector.blocks_cached(self.kv.take_newly_cached())
            output.kv_connector = self.connector.build_connector_meta()
            # An empty step still asks after the transfers under way: it is the only
            # way their end reaches us when nothing else runs.
            output.poll_kv_transfers = bool(self.loading or self.freeing)
        return output

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        num_tokens = len(request.all_token_ids) + request.num_output_placeholders
        if num_tokens >= request.max_num_tokens:
            return 0  # the token in flight ends it: computing another would be waste
        num_new = num_tokens - request.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        return num_new if num_new < token_budget else token_budget

    def _schedule_running(self, step: _Step) -> None:
        # Running requests go first: they already hold KV blocks, and finishing them
        # is what frees the blocks that waiting requests need.
        running, i = self.running, 0
        while i < len(running) and step.token_budget > 0:
            request = running[i]
            num_new = self._num_new_tokens(request, step.token_budget)
            if num_new == 0:
                i += 1
                continue
            block_ids = self.kv.allocate_slots(request, num_new)
            while block_ids is None:
                victim_index = self.policy.select_victim(running)
                victim = running.pop(victim_index)
                step.unschedule(victim)
                self._preempt(victim, step)
                if victim is request:
                    return
                if victim_index < i:
                    i -= 1
                block_ids = self.kv.allocate_slots(request, num_new)
            step.num_scheduled_tokens[request.request_id] = num_new
            step.running_reqs.append(request)
            step.running_new_block_ids.append(block_ids)
            step.token_budget -= num_new
            i += 1

    def _schedule_drafts(self, step: _Step) -> None:
        """Draft slots for the decodes, from the budget every running request already
        had its token of (so drafts never crowd a decode out), never at the cost of a
        preemption; capped at the request's last token (max_tokens, max_model_len)."""
        config, scheduled = self.config, step.num_scheduled_tokens
        decodes = [
            (i, r) for i, r in enumerate(step.running_reqs)
            if scheduled[r.request_id] == 1
            and r.num_computed_tokens + 1 == len(r.all_token_ids) + r.num_output_placeholders
        ]  # fmt: skip
        if len(decodes) >= config.speculative_disable_batch_size:
            return
        max_k, min_gain = config.num_speculative_tokens, config.speculative_min_gain
        # Requests not worth drafting for probe one slot, all in the same step: the
        # verification rows' cost stays in one step of PROBE_INTERVAL.
        probe = int(self.step_id % PROBE_INTERVAL == 0)
        for i, request in decodes:
            if step.token_budget <= 0:
                return
            cap = max_k if request.max_spec_tokens is None else min(max_k, request.max_spec_tokens)
            room = request.max_num_tokens - (len(request.all_token_ids)
                                             + request.num_output_placeholders) - 1  # fmt: skip
            k = min(cap, room, step.token_budget, num_draft_slots(
                request.spec_acceptance, max_k, min_gain) or probe)  # fmt: skip
            if k <= 0:
                continue
            block_ids = self.kv.allocate_slots(request, 1 + k)
            if block_ids is None:
                continue  # the pool is short: this decode goes without drafts
            if block_ids:
                step.running_new_block_ids[i] = [*step.running_new_block_ids[i], *block_ids]
            scheduled[request.request_id] = 1 + k
            step.num_draft_slots[request.request_id] = k
            step.token_budget -= k

    def _preempt(self, request: Request, step: _Step) -> None:
        # Recompute, not swap: the blocks go back now and the request later
        # recomputes prompt + outputs (cheap while its prefix stays cached).
        self.kv.free(request.request_id, request.num_computed_tokens)
        self.trimmed_blocks.pop(request.request_id, None)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        step.preempted_req_ids.add(request.request_id)

    def _schedule_waiting(self, step: _Step) -> None:
        # Waiting requests of an adapter that has no slot left this step wait aside,
        # in order, without holding up the others (vLLM's skipped_waiting).
        adapters, skipped = self._running_adapters(), []
        if self.loaded:
            self._schedule_loaded(step, adapters)
        while self.waiting and self._has_room(step):
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token still in flight: resume once it is known
            found = self._find_computed(request) if self._fits_adapters(request, adapters) else None
            if found is None:
                skipped.append(self.waiting.pop())
                continue
            hits, num_cached, num_external = found
            if num_external:
                if not self._start_load(request, hits, num_cached, num_external):
                    break
                self.waiting.pop()
                continue
            num_new = self._num_prefill_tokens(request, num_cached, step)
            if num_new is None or self.kv.allocate_slots(request, num_new, hits) is None:
                break  # head-of-line blocking keeps FCFS fair
            self.waiting.pop()
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, [], 0)  # nothing to load
            self._admit(request, num_cached, num_new, step, adapters)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _schedule_loaded(self, step: _Step, adapters: set[str]) -> None:
        """Requests whose KV arrived hold their blocks, and were admitted when their
        load started: they take seats before anyone waiting (else a request the pool
        cannot hold would stall them and the blocks they hold: vLLM #57841)."""
        passed: list[Request] = []
        while self.loaded and self._has_room(step):
            request = self.loaded.popleft()
            if not self._fits_adapters(request, adapters):
                passed.append(request)
                continue
            num_new = self._num_prefill_tokens(request, request.num_computed_tokens, step)
            if num_new is None:
                self.loaded.appendleft(request)
                break
            self.kv.allocate_slots(request, num_new)  # within the blocks it reserved
            self._admit(request, request.num_computed_tokens, num_new, step, adapters)
        self.loaded.extendleft(reversed(passed))

    def _has_room(self, step: _Step) -> bool:
        return step.token_budget > 0 and len(self.running) < self.config.max_num_seqs

    def _num_prefill_tokens(self, request: Request, num_cached: int, step: _Step) -> int | None:
        """This step's chunk of the request's prefill; None: it does not fit whole
        (--no-chunked-prefill) and must wait."""
        num_new = request.num_tokens - num_cached
        config = self.config
        if config.no_chunked_prefill:
            return num_new if num_new <= step.token_budget else None
        return min(num_new, config.long_prefill_token_threshold or num_new, step.token_budget)

    def _find_computed(self, request: Request) -> tuple[list, int, int] | None:
        """(local hits, tokens they cover, tokens the connector can load), or None
        while the connector asks for time."""
        if request.skip_prefix_cache:
            return [], 0, 0
        hits = self.kv.get_computed_blocks(request)
        num_cached = len(hits) * self.config.block_size
        if self.connector is None:
            return hits, num_cached, 0
        num_external = self.connector.get_num_new_matched_tokens(request, num_cached)
        return None if num_external is None else (hits, num_cached, num_external)

    def _admit(
        self, request: Request, num_cached: int, num_new: int, step: _Step, adapters: set[str]
    ) -> None:
        if request.lora_name:
            adapters.add(request.lora_name)
        self.kv.prefix_stats.record(request.num_tokens, num_cached - request.num_loaded_tokens)
        if self.connector is not None:
            self.external_stats.record(request.num_tokens, request.num_loaded_tokens)
            request.num_loaded_tokens = 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens = num_cached
        step.admitted_reqs.append(request)
        self.running.append(request)
        step.num_scheduled_tokens[request.request_id] = num_new
        step.token_budget -= num_new

    def _start_load(self, request: Request, hits: list, num_cached: int, num_external: int) -> bool:
        """Reserve blocks for the request's whole remaining prefill, uncached (a load
        fills them), and park it until the connector reports the load; False when the
        pool cannot hold it yet."""
        num_new = request.num_tokens - num_cached
        block_ids = self.kv.allocate_slots(request, num_new, hits, delay_cache_blocks=True)
        if block_ids is None:
            return False
        request.num_computed_tokens = num_cached
        request.num_external_tokens = num_external
        request.status = LOADING
        self.loading[request.request_id] = request
        # A fresh block table: the hits, then the new blocks, the loaded ones first (a
        # prefill replica's last one may be partly filled).
        first = len(hits)
        self.connector.update_state_after_alloc(
            request, block_ids[first : first + cdiv(num_external, self.block_size)], num_external
        )
        return True

    def update_kv_transfers(self, result: KVTransferResult) -> None:
        """The executor's connector finished or failed these transfers. A loaded
        request's blocks enter the prefix cache now (never before: vLLM's
        no-spurious-prefix-caching rule) and it waits for a seat, its last token still
        to compute; a failed load keeps its blocks and recomputes what did not arrive;
        an ended request's blocks are freed."""
        if self.connector is not None:
            self.connector.update_connector_output(result)
        failed = set(result.failed_recving)
        for req_id in (*result.finished_recving, *failed):
            # Loads end in the order they started: one of a request that ended while
            # its KV arrived comes before one of a request its id came back as.
            if not self._release(req_id) and (request := self.loading.pop(req_id, None)):
                self._loaded(request, req_id not in failed)
        for transfer_id in result.finished_sending:
            self._release(transfer_id)
            self.leased.discard(transfer_id)

    def _hold(self, reported_id: str, request_id: str) -> None:
        """Keep an ended request's blocks until the executor reports reported_id."""
        key = f"held:{self.num_held}"
        self.num_held += 1
        self.kv.hold(request_id, key)
        self.freeing.setdefault(reported_id, []).append(key)

    def _release(self, reported_id: str) -> bool:
        """Free the oldest blocks held until reported_id, if any."""
        keys = self.freeing.get(reported_id)
        if not keys:
            return False
        self.kv.free(keys.pop(0))
        if not keys:
            del self.freeing[reported_id]
        return True

    def _loaded(self, request: Request, ok: bool) -> None:
        if ok:
            request.num_computed_tokens += request.num_external_tokens
            request.num_loaded_tokens = request.num_external_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
        request.num_external_tokens = 0
        request.status = PREEMPTED if request.num_preemptions else WAITING
        self.loaded.append(request)

    def _running_adapters(self) -> set[str]:
        if not self.config.max_loras:
            return set()
        return {r.lora_name for r in self.running if r.lora_name}

    def _fits_adapters(self, request: Request, adapters: set[str]) -> bool:
        """--max-loras: a request joins if its adapter runs already or a slot is left."""
        name = request.lora_name
        return not name or name in adapters or len(adapters) < self.config.max_loras

    def _make_output(self, step: _Step) -> SchedulerOutput:
        new_reqs, resumed_reqs = [], []
        for request in step.admitted_reqs:
            if request.status == PREEMPTED:
                resumed_reqs.append(self._new_request_data(request, list(request.all_token_ids)))
            else:
                new_reqs.append(self._new_request_data(request, request.prompt_token_ids))
            request.status = RUNNING
        output = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_resumed_reqs=resumed_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[r.request_id for r in step.running_reqs],
                num_computed_tokens=[r.num_computed_tokens for r in step.running_reqs],
                new_block_ids=step.running_new_block_ids,
            ),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted_req_ids,
            sampling_requests=[],
            num_draft_slots=step.num_draft_slots,
            trimmed_blocks=self.trimmed_blocks,
        )
        # In num_scheduled_tokens order: running first, then admitted.
        self._advance(step.running_reqs, step, output.sampling_requests)
        self._advance(step.admitted_reqs, step, output.sampling_requests)
        self.finished_req_ids = set()
        if self.trimmed_blocks:
            self.trimmed_blocks = {}
        self.step_id += 1
        return output

    def _new_request_data(self, request: Request, token_ids: list[int]) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv.block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_name=request.lora_name,
        )

    @staticmethod
    def _advance(requests: list[Request], step: _Step, sampling: list[Request]) -> None:
        # Advanced at schedule time, not on output, so that the next step can be
        # planned while this one runs: a chunked prefill continues, and a request
        # whose chunk reaches its end holds a placeholder for the token in flight.
        # Drafts are counted as if all were accepted (vLLM's optimistic advance): the
        # result rolls back what was rejected.
        num_scheduled_tokens, drafts = step.num_scheduled_tokens, step.num_draft_slots
        for request in requests:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]
            num_drafts = drafts.get(request.request_id, 0) if drafts else 0
            if (
                request.num_computed_tokens - num_drafts
                == len(request.all_token_ids) + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1 + num_drafts
                sampling.append(request)

    # -- results in --------------------------------------------------------------

    def update_from_output(
        self,
        plan: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        num_sampled_tokens: Sequence[int] = (),
        num_draft_tokens: Sequence[int] = (),
    ) -> dict[str, OwnerOutputs]:
        """Apply one step's tokens. Without drafts sampled_token_ids[i] belongs to
        plan.sampling_requests[i]; with drafts request i has num_sampled_tokens[i] of
        them (1 + its accepted drafts) in order, and was proposed num_draft_tokens[i]
        drafts. A negative id marks a request the executor failed (it ends with an
        error, the rest of the batch goes on). Every stop rule is applied at each
        token: nothing past a stop is emitted. Returns new tokens and finish reasons
        by owner."""
        sampling = plan.sampling_requests
        counts = num_sampled_tokens or None
        expected = sum(counts) if counts is not None else len(sampling)
        if len(sampled_token_ids) != expected or (
            counts is not None and len(counts) != len(sampling)
        ):
            raise ValueError(
                f"step {plan.step_id}: {len(sampled_token_ids)} sampled tokens for "
                f"{len(sampling)} sampling requests"
            )
        outputs: dict[str, OwnerOutputs] = {}
        ended: list[tuple[Request, RequestStatus]] = []
        if counts is None:  # the plain path: a token per request
            append, owner, out = self._append_token, None, OwnerOutputs()
            for request, token_id in zip(sampling, sampled_token_ids, strict=True):
                if request.status.is_finished:
                    continue  # finished or aborted while this step was in flight
                request.num_output_placeholders -= 1
                if request.owner != owner:  # mostly one router: one lookup a step
                    owner = request.owner
                    out = outputs.get(owner) or outputs.setdefault(owner, OwnerOutputs())
                status = append(request, token_id, out)
                if status is not None:
                    ended.append((request, status))
        else:
            self._apply_drafted(plan, sampled_token_ids, counts, num_draft_tokens, outputs, ended)
        if ended:
            self._end(ended, outputs)
        return outputs

    def _apply_drafted(self, plan, sampled_token_ids, counts, num_draft_tokens, outputs, ended):
        """update_from_output with drafts: request i took counts[i] tokens; the rest of
        its optimistic advance rolls back, and its tokens stop at the first stop."""
        drafts, start = plan.num_draft_slots, 0
        for i, request in enumerate(plan.sampling_requests):
            num_tokens = counts[i]
            start += num_tokens
            if request.status.is_finished:
                continue
            num_slots = drafts.get(request.request_id, 0)
            request.num_output_placeholders -= 1 + num_slots
            if num_slots:
                num_proposed = num_draft_tokens[i] if num_draft_tokens else num_slots
                self._settle_drafts(request, num_slots, num_proposed, num_tokens - 1)
            out = outputs.get(request.owner)
            if out is None:
                out = outputs[request.owner] = OwnerOutputs()
            for token_id in sampled_token_ids[start - num_tokens : start]:
                status = self._append_token(request, token_id, out)
                if status is not None:
                    ended.append((request, status))
                    break

    def _end(self, ended: list[tuple[Request, RequestStatus]], outputs) -> None:
        queued_ids = set()
        for request, status in ended:
            out = outputs[request.owner]
            out.finished[request.request_id] = FINISH_REASON[status]
            out.num_cached_tokens.append(max(0, request.num_cached_tokens))
            if not self._finish(request, status):
                queued_ids.add(request.request_id)  # preempted: its late token ended it
            if status == TRANSFERRED and request.kv_handoff is not None:
                out.kv_transfers[request.request_id] = request.kv_handoff
        self._drop_finished(queued_ids)

    def _append_token(
        self, request: Request, token_id: int, out: OwnerOutputs
    ) -> RequestStatus | None:
        """One new token of a request; the status it ends with, or None."""
        if token_id < 0:
            return ERROR
        tokens = request.all_token_ids
        tokens.append(token_id)
        if len(tokens) % self.block_size == 0:
            self.kv.update_block_hashes(request)
        out.req_ids.append(request.request_id)
        out.new_token_ids.append(token_id)
        if token_id in request.stop_ids and (
            len(tokens) - request.num_prompt_tokens >= request.stop.min_tokens
        ):
            return STOPPED
        if len(tokens) >= request.max_num_tokens:
            return TRANSFERRED if request.do_remote_decode else LENGTH
        return None

    def _settle_drafts(
        self, request: Request, num_slots: int, num_proposed: int, num_accepted: int
    ) -> None:
        """A verified step: roll back what was rejected (or never proposed) of the
        optimistic advance, give back the blocks past it, and measure acceptance."""
        num_rejected = num_slots - num_accepted
        if num_rejected and request.status == RUNNING:  # preempted: it starts over anyway
            request.num_computed_tokens -= num_rejected
            num_blocks = self.kv.trim(request, request.num_computed_tokens)
            if num_blocks is not None:
                self.trimmed_blocks[request.request_id] = num_blocks
        if num_proposed:
            self.spec_stats.record(num_proposed, num_accepted)
        # What a slot bought: a slot the proposer left empty (no n-gram match) is
        # budget and a proposer's search spent for nothing, as a rejected draft is.
        request.spec_acceptance = updated_acceptance(
            request.spec_acceptance, num_slots, num_accepted
        )

    def _finish(self, request: Request, status: RequestStatus) -> bool:
        """Free the request; the caller takes it out of the queues. Returns whether it
        was running (else it sits in the waiting queue)."""
        request_id, was_loading = request.request_id, request.status == LOADING
        was_running = request.status == RUNNING
        if was_running:
            # The executor still holds it; preempted ones were already dropped there.
            self.finished_req_ids.add(request_id)
        request.status = status
        if was_loading:
            # A load is writing its blocks: they are freed when it is reported done.
            del self.loading[request_id]
            self._hold(request_id, request_id)
        elif self.connector is not None and (handoff := self.connector.request_finished(
            request, self.kv.block_ids(request_id)
        )) is not None:  # fmt: skip
            request.kv_handoff = handoff  # a transfer still reads the blocks
            self._hold(handoff.transfer_id, request_id)
            if status == TRANSFERRED:
                self.leased.add(handoff.transfer_id)
        else:
            self.kv.free(request_id)
        del self.requests[request_id]
        return was_running

    def _drop_finished(self, queued_ids: set[str]) -> None:
        # One pass per step over the running list, not a list.remove per request.
        self.running = [r for r in self.running if not r.status.is_finished]
        if queued_ids:
            self.waiting.remove_all(queued_ids)
            if self.loaded:
                self.loaded = deque(r for r in self.loaded if r.request_id not in queued_ids)

    # -- introspection -----------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Requests, or transfers whose blocks wait to be freed."""
        return bool(self.requests or self.freeing)

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
        return self.kv.pool.num_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage()

    def num_prefix_hit_blocks(self, request: Request) -> int:
        """Full blocks of the request's known tokens already in the prefix cache."""
        return len(self.kv.get_computed_blocks(request))

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of the running requests, and of the waiting ones, sorted."""
        waiting = {r.lora_name for r in (*self.waiting, *self.loaded) if r.lora_name}
        return sorted(self._running_adapters()), sorted(waiting)

    def make_stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            step_id=self.step_id,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loaded),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            kv_cache_usage=pool.usage(),
            prefix_cache_queries=self.kv.prefix_stats.num_queries,
            prefix_cache_hits=self.kv.prefix_stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_loading_reqs=len(self.loading),
            external_prefix_cache_queries=self.external_stats.num_queries,
            external_prefix_cache_hits=self.external_stats.num_hits,
            num_kv_leases=len(self.leased),
        )
