"""A prefill executor's side of disaggregation (--kv-role prefill): every rank's KV
tensors readable by decode executors through its transfer engine; rank 0 answers their
handshake and holds the leases of the blocks it handed off."""

from collections.abc import Callable

from flagstop.executor.kv_transfers.base import LayoutMismatch, NoKVWorker
from flagstop.executor.kv_transfers.leases import Leases
from flagstop.scheduler_svc.core.kv_connector import (
    KVConnectorMetadata,
    KVTransferResult,
)
from flagstop.v1 import executor_pb2


class PrefillSide:
    """A prefill executor (--kv-role prefill): every rank's KV tensors are readable by
    decode executors (through its transfer engine, set up by the runner); rank 0 holds
    the leases and answers the decode side's handshake."""

    def __init__(
        self, layout: str, engine_id: str, num_blocks: int, lease_s: float,
        ranks: Callable[[], list[executor_pb2.KVRank]],
    ) -> None:  # fmt: skip
        """ranks: every rank's transfer session and regions, rank 0 first (read when
        first asked: the other ranks publish theirs as they start; it holds this
        rank's transfer engine, which stops serving once collected)."""
        self.layout, self.engine_id, self.num_blocks = layout, engine_id, num_blocks
        self.leases = Leases(lease_s)
        self._ranks, self.ranks = ranks, None

    num_host_blocks = 0

    def prefill_side(self, engine_id: str | None = None) -> "PrefillSide | None":
        return self if engine_id in (None, self.engine_id) else None

    def handshake(self, layout: str) -> executor_pb2.KVHandshakeResponse:
        """Raises LayoutMismatch, naming both layouts."""
        if layout != self.layout:
            raise LayoutMismatch(f"KV layouts differ: this prefill executor's is {self.layout}, "
                                 f"the decode side's {layout}")  # fmt: skip
        if self.ranks is None:
            self.ranks = self._ranks()
        return executor_pb2.KVHandshakeResponse(
            kv_layout=self.layout, engine_id=self.engine_id, num_blocks=self.num_blocks,
            ranks=self.ranks,
        )  # fmt: skip

    def start(self, meta: KVConnectorMetadata) -> None:
        if meta.sends:
            self.leases.hold([send.transfer_id for send in meta.sends])

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        return None

    def finished(self) -> KVTransferResult:
        return KVTransferResult(finished_sending=self.leases.take_ended())

    async def wait(self, timeout_s: float) -> None:
        await self.leases.wait(timeout_s)

    def reset(self) -> None:
        self.leases.clear()


class PrefillFollower(NoKVWorker):
    """A prefill executor's rank other than 0: its KV tensors are readable through its
    transfer engine (held here: the engine stops serving once collected); rank 0
    keeps the leases."""

    def __init__(self, transport: object) -> None:
        self.transport = transport
