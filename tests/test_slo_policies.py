"""The policies that decide each step (slo, fair, hrrn) and the decision seam itself,
in-process on random workloads: each policy's defining property, the decisions
honoured and counted, nonsense failing open, the ordering-only policies unchanged."""

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from flagstop.router.objective_defaults import ObjectiveDefaults, SLOTarget
from flagstop.scheduler_svc.convert import objectives_from_proto
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.decision import NO_DECISION, PolicyView, StepDecision
from flagstop.scheduler_svc.core.objectives import NO_OBJECTIVES, Objectives, ms_of, seconds_of
from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.scheduler_svc.core.policy import FCFSPolicy, make_policy
from flagstop.scheduler_svc.core.request import (
    ALL_TOKENS,
    FINISH_REASON,
    Request,
    Retention,
    StopParams,
)
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core.step_cost import StepCostModel
from flagstop.v1 import generation_pb2, scheduler_pb2
from tests.helpers.scheduler_invariants import check_idle, check_invariants

BLOCK = 16


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def engine(policy, num_blocks: int = 512, budget: int = 256, **config) -> tuple[Scheduler, Clock]:
    clock = Clock()
    base = dict(max_num_batched_tokens=budget, max_num_seqs=32, max_model_len=4096,
                block_size=BLOCK)  # fmt: skip
    scheduler = Scheduler(SchedulerConfig(**{**base, **config}), num_blocks, policy, clock=clock)
    return scheduler, clock


def request(rid: str, num_prompt: int, max_tokens: int, now: float = 0.0, **objectives) -> Request:
    prompt = [(hash(rid) + i) % 30000 + 10 for i in range(num_prompt)]
    return Request(rid, "router-0", prompt, StopParams(max_tokens, ignore_eos=True),
                   arrival_time=now, objectives=Objectives(**objectives))  # fmt: skip


def advance(scheduler: Scheduler, clock: Clock, plan) -> None:
    """Run the plan on the step-cost model's time and feed one token per sample."""
    seconds = scheduler.policy_step.cost.seconds(
        plan.total_num_scheduled_tokens, plan.num_context_tokens
    )
    clock.now += seconds
    scheduler.update_from_output(plan, StepOutcome([7] * len(plan.sampling_requests)))
    check_invariants(scheduler)


workloads = st.lists(
    st.tuples(st.integers(1, 600), st.integers(1, 40), st.floats(0.0, 0.5), st.floats(0.02, 1.0)),
    min_size=1,
    max_size=30,
)  # fmt: skip  (prompt tokens, output tokens, arrival gap s, TTFT target s)


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_slo_never_admits_a_request_it_predicts_will_miss(jobs):
    policy = make_policy("slo")
    scheduler, clock = engine(policy)
    arrivals = []
    t = 0.0
    for i, (num_prompt, max_tokens, gap, ttft) in enumerate(jobs):
        t += gap
        arrivals.append((t, request(f"r{i}", num_prompt, max_tokens, t, ttft_s=ttft)))
    deadlines = {r.request_id: t + r.objectives.ttft_s for t, r in arrivals}
    for _ in range(3000):
        while arrivals and arrivals[0][0] <= clock.now:
            scheduler.add_request(arrivals.pop(0)[1])
        if not arrivals and not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        for new in plan.scheduled_new_reqs:
            assert policy.predicted[new.req_id] <= deadlines[new.req_id] + 1e-9
        for shed, reason in scheduler.policy_step.take_shed():
            assert "retry" in reason and shed.request_id not in scheduler.requests
        if not plan.num_scheduled_tokens:
            clock.now = arrivals[0][0] if arrivals else clock.now + 0.01
            continue
        advance(scheduler, clock, plan)
    check_idle(scheduler)


def test_slo_orders_equal_prompts_by_deadline_and_sheds_what_cannot_make_it():
    policy = make_policy("slo")
    scheduler, _ = engine(policy, budget=64, max_num_seqs=2)
    ttfts = {"late": 5.0, "soon": 0.5, "mid": 2.0, "hopeless": 0.001}
    for rid, ttft in ttfts.items():
        scheduler.add_request(request(rid, 64, 4, ttft_s=ttft))
    plan = scheduler.schedule()
    [(shed, reason)] = scheduler.policy_step.take_shed()
    assert shed.request_id == "hopeless" and "target of 1 ms" in reason
    assert [r.req_id for r in plan.scheduled_new_reqs] == ["soon"]
    assert [r.request_id for r in scheduler.waiting] == ["mid", "late"]
    assert scheduler.policy_step.num_shed == 1


