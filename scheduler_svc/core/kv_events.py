"""What a fleet's router learns of this pool (docs/llm-d.md): every block the prefix
cache gains and loses, as KV events in vLLM's terms (BlockStored, BlockRemoved,
AllBlocksCleared), in the order they happened. A subscriber that applies them holds
exactly the set of cached blocks the pool holds.

The pool and the manager call the log at three seams: `stored` when blocks become
cached (with their tokens, which an llm-d indexer hashes by itself), `removed` when a
cached block is evicted or uncached, `cleared` when the pool starts over (a new
executor). The shell takes each step's events (`take`) and publishes them. The null
log, NO_KV_EVENTS, keeps nothing: the seams cost a call when events are off.

The events are made in vLLM's own layout (msgspec structs, positional and tagged), so
that the shell encodes them as they are: no second object per event on the step's
path. msgspec is a data library here; the core does no I/O."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from flagstop.scheduler_svc.core.kv_groups import KVCacheGroup
from flagstop.scheduler_svc.core.request import Request

GPU, CPU = "GPU", "CPU"  # the pool's medium, the host tier's
HASH_BYTES = 32  # a block hash's digest (sha256); a group past the first suffixes a byte
FULL_ATTENTION_SPEC = ("full_attention", None)  # vLLM's kv_cache_spec kind and window


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Consecutive blocks of one group newly cached: their hashes, the hash of the
    block before the first (None: the first of a sequence), their tokens, and the
    keys beside the tokens that their hashes cover (the cache salt, images' hashes:
    vLLM's extra_keys, one entry a block). lora_id is None: flagstop names adapters by
    digest, not by an integer (lora_name says which)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def spec_of(group: KVCacheGroup) -> tuple[str, int | None]:
    """vLLM's kv_cache_spec kind of a group, and its window."""
    if group.is_recurrent:
        return "mamba", None
    if group.is_window:
        return "sliding_window", group.sliding_window
    return FULL_ATTENTION_SPEC


@dataclass(slots=True)
class KVEventLog:
    """The events since the shell last took them, in order; specs: each KV cache
    group's (kind, window), as the manager describes its groups."""

    events: list[KVEvent] = field(default_factory=list)
    specs: list[tuple[str, int | None]] = field(default_factory=lambda: [FULL_ATTENTION_SPEC])

    def describe(self, groups: Sequence[KVCacheGroup]) -> None:
        self.specs = [spec_of(g) for g in groups]

    def cached(self, request: Request, group_idx: int, key: bytes, indices: Sequence[int],
               block_size: int) -> None:  # fmt: skip
        """The request's blocks at these indices of group group_idx (whose hashes end
        in key) became cached: one event a run of consecutive blocks."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        kind, window = self.specs[group_idx]
        for first, last in _runs(indices):
            self.events.append(BlockStored(
                [hashes[i] + key for i in range(first, last + 1)],
                hashes[first - 1] + key if first else None,
                tokens[first * block_size : (last + 1) * block_size], block_size, None, GPU,
                request.lora_name or None, _extra_keys(request, first, last, block_size),
                group_idx, kind, window,
            ))  # fmt: skip

    def removed(self, block_hash: bytes, medium: str = GPU) -> None:
        """One block evicted (from the pool, or the host tier); consecutive removals of
        a group and medium share one event."""
        group_idx = _group_of(block_hash)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and (last.group_idx, last.medium) == (group_idx, medium):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium, group_idx))

    def offloaded(self, block_hash: bytes, block_size: int) -> None:
        """A cached block written to the host tier: announced by its hash, medium CPU,
        without tokens (its GPU announcement had them: llm-d's convention)."""
        group_idx = _group_of(block_hash)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.medium == CPU and last.group_idx == group_idx:
            last.block_hashes.append(block_hash)
        else:
            kind, window = self.specs[group_idx]
            self.events.append(BlockStored([block_hash], None, [], block_size, None, CPU, None,
                                           None, group_idx, kind, window))  # fmt: skip

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


class NoKVEvents:
    """Events off: nothing kept."""

    __slots__ = ()

    def describe(self, groups: Sequence[KVCacheGroup]) -> None:
        pass

    def cached(self, request: Request, group_idx: int, key: bytes, indices: Sequence[int],
               block_size: int) -> None:  # fmt: skip
        pass

    def removed(self, block_hash: bytes, medium: str = GPU) -> None:
        pass

    def offloaded(self, block_hash: bytes, block_size: int) -> None:
        pass

    def cleared(self) -> None:
        pass

    def take(self) -> list[KVEvent]:
        return []


NO_KV_EVENTS = NoKVEvents()


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive indices, in order."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _extra_keys(request: Request, first: int, last: int, block_size: int) -> list | None:
    """Per block, what its hash covers beside its tokens: the request's cache salt (the
    first block's: the rest chain from it, as vLLM's) and the hashes of the images it
    overlaps (None: nothing), or None for all."""
    if not request.cache_salt and not request.media:
        return None
    keys = []
    for i in range(first, last + 1):
        start, end = i * block_size, (i + 1) * block_size
        media = [m.hash.hex() for m in request.media if m.offset < end and m.end > start]
        salt = [request.cache_salt] if request.cache_salt and i == 0 else []
        keys.append(tuple(salt + media) or None)
    return keys


def _group_of(block_hash: bytes) -> int:
    return block_hash[HASH_BYTES] if len(block_hash) > HASH_BYTES else 0
