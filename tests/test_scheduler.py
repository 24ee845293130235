"""Unit tests of the scheduling rules, driven in-process step by step."""

import pytest

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.decision import StepDecision
from flagstop.scheduler_svc.core.output import SchedulerOutput, StepOutcome
from flagstop.scheduler_svc.core.request import FinishReason, RequestStatus
from flagstop.scheduler_svc.core.scheduler import RequestRejected, Scheduler
from tests.helpers.scheduler_invariants import check_idle, check_invariants
from tests.helpers.scheduler_steps import EOS, make_request, run_to_idle, step


def outputs(request) -> list[int]:
    return request.all_token_ids[request.num_prompt_tokens :]


def make_scheduler(num_blocks: int = 64, policy: str = "fcfs", **overrides) -> Scheduler:
    config = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, block_size=4)
    config.update(overrides)
    return Scheduler(SchedulerConfig(policy=policy, **config), num_blocks)


def step_until_preemption(scheduler: Scheduler, max_steps: int = 50) -> SchedulerOutput:
    for _ in range(max_steps):
        plan, _ = step(scheduler)
        if plan.preempted_req_ids:
            return plan
    raise AssertionError("no preemption")


# -- admission -------------------------------------------------------------------


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_a_long_prompt_waits_until_the_pool_could_hold_it_whole(reserve_full_isl):
    # 16 blocks of 4: a decode holds 3 of them; the 56-token prompt needs 14 more,
    # 13 free: whole it does not fit, its first 16-token chunk does.
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=16,
                               reserve_full_isl=reserve_full_isl)  # fmt: skip
    scheduler.add_request(make_request("decode", num_prompt=8, max_tokens=40, ignore_eos=True))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_request("long", num_prompt=56, max_tokens=4))
    assert scheduler.num_free_blocks == 13
    plan, _ = step(scheduler)
    admitted = [r.req_id for r in plan.scheduled_new_reqs]
    assert admitted == ([] if reserve_full_isl else ["long"])
    run_to_idle(scheduler)
    # The old rule's loop: the decode's growth preempts the prompt it let in.
    assert (scheduler.num_preemptions > 0) is not reserve_full_isl
    check_idle(scheduler)


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        (dict(prompt=[]), "prompt is empty"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(num_prompt=250, max_tokens=7), "exceeds the model's max_model_len of 256"),
        (dict(num_prompt=30, max_tokens=10), r"exceeds the whole KV cache \(32 tokens\)"),
    ],
)
def test_unservable_requests_are_rejected_with_a_reason(request_kw, message):
    scheduler = make_scheduler(num_blocks=8)
    with pytest.raises(RequestRejected, match=message):
        scheduler.add_request(make_request("a", **request_kw))
    check_idle(scheduler)


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(RequestRejected, match="already in use"):
        scheduler.add_request(make_request("a"))


def test_chunked_prefill_off_needs_a_budget_for_a_whole_prompt():
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, no_chunked_prefill=True)


# -- the step plan ---------------------------------------------------------------


def test_new_request_is_sent_once_then_only_as_a_diff():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", num_prompt=6, max_tokens=5, ignore_eos=True))
    plan, _ = step(scheduler)
    [new] = plan.scheduled_new_reqs
    assert new.token_ids == scheduler.requests["a"].prompt_token_ids
    assert new.block_ids == [0, 1] and new.num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"a": 6}
    plan, _ = step(scheduler)  # decode at position 6: still in block 1
    assert not plan.scheduled_new_reqs
    cached = plan.scheduled_cached_reqs
    assert (cached.req_ids, cached.num_computed_tokens, cached.new_block_ids) == (["a"], [6], [()])
    plan, _ = step(scheduler)  # position 7 still in block 1; position 8 needs block 2
    plan, _ = step(scheduler)
    assert list(plan.scheduled_cached_reqs.new_block_ids[0]) == [2]


def test_running_requests_are_served_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("old", num_prompt=8, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("new", num_prompt=20, ignore_eos=True))
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"old": 1, "new": 9}
    assert plan.total_num_scheduled_tokens == 10


