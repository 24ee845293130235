"""Prefill/decode disaggregation, the decode executor's side: it reads a handed-off
request's prompt KV from the prefill executor that computed it, into the blocks the
scheduler reserved, while the step loop goes on.

Each load runs on a pull thread (one per rank: loads end in the order they started):
- the handshake with the prefill executor, once per instance of it (rank 0 asks over
  gRPC; the prefill side refuses a KV layout other than its own, one line; the other
  ranks take rank 0's answer from the group's store);
- rank 0 renews the lease the blocks are held under (a lease that ended fails the
  load before any byte is read);
- every rank reads its own shard of the blocks from the same rank of the prefill
  executor, one-sidedly (Mooncake's transfer engine; a sleep by the bytes in the
  simulator).
The ranks agree on which loads ended and whether all of them read their shard (one
all-reduce), and rank 0 then releases each lease: only a lease that held until the
release makes the load good (the prefill side frees blocks only when their lease
ends, so it held through the read). Anything else (the prefill side gone, silent past
--kv-transfer-timeout-s, refusing the handshake, a lease ended first) fails the load:
the scheduler recomputes the prompt here, and the prefill side's blocks come back
when its lease is released or expires."""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import grpc

from flagstop.executor.kv_transfers.base import NoLeases
from flagstop.scheduler_svc.core.kv_connector import (
    KVConnectorMetadata,
    KVLoad,
    KVTransferResult,
)
from flagstop.server import CHANNEL_OPTIONS, TLSConfig
from flagstop.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger("flagstop.executor")
# Per load, agreed over the ranks (the least wins): still reading, failed, read.
PENDING, FAILED, READ = 0, 1, 2


class TransferFailed(Exception):
    """A load that cannot complete; the message says why, for the log."""


class Transport(Protocol):
    def read(
        self, remote: executor_pb2.KVRank, num_remote_blocks: int, source_ids: list[int],
        block_ids: list[int],
    ) -> None:  # fmt: skip
        """Copy the remote rank's blocks source_ids[i] into ours block_ids[i], every KV
        tensor. Raises TransferFailed."""
        ...


