"""The tensor-parallel executor group: forming it over torch.distributed and driving
its ranks.

Rank 0 is the executor process (the gRPC server). On one machine it starts ranks
1..N-1 itself; across machines `torchrun` starts them (its RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT contract) and every process runs the same
`flagstop-executor`, rank 0 serving and the others following. Rendezvous is a
TCPStore (port 0 when rank 0 hosts it: nothing fixed, groups run side by side); the
activations go over NCCL on CUDA and gloo on the CPU, control messages over a gloo
CPU group.

Each step reaches every rank once: rank 0 broadcasts the scheduler's serialized
StepRequest (protobuf bytes, never a pickle) with the tokens it sampled in the step
before, which the other ranks append to their own persistent batches. Every
collective has a deadline (--tp-timeout), and rank 0 pings the others while idle, so
a rank that dies or hangs takes the whole group down within seconds instead of
leaving a rank waiting forever; the scheduler then treats the executor as lost and
recomputes on the group that a supervisor restarts."""

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.parallel import Shard, TensorParallel
from flagstop.executor.tp_messages import PING, RESET, STEP, STOP
from flagstop.server import StartupError, die_with_parent

log = logging.getLogger("flagstop.executor.tp")
WORKER_CONFIG = "FLAGSTOP_TP_WORKER_CONFIG"  # a spawned rank's settings, as JSON
ERROR_KEY = "flagstop/error/{rank}"
LOADED_KEY = "flagstop/loaded/{rank}"
LEFT_KEY = "flagstop/left/{rank}"


@dataclass(slots=True)
class Membership:
    """Where this process stands in the group."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0: rank 0 picks a free one

    @classmethod
    def from_environment(cls, config: ExecutorConfig) -> "Membership | None":
        """torchrun's contract, when it started this process; None otherwise."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        if world != config.tensor_parallel_size:
            raise StartupError(f"WORLD_SIZE={world} but --tensor-parallel-size is "
                               f"{config.tensor_parallel_size}: set them equal")  # fmt: skip
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                   os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(os.environ.get("MASTER_PORT", "29500")))  # fmt: skip


def device_for(config: ExecutorConfig, local_rank: int) -> str:
    """A rank's device: its own GPU by local rank."""
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{local_rank}"
    return config.device if config.device != "auto" else "cpu"


