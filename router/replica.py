"""One replica behind this router: a scheduler (and its executor) at one address. The
router keeps one stream to each; a replica has its own admission queue, credits,
aborts and reported load, and comes back on its own after it is lost."""

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from flagstop.reconnect import Reconnect
from flagstop.router.admission import AdmissionQueue
from flagstop.server import channel
from flagstop.v1 import scheduler_pb2, scheduler_pb2_grpc

if TYPE_CHECKING:
    from flagstop.router.engine import RouterEngine

log = logging.getLogger("flagstop.router")


class ReplicaMismatch(Exception):
    """The replica serves another model than the router's other replicas."""


class Replica:
    def __init__(self, address: str, engine: "RouterEngine") -> None:
        self.address, self.engine = address, engine
        self.admission = AdmissionQueue()
        self.aborts: list[str] = []
        self.credits = 0
        self.flush = asyncio.Event()
        self.connected = False
        self.described = False  # it described itself once: worth waiting for
        self.removed = False  # gone from the scheduler list: its requests move now
        self.reconnect = Reconnect(give_up_after_s=engine.settings.scheduler_timeout)
        self.reported = scheduler_pb2.ReplicaLoad()
        self.routed_since_report = 0
        self.last_failure = ""  # why the last attempt failed, since the last success
        self.channel = channel(address, engine.tls)
        self.task: asyncio.Task | None = None

    @property
    def load(self) -> int:
        """Requests running and waiting there (as of its last step), and those routed
        to it since: a burst of arrivals between two steps must not all pick the
        replica that looked idle."""
        reported = self.reported
        return reported.num_running + reported.num_waiting + self.routed_since_report

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        self.removed = True
        if self.task is not None:
            self.task.cancel()
        await self.channel.close()

    async def run(self) -> None:
        stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        try:
            while True:
                try:
                    await self._connect(stub)
                except grpc.aio.AioRpcError as e:
                    self._failed(logging.WARNING, e.code())
                except ReplicaMismatch as e:
                    self._failed(logging.ERROR, e)
                self.engine.lost(self)
                await self.reconnect.wait()
        finally:
            self.engine.lost(self)

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
        self.engine.described(self, info)
        self.described = True
        call = stub.Connect()
        await call.write(scheduler_pb2.RouterMessage(router_id=self.engine.settings.router_id))
        self.connected, self.credits, self.last_failure = True, 0, ""
        self.reconnect.connected()
        self.flush.set()  # tell the scheduler what is queued (resubmissions included)
        self.engine.connected(self)
        log.info("connected to scheduler %s (%s)", self.address, info.model_name)
        writer = asyncio.create_task(self._write(call))
        try:
            await self._read(call)
        finally:
            writer.cancel()
            call.cancel()

    async def _write(self, call) -> None:
        """One message per wake-up: every abort and every release the credits allow."""
        last_queued, requests = -1, self.engine.requests
        while True:
            await self.flush.wait()
            self.flush.clear()
            msg = scheduler_pb2.RouterMessage(aborts=self.aborts)
            self.aborts = []
            while self.credits and self.admission:
                add = self.admission.pop()
                msg.adds.append(add)
                requests[add.request_id].sent = True
                self.credits -= 1
            msg.num_queued = len(self.admission)
            if msg.adds or msg.aborts or msg.num_queued != last_queued:
                last_queued = msg.num_queued
                await call.write(msg)

    async def _read(self, call) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            self.engine.fan_out(msg)
            if msg.HasField("load"):
                self.reported, self.routed_since_report = msg.load, 0
            if msg.credits:
                self.credits += msg.credits
                self.flush.set()
