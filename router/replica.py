"""One replica behind this router: a scheduler (and its executor) at one address. The
router keeps one stream to each; a replica has its own admission queue, credits,
aborts and reported load, changes them itself as its stream comes and goes, and
comes back on its own after it is lost."""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from flagstop.reconnect import Reconnect
from flagstop.router.admission import AdmissionQueue
from flagstop.router.settings import RouterSettings
from flagstop.server import TLSConfig, channel
from flagstop.v1 import generation_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("flagstop.router")


# Images' pixels in one message to the scheduler at most (a request's own may be more,
# alone): several requests' images never add up past gRPC's message limit.
MEDIA_BYTES_PER_MESSAGE = 16 << 20


class Fleet(Protocol):
    """What a replica tells the router's set of replicas (replicas.py's ReplicaSet)."""

    fan_out: Callable[[scheduler_pb2.SchedulerMessage], None]  # each step's message

    def described(self, info: generation_pb2.ModelInfo) -> None: ...
    def connected(self) -> None: ...
    def sent(self, adds) -> None: ...
    def lost(self, replica: "Replica") -> None: ...


class ReplicaMismatch(Exception):
    """The replica serves another model than the router's other replicas."""


class Replica:
    def __init__(
        self, address: str, settings: RouterSettings, tls: TLSConfig, fleet: Fleet
    ) -> None:
        self.address, self.settings, self.fleet = address, settings, fleet
        self.admission = AdmissionQueue()
        self.aborts: list[str] = []
        self.credits = 0
        self.flush = asyncio.Event()
        self.connected = False
        self.described = False  # it described itself once: worth waiting for
        self.removed = False  # gone from the scheduler list: its requests move now
        self.reconnect = Reconnect(give_up_after_s=settings.scheduler_timeout)
        self.reported = scheduler_pb2.ReplicaLoad()
        self.routed_since_report = 0
        self.last_failure = ""  # why the last attempt failed, since the last success
        self.channel = channel(address, tls)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.task: asyncio.Task | None = None
        # Its LoRA adapters by name (directory and identity), from its description;
        # described again when its load reports another adapters version.
        self.adapters: dict[str, generation_pb2.LoRAAdapter] = {}
        self.max_loras = 0
        self.block_size = self.num_blocks = 0
        self.lora_version = -1
        self.kv_role = 0  # ModelInfo.kv_role: prefill, decode or both (0)
        self.describing: asyncio.Task | None = None  # held: the loop keeps tasks weakly
        # Since when (monotonic) its scheduler has said it has no executor; None: it has.
        self.executor_lost_since: float | None = None
        # Requests moved off it while its executor was away, and when: its late words
        # of them (a step run as the executor came back) are not theirs any more.
        self.evacuated: dict[str, float] = {}

    @property
    def load(self) -> int:
        """Requests running and waiting there (as of its last step), and those routed
        to it since: a burst of arrivals between two steps must not all pick the
        replica that looked idle."""
        reported = self.reported
        return reported.num_running + reported.num_waiting + self.routed_since_report

    @property
    def serving(self) -> bool:
        """Connected, with an executor: new requests may go here."""
        return self.connected and self.executor_lost_since is None

    @property
    def executor_lost_for_s(self) -> float:
        since = self.executor_lost_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def may_come_back(self) -> bool:
        """Lost, but worth queueing for (as for a restarting scheduler)."""
        return self.described and not self.removed and not self.reconnect.gave_up

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        self.removed = True
        if self.task is not None:
            self.task.cancel()
        await self.channel.close()

    def abort(self, request_id: str) -> None:
        """A request its scheduler holds ended at the client: tell the scheduler. A
        replica that is down has forgotten it already."""
        if self.connected:
            self.aborts.append(request_id)
            self.flush.set()

    async def run(self) -> None:
        stub = self.stub
        try:
            while True:
                try:
                    await self._connect(stub)
                except grpc.aio.AioRpcError as e:
                    self._failed(logging.WARNING, e.code())
                except ReplicaMismatch as e:
                    self._failed(logging.ERROR, e)
                self._lost()
                await self.reconnect.wait()
        finally:
            self._lost()

    def _lost(self) -> None:
        """The stream is gone, and with it all the scheduler held: what it knew of
        aborts and load is void; the set moves its requests on."""
        if not self.connected:
            return
        log.error("lost the scheduler at %s", self.address)
        self.connected = False
        self.reconnect.lost()
        self.aborts = []  # the scheduler that comes back never knew them
        self.reported = scheduler_pb2.ReplicaLoad()
        self.executor_lost_since, self.evacuated = None, {}
        self.fleet.lost(self)

    def _failed(self, level: int, why) -> None:
        """Said once while it stays the same; the retries that fail alike (every 2 s at
        most, for as long as the replica is away) at debug."""
        why = str(why)
        if why == self.last_failure:
            level = logging.DEBUG
        self.last_failure = why
        log.log(level, "scheduler %s: %s", self.address, why)

    async def _connect(self, stub) -> None:
        info = await stub.Describe(scheduler_pb2.DescribeSchedulerRequest(), timeout=5)
        self.fleet.described(info.model)
        self.take_model(info.model)
        self.kv_role = info.model.kv_role
        self.described = True
        call = stub.Connect()
        await call.write(scheduler_pb2.RouterMessage(router_id=self.settings.router_id))
        self.connected, self.credits, self.last_failure = True, 0, ""
        self.reconnect.connected()
        self.flush.set()  # tell the scheduler what is queued (resubmissions included)
        self.fleet.connected()
        log.info("connected to scheduler %s (%s)", self.address, info.model.model_name)
        writer = asyncio.create_task(self._write(call))
        try:
            await self._read(call)
        finally:
            writer.cancel()
            call.cancel()

    def take_model(self, model) -> None:
        """What its description says of it: its adapters, and its pool's shape (the
        fleet's gateway reads vllm:cache_config_info)."""
        self.adapters = {a.name: a for a in model.lora_adapters}
        self.max_loras = model.max_loras
        self.block_size, self.num_blocks = model.block_size, model.num_blocks

    def holds(self, lora_name: str, lora_id: str) -> bool:
        """Whether it can run a request of this adapter (identity "": any of the name)."""
        if not lora_name:
            return True
        adapter = self.adapters.get(lora_name)
        return adapter is not None and lora_id in ("", adapter.id)

    async def describe_adapters(self) -> None:
        """Its adapters changed (loaded or unloaded there, or by another router)."""
        try:
            info = await self.stub.Describe(scheduler_pb2.DescribeSchedulerRequest(), timeout=5)
            self.take_model(info.model)
        except grpc.aio.AioRpcError as e:
            log.warning("scheduler %s: its adapters not described again: %s", self.address,
                        e.code())  # fmt: skip

    def evacuate(self, request_id: str) -> None:
        """It moves elsewhere: aborted here, and what this scheduler still says of it
        is dropped."""
        self.abort(request_id)
        self.evacuated[request_id] = time.monotonic()

    def forget_evacuated(self, after_s: float = 30.0) -> None:
        """Long enough for the scheduler to have heard the abort."""
        if self.evacuated:
            old = time.monotonic() - after_s
            self.evacuated = {r: t for r, t in self.evacuated.items() if t > old}

    def _executor_changed(self, lost: bool) -> None:
        """No new request goes here while its executor is away; what it holds moves
        once that lasts past --replica-grace-s (the set's rebalance)."""
        if lost:
            log.error("scheduler %s has no executor: requests go elsewhere", self.address)
            self.executor_lost_since = time.monotonic()
        else:
            log.info("scheduler %s has an executor again", self.address)
            self.executor_lost_since = None
        self.fleet.connected()  # readiness

    async def _write(self, call) -> None:
        """One message per wake-up: every abort and every release the credits allow."""
        last_queued = -1
        while True:
            await self.flush.wait()
            self.flush.clear()
            msg = scheduler_pb2.RouterMessage(aborts=self.aborts)
            self.aborts = []
            num_pixel_bytes = 0
            while self.credits and self.admission:
                add = self.admission.pop()
                num_pixel_bytes += sum(len(m.pixel_values) for m in add.media_data)
                if msg.adds and num_pixel_bytes > MEDIA_BYTES_PER_MESSAGE:
                    self.admission.push_front([add])  # its images ride the next message
                    self.flush.set()
                    break
                msg.adds.append(add)
                self.credits -= 1
            msg.num_queued = len(self.admission)
            if msg.adds:
                self.fleet.sent(msg.adds)
            if msg.adds or msg.aborts or msg.num_queued != last_queued:
                last_queued = msg.num_queued
                await call.write(msg)

    async def _read(self, call) -> None:
        fan_out = self.fleet.fan_out
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            fan_out(without(msg, self.evacuated) if self.evacuated else msg)
            if msg.HasField("load"):
                self.reported, self.routed_since_report = msg.load, 0
                if msg.load.executor_lost != (self.executor_lost_since is not None):
                    self._executor_changed(msg.load.executor_lost)
                if msg.load.lora_adapters_version != self.lora_version:
                    self.lora_version = msg.load.lora_adapters_version
                    self.describing = asyncio.create_task(self.describe_adapters())
            if msg.credits:
                self.credits += msg.credits
                self.flush.set()


