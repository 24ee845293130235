import pytest

from flagstop.scheduler_svc.core.block_pool import BlockPool
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager, hash_block
from flagstop.scheduler_svc.core.request import Request, StopParams


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_is_lru_and_removes_from_the_middle():
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    assert ids(pool.free_queue) == [3, 4]
    for block, block_hash in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(block, block_hash)
    pool.free_blocks([c, a, b])
    assert ids(pool.free_queue) == [3, 4, 2, 0, 1]
    pool.touch([pool.blocks[2]])  # a prefix hit revives a free block from the middle
    assert ids(pool.free_queue) == [3, 4, 0, 1]
    assert pool.blocks[2].ref_cnt == 1 and pool.num_free_blocks == 4


def test_blocks_without_a_hash_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, b"a")
    pool.cache_block(c, b"c")
    pool.free_blocks([a, b])  # cached a to the tail, b (no hash) to the head
    pool.free_blocks([c, d])
    assert ids(pool.free_queue) == [3, 1, 0, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 1]  # no prefix evicted
    assert pool.get_cached_block(b"a") is a and pool.get_cached_block(b"c") is c


def test_get_new_blocks_refuses_more_than_free():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)


def test_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(2)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, b"h")
    pool.free_blocks([block])
    assert pool.get_cached_block(b"h") is block  # lazy eviction: still a hit
    pool.get_new_blocks(1)  # takes the other block first (LRU)
    assert pool.get_cached_block(b"h") is block
    reused = pool.get_new_blocks(1)[0]
    assert reused is block and block.block_hash is None
    assert pool.get_cached_block(b"h") is None


def test_duplicate_content_keeps_the_first_cached_block():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, b"h")
    pool.cache_block(second, b"h")
    assert pool.get_cached_block(b"h") is first and second.block_hash is None


def test_usage_fraction():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.usage() == pytest.approx(0.25)


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, "o", prompt, StopParams(max_tokens=8))


def make_manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    kv.update_block_hashes(req)
    hits = kv.get_computed_blocks(req)
    req.num_computed_tokens = 0
    block_ids = kv.allocate_slots(req, req.num_tokens - 4 * len(hits), hits)
    assert block_ids is not None
    req.num_computed_tokens = req.num_tokens
    return list(block_ids)


def test_block_hashes_chain_the_parent():
    kv = make_manager()
    a, b = request("a", [1, 2, 3, 4, 5, 6, 7, 8]), request("b", [9, 9, 9, 9, 5, 6, 7, 8])
    kv.update_block_hashes(a)
    kv.update_block_hashes(b)
    assert a.block_hashes[0] == hash_block(b"", [1, 2, 3, 4])
    # Same tokens in block 1, different prefix: a different block.
    assert a.block_hashes[1] != b.block_hashes[1]


def test_prefix_hit_never_covers_the_last_token():
    kv = make_manager()
    admit(kv, request("a", list(range(8))))
    exact = request("b", list(range(8)))
    kv.update_block_hashes(exact)
    # Both blocks are cached, but the second holds b's last token, whose logits we need.
    assert len(kv.get_computed_blocks(exact)) == 1
    longer = request("c", list(range(9)))
    kv.update_block_hashes(longer)
    assert len(kv.get_computed_blocks(longer)) == 2


def test_shared_prefix_is_ref_counted_and_survives_one_owner():
    kv = make_manager()
    a_ids = admit(kv, request("a", list(range(10))))
    b_ids = admit(kv, request("b", [*range(8), 42, 43]))
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in b_ids] == [1, 1, 1]


def test_free_in_reverse_order_evicts_the_tail_first():
    kv = make_manager(num_blocks=3)
    block_ids = admit(kv, request("a", list(range(12))))
    kv.free("a")
    assert ids(kv.pool.free_queue) == block_ids[::-1]


def test_allocate_is_all_or_nothing():
    kv = make_manager(num_blocks=2)
    req = request("a", list(range(12)))
    kv.update_block_hashes(req)
    assert kv.allocate_slots(req, 12) is None
    assert kv.pool.num_free_blocks == 2 and not kv.req_blocks


def test_revived_hits_count_against_the_free_blocks():
    kv = make_manager(num_blocks=3)
    admit(kv, request("a", list(range(9))))  # 3 blocks, 2 of them cached (full)
    kv.free("a")
    b = request("b", [*range(8), 50, 51, 52, 53, 54])
    kv.update_block_hashes(b)
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    # 2 revived hits + 2 new blocks > 3 free blocks.
    assert kv.allocate_slots(b, b.num_tokens - 8, hits) is None
    assert all(h.ref_cnt == 0 for h in hits.groups[0])


