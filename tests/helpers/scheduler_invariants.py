"""Consistency checks of the scheduler's state: run by the tests after every step and
cheap enough to assert in a debug build of the service."""

from collections import Counter

from flagstop.scheduler_svc.core.request import RequestStatus
from flagstop.scheduler_svc.core.scheduler import Scheduler


def check_invariants(scheduler: Scheduler) -> None:
    kv, pool = scheduler.kv, scheduler.kv.pool
    owners: Counter[int] = Counter()
    for rid, state in kv.req_blocks.items():
        _check_groups(scheduler, rid, state)
        ids = [b.block_id for blocks in state.blocks for b in blocks if b is not pool.null_block]
        assert len(set(ids)) == len(ids), f"{rid} holds a block twice: {ids}"
        owners.update(ids)
    for block in pool.blocks:
        if block is pool.null_block:
            assert block.ref_cnt == 0 and block.prev_free is None and block.block_hash is None
            continue
        n = owners[block.block_id]
        assert block.ref_cnt == n, f"block {block.block_id}: ref {block.ref_cnt}, owners {n}"
        assert n <= 1 or block.block_hash is not None, f"uncached block {block.block_id} shared"
        in_queue = block.prev_free is not None
        assert in_queue == (n == 0), f"block {block.block_id}: free-queue membership wrong"
    retained = [b for level in pool.retained.levels.values() for b in level]
    free_ids = [b.block_id for b in (*pool.free_queue, *retained)]
    assert len(free_ids) == pool.num_free_blocks == pool.num_usable_blocks - len(owners)
    # Retention: a free retained block is cached and in its priority's queue, never
    # more of them than the bound; an ordinary free block has no retention.
    assert all(b.block_hash is not None and b.priority > 0 for b in retained)
    assert all(b.priority == 0 for b in pool.free_queue)
    assert len(retained) <= pool.max_retained, "retained blocks past the bound"
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    _check_queues(scheduler)


def _check_groups(scheduler: Scheduler, rid: str, state) -> None:
    """Every group's table as long as the others; a window group's null blocks lead
    it, and none of them is one a query may still see."""
    kv, null = scheduler.kv, scheduler.kv.pool.null_block
    lengths = {len(blocks) for blocks in state.blocks}
    assert len(lengths) == 1, f"{rid}: group tables of lengths {lengths}"
    request = scheduler.requests.get(rid)
    for w, (g, window) in enumerate(kv.window_groups):
        blocks = state.blocks[g]
        num_null = sum(b is null for b in blocks)
        assert all(b is null for b in blocks[:num_null]), f"{rid}: a null block after a live one"
        assert state.num_skipped_blocks[w] == num_null
        if request is not None:
            # Never freed a block a query may still see: skipping counts only the
            # tokens known computed (a rollback of drafts never goes below them).
            safe = request.num_computed_tokens - request.num_output_placeholders
            assert num_null <= max(0, safe - window + 1) // kv.block_size, (
                f"{rid}: {num_null} blocks of window group {g} freed at {safe} computed"
            )


def _check_queues(scheduler: Scheduler) -> None:
    transfers = scheduler.transfers
    running, loading = scheduler.running, list(transfers.loading.values())
    waiting, loaded = list(scheduler.waiting), list(transfers.loaded)
    assert len(running) <= scheduler.config.max_num_seqs
    adapters = {r.lora_name for r in running if r.lora_name}
    assert len(adapters) <= scheduler.config.max_loras, f"adapters {adapters} above --max-loras"
    assert all(r.status == RequestStatus.RUNNING for r in running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
               for r in (*waiting, *loaded))  # fmt: skip
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in loading)
    queued = [r.request_id for r in (*running, *loading, *loaded, *waiting)]
    assert len(set(queued)) == len(queued), "a request is queued twice"
    assert set(queued) == set(scheduler.requests), "requests and queues disagree"
    held = [key for keys in transfers.freeing.values() for key in keys]
    assert all(keys for keys in transfers.freeing.values()), "an empty freeing entry"
    assert len(set(held)) == len(held), "blocks held twice"
    assert set(scheduler.kv.req_blocks) == (
        {r.request_id for r in (*running, *loading, *loaded)} | set(held)
    ), "blocks held by a request no queue knows"
    assert transfers.leased <= set(transfers.freeing), "a lease without its blocks"
    for request in loading + loaded:
        _check_reserved(scheduler, request)
    for request in scheduler.requests.values():
        assert request.num_output_placeholders >= 0
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders


def _check_reserved(scheduler: Scheduler, request) -> None:
    # A load reserves the whole remaining prefill, and nothing it writes is a prefix
    # hit before it is reported done.
    blocks = scheduler.kv.req_blocks[request.request_id].blocks[0]
    bs = scheduler.config.block_size
    assert len(blocks) * bs >= request.num_tokens, f"{request.request_id} reserved too little"
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        first = request.num_computed_tokens // bs
        assert all(b.block_hash is None for b in blocks[first:]), "a loading block is cached"


def check_idle(scheduler: Scheduler) -> None:
    """Nothing left: every block free with ref count 0 and no request state anywhere."""
    check_invariants(scheduler)
    kv, transfers = scheduler.kv, scheduler.transfers
    assert not scheduler.requests and not scheduler.running and not len(scheduler.waiting)
    assert not transfers.loading and not transfers.loaded and not transfers.freeing
    assert not transfers.leased
    assert not kv.req_blocks
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