def test_slo_without_shedding_orders_only():
    scheduler, _ = engine(make_policy("slo", shed=False))
    scheduler.add_request(request("hopeless", 64, 4, ttft_s=0.001))
    plan = scheduler.schedule()
    assert not scheduler.policy_step.take_shed() and [
        r.req_id for r in plan.scheduled_new_reqs
    ] == ["hopeless"]


def test_slo_prefill_budget_keeps_the_decodes_within_their_tpot():
    policy = make_policy("slo")
    scheduler, clock = engine(policy, budget=4096, num_blocks=2048)
    for i in range(8):
        scheduler.add_request(request(f"d{i}", 32, 200, tpot_s=0.02))
    for _ in range(3):
        advance(scheduler, clock, scheduler.schedule())
    scheduler.add_request(request("long", 3000, 4, clock.now))
    cost = scheduler.policy_step.cost
    for _ in range(10):
        plan = scheduler.schedule()
        # The model's step time stays within the tightest TPOT (one block of
        # prefill is always allowed, so prompts progress).
        predicted = cost.seconds(plan.total_num_scheduled_tokens, plan.num_context_tokens)
        assert predicted <= 0.02 or plan.num_scheduled_tokens.get("long", 0) <= BLOCK
        assert plan.num_scheduled_tokens.get("long", 0) < 3000
        advance(scheduler, clock, plan)


class Scripted(FCFSPolicy):
    """FCFS order with a scripted decision each step."""

    def __init__(self, decide) -> None:
        self._decide = decide

    def decide(self, view: PolicyView) -> StepDecision:
        return self._decide(view)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 80)),
       st.frozensets(st.sampled_from(["a", "b", "c"])))  # fmt: skip
def test_the_prefill_budget_caps_and_defers_are_honoured(budget, caps, defer):
    scheduler, _ = engine(Scripted(lambda v: StepDecision(defer=defer, prefill_budget=budget,
                                                            chunk_caps=caps)))  # fmt: skip
    for rid in "abc":
        scheduler.add_request(request(rid, 200, 3))
    plan = scheduler.schedule()
    scheduled = plan.num_scheduled_tokens
    assert sum(scheduled.values()) <= budget
    assert not defer & scheduled.keys()
    for rid, num in scheduled.items():
        assert num <= caps.get(rid, num)
    if budget >= 200 * 3 and not defer and not caps:
        assert scheduled == {"a": 200, "b": 56}  # the token budget (256) still binds


def test_shed_requests_end_with_their_reason_and_are_counted():
    shed_once = {"b": "over capacity: retry in 2 s"}
    scheduler, _ = engine(Scripted(lambda v: StepDecision(shed=dict(shed_once))))
    for rid in "abc":
        scheduler.add_request(request(rid, 20, 2))
    plan = scheduler.schedule()
    [(shed, reason)] = scheduler.policy_step.take_shed()
    assert (shed.request_id, reason) == ("b", "over capacity: retry in 2 s")
    assert FINISH_REASON[shed.status].label == "abort"
    assert [r.req_id for r in plan.scheduled_new_reqs] == ["a", "c"]
    shed_once.clear()
    assert scheduler.policy_step.num_shed == 1 and scheduler.policy_step.take_shed() == []


def test_nonsense_decisions_fail_open_and_are_counted():
    def nonsense(view: PolicyView) -> StepDecision:
        running = [r.request_id for r in view.running]
        return StepDecision(shed={"ghost": "x", **dict.fromkeys(running, "y")},
                            defer=frozenset({"ghost"}), prefill_budget=-5,
                            chunk_caps={"a": -1, "ghost": 3})  # fmt: skip

    plans = {}
    for name, policy in (("fcfs", FCFSPolicy()), ("nonsense", Scripted(nonsense))):
        scheduler, clock = engine(policy, budget=64)
        for rid in "abc":
            scheduler.add_request(request(rid, 50, 5))
        plans[name] = []
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            plans[name].append(dict(plan.num_scheduled_tokens))
            advance(scheduler, clock, plan)
        if name == "nonsense":
            assert (
                scheduler.policy_step.num_ignored_decisions > 0
                and scheduler.policy_step.num_shed == 0
            )
    assert plans["nonsense"] == plans["fcfs"]


