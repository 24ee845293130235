import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from flagstop.scheduler_svc.core.block_pool import BlockPool, KVCacheBlock
from flagstop.scheduler_svc.core.request import Request
from flagstop.utils import cdiv


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    # sha256 rather than hash(): the cache is shared by every client, and a colliding
    # hash would hand one request another's KV (vLLM moved to sha256 for this reason).
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def lora_root(lora_id: str) -> bytes:
    """The parent of a request's first block hash: its adapter's identity (the digest
    of its files, never its name), so that the same tokens under two adapters, under
    one and the base model, or under a name before and after it was loaded again from
    other files, never share KV."""
    return hashlib.sha256(b"lora:" + lora_id.encode()).digest() if lora_id else b""


def chain_hashes(
    token_ids: list[int], block_size: int, first_block: int = 0, parent_hash: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full blocks of token_ids from first_block on (whose
    parent's hash is parent_hash): the prefix cache's keys, and the router's too."""
    hashes = []
    for start in range(first_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
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
    blocks: list[KVCacheBlock]
    # How many leading blocks are already in the prefix cache.
    num_cached_blocks: int = 0


NO_NEW_BLOCKS: tuple[int, ...] = ()


class KVCacheManager:
    """Maps requests to blocks: prefix lookups, slot allocation, caching and freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
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
                               hashes[-1] if hashes else lora_root(request.lora_id))  # fmt: skip

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest cached prefix of full blocks, never covering the last token:
        its logits are what the next step must produce."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> Sequence[int] | None:
        """Give the request room for num_new_tokens more tokens (after the prefix hits).
        All or nothing: None when the free blocks cannot cover it. Returns the block ids
        appended to the request's block table. delay_cache_blocks: a connector fills
        them, so none is cached (no other request may hit it) until cache_blocks."""
        state = self.req_blocks.get(request.request_id)
        num_total = request.num_computed_tokens + num_new_tokens
        if state is not None and num_total <= len(state.blocks) * self.block_size:
            # The decode fast path: room was already allocated, at most a block to cache.
            self._cache_full_blocks(request, state, num_total)
            return NO_NEW_BLOCKS
        hits = new_computed_blocks or []
        num_total += len(hits) * self.block_size
        num_allocated = len(state.blocks) if state is not None else 0
        num_needed = cdiv(num_total, self.block_size) - num_allocated - len(hits)
        # Hits sitting in the free queue (ref 0) are taken from the same free pool.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.free_queue.num_free_blocks:
            return None
        if state is None:
            state = self.req_blocks[request.request_id] = _RequestBlocks([])
        self.pool.touch(hits)
        new_blocks = hits + self.pool.get_new_blocks(num_needed)
        state.blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, state, num_total)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """A connector filled the request's blocks up to num_computed_tokens."""
        state = self.req_blocks.get(request.request_id)
        if state is not None:
            self._cache_full_blocks(request, state, num_computed_tokens)

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_total: int) -> None:
        # Only blocks whose tokens are all known and computed once this step has run;
        # a block ending in a token still in flight is cached on a later call.
        num_full = min(num_total, len(request.all_token_ids)) // self.block_size
        if num_full <= state.num_cached_blocks or not self.enable_caching:
            return
        blocks, hashes, cache_block = state.blocks, request.block_hashes, self.pool.cache_block
        cached = [blocks[i] for i in range(state.num_cached_blocks, num_full)
                  if cache_block(blocks[i], hashes[i])]  # fmt: skip
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
        if state is None or len(state.blocks) <= num_kept:
            return None
        # Only blocks of tokens that were never known: none of them is cached.
        assert state.num_cached_blocks <= num_kept, "a cached block past the tokens"
        self.pool.free_blocks(reversed(state.blocks[num_kept:]))
        del state.blocks[num_kept:]
        return num_kept

    def hold(self, request_id: str, key: str) -> None:
        """Keep an ended request's blocks under key (a transfer still uses them), so
        that its id may come back for a new request meanwhile."""
        if (state := self.req_blocks.pop(request_id, None)) is not None:
            self.req_blocks[key] = state

    def free(self, request_id: str, num_valid_tokens: int | None = None) -> None:
        """The blocks of a request (or held under that key). num_valid_tokens: a
        preemption victim's tokens whose KV is (or will be, by a step in flight)
        computed. Its blocks cached past them were cached by this very step for tokens
        the step no longer computes: they are uncached, else a later hit would read KV
        that was never written."""
        state = self.req_blocks.pop(request_id, None)
        if state is None:
            return
        if num_valid_tokens is not None:
            for block in state.blocks[num_valid_tokens // self.block_size :]:
                if block.block_hash is not None and block.ref_cnt == 1:
                    self.pool.uncache(block)
        # Tail blocks first: they join the free queue ahead of the prefix blocks and
        # are evicted first, so shared prefixes stay cached longest.
        self.pool.free_blocks(reversed(state.blocks))

    def block_ids(self, request_id: str) -> list[int]:
        state = self.req_blocks.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []
