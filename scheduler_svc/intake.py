"""A request's way into the core: refused while nothing can serve it, held while the
executor compiles its grammar (vLLM's WAITING_FOR_FSM: the request waits, the batch
does not), its LoRA adapter resolved to the identity it runs under, then added."""

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from flagstop.scheduler_svc.convert import request_from_proto
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.v1 import scheduler_pb2

if TYPE_CHECKING:
    from flagstop.scheduler_svc.router_links import RouterConnection
    from flagstop.scheduler_svc.service import SchedulerService

log = logging.getLogger("flagstop.scheduler")


def request_error(request_id: str, code: grpc.StatusCode, message: str):
    return scheduler_pb2.RequestError(request_id=request_id, code=code.value[0], message=message)


class Intake:
    def __init__(self, service: "SchedulerService") -> None:
        self.service = service
        self.fallback = service.settings.fallback_objectives()
        # Constrained requests waiting for their grammar: by id, (owner, task).
        self.compiling: dict[str, tuple[str, asyncio.Task]] = {}

    @property
    def num_compiling(self) -> int:
        return len(self.compiling)

    def add(self, conn: "RouterConnection", add: scheduler_pb2.AddRequest):
        """A router's request: None once it is in (or on its way), else its error."""
        service = self.service
        # While a lost executor may still come back, new requests wait with the rest.
        if not service.accepting or service.scheduler is None or service.link.reconnect.gave_up:
            return request_error(add.request_id, grpc.StatusCode.UNAVAILABLE,
                                 "the scheduler is not serving (starting, stopping, or no "
                                 "executor)")  # fmt: skip
        if add.sampling.HasField("structured_outputs"):
            task = asyncio.create_task(self._compile_then_admit(conn, add))
            self.compiling[add.request_id] = (conn.router_id, task)
            return None
        return self._admit(conn, add)

    def _admit(self, conn: "RouterConnection", add: scheduler_pb2.AddRequest):
        service, lora_id = self.service, ""
        if add.lora_name:
            if refusal := service.adapters.refusal(add.lora_name, add.lora_id):
                return request_error(add.request_id, *refusal)
            lora_id = service.link.adapters[add.lora_name].id
        try:
            request = request_from_proto(add, conn.router_id, service.eos_token_ids, lora_id,
                                         self.fallback)  # fmt: skip
            service.scheduler.add_request(request)
        except RequestRejected as e:
            return request_error(add.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        service.telemetry.on_add(add.request_id, len(add.prompt_token_ids), add.traceparent)
        return None

    async def _compile_then_admit(self, conn: "RouterConnection", add: scheduler_pb2.AddRequest):
        """A grammar the executor refuses ends the request with INVALID_ARGUMENT; an
        executor that does not answer (lost, restarting) leaves the compile to the
        request's first step."""
        error, service = None, self.service
        try:
            await service.link.prepare_grammar(add)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                error = request_error(add.request_id, e.code(), e.details())
            else:
                log.warning("grammar of %s not compiled ahead: %s", add.request_id, e.code())
        finally:
            self.compiling.pop(add.request_id, None)
        if service.links.routers.get(conn.router_id) is not conn:
            return  # its router left meanwhile
        error = error or self._admit(conn, add)
        if error is not None:
            service.links.send_errors(conn.router_id, [error])
        service.link.wakeup.set()

    def cancel(self, request_ids) -> None:
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    def cancel_owned_by(self, router_id: str) -> None:
        self.cancel([r for r, (owner, _) in self.compiling.items() if owner == router_id])
