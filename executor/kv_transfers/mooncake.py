"""Mooncake's transfer engine (mooncake-transfer-engine, kvcache-ai/Mooncake) as the
KV transport of prefill/decode disaggregation: each rank of a prefill or decode
executor runs one engine with its KV tensors registered; a decode rank reads blocks
of the same rank of a prefill executor one-sidedly, over TCP (its RDMA transport on
machines that have it), with no metadata server (P2P handshake).

Every KV tensor has its block dimension first (as the host tier relies on), so a
block of a tensor is one contiguous range: a run of consecutive blocks on both sides
is one read, and a load is one batch of them.

Facts this rests on (measured here, 0.3.13.post1): a peer that is stopped fails a
read after MC_TCP_PROGRESS_TIMEOUT_SEC (set from --kv-transfer-timeout-s), one that is
killed fails it at once, a read past what the peer registered is refused; the engine
releases the GIL while it reads. Its handshake and data ports listen on every
interface whatever the host given (not configurable in this release), and the bytes
cross unencrypted: run disaggregated replicas on a trusted network."""

import contextlib
import logging
import os

import torch

from flagstop.executor.kv_transfers.decode import TransferFailed
from flagstop.v1 import executor_pb2

log = logging.getLogger("flagstop.executor")


class MooncakeTransport:
    def __init__(self, caches: list[torch.Tensor], host: str, timeout_s: float) -> None:
        """caches: the rank's KV tensors, [num_blocks, ...] each, in the layout's order."""
        engine_class = _engine_class(caches[0].device)
        seconds = str(max(1, round(timeout_s)))
        for name in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC",
                     "MC_HANDSHAKE_CONNECT_TIMEOUT"):  # fmt: skip
            os.environ.setdefault(name, seconds)
        with _quiet_stderr():  # glog's banner and a spurious error line at every start
            self.engine = engine_class()
            started = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if started != 0:
            raise ValueError(f"Mooncake's transfer engine did not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.regions = []
        for cache in caches:
            num_bytes = cache.numel() * cache.element_size()
            if self.engine.register_memory(cache.data_ptr(), num_bytes) != 0:
                raise ValueError(f"Mooncake's transfer engine refused {num_bytes} bytes of KV")
            self.regions.append((cache.data_ptr(), num_bytes // cache.shape[0]))
        self.num_blocks = caches[0].shape[0]

    @property
    def rank(self) -> executor_pb2.KVRank:
        """What a decode rank needs to read this rank's blocks."""
        return executor_pb2.KVRank(session=self.session, regions=[
            executor_pb2.KVRegion(address=a, block_bytes=b) for a, b in self.regions
        ])  # fmt: skip

    def read(
        self, remote: executor_pb2.KVRank, num_remote_blocks: int, source_ids: list[int],
        block_ids: list[int],
    ) -> None:  # fmt: skip
        if len(remote.regions) != len(self.regions):
            raise TransferFailed(f"{len(remote.regions)} KV tensors there, "
                                 f"{len(self.regions)} here")  # fmt: skip
        if any(not 0 <= b < num_remote_blocks for b in source_ids):
            raise TransferFailed(f"a block past the prefill side's {num_remote_blocks}")
        ours, theirs, lengths = [], [], []
        for (address, block_bytes), region in zip(self.regions, remote.regions, strict=True):
            if region.block_bytes != block_bytes:
                raise TransferFailed(f"blocks of {region.block_bytes} bytes there, "
                                     f"{block_bytes} here")  # fmt: skip
            for local, remote_block, num in _runs(block_ids, source_ids):
                ours.append(address + local * block_bytes)
                theirs.append(region.address + remote_block * block_bytes)
                lengths.append(num * block_bytes)
        if self.engine.batch_transfer_sync_read(remote.session, ours, theirs, lengths) != 0:
            raise TransferFailed(f"the transfer engine's read from {remote.session} failed")


def _runs(block_ids: list[int], source_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first local block, first remote block, count) of each run consecutive on both
    sides."""
    runs: list[list[int]] = []
    for local, remote in zip(block_ids, source_ids, strict=True):
        if runs and local == runs[-1][0] + runs[-1][2] and remote == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([local, remote, 1])
    return [(a, b, n) for a, b, n in runs]


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (before any other thread writes)."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _engine_class(device: torch.device):
    """Mooncake's TransferEngine, or why it cannot serve this device."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its start-up chatter, at INFO, per rank
    try:
        from mooncake.engine import SUPPORT_CUDA, TransferEngine
    except ImportError as e:
        raise ValueError(f"--kv-role needs Mooncake's transfer engine ({e}): pip install "
                         "mooncake-transfer-engine-non-cuda (or mooncake-transfer-engine "
                         "on CUDA); on Debian it needs libibverbs1") from None  # fmt: skip
    if device.type == "cuda" and not SUPPORT_CUDA:
        raise ValueError("--kv-role on CUDA: this Mooncake build reads host memory only; "
                         "install mooncake-transfer-engine (its CUDA build)")  # fmt: skip
    return TransferEngine