def test_an_empty_decision_plans_as_the_null_one():
    plans = {}
    for name, policy in (("null", FCFSPolicy()), ("empty", Scripted(lambda v: StepDecision()))):
        scheduler, clock = engine(policy, budget=48, num_blocks=40)
        for i in range(6):
            scheduler.add_request(request(f"r{i}", 30 + 7 * i, 30))
        plans[name] = []
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            plans[name].append((dict(plan.num_scheduled_tokens), set(plan.preempted_req_ids)))
            advance(scheduler, clock, plan)
    assert plans["empty"] == plans["null"] and FCFSPolicy().decide(None) is NO_DECISION


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 30)), min_size=4, max_size=20),
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 30)), min_size=4, max_size=20),
)
def test_fair_keeps_backlogged_tenants_within_the_vtc_bound_and_never_idles(jobs_a, jobs_b):
    policy = make_policy("fair")
    scheduler, clock = engine(policy, budget=128, max_num_seqs=4)
    for tenant, jobs in (("a", jobs_a), ("b", jobs_b)):
        for i, (num_prompt, max_tokens) in enumerate(jobs):
            scheduler.add_request(request(f"{tenant}{i}", num_prompt, max_tokens, tenant=tenant))
    longest = max(p + 2 * m for p, m in jobs_a + jobs_b)
    bound = 2 * longest
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens or not scheduler.waiting, "idle while work waits"
        waiting = {r.objectives.tenant for r in scheduler.waiting}
        if waiting == {"a", "b"}:
            gap = abs(policy.counters["a"] - policy.counters["b"])
            assert gap <= bound, (gap, bound)
        advance(scheduler, clock, plan)
    check_idle(scheduler)


def test_fair_serves_a_light_tenant_before_the_heavy_backlog():
    scheduler, _ = engine(make_policy("fair"), budget=100, max_num_seqs=2)
    for i in range(10):
        scheduler.add_request(request(f"heavy{i}", 100, 10, tenant="heavy"))
    scheduler.add_request(request("light0", 100, 10, tenant="light"))
    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["heavy0"]
    scheduler.update_from_output(first, StepOutcome([7] * len(first.sampling_requests)))
    second = scheduler.schedule()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["light0"]


def test_fair_gives_backlogged_tenants_service_by_their_weights():
    policy = make_policy("fair", weights={"gold": 3.0})
    scheduler, clock = engine(policy, budget=64, max_num_seqs=2)
    for i in range(30):
        for tenant in ("gold", "free"):
            scheduler.add_request(request(f"{tenant}{i}", 32, 4, tenant=tenant))
    served = {"gold": 0, "free": 0}
    for _ in range(60):
        plan = scheduler.schedule()
        for request_id, num in plan.num_scheduled_tokens.items():
            served[request_id.rstrip("0123456789")] += num
        advance(scheduler, clock, plan)
    # Both stayed backlogged: gold got three times free's service, within a request's.
    assert abs(served["gold"] - 3 * served["free"]) <= 3 * (32 + 2 * 4), served
    assert abs(policy.counters["gold"] - policy.counters["free"]) <= 2 * (32 + 2 * 4)


def test_fair_holds_a_seat_back_from_the_tenant_above_its_share():
    def fill(reserve: float) -> tuple[Scheduler, Clock]:
        scheduler, clock = engine(make_policy("fair", reserve=reserve), max_num_seqs=8)
        scheduler.add_request(request("light0", 16, 50, tenant="light"))
        for i in range(20):
            scheduler.add_request(request(f"heavy{i}", 16, 50, tenant="heavy"))
        for _ in range(3):
            advance(scheduler, clock, scheduler.schedule())
        return scheduler, clock

    # Without the reserve the heavy tenant takes every seat the light one left.
    scheduler, clock = fill(0.0)
    assert len(scheduler.running) == 8
    # With it, the last seat stays free while the light tenant is active: its next
    # request is admitted at once, and the heavy backlog never takes that seat.
    scheduler, clock = fill(1 / 8)
    assert len(scheduler.running) == 7 and {r.objectives.tenant for r in scheduler.running} == {
        "light", "heavy"}  # fmt: skip
    scheduler.add_request(request("light1", 16, 50, now=clock.now, tenant="light"))
    plan = scheduler.schedule()
    assert [r.req_id for r in plan.scheduled_new_reqs] == ["light1"]
    check_invariants(scheduler)


def test_fair_settings_reach_the_policy():
    from flagstop.scheduler_svc.core.policy import policy_for

    policy = policy_for(SchedulerConfig(policy="fair", tenant_weights={"a": 2.0}, fair_reserve=0.1,
                                        fair_hold=0.2))  # fmt: skip
    assert (policy.weights, policy.reserve, policy.hold_rate) == ({"a": 2.0}, 0.1, 0.2)