def test_seat_limit():
    scheduler = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, ignore_eos=True))
    plan, _ = step(scheduler)
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert len(scheduler.waiting) == 1


def test_chunked_prefill_runs_beside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    for rid in ("d1", "d2"):
        scheduler.add_request(make_request(rid, num_prompt=3, max_tokens=20, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("long", num_prompt=20, max_tokens=3, ignore_eos=True))
    chunks = []
    while outputs(scheduler.requests["long"]) == []:
        plan, _ = step(scheduler)
        assert plan.num_scheduled_tokens["d1"] == plan.num_scheduled_tokens["d2"] == 1
        assert plan.total_num_scheduled_tokens <= 8
        chunks.append(plan.num_scheduled_tokens["long"])
    assert chunks == [6, 6, 6, 2]
    run_to_idle(scheduler)


def test_long_prefill_threshold_caps_a_chunk():
    scheduler = make_scheduler(long_prefill_token_threshold=5)
    scheduler.add_request(make_request("a", num_prompt=12))
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 5}
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 5}
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 2}


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=256, no_chunked_prefill=True)
    scheduler.add_request(make_request("a", num_prompt=250, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("b", num_prompt=10, max_tokens=3, ignore_eos=True))
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 250}  # b's 10 tokens do not fit the 6 left whole
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 10}
    run_to_idle(scheduler)


# -- stop conditions -------------------------------------------------------------


def feed(scheduler: Scheduler, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
    got, reason = [], None
    for token in tokens:
        _, outputs = step(scheduler, token)
        for out in outputs.values():
            got += out.new_token_ids
            reason = out.finished.get("a", reason)
        if not scheduler.has_unfinished_requests():
            break
    return got, reason


@pytest.mark.parametrize(
    ("request_kw", "tokens", "expected", "reason"),
    [
        ({}, [5, EOS, 5], [5, EOS], FinishReason.STOP),
        ({"ignore_eos": True}, [5, EOS, 5, 5], [5, EOS, 5], FinishReason.LENGTH),
        ({"stop_token_ids": frozenset({9})}, [5, 9, 5], [5, 9], FinishReason.STOP),
        ({"min_tokens": 2}, [EOS, EOS, 5], [EOS, EOS], FinishReason.STOP),
        (
            {"min_tokens": 3, "stop_token_ids": frozenset({9})},
            [9, 9, 9],
            [9, 9, 9],
            FinishReason.STOP,
        ),
        ({}, [5, 5, 5, 5], [5, 5, 5], FinishReason.LENGTH),
    ],
)
def test_stop_conditions(request_kw, tokens, expected, reason):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=3, **request_kw))
    assert feed(scheduler, tokens) == (expected, reason)
    check_idle(scheduler)


def test_max_model_len_ends_a_request_without_max_tokens():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add_request(make_request("a", num_prompt=6, max_tokens=None, ignore_eos=True))
    assert feed(scheduler, [5] * 10) == ([5] * 4, FinishReason.LENGTH)


def test_the_pool_bounds_a_request_without_max_tokens():
    scheduler = make_scheduler(num_blocks=3)  # 12 tokens, below max_model_len
    scheduler.add_request(make_request("a", num_prompt=6, max_tokens=None, ignore_eos=True))
    assert feed(scheduler, [5] * 10) == ([5] * 6, FinishReason.LENGTH)


def test_outputs_are_grouped_by_owner():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", owner="r1", max_tokens=1))
    scheduler.add_request(make_request("b", owner="r2"))
    scheduler.add_request(make_request("c", owner="r1"))
    _, outputs = step(scheduler)
    assert set(outputs) == {"r1", "r2"}
    assert outputs["r1"].req_ids == ["a", "c"] and outputs["r2"].req_ids == ["b"]
    assert outputs["r1"].finished == {"a": FinishReason.LENGTH}
    plan, _ = step(scheduler)
    assert plan.finished_req_ids == {"a"}  # the executor drops it next step


# -- preemption ------------------------------------------------------------------


