"""Random adds, aborts and steps on tiny pools, checking the scheduler after every
step; at the end it must drain to idle with every surviving request's tokens equal
to the stand-in model's reference. With a host tier, its loads finish late, fail or
are aborted mid-way (tests/helpers/fake_kv_tier.py). As a prefill replica, requests
are handed off after their first token and their blocks held under leases that end
late; as a decode replica, requests arrive with their prompt's KV waiting at a
prefill replica, and their loads finish late, fail or are aborted. With KV cache
groups (full attention, sliding windows, or both as gpt-oss and Gemma 3 mix them, and
recurrent layers beside full attention as Qwen3-Next mixes them), every group's
invariants hold after every step, each window group reads its own window back and each
recurrent group the state of exactly the tokens computed (tests/helpers/hash_model.py)."""

import itertools
import os
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.disaggregation import DecodeConnector, PrefillConnector
from flagstop.scheduler_svc.core.kv_connector import KVHandoff
from flagstop.scheduler_svc.core.kv_events import KVEventLog
from flagstop.scheduler_svc.core.kv_groups import (
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    KVLayer,
    kv_cache_groups,
)
from flagstop.scheduler_svc.core.request import FinishReason, Request, Retention, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from tests.helpers.fake_kv_tier import FakeTierWorker, FlakyHostTier, prefill_side_blocks
from tests.helpers.hash_model import Driver, HashModelExecutor, pooled_output, reference_tokens
from tests.helpers.kv_events import KVEventSubscriber
from tests.helpers.scheduler_invariants import check_idle, check_invariants

VOCAB, EOS, BLOCK_SIZE, MAX_MODEL_LEN = 24, frozenset({0}), 4, 64
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 1, 2, 3, 4]]
# A request's retention, (priority, ttl seconds) of its prompt, or none.
RETENTIONS = [None, None, (1, 4.0), (60, 50.0)]
_FULL, _WINDOW = KVLayer(), lambda w: KVLayer(SLIDING_ATTENTION, w)
_LINEAR = KVLayer(LINEAR_ATTENTION)
LAYOUTS = {
    "full": lambda w: [_FULL] * 2,
    "window": lambda w: [_WINDOW(w)] * 2,  # Mistral: every layer windowed
    "alternating": lambda w: [_WINDOW(w), _FULL] * 2,  # gpt-oss
    "five_to_one": lambda w: [*[_WINDOW(w)] * 5, _FULL],  # Gemma 3
    "recurrent": lambda w: [_LINEAR, _LINEAR, _LINEAR, _FULL] * 2,  # Qwen3-Next
    "recurrent_window": lambda w: [_LINEAR, _WINDOW(w), _FULL],
}


