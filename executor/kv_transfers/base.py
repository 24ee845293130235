"""The executor side of the KV connector seam (the scheduler's is
scheduler_svc/core/kv_connector.py): what each step's plan asks of it, and the
transfers it reports back. Three kinds: the prefix cache's host tier
(executor/kv_transfers/host_tier.py), and the two sides of prefill/decode disaggregation: a
prefill executor's leases over the blocks it handed off (prefill.py), a
decode executor's reads of them (executor/kv_transfers/decode.py).

Which worker a rank gets: factory.py. This module is the floor every worker stands
on, torch-free: the executor simulator runs the disaggregation sides too."""

import asyncio
from typing import Protocol

from flagstop.executor.kv_transfers.leases import Leases
from flagstop.scheduler_svc.core.kv_connector import (
    NO_TRANSFERS,
    KVConnectorMetadata,
    KVTransferResult,
)
from flagstop.v1 import executor_pb2

# A step with nothing to compute waits this long for a transfer to end before
# answering: the scheduler's only news of one is a step result, and an idle engine
# would otherwise poll in a busy loop. The loop serves gRPC (a decode executor's
# lease calls) meanwhile.
POLL_WAIT_S = 0.005


class LeaseServer(Protocol):
    """What serves decode executors' handshakes and leases (prefill.py's PrefillSide)."""

    leases: Leases

    def handshake(self, layout: str) -> executor_pb2.KVHandshakeResponse: ...


class KVWorker(Protocol):
    num_host_blocks: int  # blocks it holds beyond the pool (a host tier's; 0: none)

    def prefill_side(self, engine_id: str | None = None) -> LeaseServer | None:
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

    def prefill_side(self, engine_id: str | None = None) -> LeaseServer | None:
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
