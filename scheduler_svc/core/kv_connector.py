"""The KV connector seam, scheduler side (after vLLM V1's KVConnectorBase_V1): KV that
lives beyond this pool (a host tier, a prefill replica) is found, loaded into blocks
the scheduler reserved, and reported back; blocks a transfer still reads (a decode
replica's, of a request handed off) are freed once the connector says so.

The scheduler asks `get_num_new_matched_tokens` for a waiting request after its local
prefix hits; a positive answer reserves the request's blocks for its whole remaining
prefill (vLLM #45388: reserving only the loaded part deadlocks), parks it in its own
queue as WAITING_FOR_REMOTE_KVS (no token budget, no seat of --max-num-seqs, never
blocking the requests behind it) and tells the connector which blocks to fill
(`update_state_after_alloc`). Each step's plan carries `build_connector_meta()` to the
executor, whose worker side moves the bytes and reports finished and failed loads;
the core's KVTransfers (kv_transfers.py) applies them. Loads here are always asynchronous: the
request runs only once its KV is whole, so no layer of a forward waits on a transfer.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flagstop.scheduler_svc.core.block_pool import KVCacheBlock
from flagstop.scheduler_svc.core.kv_events import KVEventLog, NoKVEvents
from flagstop.scheduler_svc.core.kv_handoff import KVHandoff
from flagstop.scheduler_svc.core.request import Request


@dataclass(slots=True)
class KVLoad:
    """Fill a request's blocks block_ids[i] from the connector's source_ids[i]: a host
    tier's slots, or (endpoint set) a prefill executor's blocks, read under its lease
    transfer_id. A remote load of no blocks only releases that lease."""

    req_id: str
    block_ids: list[int]
    source_ids: list[int]
    endpoint: str = ""
    engine_id: str = ""
    transfer_id: str = ""


@dataclass(slots=True)
class KVSend:
    """Prefill side: hold these blocks under a lease until a decode executor has read
    them or it expires; reported as transfer_id in finished_sending."""

    transfer_id: str
    block_ids: list[int]


@dataclass(slots=True)
class KVConnectorMetadata:
    """One step's transfers for the executor's connector: loads to start and leases to
    hold before the forward, and blocks this step computes to save after it."""

    loads: list[KVLoad] = field(default_factory=list)
    save_block_ids: list[int] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    sends: list[KVSend] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.save_block_ids or self.sends)


@dataclass(slots=True, frozen=True)
class KVTransferResult:
    """What the executor's connector reports in a step result."""

    finished_recving: Sequence[str] = ()
    failed_recving: Sequence[str] = ()
    finished_sending: Sequence[str] = ()

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.failed_recving or self.finished_sending)


NO_TRANSFERS = KVTransferResult()  # its fields are tuples: shared, never changed


class KVConnector(Protocol):
    num_host_blocks: int  # blocks it can hold beyond the pool (0: none of its own)
    # A prefill replica's: a request added with do_remote_decode ends after its
    # first token (FINISHED_TRANSFERRED) and request_finished hands its KV off.
    hands_off: bool

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens past the first num_computed_tokens (the local hits) that can be
        loaded, never the last known token (its logits are the next step's); None:
        ask again next step. No side effects."""
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The blocks reserved for the loadable tokens: the load to start. Also called
        with none when a request is admitted with nothing to load."""
        ...

    def blocks_cached(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks that enter the prefix cache with this step (their tokens are computed
        by it, or were loaded): a write-through tier saves the ones it lacks."""
        ...

    def build_connector_meta(self) -> KVConnectorMetadata:
        """The transfers decided since the last plan (taken: the next call starts empty)."""
        ...

    def update_connector_output(self, result: KVTransferResult) -> None:
        """Transfers the executor finished or failed (their sources may be reused)."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> KVHandoff | None:
        """A request ended (its status says how); a hand-off: a transfer still reads
        its blocks, which the scheduler frees once finished_sending names the
        hand-off's transfer_id. None: free them now."""
        ...

    def reset(self, num_host_blocks: int) -> None:
        """The executor was replaced: whatever it held beyond the pool is gone (the new
        one holds num_host_blocks)."""
        ...

    def executor_replaced(self, endpoint: str, engine_id: str) -> None:
        """A new executor instance took over: where its KV is read from now on (a
        prefill side's hand-offs name it)."""
        ...

    def announce(self, events: KVEventLog | NoKVEvents) -> None:
        """Where to tell what its tier gains and loses (KV events, medium CPU: a
        fleet's router counts a block on the host as cached); a connector without a
        tier tells nothing."""
        ...

    @property
    def num_cached_blocks(self) -> int:
        """Blocks resident beyond the pool (the load report's)."""
        ...
