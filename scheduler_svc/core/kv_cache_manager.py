import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flagstop.scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from flagstop.scheduler_svc.core.kv_events import NO_KV_EVENTS, KVEventLog, NoKVEvents
from flagstop.scheduler_svc.core.kv_groups import KVCacheGroup, group_key, kv_cache_groups
from flagstop.scheduler_svc.core.media import MediaPlaceholder
from flagstop.scheduler_svc.core.request import Request, Retention
from flagstop.utils import cdiv


def hash_block(parent_hash: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    # sha256 rather than hash(): the cache is shared by every client, and a colliding
    # hash would hand one request another's KV (vLLM moved to sha256 for this reason).
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes() + extra).digest()


def prefix_root(lora_id: str, cache_salt: str = "") -> bytes:
    """The parent of a request's first block hash: its adapter's identity (the digest
    of its files, never its name), so that the same tokens under two adapters, under
    one and the base model, or under a name before and after it was loaded again from
    other files, never share KV; and its cache salt (vLLM's cache_salt, or the one the
    router enforces for a tenant: docs/sessions.md), so that requests under two salts
    never share KV either."""
    root = hashlib.sha256(b"lora:" + lora_id.encode()).digest() if lora_id else b""
    return hashlib.sha256(root + b"salt:" + cache_salt.encode()).digest() if cache_salt \
        else root  # fmt: skip