@dataclass(slots=True)
class Group:
    """A formed group, as rank `tp.rank` sees it."""

    tp: TensorParallel
    store: dist.Store
    timeout_s: float
    children: list[subprocess.Popen] = field(default_factory=list)
    device: str = "cpu"
    # Rank 0: for the next message, what it sampled ([n, n counts, tokens]: with
    # drafts, a count of tokens per sampling request; n = 0 without).
    sampled: list[int] = field(default_factory=list)
    last_sent: float = field(default_factory=time.monotonic)

    # -- rank 0 ----------------------------------------------------------------

    def send(self, kind: int, payload: bytes = b"") -> None:
        """A message to the other ranks; a step carries the tokens sampled in the one
        before (kept through pings, dropped by a reset)."""
        tokens = b""
        if kind == STEP:
            tokens = np.asarray(self.sampled, np.int32).tobytes()
        if kind in (STEP, RESET):
            self.sampled = []
        header = torch.tensor([kind, len(tokens), len(payload)], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.tp.cpu_group)
        if tokens or payload:
            body = torch.frombuffer(bytearray(tokens + payload), dtype=torch.uint8)
            dist.broadcast(body, 0, group=self.tp.cpu_group)
        self.last_sent = time.monotonic()

    def send_drafts(self, drafts) -> None:
        """A step's drafts, decided here, to the other ranks (within the step)."""
        body = np.concatenate(([len(drafts.num_drafts)], drafts.num_drafts, drafts.token_ids))
        payload = torch.from_numpy(body.astype(np.int64))
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self.tp.cpu_group)
        dist.broadcast(payload, 0, group=self.tp.cpu_group)

    def receive_drafts(self):
        from flagstop.executor.step_inputs import Drafts

        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.tp.cpu_group)
        body = torch.empty(int(size.item()), dtype=torch.int64)
        dist.broadcast(body, 0, group=self.tp.cpu_group)
        values = body.numpy()
        n = int(values[0])
        return Drafts(values[1 : 1 + n].copy(), values[1 + n :].copy())

    def set_sampled(self, token_ids: list[int], num_sampled: list[int] = ()) -> None:
        """What rank 0 sampled in a step (with drafts, num_sampled per request), for
        the next message."""
        self.sampled = [len(num_sampled), *num_sampled, *token_ids]

    def ping_if_idle(self) -> None:
        if time.monotonic() - self.last_sent > self.timeout_s / 4:
            self.send(PING)

    # -- the other ranks -------------------------------------------------------

    def receive(self) -> tuple[int, list[int], list[int], bytes]:
        """(kind, tokens sampled in the step before, their counts per request (empty
        without drafts), payload)."""
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.tp.cpu_group)
        kind, num_token_bytes, num_bytes = header.tolist()
        if not num_token_bytes + num_bytes:
            return kind, [], [], b""
        body = torch.empty(num_token_bytes + num_bytes, dtype=torch.uint8)
        dist.broadcast(body, 0, group=self.tp.cpu_group)
        raw = body.numpy().tobytes()
        sampled = np.frombuffer(raw[:num_token_bytes], np.int32).tolist()
        tokens, counts = sampled, []
        if sampled:
            n = sampled[0]
            counts, tokens = sampled[1 : 1 + n], sampled[1 + n :]
        return kind, tokens, counts, raw[num_token_bytes:]

    # -- both ------------------------------------------------------------------

    def stop_children(self, grace_s: float = 0.0) -> None:
        """Wait up to grace_s for the ranks we started to exit (after STOP), then kill."""
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def wait_left(self, grace_s: float) -> None:
        """Up to grace_s for every other rank to have left the group (leave()): rank 0
        hosts the store and is the other end of every connection, so it stays until
        they have torn theirs down. Ranks it started are waited for as processes too;
        torchrun's others only this way."""
        keys = [LEFT_KEY.format(rank=rank) for rank in range(1, self.tp.size)]
        deadline = time.monotonic() + grace_s
        while keys and not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)

    def worker_error(self) -> str:
        """The first error another rank reported, or why a rank we started is gone."""
        for rank in range(1, self.tp.size):
            key = ERROR_KEY.format(rank=rank)
            if self.store.check([key]):
                return f"rank {rank}: {self.store.get(key).decode()}"
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                return f"rank {rank} exited with {child.returncode}"
        return ""


