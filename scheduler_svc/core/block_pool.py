"""The KV blocks: reference counts, the content-addressed prefix cache, and the free
blocks in eviction order. A cached block may carry a retention (docs/sessions.md): a
priority and an expiry, set when a request that asked for it frees the block. A free
retained block is evicted only after every ordinary free block, lowest priority first
(least recently freed first within one), and becomes ordinary when it expires or when
retained free blocks pass the bound (a share of the pool: no one pins the pool, and
retention never blocks an admission, the retained blocks being free)."""

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.kv_events import NO_KV_EVENTS, KVEventLog, NoKVEvents


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, cached block of tokens; kept after the block is
    # freed (lazy eviction) so that a later request can still hit it.
    block_hash: bytes | None = None
    # Its retention: a priority (0: none) until expires_at (the pool's clock).
    priority: int = 0
    expires_at: float = 0.0
    # Intrusive links of the free queue: O(1) removal from its middle without
    # allocating a node per operation.
    prev_free: "KVCacheBlock | None" = None
    next_free: "KVCacheBlock | None" = None

    def drop_retention(self) -> None:
        """Its retention is over (ran out, demoted, or its contents evicted): both
        fields go, so that a later retention of the block (new contents, or a new hit)
        starts from nothing. A stale expires_at once kept a block reused for a 1 s
        retention for the hour its earlier contents had asked (retain keeps the later
        expiry of two): tests/test_sessions_stack.py's flake under one test order."""
        self.priority, self.expires_at = 0, 0.0


