"""A request's way into the core: refused while nothing can serve it, held while the
executor takes its images' pixels and compiles its grammar (vLLM's WAITING_FOR_FSM:
the request waits, the batch does not), its LoRA adapter resolved to the identity it
runs under, then added."""

import asyncio
import logging

import grpc

from flagstop.scheduler_svc.adapter_loads import Adapters
from flagstop.scheduler_svc.convert import request_from_proto
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.objectives import Objectives
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core_handle import CoreHandle
from flagstop.scheduler_svc.executor_link import ExecutorLink
from flagstop.scheduler_svc.router_connection import RouterConnection
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.v1 import scheduler_pb2

log = logging.getLogger("flagstop.scheduler")
# What the executor answers for a request it will not run as asked.
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
MEDIA_RETRY_S = 0.2


def request_error(request_id: str, code: grpc.StatusCode, message: str):
    return scheduler_pb2.RequestError(request_id=request_id, code=code.value[0], message=message)


class Intake:
    def __init__(
        self, core: CoreHandle, adapters: Adapters, link: ExecutorLink,
        telemetry: SchedulerTelemetry, fallback: Objectives,
    ) -> None:  # fmt: skip
        """fallback: the targets of a request that states none."""
        self.core, self.adapters, self.link, self.telemetry = core, adapters, link, telemetry
        self.fallback = fallback
        # Constrained requests waiting for their grammar: by id, (owner, task).
        self.compiling: dict[str, tuple[str, asyncio.Task]] = {}

    @property
    def num_compiling(self) -> int:
        return len(self.compiling)

    def add(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        """A router's request: None once it is in (or on its way), else its error."""
        # While a lost executor may still come back, new requests wait with the rest.
        core = self.core
        if not core.accepting or core.scheduler is None or self.link.reconnect.gave_up:
            return request_error(add.request_id, grpc.StatusCode.UNAVAILABLE,
                                 "the scheduler is not serving (starting, stopping, or no "
                                 "executor)")  # fmt: skip
        if add.sampling.HasField("structured_outputs") or add.media_data:
            task = asyncio.create_task(self._prepare_then_admit(conn, add))
            self.compiling[add.request_id] = (conn.router_id, task)
            return None
        return self._admit(conn, add, core.scheduler)

    def _admit(self, conn: RouterConnection, add: scheduler_pb2.AddRequest, scheduler: Scheduler):
        lora_id = ""
        if add.lora_name:
            if refusal := self.adapters.refusal(add.lora_name, add.lora_id):
                return request_error(add.request_id, *refusal)
            lora_id = self.link.adapters[add.lora_name].id
        try:
            request = request_from_proto(add, conn.router_id, self.core.eos_token_ids, lora_id,
                                         self.fallback)  # fmt: skip
            scheduler.add_request(request)
        except RequestRejected as e:
            return request_error(add.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.telemetry.on_add(add.request_id, len(add.prompt_token_ids), add.traceparent)
        return None

    async def _prepare_then_admit(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        """Pixels or a grammar the executor refuses end the request with
        INVALID_ARGUMENT. Pixels an executor did not answer for (lost, restarting) are
        sent again until one takes them (the request is admitted only then: a new
        executor gets the pixels of the requests already admitted,
        ExecutorLink._restore_media), within --executor-timeout; a grammar's compile
        is left to the request's first step."""
        error = None
        try:
            if add.media_data:
                await self._send_media(add)
            if add.sampling.HasField("structured_outputs"):
                await self._compile(add)
        except grpc.aio.AioRpcError as e:
            error = request_error(add.request_id, e.code(), e.details())
        finally:
            self.compiling.pop(add.request_id, None)
        if conn.closed or self.core.scheduler is None:
            return  # its router left meanwhile
        error = error or self._admit(conn, add, self.core.scheduler)
        if error is not None:
            conn.send_errors([error])
        self.link.wakeup.set()

    async def _send_media(self, add: scheduler_pb2.AddRequest) -> None:
        """Raises AioRpcError: a refusal, or no executor within --executor-timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.link.settings.executor_timeout
        while True:
            try:
                return await self.link.prepare_media(add.media_data)
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSALS or loop.time() > deadline:
                    raise
                log.warning("images of %s not taken (%s): sent again", add.request_id,
                            e.code())  # fmt: skip
                await asyncio.sleep(MEDIA_RETRY_S)

    async def _compile(self, add: scheduler_pb2.AddRequest) -> None:
        """Raises AioRpcError for a refusal; the executor's absence is logged."""
        try:
            await self.link.prepare_grammar(add)
        except grpc.aio.AioRpcError as e:
            if e.code() in REFUSALS:
                raise
            log.warning("grammar of %s not compiled ahead: %s", add.request_id, e.code())

    def cancel(self, request_ids) -> None:
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    def cancel_owned_by(self, router_id: str) -> None:
        self.cancel([r for r, (owner, _) in self.compiling.items() if owner == router_id])