def test_a_held_request_sits_the_step_out_and_keeps_its_blocks_and_place():
    held = {2: frozenset({"b", "ghost"})}  # step -> the running ids held out of it
    scheduler, clock = engine(
        Scripted(lambda v: StepDecision(hold=held.get(scheduler.step_id, frozenset())))
    )
    for rid in "abc":
        scheduler.add_request(request(rid, 20, 6))
    for _ in range(2):
        advance(scheduler, clock, scheduler.schedule())
    blocks = scheduler.kv.block_ids("b")
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens.keys() == {"a", "c"}
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    assert scheduler.kv.block_ids("b") == blocks and not plan.preempted_req_ids
    assert scheduler.policy_step.num_held_steps == scheduler.stats().num_held_steps == 1
    advance(scheduler, clock, plan)
    assert scheduler.schedule().num_scheduled_tokens.keys() == {"a", "b", "c"}
    check_invariants(scheduler)


def heavy_batch_and_a_light_arrival(hold: float) -> tuple[Scheduler, Clock]:
    """A heavy tenant decoding in most seats, then a new light request."""
    scheduler, clock = engine(make_policy("fair", hold=hold), max_num_seqs=8)
    for i in range(6):
        scheduler.add_request(request(f"heavy{i}", 16, 50, tenant="heavy"))
    for _ in range(3):
        advance(scheduler, clock, scheduler.schedule())
    scheduler.add_request(request("light0", 100, 5, now=clock.now, tenant="light"))
    scheduler.add_request(request("heavy9", 16, 50, now=clock.now, tenant="heavy"))
    return scheduler, clock


def test_fair_runs_a_light_tenants_first_chunk_in_a_step_of_its_own():
    # Held: its prefill rides alone; the heavy decodes (blocks kept) and the heavy
    # newcomer wait one step, then all run again.
    scheduler, clock = heavy_batch_and_a_light_arrival(hold=1.0)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"light0": 100}
    advance(scheduler, clock, plan)
    after = scheduler.schedule().num_scheduled_tokens
    assert {f"heavy{i}" for i in range(6)} <= after.keys() and "light0" in after
    # Not held (--fair-hold 0): beside the heavy decodes, as before.
    scheduler, _ = heavy_batch_and_a_light_arrival(hold=0.0)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens.keys() == {f"heavy{i}" for i in range(6)} | {
        "light0",
        "heavy9",
    }
    assert scheduler.policy_step.num_held_steps == 0


def test_a_hold_never_idles_the_engine():
    # Every seat taken (no reserve): the light request cannot be admitted, so the step
    # its hold would have emptied runs the heavy decodes instead.
    scheduler, clock = engine(make_policy("fair", reserve=0.0, hold=1.0), max_num_seqs=4)
    for i in range(4):
        scheduler.add_request(request(f"heavy{i}", 16, 50, tenant="heavy"))
    advance(scheduler, clock, scheduler.schedule())
    scheduler.add_request(request("light0", 16, 5, now=clock.now, tenant="light"))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens.keys() == {f"heavy{i}" for i in range(4)}
    check_invariants(scheduler)


def test_fair_holds_at_most_its_fraction_of_the_steps():
    policy = make_policy("fair", hold=0.25)
    scheduler, clock = engine(policy, budget=128, max_num_seqs=8)
    for i in range(8):
        scheduler.add_request(request(f"heavy{i}", 16, 200, tenant="heavy"))
    num_steps = 0
    for i in range(40):  # a light request every step: more than the bucket allows
        scheduler.add_request(request(f"light{i}", 4, 1, now=clock.now, tenant="light"))
        advance(scheduler, clock, scheduler.schedule())
        num_steps += 1
    assert 0 < scheduler.policy_step.num_held_steps <= 0.25 * num_steps + 2  # the burst


def test_a_hold_crosses_the_policy_wire_and_nonsense_is_refused():
    from flagstop.scheduler_svc.policy_wire import check, decision_from_proto, decision_to_proto
    from flagstop.v1 import policy_pb2

    query = policy_pb2.PolicyQuery(running=[policy_pb2.PolicyRequest(request_id="a")],
                                   waiting=[policy_pb2.PolicyRequest(request_id="b")])  # fmt: skip
    wire = decision_to_proto(StepDecision(["b"], hold=frozenset({"a"})), [])
    assert check(wire, query) == "" and decision_from_proto(wire).hold == {"a"}
    wire = decision_to_proto(StepDecision(["b"], hold=frozenset({"b"})), [])
    assert check(wire, query) == "nonsense"  # only a running request can sit a step out