class FreeBlockQueue:
    """Doubly linked list of free blocks, taken from the head: blocks without a hash
    first (nothing is lost by reusing them), then cached ones least recently freed
    first (evicted first)."""

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        self._link(last, block, self._tail)

    def prepend(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, in their order (taken before everything free)."""
        for block in reversed(blocks):
            first = self._head.next_free
            assert first is not None
            self._link(self._head, block, first)

    def _link(self, prev: KVCacheBlock, block: KVCacheBlock, nxt: KVCacheBlock) -> None:
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


@dataclass(slots=True)
class RetentionStats:
    num_retained: int = 0  # blocks given a retention (or a longer one)
    num_hits: int = 0  # prefix hits on free retained blocks
    num_evicted: int = 0  # retained blocks evicted while still retained
    num_expired: int = 0  # retentions that ran out (or were demoted by the bound)


@dataclass(slots=True)
class RetainedBlocks:
    """The free retained blocks: a queue per priority, least recently freed first, and
    their expiries (a heap; entries of blocks no longer there are skipped)."""

    levels: dict[int, FreeBlockQueue] = field(default_factory=dict)
    expiries: list[tuple[float, int, KVCacheBlock]] = field(default_factory=list)
    num_free_blocks: int = 0

    def add(self, block: KVCacheBlock) -> None:
        level = self.levels.get(block.priority)
        if level is None:
            level = self.levels[block.priority] = FreeBlockQueue([])
            self.levels = dict(sorted(self.levels.items()))  # lowest priority first
        level.append(block)
        heapq.heappush(self.expiries, (block.expires_at, block.block_id, block))
        self.num_free_blocks += 1
        if len(self.expiries) > 4 * self.num_free_blocks + 64:  # mostly stale entries
            self.expiries = [(b.expires_at, b.block_id, b) for q in self.levels.values()
                             for b in q]  # fmt: skip
            heapq.heapify(self.expiries)

    def remove(self, block: KVCacheBlock) -> None:
        self.levels[block.priority].remove(block)
        self.num_free_blocks -= 1

    def lowest(self) -> KVCacheBlock | None:
        """The block to evict first: the lowest priority's least recently freed."""
        for level in self.levels.values():
            if level.num_free_blocks:
                return next(iter(level))
        return None

    def expired(self, now: float) -> list[KVCacheBlock]:
        """The free retained blocks whose retention ran out (taken out of here)."""
        out = []
        while self.expiries and self.expiries[0][0] <= now:
            expires_at, _, block = heapq.heappop(self.expiries)
            free_here = block.priority and block.ref_cnt == 0 and block.prev_free is not None
            if free_here and block.expires_at == expires_at:
                self.remove(block)
                out.append(block)
        return out


class BlockPool:
    """Fixed-size KV blocks with reference counts and a content-addressed prefix cache."""

    __slots__ = ("blocks", "cached_blocks", "clock", "events", "free_queue", "max_retained",
                 "null_block", "num_blocks", "num_usable_blocks", "retained",
                 "retention_stats")  # fmt: skip

    def __init__(self, num_blocks: int, null_block: bool = False,
                 retention_share: float = 0.0, clock: Callable[[], float] = lambda: 0.0,
                 events: KVEventLog | NoKVEvents = NO_KV_EVENTS) -> None:  # fmt: skip
        """null_block: block 0 is set aside, never allocated nor freed: a window
        group's table holds it where a block left the window (its positions are
        never read), as vLLM's does. retention_share: the most of the pool that free
        retained blocks may hold (0: no retention); clock: the time expiries are in;
        events: told of every cached block evicted (kv_events.py)."""
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if null_block else None
        self.free_queue = FreeBlockQueue(self.blocks[int(null_block) :])
        self.num_usable_blocks = num_blocks - null_block
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.max_retained = int(retention_share * self.num_usable_blocks)
        self.clock = clock
        self.retained = RetainedBlocks()
        self.retention_stats = RetentionStats()
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, retained ones included: any of them can be given out."""
        return self.free_queue.num_free_blocks + self.retained.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        if self.retained.expiries:  # expired retentions go first: ordinary, least recent
            self._expire()
        blocks = [self._next_free() for _ in range(n)]
        for block in blocks:
            if block.block_hash is not None:
                self.uncache(block)  # evicted: its contents are about to change
            block.ref_cnt = 1
        return blocks

    def _next_free(self) -> KVCacheBlock:
        """An ordinary free block, else the retained one to evict first."""
        if self.free_queue.num_free_blocks:
            return self.free_queue.popleft()
        block = self.retained.lowest()
        assert block is not None
        self.retained.remove(block)
        self.retention_stats.num_evicted += 1
        block.drop_retention()
        return block

    def _expire(self) -> None:
        """Retentions that ran out: their blocks join the ordinary ones, to be
        evicted first (they were kept past their LRU turn). Checked at each
        allocation: an expired block is evicted by the next one, as LRU would have."""
        expired = self.retained.expired(self.clock())
        for block in expired:
            block.drop_retention()
        if expired:
            self.retention_stats.num_expired += len(expired)
            self.free_queue.prepend(expired)

    def retain(self, blocks: Iterable[KVCacheBlock], priority: int, expires_at: float) -> None:
        """Give cached blocks a retention (a block keeps the higher priority and the
        later expiry of two); they are retained once freed."""
        for block in blocks:
            if block.block_hash is None:
                continue
            if priority > block.priority or expires_at > block.expires_at:
                self.retention_stats.num_retained += 1
            if block.ref_cnt == 0 and block.priority:  # free and retained: moves level
                self.retained.remove(block)
                block.priority = max(block.priority, priority)
                block.expires_at = max(block.expires_at, expires_at)
                self.retained.add(block)
                continue
            block.priority = max(block.priority, priority)
            block.expires_at = max(block.expires_at, expires_at)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving freed ones from the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.priority:
                    self.retained.remove(block)
                    self.retention_stats.num_hits += 1
                else:
                    self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Whether the block became the cached one of its hash. The first block with
        a given content stays the cached one: block tables are append-only, so a
        duplicate simply stays uncached and is freed as usual."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            return True
        return False

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; of the blocks reaching zero, cached ones join the tail
        (evicted last) and the others the head, in order: reusing a block without a
        hash evicts no prefix (vLLM's free-queue order; on bench/scheduler_bench.py's
        memory-bound run it took recomputed tokens from 4,584 to 3,897)."""
        unhashed, now = [], None
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    block.drop_retention()
                    unhashed.append(block)
                elif block.priority and block.expires_at > (now := now or self.clock()):
                    self.retained.add(block)
                else:
                    block.drop_retention()
                    self.free_queue.append(block)
        if unhashed:
            self.free_queue.prepend(unhashed)
        if self.retained.num_free_blocks > self.max_retained:
            self._demote(self.retained.num_free_blocks - self.max_retained)

    def _demote(self, n: int) -> None:
        """Past the bound: the n retained blocks that would be evicted first become
        ordinary (joining the ordinary ones as most recently freed)."""
        for _ in range(n):
            block = self.retained.lowest()
            assert block is not None
            self.retained.remove(block)
            block.drop_retention()
            self.free_queue.append(block)
        self.retention_stats.num_expired += n

    def uncache(self, block: KVCacheBlock) -> None:
        """The block's contents are not what its hash says: no later request may hit it."""
        assert block.block_hash is not None
        del self.cached_blocks[block.block_hash]
        self.events.removed(block.block_hash)
        block.block_hash = None
        block.drop_retention()