def test_fcfs_preempts_the_newest_and_resumes_it():
    # 4 blocks of 4 tokens; two requests of 6 prompt tokens each need 2 blocks, then 3.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("old", num_prompt=6, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("new", num_prompt=6, max_tokens=8, ignore_eos=True))
    plan = step_until_preemption(scheduler)  # old needs a 3rd block for position 8
    assert plan.preempted_req_ids == {"new"}
    assert plan.num_scheduled_tokens == {"old": 1}
    new = scheduler.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and scheduler.waiting.peek() is new
    num_outputs = len(outputs(new))
    plans = run_to_idle(scheduler)
    [resumed] = next(p for p in plans if p.scheduled_resumed_reqs).scheduled_resumed_reqs
    assert resumed.req_id == "new" and len(resumed.token_ids) == 6 + num_outputs
    assert resumed.num_computed_tokens == 0 and len(resumed.block_ids) == -(
        -len(resumed.token_ids) // 4
    )


def test_nothing_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", num_prompt=6, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", num_prompt=6, max_tokens=8, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("c", num_prompt=1, max_tokens=1))
    plan = step_until_preemption(scheduler)
    assert plan.preempted_req_ids == {"b"} and "c" not in plan.num_scheduled_tokens


def test_priority_orders_waiting_by_priority_then_arrival():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, priority, arrival in [("late-low", 5, 3.0), ("high", 0, 2.0), ("early-low", 5, 1.0)]:
        scheduler.add_request(
            make_request(rid, max_tokens=1, priority=priority, arrival_time=arrival)
        )
    order = [next(iter(p.num_scheduled_tokens)) for p in run_to_idle(scheduler)]
    assert order == ["high", "early-low", "late-low"]


def test_priority_preempts_the_least_important_even_if_already_scheduled():
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    scheduler.add_request(make_request("low", num_prompt=5, priority=9, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("high", num_prompt=8, priority=0, ignore_eos=True))
    step(scheduler)
    # "low" runs first and is scheduled, then "high" needs a block for position 8.
    plan = step_until_preemption(scheduler)
    assert plan.preempted_req_ids == {"low"}
    assert plan.num_scheduled_tokens == {"high": 1}
    assert "low" not in plan.scheduled_cached_reqs.req_ids
    run_to_idle(scheduler)


def test_a_victim_unscheduled_mid_step_leaves_no_block_cached_for_its_lost_chunk():
    # "low" prefills in chunks of 8, and its third chunk (tokens 16-23: blocks 4 and
    # 5, cached as the step is planned) is scheduled before "high", behind it in the
    # batch, needs a block for its decode and preempts it. Block 5 goes to "high", but
    # block 4 waits in the free queue: its tokens were never computed, so it must not
    # stay a prefix hit.
    scheduler = make_scheduler(num_blocks=7, policy="priority", long_prefill_token_threshold=8)
    low = make_request("low", num_prompt=24, max_tokens=1, priority=9, ignore_eos=True)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(make_request("high", num_prompt=4, max_tokens=4, priority=0))
    step(scheduler)
    plan, _ = step(scheduler)
    assert plan.preempted_req_ids == {"low"} and "low" not in plan.num_scheduled_tokens
    cached = scheduler.kv.pool.cached_blocks
    assert all(h in cached for h in low.block_hashes[:4])  # computed in steps 1-2
    assert low.block_hashes[4] not in cached
    run_to_idle(scheduler)


# -- abort -----------------------------------------------------------------------


def test_abort_waiting_running_and_preempted_requests():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, num_prompt=6, max_tokens=8, ignore_eos=True))
    step_until_preemption(scheduler)  # b preempted, c still waiting
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    scheduler.abort(["b", "c"])
    scheduler.abort(["b", "c", "c", "unknown"])  # idempotent
    check_invariants(scheduler)
    assert set(scheduler.requests) == {"a"}
    scheduler.abort(["a"])
    plan = scheduler.schedule()
    assert plan.finished_req_ids == {"a"}  # only the one the executor still holds
    check_idle(scheduler)


