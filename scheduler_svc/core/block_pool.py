from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, cached block of tokens; kept after the block is
    # freed (lazy eviction) so that a later request can still hit it.
    block_hash: bytes | None = None
    # Intrusive links of the free queue: O(1) removal from its middle without
    # allocating a node per operation.
    prev_free: "KVCacheBlock | None" = None
    next_free: "KVCacheBlock | None" = None


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


class BlockPool:
    """Fixed-size KV blocks with reference counts and a content-addressed prefix cache."""

    __slots__ = ("blocks", "cached_blocks", "free_queue", "null_block", "num_blocks",
                 "num_usable_blocks")  # fmt: skip

    def __init__(self, num_blocks: int, null_block: bool = False) -> None:
        """null_block: block 0 is set aside, never allocated nor freed: a window
        group's table holds it where a block left the window (its positions are
        never read), as vLLM's does."""
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if null_block else None
        self.free_queue = FreeBlockQueue(self.blocks[int(null_block) :])
        self.num_usable_blocks = num_blocks - null_block
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            if block.block_hash is not None:
                self.uncache(block)  # evicted: its contents are about to change
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving freed ones from the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
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
        unhashed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    self.free_queue.append(block)
        if unhashed:
            self.free_queue.prepend(unhashed)

    def uncache(self, block: KVCacheBlock) -> None:
        """The block's contents are not what its hash says: no later request may hit it."""
        assert block.block_hash is not None
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
