"""Which KV worker a rank gets (the seam's nulls and protocol: base.py): the host
tier with --kv-offload-bytes, a side of prefill/decode disaggregation with --kv-role
prefill or decode, else none. It imports every worker (torch with them); the
torch-free simulator imports the sides it runs directly."""

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.kv_transfers.base import KVWorker, NoKVWorker
from flagstop.executor.kv_transfers.decode import DecodeSide, StoreBoard
from flagstop.executor.kv_transfers.host_tier import HostTier
from flagstop.executor.kv_transfers.mooncake import MooncakeTransport
from flagstop.executor.kv_transfers.prefill import PrefillFollower, PrefillSide
from flagstop.executor.parallel import TensorParallel


def make_kv_worker(
    config: ExecutorConfig, tp: TensorParallel, caches: list, block_bytes: int, layout: str,
    engine_id: str, num_blocks: int,
) -> KVWorker:  # fmt: skip
    """This rank's worker: --kv-offload-bytes, the host tier over every KV tensor of
    the rank (caches); --kv-role, its side of disaggregation over Mooncake's transfer
    engine; else none."""
    if config.kv_offload_bytes:
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
    transport = MooncakeTransport(caches, config.kv_transfer_host or "127.0.0.1",
                                  config.kv_transfer_timeout_s)  # fmt: skip
    if config.kv_role == "decode":
        board = StoreBoard(tp.store) if tp.size > 1 else None
        return DecodeSide(tp.rank, layout, transport, tp.mins_over_ranks, board)
    if tp.size > 1:  # every rank's regions, for rank 0's handshake
        tp.store.set(f"flagstop/kv-rank/{tp.rank}", transport.rank.SerializeToString())
    if tp.rank != 0:
        return PrefillFollower(transport)

    def ranks() -> list:
        others = [type(transport.rank).FromString(tp.store.get(f"flagstop/kv-rank/{r}"))
                  for r in range(1, tp.size)]  # fmt: skip
        return [transport.rank, *others]

    return PrefillSide(layout, engine_id, num_blocks, config.kv_lease_s, ranks)