def test_abort_while_the_step_is_in_flight_drops_late_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", max_tokens=8, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.abort(["a"])
    free_after_abort = scheduler.kv.pool.num_free_blocks
    outputs = scheduler.update_from_output(plan, StepOutcome([5, 6]))
    assert outputs["router-0"].req_ids == ["b"]
    assert scheduler.kv.pool.num_free_blocks == free_after_abort
    scheduler.abort(["b"])
    check_idle(scheduler)


def test_a_late_token_never_reaches_a_new_request_with_the_same_id():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.abort(["a"])
    scheduler.add_request(make_request("a", ignore_eos=True))  # e.g. a router's resubmission
    assert scheduler.update_from_output(plan, StepOutcome([5])) == {}
    assert outputs(scheduler.requests["a"]) == []


def test_a_request_the_executor_failed_ends_alone_with_an_error():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", ignore_eos=True))
    scheduler.add_request(make_request("b", ignore_eos=True))
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, StepOutcome([-1, 6]))
    assert outputs["router-0"].req_ids == ["b"] and outputs["router-0"].new_token_ids == [6]
    assert outputs["router-0"].finished == {"a": FinishReason.ERROR}
    assert set(scheduler.requests) == {"b"}
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_a_wrong_number_of_tokens_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for 1 sampling requests"):
        scheduler.update_from_output(plan, StepOutcome([]))


# -- pipelining ------------------------------------------------------------------


def test_next_steps_are_planned_before_the_tokens_of_earlier_ones():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", num_prompt=5, max_tokens=3, ignore_eos=True))
    plans = [scheduler.schedule() for _ in range(3)]  # no token known yet
    assert [p.num_scheduled_tokens for p in plans] == [{"a": 5}, {"a": 1}, {"a": 1}]
    assert scheduler.requests["a"].num_output_placeholders == 3
    # The three tokens in flight reach max_tokens: computing a fourth would be waste.
    assert scheduler.schedule().num_scheduled_tokens == {}
    outputs = [
        scheduler.update_from_output(p, StepOutcome([t]))
        for p, t in zip(plans, (11, 12, 13), strict=True)
    ]
    assert [o["router-0"].new_token_ids for o in outputs] == [[11], [12], [13]]
    assert outputs[-1]["router-0"].finished == {"a": FinishReason.LENGTH}
    check_idle(scheduler)


def test_stats():
    scheduler = make_scheduler(num_blocks=10)
    scheduler.add_request(make_request("a", num_prompt=8))
    scheduler.add_request(make_request("b", num_prompt=8))
    step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (2, 0, 6)
    assert stats.kv_cache_usage == pytest.approx(0.4)


# -- remote (ranked) policy ------------------------------------------------------


def test_a_ranking_orders_admission_and_failing_open_restores_fcfs():
    scheduler = make_scheduler(policy="remote", max_num_seqs=1)
    for i, rid in enumerate("abcd"):
        scheduler.add_request(make_request(rid, max_tokens=1, arrival_time=float(i)))
    scheduler.policy_step.policy.apply(
        StepDecision(admission_order=["c", "a"]), []
    )  # for the next step
    assert next(iter(step(scheduler)[0].num_scheduled_tokens)) == "c"
    assert [r.request_id for r in scheduler.waiting] == ["a", "b", "d"]
    scheduler.add_request(make_request("e", max_tokens=1, arrival_time=-1.0))
    assert [r.request_id for r in scheduler.waiting] == ["a", "b", "d", "e"]  # behind the ranked
    scheduler.policy_step.policy.fail_open()
    assert [r.req_id for r in step(scheduler)[0].scheduled_new_reqs] == ["e"]  # arrival order
    assert [r.request_id for r in scheduler.waiting] == ["a", "b", "d"]
    run_to_idle(scheduler)


def test_a_preemption_order_picks_the_victim():
    scheduler = make_scheduler(num_blocks=4, policy="remote")
    scheduler.add_request(make_request("a", num_prompt=6, arrival_time=0, ignore_eos=True))
    scheduler.add_request(make_request("b", num_prompt=6, arrival_time=1, ignore_eos=True))
    step(scheduler)
    scheduler.policy_step.policy.apply(StepDecision(), ["a"])  # FCFS would pick the newest, b
    assert step_until_preemption(scheduler).preempted_req_ids == {"a"}
    run_to_idle(scheduler)


