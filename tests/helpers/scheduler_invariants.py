"""Consistency checks of the scheduler's state: run by the tests after every step and
cheap enough to assert in a debug build of the service."""

from collections import Counter

from flagstop.scheduler_svc.core.request import RequestStatus
from flagstop.scheduler_svc.core.scheduler import Scheduler


def check_invariants(scheduler: Scheduler) -> None:
    kv, pool = scheduler.kv, scheduler.kv.pool
    owners: Counter[int] = Counter()
    for rid, state in kv.req_blocks.items():
        ids = [b.block_id for b in state.blocks]
        assert len(set(ids)) == len(ids), f"{rid} holds a block twice: {ids}"
        owners.update(ids)
    for block in pool.blocks:
        n = owners[block.block_id]
        assert block.ref_cnt == n, f"block {block.block_id}: ref {block.ref_cnt}, owners {n}"
        assert n <= 1 or block.block_hash is not None, f"uncached block {block.block_id} shared"
        in_queue = block.prev_free is not None
        assert in_queue == (n == 0), f"block {block.block_id}: free-queue membership wrong"
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == pool.num_free_blocks == pool.num_blocks - len(owners)
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    _check_queues(scheduler)


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
    blocks = scheduler.kv.req_blocks[request.request_id].blocks
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
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
