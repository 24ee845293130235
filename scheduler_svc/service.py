"""The scheduler's gRPC servicer: it builds the core from the executor's description
and answers what a router or a client asks. It is the composition root of the shell:
each part has its own room and is given its collaborators (the core through
core_handle.py, the other parts, callbacks), never the service:
- router_links.py: the router streams (requests and aborts in, each step's tokens,
  credits and load out) and the one way a request fails;
- intake.py: a request's way into the core (grammars compiled first);
- adapter_loads.py: LoRA loads, replacements and unloads;
- executor_link.py: the executor's side, and the engine loop that drives the core's
  schedule() / update_from_output(), telling the others through its hooks."""

import asyncio
import dataclasses
import hmac
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
import zmq

from flagstop.health import Health
from flagstop.scheduler_svc.adapter_loads import Adapters
from flagstop.scheduler_svc.convert import kv_layers_from_proto
from flagstop.scheduler_svc.core.disaggregation import DecodeConnector, PrefillConnector
from flagstop.scheduler_svc.core.host_tier_connector import HostTierConnector
from flagstop.scheduler_svc.core.kv_connector import KVConnector
from flagstop.scheduler_svc.core.kv_groups import describe_groups, kv_cache_groups
from flagstop.scheduler_svc.core.policy import (
    RankedPolicy,
    SchedulingPolicy,
    policy_for,
)
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core_handle import CoreHandle
from flagstop.scheduler_svc.executor_link import ExecutorLink, ExecutorMismatch, LinkHooks
from flagstop.scheduler_svc.intake import Intake
from flagstop.scheduler_svc.kv_event_publisher import (
    NO_KV_EVENT_PUBLISHER,
    KVEventPublisher,
    NoKVEventPublisher,
    kv_event_publisher,
)
from flagstop.scheduler_svc.policy_client import (
    NO_REMOTE_POLICY,
    POLICY_SERVICE,
    NoRemotePolicy,
    RemotePolicyClient,
)
from flagstop.scheduler_svc.router_links import RouterLinks
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.server import StartupError, TLSConfig
from flagstop.v1 import executor_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("flagstop.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self, settings: SchedulerSettings, health: Health, telemetry: SchedulerTelemetry
    ) -> None:
        self.settings = settings
        self.tls = TLSConfig.from_settings(settings)
        self.health = health
        self.telemetry = telemetry
        self.core = CoreHandle()
        self.kv_connector: KVConnector | None = None  # the core's, built from Describe
        self.policy_client: RemotePolicyClient | NoRemotePolicy = NO_REMOTE_POLICY
        # KV events for a fleet's router (docs/llm-d.md), once the model is known.
        self.kv_publisher: KVEventPublisher | NoKVEventPublisher = NO_KV_EVENT_PUBLISHER
        hooks = LinkHooks(
            on_step=lambda plan, result, outputs: (self.links.dispatch(plan, result, outputs),
                                                   self.kv_publisher.flush()),
            on_shed=lambda shed: self.links.refuse_shed(shed),
            before_schedule=lambda scheduler: self.policy_client.maybe_query(scheduler),
            num_queued_at_routers=lambda: self.links.num_queued,
            fail_all=self.fail_all, on_connection=self.executor_changed,
            on_new_executor=self.executor_replaced, media_in_flight=self.media_in_flight,
        )  # fmt: skip
        self.link = ExecutorLink(settings, self.tls, telemetry, hooks)
        # The router links come last, and the earlier parts call them late (lambdas).
        self.adapters = Adapters(self.core, self.link, lambda *failed: self.links.fail(*failed))
        self.intake = Intake(self.core, self.adapters, self.link, telemetry,
                             settings.fallback_objectives())  # fmt: skip
        self.links = RouterLinks(self.core, self.intake, self.link, settings, telemetry)

    @property
    def scheduler(self) -> Scheduler | None:
        return self.core.scheduler

    # -- the executor --------------------------------------------------------

    async def connect_executor(self) -> None:
        """Describe the executor (waiting for it to come up) and size the pool from it;
        a configuration it cannot honour stops start-up (StartupError)."""
        s = self.settings
        try:
            info = await self.link.first_executor()
            config = s.core_config(
                info.model.max_model_len, info.model.block_size, info.num_speculative_tokens,
                info.model.max_loras, info.model.accepts_images,
                info.model.bidirectional_images,
            )  # fmt: skip
            groups = kv_cache_groups(kv_layers_from_proto(info.model))
        except (ExecutorMismatch, ValueError) as e:
            raise StartupError(str(e)) from None
        self.telemetry.model_name = info.model.model_name
        self.core.eos_token_ids = frozenset(info.model.eos_token_ids)
        self.kv_connector = self.telemetry.kv_connector = self._connector(info, config, groups)
        policy = policy_for(config)
        self.kv_publisher = self._kv_publisher(info.model.model_name)
        scheduler = Scheduler(config, info.model.num_blocks, policy, self.kv_connector, groups,
                              kv_events=self.kv_publisher.log)  # fmt: skip
        self.core.scheduler = scheduler
        self._remote_client(policy, s.policy_addr)
        if s.shadow_policy:
            scheduler.policy_step.set_shadow(self._new_shadow(s.shadow_policy))
        extras = ""
        if info.num_speculative_tokens:
            extras = f", speculative decoding ({info.speculative_method}, k <= "
            extras += f"{info.num_speculative_tokens})"
        if info.model.num_host_blocks:
            extras += f", a host tier of {info.model.num_host_blocks} blocks"
        if config.max_num_encoder_input_tokens:
            extras += (
                f", images (an encoder budget of {config.max_num_encoder_input_tokens}"
                f" tokens a step, a cache of {config.encoder_cache_size})"
            )
        if info.model.kv_role:
            role = generation_pb2.KVRole.Name(info.model.kv_role).removeprefix("KV_ROLE_")
            extras += f", KV role {role.lower()}"
        if len(groups) > 1 or groups[0].is_window:
            # Each group's share of the pool, were every group's table as long (vLLM's
            # "GPU KV cache size" of a hybrid model); a window group holds far less.
            per_group = scheduler.num_total_blocks // len(groups) * config.block_size
            extras += f", KV cache groups {describe_groups(groups)} ({per_group} tokens a group)"
        kv_bytes = sum(x.kv_bytes_per_token for x in info.model.kv_layers)
        self.telemetry.kv_cache_groups(describe_groups(groups), kv_bytes,
                                       scheduler.kv_capacity_tokens)  # fmt: skip
        log.info("executor %s: %s, %d blocks of %d (a sequence of up to %d tokens)%s",
                 s.executor, info.model.model_name, info.model.num_blocks,
                 info.model.block_size, scheduler.kv_capacity_tokens, extras)  # fmt: skip

    def _kv_publisher(self, model: str) -> KVEventPublisher | NoKVEventPublisher:
        try:
            publisher = kv_event_publisher(self.settings.kv_events_config, model)
        except zmq.ZMQError as e:
            raise StartupError(f"--kv-events-config: cannot bind its sockets: {e}") from None
        publisher.start()
        return publisher

    @staticmethod
    def _connector(info: executor_pb2.DescribeExecutorResponse, config, groups):
        """The KV connector the executor calls for: a host tier, a prefill or a decode
        replica's side of disaggregation, or none."""
        if info.model.kv_role and any(g.is_recurrent for g in groups):
            raise StartupError("prefill/decode disaggregation (--kv-role) moves one "
                               "full-attention block table; this model's recurrent layers "
                               f"({describe_groups(groups)}) keep states that it does not "
                               "move: serve it without --kv-role")  # fmt: skip
        if info.model.kv_role and (len(groups) > 1 or groups[0].is_window):
            raise StartupError("prefill/decode disaggregation (--kv-role) moves one "
                               "full-attention block table; this model's layers make KV "
                               f"cache groups {describe_groups(groups)}: start its executors "
                               "with --disable-hybrid-kv-cache-manager (one group, every "
                               "layer's KV kept) or without --kv-role")  # fmt: skip
        if info.model.num_host_blocks:
            if config.no_prefix_caching:
                raise StartupError("--no-prefix-caching: the executor's host tier "
                                   "(--kv-offload-bytes) is keyed by the prefix cache; "
                                   "drop one of them")  # fmt: skip
            return HostTierConnector(info.model.num_host_blocks, config.block_size, len(groups))
        if info.model.kv_role == generation_pb2.KV_ROLE_PREFILL:
            return PrefillConnector(info.kv_endpoint, info.kv_engine_id, uuid.uuid4().hex[:12])
        if info.model.kv_role == generation_pb2.KV_ROLE_DECODE:
            return DecodeConnector(config.block_size)
        return None

    def executor_replaced(self, info: executor_pb2.DescribeExecutorResponse) -> None:
        """A new executor instance: the requests whose adapter changed end, and its KV
        is read from there now (hand-offs name it)."""
        self.adapters.changed()
        if self.kv_connector is not None:
            self.kv_connector.executor_replaced(info.kv_endpoint, info.kv_engine_id)

    def media_in_flight(self) -> list:
        scheduler = self.scheduler
        if scheduler is None:
            return []
        return [item for r in scheduler.requests.values() for item in r.media_data]

    async def run(self) -> None:
        await self.connect_executor()
        assert self.scheduler is not None
        await self.link.run(self.scheduler)

    def executor_changed(self) -> None:
        """Ready while an executor is connected (and we admit); the routers hear it at
        once, in the load (executor_lost), to place requests elsewhere meanwhile."""
        self.health.set_ready(self.core.accepting and self.link.connected)
        if self.scheduler is not None:
            self.links.report_load()

    # -- the policy ------------------------------------------------------------

    def _remote_client(self, policy: SchedulingPolicy, address: str) -> None:
        """The client that feeds a remote policy (a RankedPolicy) its answers; None for
        a built-in one."""
        self.policy_client.close()
        self.policy_client = NO_REMOTE_POLICY
        if isinstance(policy, RankedPolicy):
            s = self.settings
            self.policy_client = RemotePolicyClient(
                address, policy, s.policy_deadline_ms / 1000, self._policy_changed, self.tls
            )

    async def SetPolicy(self, request, context) -> scheduler_pb2.SetPolicyResponse:
        """The admin call: swap the live policy and set the shadow, between two steps
        (the engine loop and this call share one event loop)."""
        await self._check_admin(context)
        scheduler = self.scheduler
        if scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the executor")
        try:
            policy = self._new_policy(request) if request.policy else scheduler.policy_step.policy
            shadow = self._new_shadow(request.shadow)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if policy is not scheduler.policy_step.policy:
            scheduler.set_policy(policy)
            self._remote_client(policy, request.policy_addr or self.settings.policy_addr)
        scheduler.policy_step.set_shadow(shadow)
        log.info(
            "policy %s, shadow %s (admin call)", policy.name, shadow.name if shadow else "none"
        )
        self.link.wakeup.set()
        shadow_name = scheduler.policy_step.shadow.name
        return scheduler_pb2.SetPolicyResponse(policy=policy.name, shadow_policy=shadow_name)

    def _new_policy(self, request) -> SchedulingPolicy:
        """The asked policy with the scheduler's options (raises ValueError)."""
        config = dataclasses.replace(self.scheduler.config, policy=request.policy)
        return policy_for(config)

    def _new_shadow(self, name: str) -> SchedulingPolicy | None:
        if name == "remote":
            raise ValueError("a shadow policy is a built-in one (fcfs, priority, hrrn, slo, fair)")
        return policy_for(dataclasses.replace(self.scheduler.config, policy=name)) if name else None

    async def _check_admin(self, context) -> None:
        key = self.settings.admin_key
        if key is None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "admin calls are off: start "
                "the scheduler with --admin-key (or FLAGSTOP_SCHEDULER_ADMIN_KEY)",
            )
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key.get_secret_value()}".encode()):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong admin key: send 'authorization: Bearer <key>'",
            )

    def _policy_changed(self, active: bool, failure: str) -> None:
        if failure:
            self.telemetry.event("policy fallback", {"flagstop.reason": failure})
        # Health detail: the policy's own entry is SERVING while its rankings are used;
        # the scheduler as a whole keeps serving (FCFS) either way.
        self.health.set_detail(POLICY_SERVICE, active)

    # -- routers ---------------------------------------------------------------

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.RouterMessage], context
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        async for msg in self.links.stream(request_iterator):  # once a step, not a token
            yield msg

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        if self.scheduler is not None:
            self.links.fail(self.scheduler.request_ids_by_owner(), code, message)

    # -- unary -----------------------------------------------------------------

    async def Describe(self, request, context) -> scheduler_pb2.DescribeSchedulerResponse:
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the executor")
        reply = scheduler_pb2.DescribeSchedulerResponse()
        reply.model.CopyFrom(self.link.model)
        reply.model.max_model_len = self.scheduler.config.max_model_len  # --max-model-len
        reply.model.num_blocks = self.scheduler.num_total_blocks  # the pool of the executor now
        reply.model.kv_capacity_tokens = self.scheduler.kv_capacity_tokens
        config = self.scheduler.config
        reply.model.max_num_encoder_input_tokens = config.max_num_encoder_input_tokens
        reply.model.encoder_cache_size = config.encoder_cache_size
        reply.model.retention_share = config.retention_share
        reply.model.max_retention_s = config.max_retention_s
        return reply

    async def GetStats(self, request, context) -> scheduler_pb2.GetStatsResponse:
        if self.scheduler is None:
            return scheduler_pb2.GetStatsResponse()
        policy = self.policy_client
        return scheduler_pb2.GetStatsResponse(
            **self.scheduler.stats().as_fields(), executor_connected=self.link.connected,
            remote_policy_active=policy.active, remote_policy_failures=policy.num_failures,
            num_routers=len(self.links.routers), num_host_blocks=self.link.model.num_host_blocks,
        )  # fmt: skip

    async def LoadLoRAAdapter(self, request, context) -> generation_pb2.LoadLoRAAdapterResponse:
        return await self.adapters.load(request, context)

    async def UnloadLoRAAdapter(self, request, context) -> generation_pb2.UnloadLoRAAdapterResponse:
        return await self.adapters.unload(request, context)

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting, let the requests in flight finish (for a while), then abort
        what is left and close the router streams."""
        self.core.accepting = False
        self.health.set_ready(False)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                self.fail_all(grpc.StatusCode.UNAVAILABLE, "the scheduler shut down")
                break
            await asyncio.sleep(0.05)
        if self.scheduler is not None:
            self.link.cost_record.write(self.scheduler.policy_step.cost)
        self.links.close()
        self.kv_publisher.flush()
        self.kv_publisher.close()