class GroupDriver:
    """Rank 0's hold on the group, for the executor service: each reset and step goes
    to the other ranks before rank 0 runs it, the ranks are pinged while idle, and a
    rank that is lost takes the whole group down for a restart."""

    def __init__(self, group: Group) -> None:
        self.group: Group | None = group

    def reset(self) -> None:
        self._send(RESET)

    def step(self, step_bytes: bytes) -> None:
        """The scheduler's serialized StepRequest, as it came (never a pickle)."""
        self._send(STEP, step_bytes)

    def broadcast(self, kind: int, payload: bytes) -> None:
        """Another message to the ranks (a LoRA adapter's load or unload), between
        steps: on the event loop's thread, as every step is."""
        self._send(kind, payload)

    def sampled(self, token_ids: list[int], num_sampled: list[int]) -> None:
        """What rank 0 sampled (with drafts, num_sampled per request): sent with the
        next step."""
        if self.group is not None:
            self.group.set_sampled(token_ids, num_sampled)

    def send(self, drafts) -> None:
        """The runner's draft channel: this step's drafts to the other ranks."""
        if self.group is not None:
            try:
                self.group.send_drafts(drafts)
            except Exception as e:
                self.lost(e)

    def _send(self, kind: int, payload: bytes = b"") -> None:
        if self.group is not None:
            try:
                self.group.send(kind, payload)
            except Exception as e:
                self.lost(e)

    def lost(self, error: Exception) -> None:
        """A rank died or hung, or a step failed with the ranks out of step: the group
        cannot go on. Down it goes, at once and loudly; the scheduler sees a lost
        executor and recomputes when a supervisor has restarted it."""
        log.critical("tensor-parallel group lost (%s): exiting for a restart", error)
        if self.group is not None:
            self.group.stop_children()
        os._exit(1)

    async def keep_alive(self) -> None:
        """Ping the other ranks while idle: a dead one is found before the next step,
        and a waiting one is not mistaken for a hung rank 0."""
        while self.group is not None:
            await asyncio.sleep(self.group.timeout_s / 8)
            if self.group is None:
                return  # stopped meanwhile
            try:
                self.group.ping_if_idle()
            except Exception as e:
                self.lost(e)

    def stop(self) -> None:
        """On shutdown: the other ranks exit with this one, and nothing pings them."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.send(STOP)
                group.wait_left(grace_s=5.0)
            except Exception as e:
                log.warning("the tensor-parallel ranks did not take the stop: %s", e)
            group.stop_children(grace_s=5.0)


def start_group(config: ExecutorConfig, membership: Membership | None) -> Group:
    """This process's place in the group, before any collective: the rendezvous store,
    and, for rank 0 without torchrun, the other ranks started on this machine."""
    if membership is None:  # rank 0, the group on this machine
        membership = Membership(0, config.tensor_parallel_size, 0, "127.0.0.1", 0)
    store = _store(membership, timedelta(seconds=config.tp_timeout))
    children = []
    if membership.rank == 0 and not _started_by_torchrun():
        children = _spawn(config, membership.world_size, store.port)
    tp = TensorParallel(Shard(membership.rank, membership.world_size, config.expert_parallel),
                        store=store)  # fmt: skip
    return Group(
        tp, store, config.tp_timeout, children, device=device_for(config, membership.local_rank)
    )


def join(group: Group) -> None:
    """Once this rank's shard is loaded: wait for every rank's (failing at once, with
    its message, when one could not load), then form the process groups."""
    tp, store = group.tp, group.store
    store.set(LOADED_KEY.format(rank=tp.rank), "1")
    deadline = time.monotonic() + group.timeout_s * 4  # loading a big shard takes a while
    for other in range(tp.size):
        while not store.check([LOADED_KEY.format(rank=other)]):
            if error := group.worker_error():
                group.stop_children()
                raise StartupError(f"tensor-parallel {error}")
            if time.monotonic() > deadline:
                group.stop_children()
                raise StartupError(f"tensor-parallel rank {other} did not load its shard in time")
            time.sleep(0.05)
    timeout = timedelta(seconds=group.timeout_s)
    backend = "nccl" if group.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("flagstop/pg", store),
                            rank=tp.rank, world_size=tp.size, timeout=timeout)  # fmt: skip
    tp.device_group = dist.group.WORLD
    tp.cpu_group = dist.new_group(backend="gloo", timeout=timeout)


def leave(group: Group) -> None:
    """A rank other than 0, told to stop: its process groups torn down while rank 0
    is still up, then rank 0 told so. (Exiting with them up while rank 0 exited too
    aborted this rank once in a loaded run: SIGABRT in torch's teardown, the peers'
    connections and the store closing under it.)"""
    dist.destroy_process_group()
    group.store.set(LEFT_KEY.format(rank=group.tp.rank), "1")


def report_error(group: Group, error: Exception) -> None:
    """A rank other than 0 tells rank 0 why it stops."""
    group.store.set(ERROR_KEY.format(rank=group.tp.rank), f"{type(error).__name__}: {error}")


def _store(m: Membership, timeout: timedelta) -> dist.TCPStore:
    agent = _started_by_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = m.rank == 0 and not agent
    try:
        return dist.TCPStore(m.master_addr, m.master_port, m.world_size, is_master=is_master,
                             timeout=timeout, wait_for_workers=False)  # fmt: skip
    except Exception as e:
        where = f"{m.master_addr}:{m.master_port}"
        verb = "listen on" if is_master else "reach rank 0 at"
        raise StartupError(f"cannot {verb} {where} (MASTER_ADDR/MASTER_PORT): {e}") from None


def _started_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _spawn(config: ExecutorConfig, world_size: int, port: int) -> list[subprocess.Popen]:
    settings = config.model_dump_json(include=set(ExecutorConfig.model_fields))
    env = {**os.environ, WORKER_CONFIG: settings, "WORLD_SIZE": str(world_size),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    return [
        subprocess.Popen(
            [sys.executable, "-m", "flagstop.executor.tp_worker"],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            preexec_fn=die_with_parent,  # a started rank dies with rank 0
        )
        for rank in range(1, world_size)
    ]


def spawned_config() -> ExecutorConfig:
    return ExecutorConfig.model_validate(json.loads(os.environ[WORKER_CONFIG]))
