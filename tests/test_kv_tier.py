"""The KV connector seam and the host tier, scheduler side, driven in-process: what is
written through, what loads back after the pool forgot it, and how a request whose KV
is arriving waits (its own queue, its blocks reserved, no seat, no spurious hit)."""

from flagstop.scheduler_svc.core.block_pool import KVCacheBlock
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.host_tier_connector import HostTierConnector
from flagstop.scheduler_svc.core.kv_connector import KVTransferResult
from flagstop.scheduler_svc.core.request import RequestStatus
from flagstop.scheduler_svc.core.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_idle, check_invariants
from tests.helpers.scheduler_steps import make_request, run_to_idle, step

BS = 4
PROMPT = list(range(10, 19))  # two full blocks and one token


def make(num_blocks: int = 8, tier_slots: int = 16, **overrides) -> Scheduler:
    config = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=BS)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config), num_blocks,
                     connector=HostTierConnector(tier_slots, BS))  # fmt: skip


def flush_pool(scheduler: Scheduler, tag: int = 100) -> None:
    """Run unrelated prompts that fill the pool, evicting every cached block."""
    num_tokens = scheduler.kv.pool.num_blocks * BS // 2 - 2
    # Four halves: blocks without a hash are reused first, so the first two only
    # take what nothing cached; the last two evict the rest.
    for i in range(4):
        base = tag + 40 * i
        prompt = list(range(base, base + num_tokens))
        scheduler.add_request(make_request(f"flush{tag}-{i}", prompt=prompt, max_tokens=1))
    run_to_idle(scheduler)


def start_loading_again(scheduler: Scheduler, max_tokens: int) -> None:
    """PROMPT ran and the pool forgot it: its next request starts loading it back."""
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=1))
    run_to_idle(scheduler)
    flush_pool(scheduler)
    scheduler.add_request(make_request("again", prompt=PROMPT, max_tokens=max_tokens))
    step(scheduler)
    assert "again" in scheduler.transfers.loading


def finish_loads(scheduler: Scheduler, *req_ids: str, failed=()) -> None:
    scheduler.transfers.update(scheduler.kv, KVTransferResult(req_ids, failed))
    check_invariants(scheduler)


def test_full_blocks_are_written_through_once_in_the_step_that_computes_them():
    scheduler = make()
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=4))
    plan, _ = step(scheduler)
    meta = plan.kv_connector
    assert meta.save_block_ids == scheduler.kv.block_ids("a")[:2]  # the partial one waits
    assert sorted(meta.save_slots) == [0, 1] and not meta.loads
    run_to_idle(scheduler)
    scheduler.add_request(make_request("b", prompt=PROMPT, max_tokens=1))
    plan, _ = step(scheduler)  # a pool hit, and already in the tier: nothing to save
    assert scheduler.kv.prefix_stats.num_hits == 8 and not plan.kv_connector.save_block_ids


def test_a_prefix_the_pool_evicted_loads_back_from_the_tier_without_a_seat_or_budget():
    scheduler = make(max_num_seqs=1)
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=1))
    run_to_idle(scheduler)
    flush_pool(scheduler)
    assert not scheduler.kv.get_computed_blocks(make_request("probe", prompt=PROMPT))
    scheduler.add_request(make_request("again", prompt=PROMPT, max_tokens=2))
    scheduler.add_request(make_request("other", num_prompt=5, max_tokens=2))
    plan, _ = step(scheduler)
    [load] = plan.kv_connector.loads
    again = scheduler.transfers.loading["again"]
    assert (load.req_id, load.block_ids) == ("again", scheduler.kv.block_ids("again")[:2])
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # No tokens, no seat of --max-num-seqs=1 (the next request runs), the whole prefill
    # reserved, and nothing of it a prefix hit yet.
    assert "again" not in plan.num_scheduled_tokens and list(plan.num_scheduled_tokens) == ["other"]
    assert len(scheduler.kv.block_ids("again")) == 3
    assert plan.poll_kv_transfers
    twin = make_request("twin", prompt=PROMPT)
    assert not scheduler.kv.get_computed_blocks(twin), "a half-loaded block was a prefix hit"
    finish_loads(scheduler, "again")
    run_to_idle(scheduler)
    assert scheduler.transfers.external_stats.num_hits == 8
    assert scheduler.stats().external_prefix_cache_hits == 8