def without(msg: scheduler_pb2.SchedulerMessage, request_ids) -> scheduler_pb2.SchedulerMessage:
    """The message less what it says of these requests (they moved elsewhere)."""
    out = scheduler_pb2.SchedulerMessage(step_id=msg.step_id, credits=msg.credits)
    if msg.HasField("load"):
        out.load.CopyFrom(msg.load)
    logprobs = msg.logprobs or [None] * len(msg.request_ids)
    for request_id, token_id, logprob in zip(msg.request_ids, msg.token_ids, logprobs, strict=True):
        if request_id not in request_ids:
            out.request_ids.append(request_id)
            out.token_ids.append(token_id)
            if logprob is not None:
                out.logprobs.append(logprob)
    ends = zip(msg.finished_ids, msg.finish_reasons, strict=True)
    for i, (request_id, reason) in enumerate(ends):
        if request_id not in request_ids:
            out.finished_ids.append(request_id)
            out.finish_reasons.append(reason)
            if i < len(msg.num_cached_tokens):
                out.num_cached_tokens.append(msg.num_cached_tokens[i])
            if request_id in msg.kv_transfers:
                out.kv_transfers[request_id].CopyFrom(msg.kv_transfers[request_id])
    out.errors.extend(e for e in msg.errors if e.request_id not in request_ids)
    out.prompt_logprobs.extend(c for c in msg.prompt_logprobs if c.req_id not in request_ids)
    return out
