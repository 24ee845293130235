"""KV cache groups in the scheduler core: the groups built from a model's layers, a
window group letting go of what left the window, a recurrent group holding one state
block whatever the length, and prefix hits every group can serve. The state machine
(test_scheduler_state_machine.py) draws group layouts too."""

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager
from flagstop.scheduler_svc.core.kv_groups import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    KVLayer,
    describe_groups,
    kv_cache_groups,
    layer_slots,
)
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.utils import cdiv
from tests.helpers.hash_model import Driver, HashModelExecutor, reference_tokens
from tests.helpers.scheduler_invariants import check_idle, check_invariants

FULL, WINDOW_128 = KVLayer(), KVLayer(SLIDING_ATTENTION, 128)
GPT_OSS_20B = [WINDOW_128, FULL] * 12  # layer_types alternate, sliding first


def test_gpt_oss_layers_make_two_groups_of_twelve():
    groups = kv_cache_groups(GPT_OSS_20B)
    assert [(g.attention, g.sliding_window, len(g.layers)) for g in groups] == [
        (FULL_ATTENTION, 0, 12), (SLIDING_ATTENTION, 128, 12)]  # fmt: skip
    assert groups[0].layers == tuple(range(1, 24, 2))
    assert layer_slots(groups, 24)[:4] == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert describe_groups(groups) == "full x12 + window 128 x12"


def test_gemma3_layers_split_the_window_layers_into_groups_of_the_full_count():
    # gemma-3-1b: 26 layers, every sixth global: 4 full, 22 local (512).
    layers = [FULL if i % 6 == 5 else KVLayer(SLIDING_ATTENTION, 512) for i in range(26)]
    groups = kv_cache_groups(layers)
    assert [len(g.layers) for g in groups] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(i for g in groups for i in g.layers) == list(range(26))


def test_a_model_of_one_type_is_one_group():
    assert [len(g.layers) for g in kv_cache_groups([FULL] * 4)] == [4]
    assert [g.sliding_window for g in kv_cache_groups([KVLayer(SLIDING_ATTENTION, 8)] * 4)] == [8]


def _request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, "router", prompt, StopParams(max_tokens, 0, True), frozenset())


def _gpt_oss_scheduler(num_blocks: int, budget: int = 2048, block_size: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=16384,
                             block_size=block_size)  # fmt: skip
    return Scheduler(config, num_blocks, kv_groups=kv_cache_groups(GPT_OSS_20B))


def _held(scheduler: Scheduler, rid: str, group: int) -> int:
    blocks = scheduler.kv.req_blocks[rid].blocks[group]
    return sum(b is not scheduler.kv.pool.null_block for b in blocks)


def test_an_8k_request_holds_a_window_of_blocks_in_its_window_layers():
    # Asserted from the block pool: what the pool has handed out, after every step.
    scheduler = _gpt_oss_scheduler(num_blocks=1200)
    prompt = [(7 * i) % 97 + 1 for i in range(8192)]
    scheduler.add_request(_request("long", prompt, max_tokens=64))
    executor = HashModelExecutor(1200, 16, 100, groups=scheduler.kv_groups)
    window_blocks = cdiv(128, 16) + 1
    seen_decode = 0

    def after_step(plan) -> None:
        nonlocal seen_decode
        check_invariants(scheduler)
        if "long" not in scheduler.kv.req_blocks:
            return
        num_new = plan.num_scheduled_tokens.get("long", 0)
        held = _held(scheduler, "long", 1)
        assert held <= cdiv(128 + num_new, 16) + 1, (held, num_new)
        if num_new == 1:
            seen_decode += 1
            assert held <= window_blocks
        in_use = scheduler.kv.pool.num_usable_blocks - scheduler.kv.pool.num_free_blocks
        assert in_use == _held(scheduler, "long", 0) + held

    driver = Driver(scheduler, executor, depth=2, on_step=after_step)
    driver.run()
    assert seen_decode > 60
    assert driver.tokens["long"] == reference_tokens(prompt, StopParams(64, 0, True), frozenset(),
                                                     100, 16384)  # fmt: skip
    check_idle(scheduler)


def test_the_pool_holds_what_the_full_groups_need():
    scheduler = _gpt_oss_scheduler(num_blocks=1 + 300)
    window = cdiv(128 + 2048, 16) + 1  # a window and a whole chunk
    assert scheduler.kv_capacity_tokens == (300 - window) * 16
    # A pool smaller than a window and a chunk still holds what fits whole in it: a
    # sequence shorter than the chunk holds no more window blocks than positions.
    small = _gpt_oss_scheduler(num_blocks=1 + 47)
    assert small.kv_capacity_tokens == 23 * 16


