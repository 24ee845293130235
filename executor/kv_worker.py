"""The executor side of the KV connector seam (the scheduler's is
scheduler_svc/core/kv_connector.py): what each step's plan asks of it, and the
transfers it reports back. Three kinds: the prefix cache's host tier
(executor/kv_offload.py), and the two sides of prefill/decode disaggregation: a
prefill executor's leases over the blocks it handed off (PrefillSide, below), a
decode executor's reads of them (executor/kv_pull.py).

torch-free: the executor simulator runs the disaggregation sides too."""

import asyncio
from collections.abc import Callable
from typing import Protocol

from flagstop.executor.kv_lease import Leases
from flagstop.scheduler_svc.core.kv_connector import KVConnectorMetadata, KVTransferResult
from flagstop.v1 import executor_pb2

# A step with nothing to compute waits this long for a transfer to end before
# answering: the scheduler's only news of one is a step result, and an idle engine
# would otherwise poll in a busy loop. The loop serves gRPC (a decode executor's
# lease calls) meanwhile.
POLL_WAIT_S = 0.005


class KVWorker(Protocol):
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


class LayoutMismatch(Exception):
    """A decode executor's KV layout is not this prefill executor's: no block of one
    means the same in the other."""


def kv_layout(model_name: str, facts: dict[str, object]) -> str:
    """What two executors must share to move KV blocks between them, as one line:
    the model, and how a block of each KV tensor is laid out on each rank."""
    return model_name + " " + " ".join(f"{key}={value}" for key, value in facts.items())


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


class PrefillFollower:
    """A prefill executor's rank other than 0: its KV tensors are readable through its
    transfer engine (held here: the engine stops serving once collected); rank 0
    keeps the leases."""

    def __init__(self, transport: object) -> None:
        self.transport = transport

    def start(self, meta: KVConnectorMetadata) -> None:
        return None

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        return None

    def finished(self) -> KVTransferResult:
        return KVTransferResult()

    async def wait(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    def reset(self) -> None:
        return None