def test_a_loaded_request_computes_only_its_last_token():
    scheduler = make()
    start_loading_again(scheduler, max_tokens=2)
    finish_loads(scheduler, "again")
    plan, _ = step(scheduler)
    [data] = plan.scheduled_new_reqs
    assert data.num_computed_tokens == 8 and plan.num_scheduled_tokens == {"again": 1}
    assert scheduler.requests["again"].num_cached_tokens == 8


def test_a_failed_load_recomputes_and_drops_what_it_read():
    scheduler = make()
    start_loading_again(scheduler, max_tokens=1)
    finish_loads(scheduler, failed=["again"])
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"again": 9}
    assert (
        scheduler.transfers.connector.get_num_new_matched_tokens(
            make_request("p", prompt=PROMPT), 0
        )
        == 0
    )
    run_to_idle(scheduler)


def test_an_abort_mid_load_frees_the_blocks_only_when_the_load_ends():
    scheduler = make()
    start_loading_again(scheduler, max_tokens=1)
    held = scheduler.kv.block_ids("again")
    scheduler.abort(["again"])
    check_invariants(scheduler)
    assert scheduler.has_unfinished_requests() and "again" in scheduler.transfers.freeing
    [key] = scheduler.transfers.freeing["again"]
    assert scheduler.kv.block_ids(key) == held  # the copy still writes them
    plan, _ = step(scheduler)
    assert plan.poll_kv_transfers and not plan.is_empty
    finish_loads(scheduler, "again")
    check_idle(scheduler)
    assert not +scheduler.transfers.connector.pinned, "a slot stays pinned after its load ended"


def _blocks(*names: str) -> list[KVCacheBlock]:
    return [KVCacheBlock(i, block_hash=name.encode()) for i, name in enumerate(names)]


def _wanting(*names: str):
    request = make_request("w", num_prompt=BS * len(names) + 1)
    request.block_hashes = [name.encode() for name in names]
    return request


def test_lru_eviction_skips_the_slots_a_load_reads_and_this_step_saves():
    tier = HostTierConnector(2, BS)
    for block in _blocks("h1", "h2"):
        tier.blocks_cached([block])
        tier.build_connector_meta()
    request = _wanting("h1")
    assert tier.get_num_new_matched_tokens(request, 0) == BS
    request.num_computed_tokens = 0
    tier.update_state_after_alloc(request, [7], BS)  # h1 pinned, and now the newest
    tier.blocks_cached(_blocks("h3"))  # evicts h2, the oldest one not pinned
    assert list(tier.slots) == [b"h1", b"h3"]
    assert tier.get_num_new_matched_tokens(_wanting("h3"), 0) == 0, "read before it is saved"
    tier.blocks_cached(_blocks("h4"))  # every slot pinned or saved this step: not saved
    assert list(tier.slots) == [b"h1", b"h3"]
    tier.build_connector_meta()
    assert tier.get_num_new_matched_tokens(_wanting("h3"), 0) == BS
    tier.update_connector_output(KVTransferResult(["w"]))
    tier.build_connector_meta()
    tier.blocks_cached(_blocks("h5"))  # h1 unpinned and the oldest now
    assert list(tier.slots) == [b"h3", b"h5"]


def test_the_lookup_never_offers_the_last_token():
    tier = HostTierConnector(4, BS)
    tier.blocks_cached(_blocks("h1", "h2"))
    tier.build_connector_meta()
    request = make_request("w", num_prompt=2 * BS)  # block-aligned: its last token is h2's
    request.block_hashes = [b"h1", b"h2"]
    assert tier.get_num_new_matched_tokens(request, 0) == BS


def test_a_lost_executor_returns_loading_requests_to_the_queue_and_empties_the_tier():
    scheduler = make()
    start_loading_again(scheduler, max_tokens=1)
    scheduler.reset_executor(num_host_blocks=16)
    check_invariants(scheduler)
    assert scheduler.transfers.connector.num_cached_blocks == 0 and not scheduler.transfers.loading
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"again": 9}
    scheduler.transfers.update(
        scheduler.kv, KVTransferResult(["again"])
    )  # the old executor's: ignored
    run_to_idle(scheduler)