class RecordingScheduler(Scheduler):
    """Notes each admission in order: a first prefill scheduled, or a load started."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.admission_order: list[str] = []
        start_load = self.transfers.start_load

        def recorded_start_load(kv, request, *args) -> bool:
            started = start_load(kv, request, *args)
            if started:
                self.admission_order.append(request.request_id)
            return started

        self.transfers.start_load = recorded_start_load

    def _admit(self, request, *args) -> None:
        self.admission_order.append(request.request_id)
        super()._admit(request, *args)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 40),
        budget=st.integers(2, 48),
        max_num_seqs=st.integers(1, 6),
        chunked=st.booleans(),
        caching=st.booleans(),
        threshold=st.sampled_from([0, 3]),
        policy=st.sampled_from(["fcfs", "priority"]),
        depth=st.sampled_from([1, 2, 3]),
        # Speculative decoding: draft slots per decode (0: off) and how often a draft
        # is wrong (accepted, partly, none).
        num_spec=st.sampled_from([0, 0, 1, 3]),
        draft_error_rate=st.sampled_from([0.0, 0.3, 1.0]),
        # LoRA: slots for adapters among the running requests (0: requests name none).
        max_loras=st.sampled_from([0, 0, 1, 2]),
        # KV connector: a host tier of this many blocks (0: none), its loads' delay in
        # steps and failure rate, lookups deferred, frees delayed by a transfer.
        tier_slots=st.sampled_from([0, 3, 12, 48]),
        max_delay=st.integers(1, 4),
        fail_rate=st.sampled_from([0.0, 0.3]),
        defer_rate=st.sampled_from([0.0, 0.2]),
        delayed_free_rate=st.sampled_from([0.0, 0.3]),
        # Prefill/decode disaggregation: this scheduler's side (instead of a tier).
        kv_role=st.sampled_from(["", "", "", "prefill", "decode"]),
        # KV cache groups: the layers' attention types (windows of W tokens).
        layout=st.sampled_from(
            [
                "full",
                "full",
                "window",
                "alternating",
                "five_to_one",
                "recurrent",
                "recurrent",
                "recurrent_window",
            ]
        ),
        window=st.sampled_from([2, 4, 5, 9]),
        # Retention (docs/sessions.md): the bound on retained free blocks.
        retention_share=st.sampled_from([0.0, 0.25, 1.0]),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks, budget, max_num_seqs, chunked, caching, threshold, policy, depth,
              num_spec, draft_error_rate, max_loras, tier_slots, max_delay, fail_rate,
              defer_rate, delayed_free_rate, kv_role, layout, window, retention_share,
              seed):  # fmt: skip
        self.groups = kv_cache_groups(LAYOUTS[layout](window))
        if layout != "full":  # disaggregation with window groups is refused at start-up
            kv_role = ""
            num_blocks *= len(self.groups)
        self.config = SchedulerConfig(
            max_num_batched_tokens=budget if chunked else MAX_MODEL_LEN,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            long_prefill_token_threshold=threshold,
            no_chunked_prefill=not chunked,
            no_prefix_caching=not caching,
            policy=policy,
            num_speculative_tokens=num_spec,
            max_loras=max_loras,
            retention_share=retention_share,
        )
        self.now = 0.0  # the scheduler's clock: retentions expire on it
        self.rng, self.connector = random.Random(seed), None
        self.tier_slots, self.fail_rate, self.max_delay = tier_slots, fail_rate, max_delay
        self.draft_error_rate = draft_error_rate
        self.kv_role = kv_role
        self.remote_store: dict[str, list[list]] = {}  # a prefill replica's, by hand-off
        if kv_role == "prefill":
            self.connector = PrefillConnector("prefill:1", "engine", "machine")
        elif kv_role == "decode":
            self.connector = DecodeConnector(BLOCK_SIZE)
        elif tier_slots and caching:
            self.connector = FlakyHostTier(tier_slots, BLOCK_SIZE, self.rng, defer_rate,
                                           delayed_free_rate, len(self.groups))  # fmt: skip
        self.scheduler = RecordingScheduler(self.config, num_blocks, connector=self.connector,
                                            kv_groups=self.groups, clock=lambda: self.now,
                                            kv_events=KVEventLog())  # fmt: skip
        self.subscriber = KVEventSubscriber()  # a fleet router's view of the pool
        self.admission_order = self.scheduler.admission_order
        self.driver = Driver(self.scheduler, None, depth, self.check_plan)
        self._new_executor()
        self.ids = itertools.count()
        self.expected: dict[str, list[int]] = {}
        self.aborted: set[str] = set()
        self.arrival_order: list[str] = []
        self.adapter_of: dict[str, str] = {}
        self.turns: list[tuple[list[int], str]] = []  # (a prompt and its answer, adapter)
        self.handed_off: set[str] = set()  # requests a prefill replica is to hand off
        self.pooled: dict[str, bytes] = {}  # pooling requests' expected outputs

    def _new_executor(self) -> None:
        num_blocks = self.scheduler.kv.pool.num_blocks
        executor = HashModelExecutor(num_blocks, BLOCK_SIZE, VOCAB, self.draft_error_rate,
                                     seed=self.rng.randrange(1 << 16),
                                     groups=self.groups)  # fmt: skip
        self.driver.executor = executor
        if self.connector is not None:
            worker = FakeTierWorker(executor, self.connector, self.rng, self.fail_rate,
                                    self.max_delay)  # fmt: skip
            worker.remote = self.remote_store  # the prefill replica outlives this executor
            self.driver.tier_worker = worker

    # Now and then, and whenever KV is arriving (the interesting moment to lose it).
    @precondition(lambda self: self.scheduler.transfers.loading or self.scheduler.transfers.loaded
                  or self.driver.num_steps % 13 == 5)  # fmt: skip
    @rule()
    def lose_executor(self):
        # Its KV, its tier and its steps in flight are gone; every request recomputes.
        self.driver.in_flight.clear()
        self.scheduler.reset_executor(num_host_blocks=self.tier_slots)
        self._new_executor()

    @rule(seconds=st.sampled_from([0.5, 5.0, 100.0]))
    def pass_time(self, seconds):
        self.now += seconds

    def check_plan(self, plan) -> None:
        assert plan.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.config.max_num_seqs

    @rule(
        prefix=st.sampled_from([None, 0, 1]),
        prefix_len=st.integers(1, 9),
        suffix=st.lists(st.integers(1, VOCAB - 1), max_size=12),
        max_tokens=st.integers(1, 24),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_token=st.sampled_from([None, 3, 4]),
        priority=st.integers(0, 2),
        adapter=st.sampled_from(["", "", "a", "b", "c"]),
        disaggregated=st.booleans(),
        retention=st.sampled_from(RETENTIONS),
        pooling=st.sampled_from([False, False, False, True]),
    )
    def add(
        self, prefix, prefix_len, suffix, max_tokens, min_tokens, ignore_eos, stop_token, priority,
        adapter, disaggregated, retention, pooling,
    ):  # fmt: skip
        # An empty suffix sends a shared prefix alone: identical prompts, some block-aligned.
        # A pooling request (an embedding's, a reranker's) computes its prompt only.
        prompt = (PREFIXES[prefix][:prefix_len] if prefix is not None else []) + suffix
        self._add(prompt, max_tokens, min_tokens, ignore_eos, stop_token, priority, adapter,
                  disaggregated and not pooling, retention, pooling)  # fmt: skip

    @precondition(lambda self: self.turns)
    @rule(
        data=st.data(),
        suffix=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
        max_tokens=st.integers(1, 8),
        retention=st.sampled_from(RETENTIONS),
    )
    def follow_up(self, data, suffix, max_tokens, retention):
        # The next turn of a conversation: its prompt is the last turn's prompt and
        # answer, whose blocks the pool may have evicted and the tier may hold.
        prompt, adapter = data.draw(st.sampled_from(self.turns))
        self._add(prompt + suffix, max_tokens, 0, True, None, 0, adapter, retention=retention)

    def _add(self, prompt, max_tokens, min_tokens, ignore_eos, stop_token, priority, adapter,
             disaggregated=False, retention=None, pooling=False):  # fmt: skip
        if not prompt:
            return
        stop = StopParams(
            max_tokens, min_tokens, ignore_eos, frozenset() if stop_token is None else {stop_token}
        )
        room = min(self.scheduler.kv_capacity_tokens, MAX_MODEL_LEN)
        if len(prompt) + (1 if pooling else max_tokens) > room:
            return  # rejected at admission; covered by the unit tests
        rid = f"r{next(self.ids)}"
        adapter = adapter if self.config.max_loras else ""
        request = Request(rid, f"router-{priority % 2}", prompt, stop, EOS, priority,
                          float(len(self.arrival_order)), lora_name=adapter,
                          lora_id=adapter and f"files-of-{adapter}",
                          retention=retention and Retention(*retention, len(prompt)))  # fmt: skip
        expected = reference_tokens(prompt, stop, EOS, VOCAB, MAX_MODEL_LEN)
        if pooling:
            request.pools, expected = True, []
            self.pooled[rid] = pooled_output(prompt)
        elif disaggregated and self.kv_role == "prefill":
            request.do_remote_decode = True  # it ends with its first token
            if len(expected) > 1:
                self.handed_off.add(rid)
            expected = expected[:1]
        elif disaggregated and self.kv_role == "decode" and len(prompt) > 1:
            # A remainder: the prefill replica computed all but its last token.
            transfer_id = f"kv-{rid}"
            blocks = prefill_side_blocks(prompt[:-1], BLOCK_SIZE)
            self.remote_store[transfer_id] = blocks
            request.remote_prefill = KVHandoff(
                transfer_id, "prefill:1", "engine", tuple(range(len(blocks))), len(prompt) - 1
            )
        self.scheduler.add_request(request)
        self.adapter_of[rid] = adapter
        self.expected[rid] = expected
        self.arrival_order.append(rid)
        self.turns.append((prompt + self.expected[rid], adapter))

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.abort([rid])
        self.scheduler.abort([rid])
        self.aborted.add(rid)

    @rule()
    def step(self):
        self.driver.step()

    @invariant()
    def consistent(self):
        if hasattr(self, "scheduler"):
            check_invariants(self.scheduler)
            # The KV events tell exactly what the prefix cache holds, at every moment.
            self.subscriber.apply(self.scheduler.kv_events.take())
            assert self.subscriber.cached == set(self.scheduler.kv.pool.cached_blocks)
            assert self.subscriber.host == set(getattr(self.connector, "slots", ()))

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        self.driver.run(max_steps=self.driver.num_steps + 20_000)
        check_idle(self.scheduler)
        for rid, expected in self.expected.items():
            got = self.driver.tokens.get(rid, [])
            if rid in self.aborted:
                assert got == expected[: len(got)], rid
            else:
                assert got == expected, rid
            if rid in self.pooled and rid not in self.aborted:
                assert self.driver.pooled[rid] == self.pooled[rid], rid
                assert self.driver.finish_reasons[rid] == FinishReason.STOP, rid
            if rid in self.handed_off and rid not in self.aborted:
                assert self.driver.finish_reasons[rid] == FinishReason.TRANSFER, rid
        if self.config.policy == "fcfs":
            # Nobody is overtaken by a request of the same adapter (or of none): first
            # admissions follow arrival order; --max-loras lets other adapters' pass, and
            # a connector that asks for time lets the others pass the one it defers.
            deferred = getattr(self.connector, "deferred_ids", set())
            order = [r for r in dict.fromkeys(self.admission_order) if r not in deferred]
            admitted = set(order)
            for adapter in set(self.adapter_of.values()):
                ours = [r for r in order if self.adapter_of[r] == adapter]
                assert ours == [r for r in self.arrival_order
                                if r in admitted and self.adapter_of[r] == adapter]  # fmt: skip


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("FLAGSTOP_MACHINE_EXAMPLES", 200)),
    stateful_step_count=60,
    deadline=None,
)
TestSchedulerMachine = SchedulerMachine.TestCase
