"""LoRA adapters in the scheduler's shell: their loads, replacements and unloads, one
at a time, and which requests may run under them.

A request runs under the adapter its name had when it began (its identity,
AddRequest.lora_id): one whose adapter is unloaded, replaced, or found changed on an
executor that came back, ends, for its tokens would go on from other weights. The
executor's side changes only after the steps in flight (executor_link.py)."""

import asyncio
from collections.abc import Callable

import grpc

from flagstop.adapters import already_loaded
from flagstop.scheduler_svc.core_handle import CoreHandle
from flagstop.scheduler_svc.executor_link import ExecutorLink
from flagstop.v1 import generation_pb2

# The one way requests fail here (router_links.py's fail): ids by owner, code, message.
FailRequests = Callable[[dict[str, list[str]], grpc.StatusCode, str], None]


class Adapters:
    def __init__(self, core: CoreHandle, link: ExecutorLink, fail: FailRequests) -> None:
        self.core, self.link, self.fail = core, link, fail
        self.changes = asyncio.Lock()
        self.replacing: set[str] = set()  # whose requests are refused meanwhile

    async def load(self, request, context) -> generation_pb2.LoadLoRAAdapterResponse:
        """ALREADY_EXISTS for a name loaded here, unless load_inplace: then its
        requests end (UNAVAILABLE, retry) and new ones are refused until the executor
        holds the new files, which bring a new identity."""
        name = request.lora_name
        async with self.changes:
            replacing = name in self.link.adapters
            if replacing and not request.load_inplace:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, already_loaded(name))
            if replacing:
                self.replacing.add(name)
                self.changed()
            try:
                return await self.link.load_lora(request)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())
            finally:
                self.replacing.discard(name)

    async def unload(self, request, context) -> generation_pb2.UnloadLoRAAdapterResponse:
        """Its requests end first (NOT_FOUND: the adapter is gone), then the executor
        drops it."""
        name = request.lora_name
        async with self.changes:
            if name not in self.link.adapters:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {name!r} is "
                                    "loaded (/v1/models lists them)")  # fmt: skip
            self.link.set_adapter(name, None)  # gone here at once, even if the executor is away
            self.changed()
            try:
                return await self.link.unload_lora(request)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())

    def refusal(self, name: str, lora_id: str) -> tuple[grpc.StatusCode, str] | None:
        """Why a request of adapter `name` (admitted under lora_id; "": any) cannot run
        here now, or None."""
        adapter = self.link.adapters.get(name)
        if adapter is None:
            return grpc.StatusCode.NOT_FOUND, (
                f"LoRA adapter {name!r} is not loaded (unloaded, or never loaded on this "
                "replica): /v1/models lists the adapters"
            )
        if name in self.replacing:
            return grpc.StatusCode.UNAVAILABLE, (
                f"LoRA adapter {name!r} is being replaced (load_inplace): retry the request"
            )
        if lora_id and lora_id != adapter.id:
            return grpc.StatusCode.ABORTED, (
                f"LoRA adapter {name!r} was loaded again from other files since this "
                "request began, and its tokens would go on under other weights: retry it"
            )
        return None

    def changed(self) -> None:
        """End every request whose adapter is no longer the one it began under."""
        scheduler = self.core.scheduler
        if scheduler is None:
            return
        ended: dict[tuple[grpc.StatusCode, str], dict[str, list[str]]] = {}
        for request in scheduler.lora_requests():
            if refusal := self.refusal(request.lora_name, request.lora_id):
                by_owner = ended.setdefault(refusal, {})
                by_owner.setdefault(request.owner, []).append(request.request_id)
        for (code, message), ids_by_owner in ended.items():
            self.fail(ids_by_owner, code, message)
