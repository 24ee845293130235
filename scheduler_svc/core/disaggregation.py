"""Prefill/decode disaggregation, scheduler side: the two connectors of the seam
(kv_connector.py) a replica runs by its executor's --kv-role.

A router sends a long prompt to a prefill replica with do_remote_decode. There the
request runs as any other until its first token; then it ends (FINISHED_TRANSFERRED)
and PrefillConnector hands it off: its blocks stay held under a lease (the executor's,
until a decode executor has read them or --kv-lease-s passes) and the router learns
where they wait (a KVHandoff). The router sends the remainder (prompt + that token) to
a decode replica, where DecodeConnector offers the prompt's tokens past the local
prefix hits as loadable: the scheduler reserves the blocks and parks the request
WAITING_FOR_REMOTE_KVS while the executor reads them from the prefill executor; its
first token's KV is the only prefill left. A load that fails (the prefill side lost,
slow, or its lease ended before the read did) recomputes the prompt here.
"""

from collections.abc import Sequence
from itertools import count

from flagstop.scheduler_svc.core.block_pool import KVCacheBlock
from flagstop.scheduler_svc.core.kv_connector import (
    KVConnectorMetadata,
    KVHandoff,
    KVLoad,
    KVSend,
    KVTransferResult,
)
from flagstop.scheduler_svc.core.kv_events import KVEventLog, NoKVEvents
from flagstop.scheduler_svc.core.request import Request, RequestStatus


class _NoTier:
    """What both connectors lack: blocks of their own, saves, state to reset."""

    num_host_blocks = 0
    num_cached_blocks = 0

    def __init__(self) -> None:
        self.meta = KVConnectorMetadata()

    def blocks_cached(self, blocks: Sequence[KVCacheBlock]) -> None:
        return None

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self.meta = self.meta, KVConnectorMetadata()
        return meta

    def update_connector_output(self, result: KVTransferResult) -> None:
        return None

    def reset(self, num_host_blocks: int) -> None:
        # What was decided for a lost executor is void: its leases died with it, and a
        # request whose load was not sent yet recomputes (the prefill side's lease ends).
        self.meta = KVConnectorMetadata()

    def executor_replaced(self, endpoint: str, engine_id: str) -> None:
        return None

    def announce(self, events: KVEventLog | NoKVEvents) -> None:
        return None


class PrefillConnector(_NoTier):
    hands_off = True

    def __init__(self, endpoint: str, engine_id: str, instance: str) -> None:
        """endpoint, engine_id: the executor's (Describe); instance: unique to this
        scheduler process, so that no two hand-offs ever share a transfer id (a decode
        side's late release of an old lease must never end a new one)."""
        super().__init__()
        self.endpoint, self.engine_id = endpoint, engine_id
        self.transfer_ids = (f"kv-{instance}-{n}" for n in count())

    def executor_replaced(self, endpoint: str, engine_id: str) -> None:
        """Hand-offs name the new executor from now on."""
        self.endpoint, self.engine_id = endpoint, engine_id

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0  # nothing to load here: prefills compute

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> KVHandoff | None:
        if request.status != RequestStatus.FINISHED_TRANSFERRED or not block_ids:
            return None
        handoff = KVHandoff(next(self.transfer_ids), self.endpoint, self.engine_id,
                            tuple(block_ids), request.num_computed_tokens)  # fmt: skip
        self.meta.sends.append(KVSend(handoff.transfer_id, list(block_ids)))
        return handoff


class DecodeConnector(_NoTier):
    hands_off = False

    def __init__(self, block_size: int) -> None:
        """block_size: both sides' (the handshake refuses a prefill side's other)."""
        super().__init__()
        self.block_size = block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """The prompt tokens the prefill replica computed past the local hits (never the
        last known token: it is the request's first, which we compute)."""
        handoff = request.remote_prefill
        if handoff is None:
            return 0
        num_remote = min(handoff.num_tokens, request.num_tokens - 1)
        return max(0, num_remote - num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The load to start (a load of no blocks when nothing is left to read: it only
        releases the prefill side's lease)."""
        handoff, request.remote_prefill = request.remote_prefill, None
        if handoff is None:
            return
        first = request.num_computed_tokens // self.block_size
        sources = list(handoff.block_ids[first : first + len(block_ids)])
        self.meta.loads.append(KVLoad(request.request_id, block_ids, sources, handoff.endpoint,
                                      handoff.engine_id, handoff.transfer_id))  # fmt: skip

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """Ended before its load was planned: the prefill side's lease goes now."""
        self.update_state_after_alloc(request, [], 0)
        return None