def test_a_lost_executor_restarts_every_request_by_recompute_on_a_new_pool():
    scheduler = make_scheduler(num_blocks=64)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, num_prompt=6, max_tokens=20))
    for _ in range(3):
        step(scheduler)
    in_flight = scheduler.schedule()  # its tokens never come back
    outputs_so_far = {r.request_id: outputs(r) for r in scheduler.running}
    scheduler.reset_executor(num_blocks=32)
    check_invariants(scheduler)
    assert not scheduler.running and [r.request_id for r in scheduler.waiting] == ["a", "b", "c"]
    assert scheduler.kv.pool.num_blocks == 32 and scheduler.num_preemptions == 3
    assert all(r.num_output_placeholders == 0 for r in scheduler.requests.values())
    assert in_flight.sampling_requests
    plan = scheduler.schedule()
    # Resumed with every token they have, from position 0 on the new executor.
    resumed = {d.req_id: d for d in plan.scheduled_resumed_reqs}
    assert set(resumed) == {"a", "b", "c"} and not plan.finished_req_ids
    for rid, data in resumed.items():
        assert list(data.token_ids)[6:] == outputs_so_far[rid] and data.num_computed_tokens == 0
    scheduler.update_from_output(plan, StepOutcome([7] * len(plan.sampling_requests)))
    run_to_idle(scheduler)


# -- LoRA adapters ----------------------------------------------------------------


def test_the_same_prompt_under_two_adapters_never_shares_kv():
    scheduler = make_scheduler(max_loras=4)
    prompt = list(range(10, 30))  # five full blocks
    for rid, name in (("base", ""), ("a", "a"), ("b", "b"), ("a2", "a")):
        scheduler.add_request(make_request(rid, prompt=prompt, max_tokens=1, lora_name=name))
        run_to_idle(scheduler)
    stats = scheduler.kv.prefix_stats
    # Only a2 found its prefix (a's four full blocks before the last token's): 16 tokens.
    assert (stats.num_queries, stats.num_hits) == (80, 16), stats


def test_the_prefix_cache_keys_an_adapter_by_its_files_not_its_name():
    """a loaded again from other files (another identity) hits nothing of what the
    old files computed; the old files again, or the same files under another name,
    hit it all."""
    scheduler = make_scheduler(max_loras=4)
    prompt = list(range(10, 30))
    for rid, name, files in (("old", "a", "v1"), ("new", "a", "v2"), ("back", "a", "v1"),
                             ("alias", "b", "v1")):  # fmt: skip
        request = make_request(rid, prompt=prompt, max_tokens=1, lora_name=name, lora_id=files)
        scheduler.add_request(request)
        run_to_idle(scheduler)
        assert request.num_cached_tokens == (16 if rid in ("back", "alias") else 0), rid
    with pytest.raises(RequestRejected, match="no identity"):
        scheduler.add_request(make_request("x", lora_name="a", lora_id=""))


def test_max_loras_holds_a_third_adapter_back_without_blocking_the_rest():
    """Two slots: requests of a third adapter wait, in order, while the base model's
    and the running adapters' requests behind them join; they join once a slot frees."""
    scheduler = make_scheduler(max_loras=2)
    for rid, name in (("a", "a"), ("b", "b"), ("c1", "c"), ("base", ""), ("a2", "a"),
                      ("c2", "c")):  # fmt: skip
        scheduler.add_request(make_request(rid, max_tokens=2 if name != "c" else 1,
                                           lora_name=name))  # fmt: skip
    plan, _ = step(scheduler)
    assert list(plan.num_scheduled_tokens) == ["a", "b", "base", "a2"]
    assert [r.request_id for r in scheduler.waiting] == ["c1", "c2"]
    admitted = [list(p.num_scheduled_tokens) for p in run_to_idle(scheduler)]
    assert admitted[0] == ["a", "b", "base", "a2"]  # their last token
    assert admitted[1] == ["c1", "c2"]
    with pytest.raises(RequestRejected, match="start the executor with --max-loras"):
        make_scheduler().add_request(make_request("x", lora_name="a"))