def test_hrrn_puts_short_prompts_first_and_lets_a_long_one_age_past_them():
    scheduler, _ = engine(make_policy("hrrn"), budget=600, max_num_seqs=1)
    scheduler.add_request(request("long", 500, 1, 0.0))
    scheduler.add_request(request("short", 20, 1, 0.0))
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["short"]
    scheduler2, _ = engine(make_policy("hrrn"), budget=600, max_num_seqs=1)
    scheduler2.add_request(request("long", 500, 1, -60.0))  # waited a minute
    scheduler2.add_request(request("short", 20, 1, 0.0))
    assert [r.req_id for r in scheduler2.schedule().scheduled_new_reqs] == ["long"]


def test_the_step_cost_model_learns_the_executor_it_measures():
    model = StepCostModel()
    truth = StepCostModel(base_s=0.012, s_per_token=2e-5, s_per_context_token=1e-7)
    for i in range(400):
        tokens, context = (i * 37) % 2048 + 1, (i * 7919) % 300_000 + 1
        model.observe(tokens, context, truth.seconds(tokens, context))
    for tokens, context in ((1, 1), (2048, 300_000), (512, 64_000)):
        assert math.isclose(model.seconds(tokens, context), truth.seconds(tokens, context),
                            rel_tol=0.02)  # fmt: skip
    assert model.tokens_within(0.05, 10) == truth.tokens_within(0.05, 10) or abs(
        model.tokens_within(0.05, 10) - truth.tokens_within(0.05, 10)) < 40  # fmt: skip


def test_a_policy_swapped_between_steps_keeps_every_request_in_order():
    scheduler, clock = engine(FCFSPolicy(), budget=64, max_num_seqs=2)
    for i in range(8):
        scheduler.add_request(request(f"r{i}", 40 - 4 * i, 5, float(i), ttft_s=30.0))
    advance(scheduler, clock, scheduler.schedule())
    waiting = [r.request_id for r in scheduler.waiting]
    scheduler.set_policy(make_policy("hrrn"))
    assert [r.request_id for r in scheduler.waiting] == waiting
    finished = set()
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        clock.now += 0.01
        for out in scheduler.update_from_output(
            plan, StepOutcome([7] * len(plan.sampling_requests))
        ).values():
            finished |= out.finished.keys()
    assert finished == {f"r{i}" for i in range(8)}
    check_idle(scheduler)


def test_a_shadow_policy_is_compared_and_counted_but_never_applied():
    live_plans, shadow_plans = [], []
    for plans, shadow in ((live_plans, None), (shadow_plans, "slo")):
        scheduler, clock = engine(FCFSPolicy(), budget=64, max_num_seqs=2)
        scheduler.policy_step.set_shadow(None if shadow is None else make_policy(shadow))
        for i in range(6):  # the last one's target no step can meet: slo would shed it
            ttft = 0.0001 if i == 5 else 30.0
            scheduler.add_request(request(f"r{i}", 60 - 10 * i, 4, 0.0, ttft_s=ttft))
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            plans.append(dict(plan.num_scheduled_tokens))
            advance(scheduler, clock, plan)
    assert shadow_plans == live_plans  # nothing it decided was applied
    shadow = scheduler.policy_step.shadow
    assert shadow.name == "slo" and shadow.num_decisions > 0
    assert shadow.num_would_shed >= 1 and scheduler.policy_step.num_shed == 0
    assert shadow.num_agreed < shadow.num_decisions and shadow.recent
    assert "r5" in shadow.recent[0].would_shed


def test_objectives_are_seconds_inside_and_milliseconds_on_the_wire():
    """One type end to end: the wire's ms (0: none) read as seconds (None: none), the
    scheduler's fallback filling only what a request leaves unstated."""
    fallback = Objectives(ttft_s=2.0, tpot_s=0.1)
    add = scheduler_pb2.AddRequest(slo_ttft_ms=250, tenant="acme", request_class="chat")
    assert objectives_from_proto(add, fallback) == Objectives(0.25, 0.1, "acme", "chat")
    assert objectives_from_proto(scheduler_pb2.AddRequest(), fallback) is fallback
    assert ms_of(0.25) == 250 and ms_of(None) == 0 and seconds_of(0) is None
    assert all(ms_of(seconds_of(ms)) == ms for ms in (1001, 1003.5, 0.001, 86_400_000))
    defaults = ObjectiveDefaults({"class:chat": SLOTarget(tpot_ms=50), "*": SLOTarget(ttft_ms=900)})
    request = generation_pb2.GenerateRequest(request_class="chat")
    resolved = defaults.resolve(request, [("x-llm-d-slo-ttft-ms", "300")])
    assert resolved == Objectives(0.3, 0.05, "", "chat")
    assert resolved.attained(0.29, 0.06) == "missed_tpot"
    assert NO_OBJECTIVES.attained(9.0, 9.0) == "no_target"