def chain_hashes(
    token_ids: list[int], block_size: int, first_block: int = 0, parent_hash: bytes = b"",
    media: Sequence[MediaPlaceholder] = (),
) -> list[bytes]:  # fmt: skip
    """The chained hashes of the full blocks of token_ids from first_block on (whose
    parent's hash is parent_hash): the prefix cache's keys, and the router's too. A
    block that covers an image's placeholders hashes the image's content hash too
    (vLLM's extra keys): the same text with another image never hits."""
    hashes = []
    for start in range(first_block * block_size, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = b"".join(m.hash for m in media if m.offset < end and m.end > start) \
            if media else b""  # fmt: skip
        parent_hash = hash_block(parent_hash, token_ids[start:end], extra)
        hashes.append(parent_hash)
    return hashes


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, tokens served from the cache

    def record(self, num_queries: int, num_hits: int) -> None:
        self.num_queries += num_queries
        self.num_hits += num_hits


@dataclass(slots=True)
class _RequestBlocks:
    # Per group, a block per block_size positions (all of equal length): a window
    # group's blocks that left every query's window are the pool's null block.
    blocks: list[list[KVCacheBlock]]
    # How many leading positions' blocks are already in the prefix cache.
    num_cached_blocks: int = 0
    # Per window group (in window_groups order): how many leading blocks are null.
    num_skipped_blocks: list[int] | None = None
    # Tokens the tables have room for (block_size x their length): read per running
    # request per step, so kept rather than computed.
    num_slots: int = 0


class ComputedBlocks:
    """A request's prefix-cache hits: per group, a block per hit position (a window
    group's out-of-window ones null). len(): the positions, the same in every group."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[list[KVCacheBlock]]) -> None:
        self.groups = groups

    def __len__(self) -> int:
        return len(self.groups[0])


NO_NEW_BLOCKS: tuple[int, ...] = ()


class KVCacheManager:
    """Maps requests to blocks: prefix lookups, slot allocation, caching and freeing,
    for every KV cache group (kv_groups.py) out of one pool. Block ids go to the
    executor position-major: for each new block position, one id per group, so
    that appending a step's ids to a plan's keeps the layout."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True,
        groups: Sequence[KVCacheGroup] | None = None, retention_share: float = 0.0,
        clock: Callable[[], float] = lambda: 0.0, events: KVEventLog | NoKVEvents = NO_KV_EVENTS,
    ) -> None:  # fmt: skip
        """retention_share, clock: the pool's (block_pool.py: retained blocks); events:
        told of every block cached and evicted (kv_events.py)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = list(groups or kv_cache_groups([]))
        self.num_groups = len(self.groups)
        # (group index, window) of the window groups, a recurrent one's included (a
        # window of 2: kv_groups.py): the only ones that skip blocks.
        self.window_groups = [(g, x.window) for g, x in enumerate(self.groups) if x.window]
        self.full_groups = [g for g, x in enumerate(self.groups) if not x.window]
        self.pool = BlockPool(num_blocks, bool(self.window_groups), retention_share, clock,
                              events)  # fmt: skip
        self.events = events
        events.describe(self.groups)
        # A group's cached blocks are keyed by its hashes and its index: the same tokens
        # are different KV in each group's layers.
        self.group_keys = [group_key(g) for g in range(self.num_groups)]
        self.req_blocks: dict[str, _RequestBlocks] = {}
        self.prefix_stats = PrefixCacheStats()
        # Blocks cached since the last take_newly_cached (kept only for a KV connector's
        # write-through, which learns of them once the step's plan is final).
        self.newly_cached: list[KVCacheBlock] | None = None

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly completed full blocks (called as tokens arrive)."""
        if not self.enable_caching:
            return
        hashes = request.block_hashes
        hashes += chain_hashes(request.all_token_ids, self.block_size, len(hashes),
                               hashes[-1] if hashes else prefix_root(request.lora_id,
                                                                     request.cache_salt),
                               request.media)  # fmt: skip

    # -- prefix hits ---------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix every group can serve, in full blocks, never
        covering the last token (its logits are what the next step must produce): full
        attention scanned from the left, then each window group back from there to
        the last point whose window before it is cached (vLLM's hybrid hit), until
        they agree."""
        if not self.enable_caching:
            return ComputedBlocks([[] for _ in self.groups])
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        num_hit, full_hits = len(hashes), {}
        for g in self.full_groups:
            full_hits[g] = self._full_hit(hashes, g, num_hit)
            num_hit = len(full_hits[g])
        changed = bool(self.window_groups)
        while changed:
            changed = False
            for g, window in self.window_groups:
                n = self._window_hit(hashes, g, num_hit, window)
                changed, num_hit = changed or n != num_hit, min(n, num_hit)
        # A full group's hits are the blocks its scan found (no second lookup).
        return ComputedBlocks([full_hits[g][:num_hit] if g in full_hits
                               else self._hit_blocks(hashes, g, num_hit)
                               for g in range(self.num_groups)])  # fmt: skip

    def _cached(self, block_hash: bytes, g: int) -> KVCacheBlock | None:
        return self.pool.get_cached_block(block_hash + self.group_keys[g])

    def _full_hit(self, hashes: list[bytes], g: int, num_hit: int) -> list[KVCacheBlock]:
        """The cached blocks of the group's longest prefix of the first num_hit hashes."""
        # Group 0's keys are the hashes themselves: no concatenation per block there
        # (every admission scans its prompt).
        get, key, hits = self.pool.cached_blocks.get, self.group_keys[g], []
        for i in range(num_hit):
            block = get(hashes[i] + key if key else hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hit(self, hashes: list[bytes], g: int, num_hit: int, window: int) -> int:
        """The longest n <= num_hit whose window before it is cached: the blocks of the
        window - 1 positions before position n * block_size."""
        num_needed = cdiv(window - 1, self.block_size)
        top = num_hit
        for i in range(num_hit - 1, -1, -1):
            if self._cached(hashes[i], g) is None:
                top = i
            elif top - i >= num_needed:
                return top
        return top

    def _hit_blocks(self, hashes: list[bytes], g: int, num_hit: int) -> list[KVCacheBlock]:
        group, key = self.groups[g], self.group_keys[g]
        first = 0
        if group.window:  # the blocks before its window are not needed: null
            first = max(0, num_hit - cdiv(group.window - 1, self.block_size))
        get = self.pool.cached_blocks.__getitem__
        hits = [get(h + key if key else h) for h in hashes[first:num_hit]]
        return [self.pool.null_block] * first + hits if first else hits  # type: ignore[list-item]

    # -- slots ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
        delay_cache_blocks: bool = False,
    ) -> Sequence[int] | None:
        """Give the request room for num_new_tokens more tokens (after the prefix hits).
        All or nothing: None when the free blocks cannot cover it. Returns the block ids
        appended to the request's block tables (position-major). delay_cache_blocks: a
        connector fills them, so none is cached (no other request may hit it) until
        cache_blocks. A window group first lets go of what left the window."""
        state = self.req_blocks.get(request.request_id)
        num_total = request.num_computed_tokens + num_new_tokens
        if state is not None:
            if self.window_groups:
                self._skip_blocks(request, state)
            if num_total <= state.num_slots:
                # The decode fast path: room was already allocated, at most a block to
                # cache (the check inlined: it runs per running request per step).
                if self.enable_caching and (
                    min(num_total, len(request.all_token_ids)) // self.block_size
                    > state.num_cached_blocks
                ):
                    self._cache_full_blocks(request, state, num_total)
                self._ready(request, state)
                return NO_NEW_BLOCKS
        hits = new_computed_blocks.groups if new_computed_blocks else None
        num_hits = len(hits[0]) if hits else 0
        num_total += num_hits * self.block_size
        num_allocated = len(state.blocks[0]) if state is not None else 0
        num_needed = cdiv(num_total, self.block_size) - num_allocated - num_hits
        # Hits sitting in the free queue (ref 0) are taken from the same free pool.
        null = self.pool.null_block
        num_revived = sum(b.ref_cnt == 0 and b is not null for g in hits for b in g) if hits else 0
        if num_needed * self.num_groups + num_revived > self.pool.num_free_blocks:
            return None
        if state is None:
            state = self.req_blocks[request.request_id] = self._new_state()
            # Its hits are cached blocks already: caching starts past them (a prefix-
            # heavy admission no longer walks its shared blocks once more).
            state.num_cached_blocks = num_hits
        if hits:
            # Every group's hits taken before any new block: a hit of one group may sit
            # in the free queue, where another group's new block would evict it.
            for group_hits in hits:
                self.pool.touch([b for b in group_hits if b is not null])
        get_new_blocks = self.pool.get_new_blocks
        new_blocks = [(hits[g] + get_new_blocks(num_needed)) if hits else get_new_blocks(num_needed)
                      for g in range(self.num_groups)]  # fmt: skip
        for blocks, new in zip(state.blocks, new_blocks, strict=True):
            blocks.extend(new)
        state.num_slots = len(state.blocks[0]) * self.block_size
        if hits and self.window_groups:
            self._count_null_hits(state)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, state, num_total)
        self._ready(request, state)
        if self.num_groups == 1:
            return [b.block_id for b in new_blocks[0]]
        return [b.block_id for position in zip(*new_blocks, strict=True) for b in position]

    def _ready(self, request: Request, state: _RequestBlocks) -> None:
        """The positions the request may compute up to with no call here: within its
        slots and up to the end of its first uncached block (that block, once full, is
        cached at the call past it: one call a block for a decode, not two; a window
        group frees blocks every step: always a call)."""
        if self.window_groups:
            return
        if self.enable_caching:
            boundary = (state.num_cached_blocks + 1) * self.block_size
            request.num_ready_kv_slots = min(state.num_slots, boundary)
        else:
            request.num_ready_kv_slots = state.num_slots

    def can_hold(
        self, request: Request, hits: ComputedBlocks | None, max_chunk_tokens: int
    ) -> bool:
        """Whether the free blocks could hold the request's whole known sequence (the
        blocks num_blocks_for counts, less the hits other requests hold already), not
        only its first chunk: admission by this rule does not take a long prompt in only
        to preempt it again a step later (vLLM's scheduler_reserve_full_isl)."""
        num_needed = self.num_blocks_for(request.num_tokens, max_chunk_tokens)
        if hits:
            null = self.pool.null_block
            num_needed -= sum(b.ref_cnt > 0 and b is not null for g in hits.groups for b in g)
        return num_needed <= self.pool.num_free_blocks

    def _new_state(self) -> _RequestBlocks:
        skipped = [0] * len(self.window_groups) if self.window_groups else None
        return _RequestBlocks([[] for _ in self.groups], num_skipped_blocks=skipped)

    def _count_null_hits(self, state: _RequestBlocks) -> None:
        assert state.num_skipped_blocks is not None
        null = self.pool.null_block
        for w, (g, _) in enumerate(self.window_groups):
            blocks, i = state.blocks[g], state.num_skipped_blocks[w]
            while i < len(blocks) and blocks[i] is null:
                i += 1
            state.num_skipped_blocks[w] = i

    def _skip_blocks(self, request: Request, state: _RequestBlocks) -> None:
        """Free each window group's blocks that no query of this step or a later one
        sees. Counted from the tokens known to be computed: drafts of a step in flight
        may be rejected, and the positions they roll back to still need their window."""
        assert state.num_skipped_blocks is not None
        num_computed = request.num_computed_tokens - request.num_output_placeholders
        null, skipped = self.pool.null_block, state.num_skipped_blocks
        for w, (g, window) in enumerate(self.window_groups):
            num_skip = max(0, num_computed - window + 1) // self.block_size
            first = skipped[w]
            if num_skip <= first:
                continue
            blocks = state.blocks[g]
            num_skip = min(num_skip, len(blocks))
            self.pool.free_blocks(blocks[first:num_skip])
            blocks[first:num_skip] = [null] * (num_skip - first)
            skipped[w] = num_skip

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """A connector filled the request's blocks up to num_computed_tokens."""
        state = self.req_blocks.get(request.request_id)
        if state is not None:
            self._cache_full_blocks(request, state, num_computed_tokens)

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_total: int) -> None:
        # Only blocks whose tokens are all known and computed once this step has run;
        # a block ending in a token still in flight is cached on a later call.
        num_full = min(num_total, len(request.all_token_ids)) // self.block_size
        first = state.num_cached_blocks
        if num_full <= first or not self.enable_caching:
            return
        hashes, cache, null = request.block_hashes, self.pool.cache_block, self.pool.null_block
        cached = []
        for g, (blocks, key) in enumerate(zip(state.blocks, self.group_keys, strict=True)):
            indices = [i for i in range(first, num_full)
                       if (b := blocks[i]) is not null and cache(b, hashes[i] + key)]  # fmt: skip
            self.events.cached(request, g, key, indices, self.block_size)
            cached += [blocks[i] for i in indices]
        state.num_cached_blocks = num_full
        if self.newly_cached is not None:
            self.newly_cached += cached

    def take_newly_cached(self) -> list[KVCacheBlock]:
        """The blocks cached since the last call that still are (a preemption victim's
        may have been uncached since)."""
        blocks, self.newly_cached = self.newly_cached or [], []
        return [b for b in blocks if b.block_hash is not None]

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Give back the blocks past the first num_tokens slots (rejected drafts had
        them allocated): the new block count, or None when nothing was past."""
        state = self.req_blocks.get(request.request_id)
        num_kept = cdiv(num_tokens, self.block_size)
        if state is None or len(state.blocks[0]) <= num_kept:
            return None
        # Only blocks of tokens that were never known: none of them is cached, and
        # none was skipped (skipping counts only tokens known computed).
        assert state.num_cached_blocks <= num_kept, "a cached block past the tokens"
        for blocks in state.blocks:
            self.pool.free_blocks(reversed(blocks[num_kept:]))
            del blocks[num_kept:]
        state.num_slots = num_kept * self.block_size
        request.num_ready_kv_slots = min(request.num_ready_kv_slots, state.num_slots)
        return num_kept

    def hold(self, request_id: str, key: str) -> None:
        """Keep an ended request's blocks under key (a transfer still uses them), so
        that its id may come back for a new request meanwhile."""
        if (state := self.req_blocks.pop(request_id, None)) is not None:
            self.req_blocks[key] = state

    def free(self, request_id: str, num_valid_tokens: int | None = None,
             retention: Retention | None = None) -> None:  # fmt: skip
        """The blocks of a request (or held under that key). num_valid_tokens: a
        preemption victim's tokens whose KV is (or will be, by a step in flight)
        computed. Its blocks cached past them were cached by this very step for tokens
        the step no longer computes: they are uncached, else a later hit would read KV
        that was never written. retention: its prefix's (the cached blocks of its first
        retention.num_tokens), which the pool keeps past their LRU turn."""
        state = self.req_blocks.pop(request_id, None)
        if state is None:
            return
        null = self.pool.null_block
        if retention is not None:
            self._retain(state.blocks, retention, num_valid_tokens)
        for blocks in state.blocks:
            if num_valid_tokens is not None:
                for block in blocks[num_valid_tokens // self.block_size :]:
                    if block.block_hash is not None and block.ref_cnt == 1:
                        self.pool.uncache(block)
            # Tail blocks first: they join the free queue ahead of the prefix blocks
            # and are evicted first, so shared prefixes stay cached longest.
            self.pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def _retain(self, blocks: list[list[KVCacheBlock]], retention: Retention,
                num_valid_tokens: int | None) -> None:  # fmt: skip
        num_tokens = retention.num_tokens
        if num_valid_tokens is not None:
            num_tokens = min(num_tokens, num_valid_tokens)
        expires_at = self.pool.clock() + retention.ttl_s
        null = self.pool.null_block
        for group in blocks:
            kept = (b for b in group[: num_tokens // self.block_size] if b is not null)
            self.pool.retain(kept, retention.priority, expires_at)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block tables, position-major."""
        state = self.req_blocks.get(request_id)
        if state is None:
            return []
        if self.num_groups == 1:
            return [b.block_id for b in state.blocks[0]]
        return [b.block_id for position in zip(*state.blocks, strict=True) for b in position]

    def max_num_tokens(self, max_chunk_tokens: int) -> int:
        """The longest sequence the pool could hold alone (num_blocks_for's inverse);
        unbounded by the pool when no group holds every token and the windows fit."""
        usable = self.pool.num_usable_blocks
        if not self.full_groups:
            return UNBOUNDED if self.num_blocks_for(UNBOUNDED, max_chunk_tokens) <= usable else 0
        low, high = 0, usable * self.block_size  # num_blocks_for grows with the length
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.num_blocks_for(mid, max_chunk_tokens) <= usable else (
                low, mid - 1)  # fmt: skip
        return low

    def num_blocks_for(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds at once: every full group's
        for all of it, each window group's for its window and a chunk of new tokens."""
        bs, positions = self.block_size, cdiv(num_tokens, self.block_size)
        chunk = min(max_chunk_tokens, num_tokens)
        windows = sum(min(positions, cdiv(w + chunk, bs) + 1) for _, w in self.window_groups)
        return len(self.full_groups) * positions + windows


UNBOUNDED = 2**31 - 1
