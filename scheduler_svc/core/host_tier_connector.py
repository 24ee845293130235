"""The host-memory tier of the prefix cache, scheduler side: which block hashes the
executor's host buffer holds, in which slot, and the copies each step asks for.

Policy (vLLM's OffloadingConnector, SGLang HiCache's write_through): every full block
is written through to the tier in the step that computes it, keyed by the prefix
cache's chained hash, unless the tier holds that hash already. Eviction is least
recently used, where a use is a save or a load: a slot is reused from the oldest
entry on, skipping slots a load still reads and slots this step saves into. A prefix
hit in the tier (the blocks past the pool's own hits, up to the last token) loads back
into blocks the scheduler reserved, while the request waits as WAITING_FOR_REMOTE_KVS.

The executor holds the bytes (executor/kv_transfers/host_tier.py) and executes the copies in plan
order: a step's saves run after its forward and before any later step's loads, so a
load never reads a slot before the save that fills it. Only a load planned in the same
step as the slot's save could: the scheduler tells the tier of a step's cached blocks
after its lookups, and the lookup stops at a slot saved this step regardless.

With KV cache groups (kv_groups.py) a slot holds one group's block, keyed as the pool
keys it (hash and group); a position counts as a tier hit only when every group's
block of it is there, and its loads fill every group's block of each position
(position-major, as the plan's block ids)."""

from collections import Counter, OrderedDict
from collections.abc import Sequence

from flagstop.scheduler_svc.core.block_pool import KVCacheBlock
from flagstop.scheduler_svc.core.kv_connector import (
    KVConnectorMetadata,
    KVLoad,
    KVTransferResult,
)
from flagstop.scheduler_svc.core.kv_events import CPU, NO_KV_EVENTS, KVEventLog, NoKVEvents
from flagstop.scheduler_svc.core.kv_groups import group_key
from flagstop.scheduler_svc.core.request import Request


class HostTierConnector:
    hands_off = False

    def __init__(self, num_host_blocks: int, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.group_keys = [group_key(g) for g in range(num_groups)]
        self.events: KVEventLog | NoKVEvents = NO_KV_EVENTS
        self.reset(num_host_blocks)

    def reset(self, num_host_blocks: int) -> None:
        """A new executor's tier, empty: num_host_blocks slots (its blocks' places)."""
        self.num_host_blocks = num_host_blocks
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.free_slots = list(range(num_host_blocks - 1, -1, -1))
        self.pinned: Counter[int] = Counter()  # slots loads read
        self.loads_of: dict[str, list[int]] = {}  # request id -> slots its load reads
        self.meta = KVConnectorMetadata()
        self.saving: set[int] = set()  # slots this step's saves fill

    @property
    def num_cached_blocks(self) -> int:
        return len(self.slots)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # never the last token
        num_blocks, slots, saving = 0, self.slots, self.saving
        for block_hash in request.block_hashes[first:last]:
            found = [slots.get(block_hash + key) for key in self.group_keys]
            if any(slot is None or slot in saving for slot in found):
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        hashes = request.block_hashes[first : first + num_external_tokens // self.block_size]
        keys = [h + key for h in hashes for key in self.group_keys]  # position-major
        slots = [self.slots[k] for k in keys]
        for key in keys:
            self.slots.move_to_end(key)
        self.pinned.update(slots)
        self.loads_of[request.request_id] = slots
        self.meta.loads.append(KVLoad(request.request_id, block_ids, slots))

    def blocks_cached(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            block_hash = block.block_hash
            if block_hash in self.slots:
                self.slots.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            if slot is None:
                return  # every slot is read by a load or filled this step
            self.slots[block_hash] = slot
            self.events.offloaded(block_hash, self.block_size)
            self.saving.add(slot)
            self.meta.save_block_ids.append(block.block_id)
            self.meta.save_slots.append(slot)

    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.slots.items():
            if not self.pinned[slot] and slot not in self.saving:
                del self.slots[block_hash]
                self.events.removed(block_hash, CPU)
                return slot
        return None

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self.meta = self.meta, KVConnectorMetadata()
        self.saving = set()
        return meta

    def update_connector_output(self, result: KVTransferResult) -> None:
        for req_id in result.finished_recving:
            self._unpin(self.loads_of.pop(req_id, ()))
        for req_id in result.failed_recving:
            slots = set(self.loads_of.pop(req_id, ()))
            self._unpin(slots)
            # What a failed copy read is suspect: those entries go, their slots with them.
            for block_hash, slot in list(self.slots.items()):
                if slot in slots and not self.pinned[slot]:
                    del self.slots[block_hash]
                    self.events.removed(block_hash, CPU)
                    self.free_slots.append(slot)

    def _unpin(self, slots) -> None:
        self.pinned.subtract(slots)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        return None  # saves run in the step that computes a block: nothing reads it later

    def executor_replaced(self, endpoint: str, engine_id: str) -> None:
        return None  # its tier is reset with it

    def announce(self, events: KVEventLog | NoKVEvents) -> None:
        self.events = events