def test_a_prefix_hit_is_what_every_group_can_serve():
    kv = KVCacheManager(64, 4, groups=kv_cache_groups([KVLayer(SLIDING_ATTENTION, 5), FULL]))
    first = _request("a", list(range(1, 21)))
    kv.update_block_hashes(first)
    first.num_computed_tokens = 0
    assert kv.allocate_slots(first, 20) is not None
    kv.free("a")
    second = _request("b", [*range(1, 21), 30, 31])
    kv.update_block_hashes(second)
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 5
    full, window = hits.groups
    assert all(b is not kv.pool.null_block for b in full)
    # A query at position 20 sees 16..20: block 4 only (cdiv(5 - 1, 4) = 1 block before).
    assert [b is kv.pool.null_block for b in window] == [True] * 4 + [False]
    # Evict the window group's block 4: the hit falls back to where its window is cached.
    kv.pool.uncache(window[4])
    assert len(kv.get_computed_blocks(second)) == 4


def test_a_window_hit_needs_the_whole_window_before_it():
    kv = KVCacheManager(64, 4, groups=kv_cache_groups([KVLayer(SLIDING_ATTENTION, 9), FULL]))
    first = _request("a", list(range(1, 21)))
    kv.update_block_hashes(first)
    kv.allocate_slots(first, 20)
    kv.free("a")
    second = _request("b", [*range(1, 21), 30])
    kv.update_block_hashes(second)
    window_group = kv.get_computed_blocks(second).groups[1]
    # Window 9: the 8 positions before 20 are blocks 3 and 4.
    kv.pool.uncache(window_group[3])
    # Position 20 misses block 3; position 16 would need blocks 2 and 3: also missing;
    # position 12 needs blocks 1 and 2, both cached.
    assert len(kv.get_computed_blocks(second)) == 3


LINEAR = KVLayer(LINEAR_ATTENTION)
QWEN3_NEXT = [LINEAR, LINEAR, LINEAR, FULL] * 12  # full_attention_interval 4, 48 layers


def test_qwen3_next_layers_make_a_full_group_and_three_recurrent_ones():
    groups = kv_cache_groups(QWEN3_NEXT)
    assert [(g.attention, len(g.layers)) for g in groups] == [
        (FULL_ATTENTION, 12), *[(LINEAR_ATTENTION, 12)] * 3]  # fmt: skip
    assert groups[0].layers == tuple(range(3, 48, 4))
    assert [g.window for g in groups] == [0, 2, 2, 2]
    assert describe_groups(groups) == "full x12 + linear x12 + linear x12 + linear x12"


def test_a_request_holds_one_state_block_in_each_recurrent_group_from_100_to_8k_tokens():
    # Asserted from the block pool after every step: the full group grows with the
    # sequence, each recurrent group holds the block of the last computed token (and,
    # while a chunk is in flight, the blocks of the positions it computes).
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=16384,
                             block_size=16)  # fmt: skip
    groups = kv_cache_groups(QWEN3_NEXT)
    scheduler = Scheduler(config, 1 + 2000, kv_groups=groups)
    executor = HashModelExecutor(1 + 2000, 16, 100, groups=groups)
    held_at: dict[str, list[tuple[int, list[int]]]] = {"short": [], "long": []}

    def after_step(plan) -> None:
        check_invariants(scheduler)
        in_use = scheduler.kv.pool.num_usable_blocks - scheduler.kv.pool.num_free_blocks
        held_now = 0
        for rid in scheduler.kv.req_blocks:
            num_new = plan.num_scheduled_tokens.get(rid, 0)
            held = [_held(scheduler, rid, g) for g in (1, 2, 3)]
            assert all(h <= cdiv(num_new, 16) + 1 for h in held), (held, num_new)
            held_at[rid].append((scheduler.requests[rid].num_computed_tokens, held))
            held_now += _held(scheduler, rid, 0) + sum(held)
        assert in_use == held_now

    lengths = {"short": 100, "long": 8192}
    for rid, length in lengths.items():
        prompt = [(length * i) % 97 + 1 for i in range(length)]  # no prefix in common
        scheduler.add_request(_request(rid, prompt, max_tokens=40))
    Driver(scheduler, executor, depth=1, on_step=after_step).run()
    for rid in held_at:  # decoding: the state's block (the next one's from a boundary on)
        decodes = [held for n, held in held_at[rid] if n > lengths[rid] and n % 16 != 1]
        assert len(decodes) > 30 and all(held == [1, 1, 1] for held in decodes)
    check_idle(scheduler)


def test_a_recurrent_hit_needs_the_state_at_its_block_boundary():
    kv = KVCacheManager(64, 4, groups=kv_cache_groups([LINEAR, FULL]))
    first = _request("a", list(range(1, 21)))
    kv.update_block_hashes(first)
    assert kv.allocate_slots(first, 20) is not None
    kv.free("a")
    second = _request("b", [*range(1, 19), 30, 31])  # shares 18 tokens: 4 full blocks
    kv.update_block_hashes(second)
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 4
    _, linear = hits.groups
    # Position 16 resumes from the state at 16, in block 3: the blocks before it, null.
    assert [b is kv.pool.null_block for b in linear] == [True] * 3 + [False]
    # Without the state at 16 the hit falls back to the boundary whose state is kept.
    kv.pool.uncache(linear[3])
    assert len(kv.get_computed_blocks(second)) == 3
