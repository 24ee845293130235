"""Every request's tokens are the same whatever the schedule: with and without
preemption, chunked prefill, prefix caching and pipelining. The stand-in model reads
its context back through the block tables, so bookkeeping errors change tokens."""

import random

import pytest

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.request import FinishReason, Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from tests.helpers.hash_model import Driver, HashModelExecutor, reference_tokens
from tests.helpers.scheduler_invariants import check_idle, check_invariants

VOCAB, EOS, BLOCK_SIZE, MAX_MODEL_LEN = 40, frozenset({0}), 4, 96


def workload(seed: int, num_requests: int = 24) -> list[tuple[str, list[int], StopParams, int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        if requests and rng.random() < 0.15:
            prompt = list(rng.choice(requests)[1])  # a prompt sent again, word for word
        else:
            shared = rng.choice(prefixes)[: rng.randrange(15)] if rng.random() < 0.7 else []
            prompt = shared + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 18))]
        stop = StopParams(
            max_tokens=rng.randrange(1, 40),
            min_tokens=rng.randrange(3),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=frozenset({rng.randrange(VOCAB)}) if rng.random() < 0.3 else frozenset(),
        )
        requests.append((f"req-{i}", prompt, stop, rng.randrange(3)))
    return requests


CONFIGS = {
    # name: (num_blocks, config overrides)
    "roomy": (512, dict(max_num_batched_tokens=512)),
    "chunked": (512, dict(max_num_batched_tokens=12, long_prefill_token_threshold=5)),
    "no-prefix-cache": (512, dict(no_prefix_caching=True)),
    "preempting": (24, dict(max_num_batched_tokens=32)),
    "preempting-chunked-no-cache": (
        24,
        dict(max_num_batched_tokens=7, no_prefix_caching=True),
    ),
    "no-chunking": (40, dict(max_num_batched_tokens=MAX_MODEL_LEN, no_chunked_prefill=True)),
    "priority-preempting": (24, dict(max_num_batched_tokens=16, policy="priority")),
    # Speculative decoding: drafts right, partly right and wrong (the stand-in's coin),
    # with chunked prefill, prefix hits, preemption and a budget that truncates them.
    "spec": (512, dict(max_num_batched_tokens=64, num_speculative_tokens=4)),
    "spec-chunked": (
        512,
        dict(max_num_batched_tokens=12, long_prefill_token_threshold=5, num_speculative_tokens=3),
    ),
    "spec-preempting": (24, dict(max_num_batched_tokens=32, num_speculative_tokens=3)),
    "spec-priority-preempting": (
        24,
        dict(max_num_batched_tokens=16, policy="priority", num_speculative_tokens=2),
    ),
}


# Depth 2 is the service's async scheduling; 3 checks that nothing relies on it being 2.
@pytest.mark.parametrize("depth", [1, 2, 3], ids=["sync", "pipelined", "pipelined-3"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_do_not_depend_on_the_schedule(name, depth, seed):
    num_blocks, overrides = CONFIGS[name]
    config = SchedulerConfig(
        **{
            "max_num_batched_tokens": 64,
            "max_num_seqs": 8,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK_SIZE,
            **overrides,
        }
    )
    scheduler = Scheduler(config, num_blocks)
    executor = HashModelExecutor(num_blocks, BLOCK_SIZE, VOCAB)
    expected = {}
    for rid, prompt, stop, priority in workload(seed):
        if len(prompt) + stop.max_tokens > num_blocks * BLOCK_SIZE:
            continue
        scheduler.add_request(
            Request(rid, "owner", prompt, stop, EOS, priority, arrival_time=len(expected))
        )
        expected[rid] = reference_tokens(prompt, stop, EOS, VOCAB, MAX_MODEL_LEN)

    num_trims = 0

    def check_step(plan):
        nonlocal num_trims
        num_trims += len(plan.trimmed_blocks)
        assert plan.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
        check_invariants(scheduler)

    driver = Driver(scheduler, executor, depth=depth, on_step=check_step)
    driver.run(max_steps=5000)
    check_idle(scheduler)
    assert driver.tokens == expected
    assert set(driver.finish_reasons) == set(expected)
    assert all(
        r in (FinishReason.STOP, FinishReason.LENGTH) for r in driver.finish_reasons.values()
    )
    if "preempting" in name:
        assert scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    if name in ("roomy", "chunked", "preempting", "spec", "spec-preempting"):
        assert scheduler.kv.prefix_stats.num_hits > 0, "the shared prefixes were meant to hit"
    if name.startswith("spec"):
        stats = scheduler.drafts.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts meant to be mixed"
        assert max(stats.accepted_per_pos, default=0) > 0
        assert num_trims > 0, "rejected drafts were meant to give blocks back"
    # A stand-in whose outputs collapsed would prove little.
    all_tokens = [t for tokens in expected.values() for t in tokens]
    assert len(set(all_tokens)) > VOCAB // 2
