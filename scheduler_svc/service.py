"""The scheduler's gRPC shell: the router streams (requests and aborts in, each step's
tokens, credits and load out), the requests' way into the core (grammars compiled
first), and what a client asks of the scheduler (Describe, GetStats). The executor's
side, and the engine loop that drives the core, is scheduler_svc/executor_link.py."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from flagstop.adapters import already_loaded
from flagstop.health import Health
from flagstop.scheduler_svc.convert import handoff_to_proto, request_from_proto
from flagstop.scheduler_svc.core.disaggregation import DecodeConnector, PrefillConnector
from flagstop.scheduler_svc.core.host_tier import HostTierConnector
from flagstop.scheduler_svc.core.kv_connector import KVConnector
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput
from flagstop.scheduler_svc.core.policy import RankedPolicy
from flagstop.scheduler_svc.core.request import FinishReason, RequestStatus
from flagstop.scheduler_svc.core.scheduler import RequestRejected, Scheduler
from flagstop.scheduler_svc.executor_link import ExecutorLink, ExecutorMismatch
from flagstop.scheduler_svc.policy_client import POLICY_SERVICE, RemotePolicyClient
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.server import StartupError, TLSConfig
from flagstop.v1 import executor_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("flagstop.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
# A router with nothing running here still hears the load this often (and when the
# replica goes idle), so that its replica choice does not rest on an old figure.
LOAD_REPORT_INTERVAL_S = 0.25
EMPTY_LOGPROB = generation_pb2.TokenLogprob()


# Credits a router may hold beyond its queued requests while the waiting queue has room.
SPARE_CREDITS = 8


@dataclass(slots=True, eq=False)
class RouterConnection:
    router_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    credits: int = 0  # granted, not yet sent
    held: int = 0  # sent, not yet used by an add (standing credits, or on their way)
    num_queued: int = 0  # requests waiting at the router, as it last said
    load_sent_at: float = 0.0  # monotonic time of the last load report to it


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self, settings: SchedulerSettings, health: Health, telemetry: SchedulerTelemetry
    ) -> None:
        self.settings = settings
        self.tls = TLSConfig.from_settings(settings)
        self.health = health
        self.telemetry = telemetry
        self.scheduler: Scheduler | None = None
        self.kv_connector: KVConnector | None = None  # the core's, built from Describe
        self.eos_token_ids: frozenset[int] = frozenset()
        self.routers: dict[str, RouterConnection] = {}
        self.link = ExecutorLink(settings, self.tls, telemetry, self)
        self.accepting = True
        self.policy_client: RemotePolicyClient | None = None
        # Constrained requests waiting for the executor to compile their grammar
        # (vLLM's WAITING_FOR_FSM): by id, (owner, task). The step loop never waits.
        self.compiling: dict[str, tuple[str, asyncio.Task]] = {}
        # LoRA loads, replacements and unloads, one at a time; the names being
        # replaced, whose requests are refused meanwhile.
        self.adapter_changes = asyncio.Lock()
        self.replacing: set[str] = set()

    # -- the executor --------------------------------------------------------

    async def connect_executor(self) -> None:
        """Describe the executor (waiting for it to come up) and size the pool from it;
        a configuration it cannot honour stops start-up (StartupError)."""
        s = self.settings
        try:
            info = await self.link.first_executor()
            config = s.core_config(
                info.model.max_model_len, info.model.block_size, info.num_speculative_tokens,
                info.model.max_loras,
            )  # fmt: skip
        except (ExecutorMismatch, ValueError) as e:
            raise StartupError(str(e)) from None
        self.telemetry.model_name = info.model.model_name
        self.eos_token_ids = frozenset(info.model.eos_token_ids)
        self.kv_connector = self.telemetry.kv_connector = self._connector(info, config)
        self.scheduler = Scheduler(config, info.model.num_blocks, connector=self.kv_connector)
        if isinstance(self.scheduler.policy, RankedPolicy):
            self.policy_client = RemotePolicyClient(
                s.policy_addr, self.scheduler.policy, s.policy_deadline_ms / 1000,
                self._policy_changed, self.tls,
            )  # fmt: skip
        spec = ""
        if info.num_speculative_tokens:
            spec = f", speculative decoding ({info.speculative_method}, k <= "
            spec += f"{info.num_speculative_tokens})"
        if info.model.num_host_blocks:
            spec += f", a host tier of {info.model.num_host_blocks} blocks"
        if info.model.kv_role:
            role = generation_pb2.KVRole.Name(info.model.kv_role).removeprefix("KV_ROLE_")
            spec += f", KV role {role.lower()}"
        log.info("executor %s: %s, %d blocks of %d%s", s.executor, info.model.model_name,
                 info.model.num_blocks, info.model.block_size, spec)  # fmt: skip

    @staticmethod
    def _connector(info: executor_pb2.DescribeExecutorResponse, config):
        """The KV connector the executor calls for: a host tier, a prefill or a decode
        replica's side of disaggregation, or none."""
        if info.model.num_host_blocks:
            if config.no_prefix_caching:
                raise StartupError("--no-prefix-caching: the executor's host tier "
                                   "(--kv-offload-bytes) is keyed by the prefix cache; "
                                   "drop one of them")  # fmt: skip
            return HostTierConnector(info.model.num_host_blocks, config.block_size)
        if info.model.kv_role == generation_pb2.KV_ROLE_PREFILL:
            return PrefillConnector(info.kv_endpoint, info.kv_engine_id, uuid.uuid4().hex[:12])
        if info.model.kv_role == generation_pb2.KV_ROLE_DECODE:
            return DecodeConnector(config.block_size)
        return None

    def executor_replaced(self, info: executor_pb2.DescribeExecutorResponse) -> None:
        """A new executor instance: its KV is read from there now (hand-offs name it)."""
        if self.kv_connector is not None:
            self.kv_connector.executor_replaced(info.kv_endpoint, info.kv_engine_id)

    async def run(self) -> None:
        await self.connect_executor()
        assert self.scheduler is not None
        await self.link.run(self.scheduler)

    def executor_changed(self) -> None:
        """Ready while an executor is connected (and we admit)."""
        self.health.set_ready(self.accepting and self.link.connected)

    def dispatch(
        self,
        plan: SchedulerOutput,
        result: executor_pb2.StepResult,
        outputs: dict[str, OwnerOutputs],
    ) -> None:
        logprobs = self._logprobs(plan, result) if result.logprobs else {}
        self._grant_credits()
        load, now = self._load(), time.monotonic()
        prompt_logprobs = self._prompt_logprobs(plan, result) if result.prompt_logprobs else {}
        for owner in prompt_logprobs.keys() - outputs.keys():
            outputs[owner] = OwnerOutputs()  # a prefill chunk that sampled nothing
        for owner, out in outputs.items():
            conn = self.routers.get(owner)
            if conn is None:
                continue
            conn.load_sent_at = now
            msg = scheduler_pb2.SchedulerMessage(
                step_id=plan.step_id, request_ids=out.req_ids, token_ids=out.new_token_ids,
                finished_ids=list(out.finished), finish_reasons=list(out.finished.values()),
                num_cached_tokens=out.num_cached_tokens, credits=self._take_credits(conn),
                load=load, prompt_logprobs=prompt_logprobs.get(owner, ()),
            )  # fmt: skip
            for request_id, handoff in out.kv_transfers.items():
                msg.kv_transfers[request_id].CopyFrom(handoff_to_proto(handoff))
            if logprobs:
                msg.logprobs.extend(self._in_order(out.req_ids, logprobs))
            conn.outbox.put_nowait(msg)
        idle = not self.scheduler.has_unfinished_requests()
        for conn in self.routers.values():
            if conn.router_id in outputs:
                continue
            if conn.credits or idle or now - conn.load_sent_at > LOAD_REPORT_INTERVAL_S:
                conn.load_sent_at = now
                conn.outbox.put_nowait(
                    scheduler_pb2.SchedulerMessage(credits=self._take_credits(conn), load=load)
                )

    @staticmethod
    def _logprobs(plan: SchedulerOutput, result: executor_pb2.StepResult) -> dict[str, list]:
        """Each sampling request's logprob entries, one per token it emitted."""
        counts, flat, start = result.num_sampled_tokens, result.logprobs, 0
        if not counts:
            return {r.request_id: [lp] for r, lp in zip(plan.sampling_requests, flat, strict=True)}
        by_request = {}
        for request, n in zip(plan.sampling_requests, counts, strict=True):
            by_request[request.request_id], start = flat[start : start + n], start + n
        return by_request

    @staticmethod
    def _in_order(req_ids: list[str], logprobs: dict[str, list]):
        # A request's tokens are consecutive: its entries are taken in turn.
        taken: dict[str, int] = {}
        for req_id in req_ids:
            entries, i = logprobs.get(req_id, ()), taken.get(req_id, 0)
            taken[req_id] = i + 1
            yield entries[i] if i < len(entries) else EMPTY_LOGPROB

    def _prompt_logprobs(
        self, plan: SchedulerOutput, result: executor_pb2.StepResult
    ) -> dict[str, list]:
        """The step's prompt logprobs by owner: of requests still held, or that
        finished in this very step (their first token was their last)."""
        assert self.scheduler is not None
        held = self.scheduler.requests
        sampled = {r.request_id: r for r in plan.sampling_requests}
        by_owner: dict[str, list] = {}
        for chunk in result.prompt_logprobs:
            request = held.get(chunk.req_id) or sampled.get(chunk.req_id)
            if request is not None:
                by_owner.setdefault(request.owner, []).append(chunk)
        return by_owner

    def _load(self) -> scheduler_pb2.ReplicaLoad:
        scheduler = self.scheduler
        assert scheduler is not None
        load = scheduler_pb2.ReplicaLoad(
            num_running=len(scheduler.running), num_waiting=self.num_waiting(),
            kv_cache_usage=scheduler.kv_cache_usage,
            lora_adapters_version=self.link.lora_version,
        )  # fmt: skip
        if self.kv_connector is not None:
            load.num_host_cached_blocks = scheduler.transfers.num_host_cached_blocks
            load.external_prefix_cache_hits = scheduler.transfers.external_stats.num_hits
        if scheduler.config.max_loras:
            running, waiting = scheduler.loras_in_use()
            load.running_loras.extend(running)
            load.waiting_loras.extend(waiting)
            self.telemetry.lora_requests(running, waiting, scheduler.config.max_loras)
        return load

    def num_waiting(self) -> int:
        """Requests waiting here and those the routers still hold queued for us."""
        assert self.scheduler is not None
        waiting = len(self.scheduler.waiting) + len(self.compiling)
        return waiting + self.num_queued_at_routers()

    def num_queued_at_routers(self) -> int:
        return sum(c.num_queued for c in self.routers.values())

    # -- the remote policy -----------------------------------------------------

    def _policy_changed(self, active: bool, failure: str) -> None:
        if failure:
            self.telemetry.event("policy fallback", {"flagstop.reason": failure})
        # Health detail: the policy's own entry is SERVING while its rankings are used;
        # the scheduler as a whole keeps serving (FCFS) either way.
        self.health.set_detail(POLICY_SERVICE, active)

    # -- credits ---------------------------------------------------------------

    def _grant_credits(self) -> None:
        """Keep the waiting queue short: hand out room for more requests to the routers
        that have some queued, one at a time in turn; then, while room is left, a few
        standing credits each (SPARE_CREDITS), so that a request arriving at a router
        goes out at once in one message, instead of being announced, waiting a round
        trip for its credit and then sent (three messages)."""
        if self.scheduler is None or not self.accepting:
            return
        outstanding = sum(c.credits + c.held for c in self.routers.values())
        waiting = len(self.scheduler.waiting) + len(self.compiling)
        room = self.settings.max_waiting_requests - waiting - outstanding
        for spare in (0, SPARE_CREDITS):
            wanting = [c for c in self.routers.values()
                       if c.num_queued + spare > c.credits + c.held]  # fmt: skip
            while room > 0 and wanting:
                for conn in list(wanting):
                    if room == 0:
                        break
                    conn.credits += 1
                    room -= 1
                    if conn.credits + conn.held >= conn.num_queued + spare:
                        wanting.remove(conn)

    @staticmethod
    def _take_credits(conn: RouterConnection) -> int:
        # Credits are sent once and held at the router until its adds spend them.
        sent, conn.credits = conn.credits, 0
        conn.held += sent
        conn.num_queued = max(0, conn.num_queued - sent)
        return sent

    # -- routers ---------------------------------------------------------------

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.RouterMessage], context
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        conn = RouterConnection(router_id=uuid.uuid4().hex)
        reader = asyncio.create_task(self._read_router(conn, request_iterator))
        try:
            # The reader puts None when the router closes its side (one task for the
            # stream, not one per message: this runs once per engine step).
            while (msg := await conn.outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self._drop_router(conn)

    async def _read_router(self, conn: RouterConnection, request_iterator) -> None:
        registered = False
        try:
            async for msg in request_iterator:
                if not registered:
                    if msg.router_id in self.routers:
                        log.error("refused a second router calling itself %s", msg.router_id)
                        return
                    conn.router_id = msg.router_id or conn.router_id
                    self.routers[conn.router_id] = conn
                    registered = True
                self._apply(conn, msg)
        finally:
            conn.outbox.put_nowait(None)

    def _apply(self, conn: RouterConnection, msg: scheduler_pb2.RouterMessage) -> None:
        conn.num_queued = msg.num_queued
        scheduler = self.scheduler
        # While steps run, each step's message carries the credits (dispatch): only a
        # router with requests waiting for them, or an idle engine, gets them at once.
        stepping = scheduler is not None and scheduler.has_unfinished_requests()
        errors = []
        if msg.aborts and scheduler is not None:
            self._cancel_compiles(msg.aborts)
            scheduler.abort(msg.aborts)
            for request_id in msg.aborts:
                self.telemetry.on_finish(request_id, FinishReason.ABORT)
        conn.held = max(0, conn.held - len(msg.adds))
        for add in msg.adds:
            error = self._add(conn, add)
            if error is not None:
                errors.append(error)
        self._grant_credits()
        if errors or (conn.credits and (conn.num_queued or not stepping)):
            conn.outbox.put_nowait(
                scheduler_pb2.SchedulerMessage(errors=errors, credits=self._take_credits(conn))
            )
        self.link.wakeup.set()

    def _add(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        # While a lost executor may still come back, new requests wait with the rest.
        if not self.accepting or self.scheduler is None or self.link.reconnect.gave_up:
            return scheduler_pb2.RequestError(
                request_id=add.request_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                message="the scheduler is not serving (starting, stopping, or no executor)",
            )  # fmt: skip
        if add.sampling.HasField("structured_outputs"):
            task = asyncio.create_task(self._compile_then_add(conn, add))
            self.compiling[add.request_id] = (conn.router_id, task)
            return None
        return self._admit(conn, add)

    def _admit(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        lora_id = ""
        if add.lora_name:
            if refusal := self._adapter_refusal(add.lora_name, add.lora_id):
                code, message = refusal
                return scheduler_pb2.RequestError(
                    request_id=add.request_id, code=code.value[0], message=message
                )
            lora_id = self.link.adapters[add.lora_name].id
        try:
            request = request_from_proto(add, conn.router_id, self.eos_token_ids, lora_id)
            self.scheduler.add_request(request)
            self.telemetry.on_add(add.request_id, len(add.prompt_token_ids), add.traceparent)
        except RequestRejected as e:
            return scheduler_pb2.RequestError(
                request_id=add.request_id,
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                message=str(e),
            )
        return None

    async def _compile_then_add(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        """The request waits for its grammar here, the batch does not. A grammar the
        executor refuses ends the request with INVALID_ARGUMENT; an executor that does
        not answer (lost, restarting) leaves the compile to the request's first step."""
        error = None
        try:
            await self.link.prepare_grammar(add)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                error = scheduler_pb2.RequestError(
                    request_id=add.request_id, code=e.code().value[0], message=e.details()
                )
            else:
                log.warning("grammar of %s not compiled ahead: %s", add.request_id, e.code())
        finally:
            self.compiling.pop(add.request_id, None)
        if self.routers.get(conn.router_id) is not conn:
            return  # its router left meanwhile
        error = error or self._admit(conn, add)
        if error is not None:
            conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(errors=[error]))
        self.link.wakeup.set()

    def _cancel_compiles(self, request_ids) -> None:
        for request_id in request_ids:
            entry = self.compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    def _drop_router(self, conn: RouterConnection) -> None:
        """Its clients are gone with it: nobody is left to stream these tokens to."""
        if self.routers.get(conn.router_id) is conn:
            del self.routers[conn.router_id]
        self._cancel_compiles(
            [r for r, (owner, _) in self.compiling.items() if owner == conn.router_id]
        )
        if self.scheduler is not None:
            owned = self.scheduler.request_ids_by_owner().get(conn.router_id, [])
            self.scheduler.abort(owned)
            for request_id in owned:
                self.telemetry.on_finish(request_id, FinishReason.ABORT)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        if self.scheduler is None:
            return
        for owner, ids in self.scheduler.abort_all().items():
            for request_id in ids:
                self.telemetry.on_finish(request_id, FinishReason.ERROR)
            conn = self.routers.get(owner)
            if conn is not None:
                errors = [
                    scheduler_pb2.RequestError(request_id=r, code=code.value[0], message=message)
                    for r in ids
                ]
                conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(errors=errors))

    # -- unary -----------------------------------------------------------------

    async def Describe(self, request, context) -> scheduler_pb2.DescribeSchedulerResponse:
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the executor")
        reply = scheduler_pb2.DescribeSchedulerResponse()
        reply.model.CopyFrom(self.link.model)
        reply.model.max_model_len = self.scheduler.config.max_model_len  # --max-model-len
        reply.model.num_blocks = self.scheduler.num_total_blocks  # the pool of the executor now
        return reply

    async def GetStats(self, request, context) -> scheduler_pb2.GetStatsResponse:
        if self.scheduler is None:
            return scheduler_pb2.GetStatsResponse()
        policy = self.policy_client
        return scheduler_pb2.GetStatsResponse(
            **self.scheduler.stats().as_fields(), executor_connected=self.link.connected,
            remote_policy_active=policy is not None and policy.active,
            remote_policy_failures=policy.num_failures if policy is not None else 0,
            num_routers=len(self.routers), num_host_blocks=self.link.model.num_host_blocks,
        )  # fmt: skip

    # -- LoRA adapters -----------------------------------------------------------
    # A request runs under the adapter its name had when it began (its identity,
    # AddRequest.lora_id): one whose adapter is unloaded, replaced, or found changed
    # on an executor that came back, ends, for its tokens would go on from other
    # weights. The executor's side changes only after the steps in flight (link).

    async def LoadLoRAAdapter(self, request, context) -> generation_pb2.LoadLoRAAdapterResponse:
        """ALREADY_EXISTS for a name loaded here, unless load_inplace: then its
        requests end (UNAVAILABLE, retry) and new ones are refused until the executor
        holds the new files, which bring a new identity."""
        name = request.lora_name
        async with self.adapter_changes:
            replacing = name in self.link.adapters
            if replacing and not request.load_inplace:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, already_loaded(name))
            if replacing:
                self.replacing.add(name)
                self.adapters_changed()
            try:
                return await self.link.load_lora(request)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())
            finally:
                self.replacing.discard(name)

    async def UnloadLoRAAdapter(self, request, context) -> generation_pb2.UnloadLoRAAdapterResponse:
        """Its requests end first (NOT_FOUND: the adapter is gone), then the executor
        drops it."""
        name = request.lora_name
        async with self.adapter_changes:
            if name not in self.link.adapters:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {name!r} is "
                                    "loaded (/v1/models lists them)")  # fmt: skip
            self.link.set_adapter(name, None)  # gone here at once, even if the executor is away
            self.adapters_changed()
            try:
                return await self.link.unload_lora(request)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details())

    def _adapter_refusal(self, name: str, lora_id: str) -> tuple[grpc.StatusCode, str] | None:
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

    def adapters_changed(self) -> None:
        """End every request whose adapter is no longer the one it began under."""
        if self.scheduler is None:
            return
        ended: dict[tuple[str, grpc.StatusCode, str], list[str]] = {}
        for request in self.scheduler.requests.values():
            if request.lora_name and (
                refusal := self._adapter_refusal(request.lora_name, request.lora_id)
            ):  # fmt: skip
                ended.setdefault((request.owner, *refusal), []).append(request.request_id)
        for (owner, code, message), ids in ended.items():
            self.scheduler.abort(ids, RequestStatus.FINISHED_ERROR)
            for request_id in ids:
                self.telemetry.on_finish(request_id, FinishReason.ERROR)
            errors = [scheduler_pb2.RequestError(request_id=r, code=code.value[0],
                                                 message=message) for r in ids]  # fmt: skip
            if (conn := self.routers.get(owner)) is not None:
                conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(errors=errors))

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting, let the requests in flight finish (for a while), then abort
        what is left and close the router streams."""
        self.accepting = False
        self.health.set_ready(False)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                self.fail_all(grpc.StatusCode.UNAVAILABLE, "the scheduler shut down")
                break
            await asyncio.sleep(0.05)
        for conn in self.routers.values():
            conn.outbox.put_nowait(None)