def finish_all(scheduler: Scheduler, clock: Clock) -> None:
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            return
        advance(scheduler, clock, scheduler.schedule())
    raise AssertionError("requests left unfinished")


def test_slo_and_fair_retain_a_sessions_turn_and_not_a_batch_jobs_prefix():
    """A session's turn keeps every block it cached (its next turn resends prompt and
    output); a batch request's retention is dropped whatever it asked; a request of
    neither keeps what it asked (here none)."""
    for name in ("slo", "fair"):
        scheduler, clock = engine(make_policy(name))
        turn, batch, plain = request("turn", 64, 20), request("batch", 64, 4,
                                     request_class="batch"), request("plain", 64, 4)  # fmt: skip
        turn.session_id = "agent-1"
        batch.retention = Retention(80, 600.0, 64)
        for r in (turn, batch, plain):
            scheduler.add_request(r)
        finish_all(scheduler, clock)
        # The turn's 84 tokens fill 5 blocks, output included; nothing of the others.
        assert scheduler.kv.pool.retained.num_free_blocks == 5, name
        check_idle(scheduler)


def test_fair_retains_a_lighter_tenants_sessions_at_a_lower_priority():
    scheduler, _ = engine(make_policy("fair", weights={"gold": 4.0, "free": 1.0}))
    for tenant in ("gold", "free"):
        r = request(tenant, 32, 2, tenant=tenant)
        r.session_id = f"agent-{tenant}"
        scheduler.add_request(r)
    decision = scheduler.policy_step.policy.decide(scheduler._policy_view())
    assert {rid: r.priority for rid, r in decision.retain.items()} == {"gold": 50, "free": 12}


def test_a_policys_retention_is_cut_to_the_operators_bound_and_counted_when_unknown():
    class Retains(FCFSPolicy):
        def decide(self, view: PolicyView) -> StepDecision:
            retain = {r.request_id: Retention(100, 7200.0, ALL_TOKENS) for r in view.waiting}
            return StepDecision(retain={**retain, "nobody": None})

    scheduler, _ = engine(Retains(), max_retention_s=60.0)
    scheduler.add_request(request("a", 32, 2))
    scheduler.schedule()
    assert scheduler.requests["a"].retention == Retention(100, 60.0, ALL_TOKENS)
    assert scheduler.policy_step.num_ignored_decisions == 1
    scheduler, _ = engine(Retains(), retention_share=0.0)  # retention off: none at all
    scheduler.add_request(request("a", 32, 2))
    scheduler.schedule()
    assert scheduler.requests["a"].retention is None


def test_retention_crosses_the_policy_wire_and_nonsense_is_refused():
    from flagstop.scheduler_svc.policy_wire import (
        check,
        decision_from_proto,
        decision_to_proto,
        describe,
        request_from_proto,
    )
    from flagstop.v1 import policy_pb2

    turn = request("a", 32, 2)
    turn.session_id, turn.retention = "agent-1", Retention(30, 60.0, ALL_TOKENS)
    seen = request_from_proto(describe(turn, policy_pb2.PolicyRequest()))
    assert (seen.session_id, seen.retention) == ("agent-1", turn.retention)
    query = policy_pb2.PolicyQuery(waiting=[policy_pb2.PolicyRequest(request_id="a")])
    decision = StepDecision(retain={"a": Retention(70, 300.0, 48)})
    wire = decision_to_proto(decision, [])
    assert check(wire, query) == "" and decision_from_proto(wire).retain == decision.retain
    wire = decision_to_proto(StepDecision(retain={"a": None}), [])
    assert decision_from_proto(wire).retain == {"a": None}
    for bad in ({"a": Retention(101, 1.0)}, {"a": Retention(5, -1.0)}, {"b": None}):
        assert check(decision_to_proto(StepDecision(retain=bad), []), query) == "nonsense"
