"""The executor side of the KV connector seam (the scheduler's is
scheduler_svc/core/kv_connector.py): what each step's plan asks of it, and the
transfers it reports back. Three kinds: the prefix cache's host tier
(executor/kv_transfers/host_tier.py), and the two sides of prefill/decode disaggregation: a
prefill executor's leases over the blocks it handed off (PrefillSide, below), a
decode executor's reads of them (executor/kv_transfers/decode.py).

torch-free: the executor simulator runs the disaggregation sides too."""

import asyncio
from typing import TYPE_CHECKING, Protocol

from flagstop.executor.config import ExecutorConfig
from flagstop.scheduler_svc.core.kv_connector import (
    NO_TRANSFERS,
    KVConnectorMetadata,
    KVTransferResult,
)

if TYPE_CHECKING:  # torch-free: the simulator imports this module
    from flagstop.executor.kv_transfers.prefill import PrefillSide
    from flagstop.executor.parallel import TensorParallel

# A step with nothing to compute waits this long for a transfer to end before
# answering: the scheduler's only news of one is a step result, and an idle engine
# would otherwise poll in a busy loop. The loop serves gRPC (a decode executor's
# lease calls) meanwhile.
POLL_WAIT_S = 0.005


class KVWorker(Protocol):
    num_host_blocks: int  # blocks it holds beyond the pool (a host tier's; 0: none)

    def prefill_side(self, engine_id: str | None = None) -> "PrefillSide | None":
        """Whoever serves decode executors' handshakes and leases here: a prefill
        executor's rank 0 (for a lease of this instance, engine_id; None: any)."""
        ...

    def start(self, meta: KVConnectorMetadata) -> None:
        """Before the step's forward: start its loads, hold its hand-offs' blocks."""
        ...

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        """After the forward: its saves (the blocks it computed)."""
        ...

    def finished(self) -> KVTransferResult:
        """The transfers that ended, for this step's result. Every rank calls it at the
        same point of the same step (the ranks agree here on what ended)."""
        ...

    async def wait(self, timeout_s: float) -> None:
        """Rank 0, a step with nothing to compute: until a transfer may have ended, at
        most timeout_s."""
        ...

    def reset(self) -> None:
        """A new scheduler stream: wait out what still writes the cache, forget the
        rest."""
        ...


class NoLeases:
    """What every worker but a prefill executor's rank 0 answers: no leases here."""

    num_host_blocks = 0

    def prefill_side(self, engine_id: str | None = None) -> "PrefillSide | None":
        return None


class NoKVWorker(NoLeases):
    """No KV beyond the pool (no --kv-offload-bytes, --kv-role both): every call a
    no-op, nothing ever ends."""

    def start(self, meta: KVConnectorMetadata) -> None:
        return None

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        return None

    def finished(self) -> KVTransferResult:
        return NO_TRANSFERS

    async def wait(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    def reset(self) -> None:
        return None


class LayoutMismatch(Exception):
    """A decode executor's KV layout is not this prefill executor's: no block of one
    means the same in the other."""


def kv_layout(model_name: str, facts: dict[str, object]) -> str:
    """What two executors must share to move KV blocks between them, as one line:
    the model, and how a block of each KV tensor is laid out on each rank."""
    return model_name + " " + " ".join(f"{key}={value}" for key, value in facts.items())


def make_kv_worker(
    config: ExecutorConfig, tp: "TensorParallel", caches: list, block_bytes: int, layout: str,
    engine_id: str, num_blocks: int,
) -> KVWorker:  # fmt: skip
    """This rank's worker: --kv-offload-bytes, the host tier over every KV tensor of
    the rank (caches); --kv-role, its side of disaggregation over Mooncake's transfer
    engine; else none."""
    if config.kv_offload_bytes:
        from flagstop.executor.kv_transfers.host_tier import HostTier

        num_slots = tp.min_over_ranks(config.kv_offload_bytes // block_bytes)
        if num_slots < 1:
            raise ValueError(f"--kv-offload-bytes {config.kv_offload_bytes} holds no block "
                             f"of {block_bytes} bytes: raise it")  # fmt: skip
        return HostTier(caches, num_slots, tp, config.kv_offload_path)
    if config.kv_role == "both":
        return NoKVWorker()
    return _disaggregation_side(config, tp, caches, layout, engine_id, num_blocks)


def _disaggregation_side(config, tp, caches, layout, engine_id, num_blocks) -> KVWorker:
    """Every rank's KV tensors registered with Mooncake's transfer engine, and its
    side: reads (decode), or leases and the handshake (prefill, rank 0)."""
    from flagstop.executor.kv_transfers.decode import DecodeSide, StoreBoard
    from flagstop.executor.kv_transfers.mooncake import MooncakeTransport

    transport = MooncakeTransport(caches, config.kv_transfer_host or "127.0.0.1",
                                  config.kv_transfer_timeout_s)  # fmt: skip
    if config.kv_role == "decode":
        board = StoreBoard(tp.store) if tp.size > 1 else None
        return DecodeSide(tp.rank, layout, transport, tp.mins_over_ranks, board)
    if tp.size > 1:  # every rank's regions, for rank 0's handshake
        tp.store.set(f"flagstop/kv-rank/{tp.rank}", transport.rank.SerializeToString())
    from flagstop.executor.kv_transfers.prefill import PrefillFollower, PrefillSide

    if tp.rank != 0:
        return PrefillFollower(transport)

    def ranks() -> list:
        others = [type(transport.rank).FromString(tp.store.get(f"flagstop/kv-rank/{r}"))
                  for r in range(1, tp.size)]  # fmt: skip
        return [transport.rank, *others]

    return PrefillSide(layout, engine_id, num_blocks, config.kv_lease_s, ranks)