def test_only_full_known_blocks_are_cached():
    kv = make_manager()
    req = request("a", list(range(6)))
    kv.update_block_hashes(req)
    kv.allocate_slots(req, 6)
    assert len(kv.pool.cached_blocks) == 1  # the second block is not full
    req.num_computed_tokens = 6
    req.all_token_ids += [6, 7]  # 8 known tokens, but only 7 computed by the next step
    kv.update_block_hashes(req)
    assert kv.allocate_slots(req, 1) == ()
    assert len(kv.pool.cached_blocks) == 1
    req.num_computed_tokens = 7
    kv.allocate_slots(req, 1)
    assert len(kv.pool.cached_blocks) == 2


# -- retention (docs/sessions.md) ----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached_pool(n: int, share: float = 1.0):
    """A pool of n blocks, all cached and in use, and its clock."""
    clock = Clock()
    pool = BlockPool(n, retention_share=share, clock=clock)
    blocks = pool.get_new_blocks(n)
    for block in blocks:
        pool.cache_block(block, bytes([block.block_id]))
    return pool, blocks, clock


def test_retained_blocks_are_evicted_after_ordinary_ones_lowest_priority_first():
    pool, (a, b, c, d, e), _ = cached_pool(5)
    pool.retain([a], priority=50, expires_at=100.0)
    pool.retain([b, c], priority=10, expires_at=100.0)
    pool.free_blocks([a, b, c, d, e])  # retention never keeps a block from being free
    assert pool.num_free_blocks == 5 and ids(pool.free_queue) == [3, 4]
    assert ids(pool.get_new_blocks(5)) == [3, 4, 1, 2, 0]
    assert pool.retention_stats.num_evicted == 3


def test_an_expired_retention_is_ordinary_and_evicted_first():
    pool, (a, b, c), clock = cached_pool(3)
    pool.retain([a], priority=90, expires_at=10.0)
    pool.retain([b], priority=5, expires_at=1000.0)
    pool.free_blocks([c, a, b])
    clock.now = 11.0
    assert ids(pool.get_new_blocks(2)) == [0, 2]  # a expired: before c, the oldest freed
    assert pool.retention_stats.num_expired == 1 and pool.blocks[1].priority == 5


def test_a_block_reused_for_new_contents_keeps_none_of_its_old_retention():
    """A block evicted while retained for an hour, then retained for a second with
    new contents, expires after that second (a stale expiry kept it the hour)."""
    pool, (a, b, c), clock = cached_pool(3)
    pool.retain([a], priority=50, expires_at=3600.0)
    pool.free_blocks([b, c, a])
    assert pool.get_new_blocks(3)[-1] is a  # evicted while retained, for new contents
    for block in (a, c):
        pool.cache_block(block, b"new" + bytes([block.block_id]))
    pool.retain([a], priority=50, expires_at=1.0)
    pool.free_blocks([c, a])
    clock.now = 2.0
    assert pool.get_new_blocks(1) == [a]  # its second ran out: evicted before c
    assert pool.retention_stats.num_expired == 1


def test_a_retained_hit_revives_the_block_and_is_counted():
    pool, (a, b), clock = cached_pool(2)
    pool.retain([a], priority=1, expires_at=5.0)
    pool.free_blocks([a, b])
    pool.touch([a])
    assert pool.retention_stats.num_hits == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])  # still retained: back to its priority's queue
    assert pool.retained.num_free_blocks == 1
    clock.now = 6.0
    pool.touch([a])
    pool.free_blocks([a])  # freed after its expiry: ordinary
    assert pool.retained.num_free_blocks == 0 and a.priority == 0


def test_the_bound_keeps_retained_blocks_from_pinning_the_pool():
    pool, blocks, _ = cached_pool(8, share=0.25)
    pool.retain(blocks[:6], priority=1, expires_at=100.0)
    pool.retain(blocks[6:], priority=9, expires_at=100.0)
    pool.free_blocks(blocks)
    assert pool.retained.num_free_blocks == pool.max_retained == 2
    assert {b.block_id for level in pool.retained.levels.values() for b in level} == {6, 7}
    assert pool.retention_stats.num_expired == 6  # demoted, the lowest first


def test_a_session_prefix_survives_filler_that_evicts_it_under_lru():
    """A prompt's retained blocks are still cached after other prompts cycle the
    whole pool through; without retention they are gone."""
    from flagstop.scheduler_svc.core.request import Retention

    def run(retention):
        kv = KVCacheManager(12, 4, retention_share=0.5, clock=Clock())
        session = Request("s", "o", list(range(1, 17)), StopParams(1), retention=retention)
        admit(kv, session)
        kv.free("s", retention=session.retention)
        for i in range(3):  # filler: 8 blocks each time, what retention leaves of the pool
            admit(kv, request(f"f{i}", [100 + i] * 32))
            kv.free(f"f{i}")
        again = request("t", [*range(1, 17), 7])
        kv.update_block_hashes(again)
        return len(kv.get_computed_blocks(again))

    assert run(Retention(priority=10, ttl_s=60.0, num_tokens=16)) == 4
    assert run(None) == 0