class LeaseClient:
    """Rank 0's calls to prefill executors (from the pull threads: blocking gRPC)."""

    def __init__(self, tls: TLSConfig | None, timeout_s: float) -> None:
        self.tls, self.timeout_s = tls, timeout_s
        self.stubs: dict[str, executor_pb2_grpc.ExecutorStub] = {}

    def _stub(self, endpoint: str) -> executor_pb2_grpc.ExecutorStub:
        if (stub := self.stubs.get(endpoint)) is None:
            if self.tls is None:
                chan = grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
            else:
                chan = grpc.secure_channel(endpoint, self.tls.channel_credentials(),
                                           options=CHANNEL_OPTIONS)  # fmt: skip
            stub = self.stubs[endpoint] = executor_pb2_grpc.ExecutorStub(chan)
        return stub

    def _call(self, endpoint: str, method: str, request):
        try:
            return getattr(self._stub(endpoint), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            why = f"{method} at {endpoint}: {e.code().name}: {e.details()}"
            raise TransferFailed(why) from None

    def handshake(self, endpoint: str, layout: str) -> executor_pb2.KVHandshakeResponse:
        request = executor_pb2.KVHandshakeRequest(kv_layout=layout)
        return self._call(endpoint, "KVHandshake", request)

    def renew(self, load: KVLoad) -> bool:
        request = executor_pb2.RenewKVLeaseRequest(transfer_id=load.transfer_id,
                                                   engine_id=load.engine_id)  # fmt: skip
        return self._call(load.endpoint, "RenewKVLease", request).held

    def release(self, load: KVLoad) -> bool:
        request = executor_pb2.ReleaseKVLeaseRequest(transfer_id=load.transfer_id,
                                                     engine_id=load.engine_id)  # fmt: skip
        return self._call(load.endpoint, "ReleaseKVLease", request).held


class HandshakeBoard(Protocol):
    """How ranks other than 0 learn rank 0's handshakes (the group's store)."""

    def post(self, key: str, reply: executor_pb2.KVHandshakeResponse | None, why: str) -> None:
        """Rank 0's answer from the prefill executor, or why there is none."""
        ...

    def read(self, key: str) -> executor_pb2.KVHandshakeResponse:
        """Raises TransferFailed with rank 0's reason."""
        ...


class StoreBoard:
    """A HandshakeBoard over torch.distributed's store (a get waits for the key)."""

    def __init__(self, store) -> None:
        self.store = store

    def post(self, key: str, reply: executor_pb2.KVHandshakeResponse | None, why: str) -> None:
        value = b"+" + reply.SerializeToString() if reply is not None else b"-" + why.encode()
        self.store.set(f"flagstop/kv-handshake/{key}", value)

    def read(self, key: str) -> executor_pb2.KVHandshakeResponse:
        value = self.store.get(f"flagstop/kv-handshake/{key}")
        if value[:1] != b"+":
            raise TransferFailed(value[1:].decode())
        return executor_pb2.KVHandshakeResponse.FromString(value[1:])


class DecodeSide(NoLeases):
    """A decode executor's KV worker (--kv-role decode), one per rank."""

    def __init__(
        self, rank: int, layout: str, transport: Transport,
        agree: Callable[[list[int]], list[int]], board: HandshakeBoard | None = None,
    ) -> None:  # fmt: skip
        """agree: the least of each value over the ranks (an all-reduce)."""
        self.rank, self.layout, self.transport = rank, layout, transport
        self.agree, self.board = agree, board
        self.leases: LeaseClient | None = None  # rank 0's, set by the service
        self.handshakes: dict[str, executor_pb2.KVHandshakeResponse] = {}  # by engine id
        self.attempts: dict[str, int] = {}
        self.puller = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
        self.control = ThreadPoolExecutor(1, thread_name_prefix="kv-lease")
        self.pulls: deque[tuple[KVLoad, Future]] = deque()  # started, not yet agreed
        self.releases: deque[tuple[str, Future]] = deque()  # rank 0: read, being confirmed

    # -- each step ---------------------------------------------------------------

    def start(self, meta: KVConnectorMetadata) -> None:
        for load in meta.loads:
            if load.block_ids:
                self.pulls.append((load, self.puller.submit(self._pull, load)))
            elif self.rank == 0:  # nothing to read: only the lease goes
                self.control.submit(self._release_quietly, load)

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        return None

    def finished(self) -> KVTransferResult:
        """Loads read on every rank whose lease held, and those that failed."""
        own = [self._state(job) for _, job in self.pulls]
        states = self.agree(own) if own else own
        failed = []
        for state, mine in zip(states, own, strict=True):
            if state == PENDING:
                break
            load, _ = self.pulls.popleft()
            if self.rank != 0:
                continue
            if state == READ:
                self.releases.append((load.req_id, self.control.submit(self._confirm, load)))
                continue
            if mine == READ:
                log.warning("request %s: another rank did not read its shard of the prompt's "
                            "KV (it says why): it recomputes here", load.req_id)  # fmt: skip
            failed.append(load.req_id)
            self.control.submit(self._release_quietly, load)
        received = []
        while self.releases and self.releases[0][1].done():
            req_id, release = self.releases.popleft()
            (received if release.result() else failed).append(req_id)
        return KVTransferResult(received, failed)

    @staticmethod
    def _state(job: Future) -> int:
        if not job.done():
            return PENDING
        return READ if job.result() else FAILED  # a pull that raises is a bug: it fails the step

    async def wait(self, timeout_s: float) -> None:
        oldest = self.pulls[0][1] if self.pulls else self.releases[0][1] if self.releases else None
        if oldest is None:
            await asyncio.sleep(timeout_s)
            return
        # asyncio.wait, not wait_for: a timeout must not cancel the read.
        await asyncio.wait([asyncio.wrap_future(oldest)], timeout=timeout_s)

    def reset(self) -> None:
        """Wait out the reads (they write blocks the next scheduler will hand out)."""
        for _, job in self.pulls:
            job.exception()
        for _, release in self.releases:
            release.exception()
        self.pulls.clear()
        self.releases.clear()

    # -- on the pull thread ------------------------------------------------------

    def _pull(self, load: KVLoad) -> bool:
        started = time.perf_counter()
        try:
            shake = self._handshake(load)
            if self.rank == 0 and not self.leases.renew(load):
                raise TransferFailed(f"its lease {load.transfer_id} had ended")
            self.transport.read(shake.ranks[self.rank], shake.num_blocks, load.source_ids,
                                load.block_ids)  # fmt: skip
        except TransferFailed as e:
            rank = f" (rank {self.rank})" if self.rank else ""
            log.warning("request %s: its prompt's KV not read from the prefill executor at %s"
                        "%s (%s): it recomputes here", load.req_id, load.endpoint, rank,
                        e)  # fmt: skip
            return False
        log.debug("request %s: %d blocks read in %.1f ms", load.req_id, len(load.block_ids),
                  (time.perf_counter() - started) * 1e3)  # fmt: skip
        return True

    def _handshake(self, load: KVLoad) -> executor_pb2.KVHandshakeResponse:
        """The prefill executor's answer, once per instance of it. Every rank asks at the
        same loads (the same plans), so the n-th attempt names the same one on each."""
        if (shake := self.handshakes.get(load.engine_id)) is not None:
            return shake
        attempt = self.attempts[load.engine_id] = self.attempts.get(load.engine_id, 0) + 1
        key = f"{load.engine_id}/{attempt}"
        if self.rank == 0:
            try:
                shake = self._ask(load)
            except TransferFailed as e:
                if self.board is not None:
                    self.board.post(key, None, str(e))
                raise
            if self.board is not None:
                self.board.post(key, shake, "")
        else:
            shake = self.board.read(key)
        self.handshakes[load.engine_id] = shake
        return shake

    def _ask(self, load: KVLoad) -> executor_pb2.KVHandshakeResponse:
        shake = self.leases.handshake(load.endpoint, self.layout)
        if shake.engine_id != load.engine_id:
            raise TransferFailed(f"another instance ({shake.engine_id}) serves there now")
        if len(shake.ranks) <= self.rank:
            raise TransferFailed(f"it has {len(shake.ranks)} ranks")
        log.info("prefill executor %s (%s): KV layout agreed, %d rank(s)", load.endpoint,
                 shake.engine_id, len(shake.ranks))  # fmt: skip
        return shake

    # -- rank 0's lease calls ------------------------------------------------------

    def _confirm(self, load: KVLoad) -> bool:
        """Release the lease after the read; the read is good only if it held."""
        try:
            held = self.leases.release(load)
        except TransferFailed as e:
            log.warning("request %s: the prefill side did not confirm its lease (%s): the "
                        "KV read is discarded, it recomputes here", load.req_id, e)  # fmt: skip
            return False
        if not held:
            log.warning("request %s: the prefill side's lease %s ended before the read did: "
                        "the KV read is discarded, it recomputes here", load.req_id,
                        load.transfer_id)  # fmt: skip
        return held

    def _release_quietly(self, load: KVLoad) -> None:
        """The blocks are not (or no longer) wanted: let the prefill side free them now
        rather than at its lease's end (it may be gone: then nothing is held)."""
        try:
            self.leases.release(load)
        except TransferFailed as e:
            log.debug("lease %s not released: %s", load.transfer_id, e)


class SimulatedTransport:
    """The simulator's reads (a LOAD-TEST TOOL): the time a block would take, nothing
    copied."""

    def __init__(self, seconds_per_block: float) -> None:
        self.seconds_per_block = seconds_per_block

    def read(self, remote, num_remote_blocks: int, source_ids: list[int],
             block_ids: list[int]) -> None:  # fmt: skip
        if any(not 0 <= b < num_remote_blocks for b in source_ids):
            raise TransferFailed(f"a block past the prefill side's {num_remote_blocks}")
        time.sleep(len(block_ids) * self.seconds_per_block)
