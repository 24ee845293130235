"""The scheduler's link to its executor: describing it (waiting for it to come up),
refusing one that cannot honour our settings, the Execute stream that keeps up to two
steps in flight, heartbeats while idle, and a new stream to the executor that comes
back after one is lost.

The service (scheduler_svc/service.py) owns the routers and the requests' way in;
this class owns everything that talks to the executor and drives the core's
schedule() / update_from_output() between the two, telling the rest of the shell
through its hooks (LinkHooks)."""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from flagstop.reconnect import Reconnect
from flagstop.scheduler_svc.convert import outcome_from_result, step_to_proto
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput
from flagstop.scheduler_svc.core.request import Request
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.cost_record import cost_record
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.server import TLSConfig, channel
from flagstop.v1 import executor_pb2, executor_pb2_grpc, generation_pb2, scheduler_pb2

log = logging.getLogger("flagstop.scheduler")
# An idle engine probes its executor this often: a dead one is noticed (and the routers
# told: executor_lost) within it, a busy one at its next step.
HEARTBEAT_INTERVAL_S = 0.5


class ExecutorLost(Exception):
    pass


class ExecutorMismatch(Exception):
    """The executor cannot honour this scheduler's settings; the message says which."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkHooks:
    """What the link tells the rest of the shell, wired by the service (the
    composition root): the link knows the executor and the engine loop, not who
    listens."""

    # A step's result: its tokens to their routers.
    on_step: Callable[[SchedulerOutput, executor_pb2.StepResult, dict[str, OwnerOutputs]], None]
    # Requests the policy shed: their clients told to retry.
    on_shed: Callable[[list[tuple[Request, str]]], None]
    # Before each schedule(): the remote policy's query (none for a built-in one).
    before_schedule: Callable[[Scheduler], None]
    # The requests the routers still hold queued for us (the step's telemetry).
    num_queued_at_routers: Callable[[], int]
    # Every request ends with this error (no executor, or a bug in the loop).
    fail_all: Callable[[grpc.StatusCode, str], None]
    # The executor came or went.
    on_connection: Callable[[], None]
    # A new executor instance answered (its adapters and images restored).
    on_new_executor: Callable[[executor_pb2.DescribeExecutorResponse], None]
    # The images' pixels of every request still here: a new executor gets them again.
    media_in_flight: Callable[[], list[generation_pb2.MediaData]]


# Pixels in one PrepareMedia call at most (below gRPC's message limit).
MEDIA_BYTES_PER_CALL = 16 << 20


class ExecutorLink:
    def __init__(
        self, settings: SchedulerSettings, tls: TLSConfig, telemetry: SchedulerTelemetry,
        hooks: LinkHooks,
    ) -> None:  # fmt: skip
        self.settings, self.telemetry, self.hooks = settings, telemetry, hooks
        self.stub = executor_pb2_grpc.ExecutorStub(channel(settings.executor, tls))
        self.info = executor_pb2.DescribeExecutorResponse()  # the first executor's
        self.connected = False
        self.reconnect = Reconnect(give_up_after_s=settings.executor_timeout)
        self.wakeup = asyncio.Event()  # new work, or a request that may run now
        # The LoRA adapters requests may name, by name (mirrored in info.model's list,
        # which Describe reports), and a count bumped by each change (ReplicaLoad's).
        self.adapters: dict[str, generation_pb2.LoRAAdapter] = {}
        self.lora_version = 0
        # The steps sent and not yet answered, oldest first, and an event set as each
        # is answered (or all are lost with the executor).
        self.in_flight: deque[SchedulerOutput] = deque()
        # When each step in flight was sent, and when the last result came (the steps'
        # measured times teach the core's step-cost model).
        self.written_at: deque[float] = deque()
        self.last_result_at = 0.0
        self.step_returned = asyncio.Event()
        self.cost_record = cost_record(settings.step_cost_out)

    @property
    def model(self) -> generation_pb2.ModelInfo:
        return self.info.model

    # -- describing ------------------------------------------------------------

    async def first_executor(self) -> executor_pb2.DescribeExecutorResponse:
        """The executor's description, once one answers (raises ExecutorMismatch when
        it cannot honour our settings)."""
        info = await self._describe()
        self._check(info)
        self.info = info
        self.adapters = {a.name: a for a in info.model.lora_adapters}
        return info

    def _check(self, info: executor_pb2.DescribeExecutorResponse) -> None:
        """Refuse what the executor cannot honour now, not as a batch desync later."""
        s, known, model = self.settings, self.info.model, info.model
        if known.model_name and (model.model_name, model.vocab_size, model.block_size) != (
            known.model_name, known.vocab_size, known.block_size,
        ):  # fmt: skip
            raise ExecutorMismatch(
                f"the executor came back with another model ({model.model_name}, block size "
                f"{model.block_size}); retry the request"
            )
        if known.model_name and (model.kv_role, model.kv_layout) != (
            known.kv_role, known.kv_layout,
        ):  # fmt: skip
            raise ExecutorMismatch(
                f"the executor came back with another KV role or layout ({model.kv_layout}, "
                f"role {model.kv_role}); restart it as it was, or this scheduler"
            )
        for flag, ours, theirs in (
            ("--max-num-seqs", s.max_num_seqs, info.max_num_seqs),
            ("--max-num-batched-tokens", s.max_num_batched_tokens, info.max_num_batched_tokens),
            ("--max-model-len", s.max_model_len or 0, model.max_model_len),
        ):
            if ours > theirs:
                raise ExecutorMismatch(
                    f"{flag} {ours} exceeds the executor's {theirs} ({s.executor}): "
                    f"lower {flag} or raise the executor's"
                )

    async def _describe(self) -> executor_pb2.DescribeExecutorResponse:
        """Describe with backoff until an executor answers; requests that outwait
        --executor-timeout meanwhile end with UNAVAILABLE."""
        while True:
            try:
                return await self.stub.Describe(
                    executor_pb2.DescribeExecutorRequest(),
                    timeout=self.settings.executor_heartbeat_timeout,
                )
            except grpc.aio.AioRpcError as e:
                log.info("waiting for the executor at %s: %s", self.settings.executor, e.code())
            if self.reconnect.gave_up:
                self.hooks.fail_all(grpc.StatusCode.UNAVAILABLE, (
                    f"no executor for {self.settings.executor_timeout:g}s: retry the request"
                ))  # fmt: skip
            await self.reconnect.wait()

    async def _next_executor(self) -> executor_pb2.DescribeExecutorResponse:
        """Until an executor that can serve the same requests answers: its description."""
        while True:
            info = await self._describe()
            try:
                self._check(info)
            except ExecutorMismatch as e:
                log.error("%s", e)
                self.hooks.fail_all(grpc.StatusCode.UNAVAILABLE, str(e))
                await self.reconnect.wait()
                continue
            await self._restore_adapters(info)
            await self._restore_media()
            self.info.model.num_host_blocks = info.model.num_host_blocks
            self.hooks.on_new_executor(info)
            return info

    # -- LoRA adapters ---------------------------------------------------------
    # self.adapters: the first executor's, then those loaded, replaced and unloaded
    # through us, restored on each executor that comes back. A change reaches the
    # executor only once the steps in flight are answered: the service has ended the
    # requests it concerns, but a step sent before may still run them, and must run
    # them on the weights they began with (else its blocks, cached under the old
    # identity, would hold KV of the new weights: wrong for a later load of the old
    # files, which has the old identity again).

    async def load_lora(self, request) -> generation_pb2.LoadLoRAAdapterResponse:
        await self.after_steps_in_flight()
        reply = await self.stub.LoadLoRAAdapter(request, timeout=self.settings.executor_timeout)
        self.set_adapter(request.lora_name, request.lora_path, reply.id)
        return reply

    async def unload_lora(self, request) -> generation_pb2.UnloadLoRAAdapterResponse:
        """The executor's side of an unload (the service dropped it here first)."""
        await self.after_steps_in_flight()
        return await self.stub.UnloadLoRAAdapter(request, timeout=self.settings.executor_timeout)

    def set_adapter(self, name: str, path: str | None, adapter_id: str = "") -> None:
        """Register (or with path None drop) an adapter, and tell the routers."""
        if path is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = generation_pb2.LoRAAdapter(name=name, path=path, id=adapter_id)
        del self.info.model.lora_adapters[:]
        self.info.model.lora_adapters.extend(self.adapters.values())
        self.lora_version += 1

    async def _restore_adapters(self, info: executor_pb2.DescribeExecutorResponse) -> None:
        """A new executor gets our adapters: one it read itself (--lora-modules) from
        the same files is kept; any other is loaded (replacing its own of that name).
        One whose files changed meanwhile takes its new identity; one it refuses now
        is dropped, said once. (The service then ends the requests these concern.)"""
        theirs = {a.name: a.id for a in info.model.lora_adapters}
        for name, ours in list(self.adapters.items()):
            if theirs.get(name) == ours.id:
                continue
            request = generation_pb2.LoadLoRAAdapterRequest(
                lora_name=name, lora_path=ours.path, load_inplace=True
            )
            try:
                reply = await self.stub.LoadLoRAAdapter(
                    request, timeout=self.settings.executor_timeout
                )
            except grpc.aio.AioRpcError as e:
                log.error("LoRA adapter %s not restored on the new executor: %s", name,
                          e.details())  # fmt: skip
                self.set_adapter(name, None)
                continue
            if reply.id != ours.id:
                log.warning("LoRA adapter %s changed on disk (%s) while the executor was "
                            "away: its requests end", name, ours.path)  # fmt: skip
                self.set_adapter(name, ours.path, reply.id)

    async def after_steps_in_flight(self) -> None:
        """Until every step sent so far is answered, or lost with the executor."""
        if not self.in_flight:
            return
        last = self.in_flight[-1].step_id
        while self.in_flight and self.in_flight[0].step_id <= last:
            self.step_returned.clear()
            await self.step_returned.wait()

    async def prepare_grammar(self, add: scheduler_pb2.AddRequest) -> None:
        """Compile a request's constraint on the executor (raises AioRpcError)."""
        request = executor_pb2.PrepareGrammarRequest(
            structured_outputs=add.sampling.structured_outputs
        )
        await self.stub.PrepareGrammar(request, timeout=self.settings.executor_timeout)

    async def prepare_media(self, items) -> None:
        """Send images' pixels to the executor, a message of at most
        MEDIA_BYTES_PER_CALL each (one image alone may be more; raises AioRpcError)."""
        batch, num_bytes = executor_pb2.PrepareMediaRequest(), 0
        for item in items:
            if batch.items and num_bytes + len(item.pixel_values) > MEDIA_BYTES_PER_CALL:
                await self.stub.PrepareMedia(batch, timeout=self.settings.executor_timeout)
                batch, num_bytes = executor_pb2.PrepareMediaRequest(), 0
            batch.items.append(item)
            num_bytes += len(item.pixel_values)
        if batch.items:
            await self.stub.PrepareMedia(batch, timeout=self.settings.executor_timeout)

    async def _restore_media(self) -> None:
        """A new executor holds no pixels: those of every request still here go
        again, before its first step (a step's encoder work reads them)."""
        items = self.hooks.media_in_flight()
        try:
            await self.prepare_media(items)
        except grpc.aio.AioRpcError as e:  # its steps fail those requests, one line each
            log.error("could not send %d images to the new executor: %s", len(items), e.code())

    # -- the step stream -------------------------------------------------------

    async def run(self, scheduler: Scheduler) -> None:
        """The engine loop, over one executor after another. When the executor is lost
        (dead, or silent past the heartbeat deadline) its KV cache is gone with it:
        every request is preempted for recompute and goes on, with the tokens it has,
        on the next executor."""
        while True:
            call = self.stub.Execute()
            self.connected = True
            self.reconnect.connected()
            self.hooks.on_connection()
            try:
                await self._drive(call, scheduler)
            except (grpc.aio.AioRpcError, ExecutorLost) as e:
                log.error("executor lost: %s", e)
            except TimeoutError:
                log.error("executor lost: silent for %gs", self.settings.executor_heartbeat_timeout)
            except Exception:  # a bug: fail what is in flight rather than hang forever
                log.exception("engine loop failed")
                self.hooks.fail_all(grpc.StatusCode.INTERNAL, "the scheduler failed; retry")
            finally:
                call.cancel()
                self.in_flight.clear()  # lost with the executor
                self.written_at.clear()
                self.step_returned.set()
            self.connected = False
            self.reconnect.lost()
            self.hooks.on_connection()  # still live: the queue waits for the executor
            self.telemetry.executor_lost(scheduler)
            scheduler.reset_executor()
            info = await self._next_executor()
            scheduler.reset_executor(info.model.num_blocks, info.model.num_host_blocks)

    async def _drive(self, call, scheduler: Scheduler) -> None:
        """Plan step N+1 while step N runs (--max-steps-in-flight 2), so the executor
        never waits for the scheduler; read a result when two are out, or when there
        is nothing more to plan."""
        hooks, telemetry = self.hooks, self.telemetry
        in_flight = self.in_flight
        while True:
            if not scheduler.has_unfinished_requests() and not in_flight:
                await self._idle(call)
                continue
            hooks.before_schedule(scheduler)
            plan = scheduler.schedule()
            if scheduler.policy_step.shed:
                hooks.on_shed(scheduler.policy_step.take_shed())
            if not plan.is_empty:
                step = step_to_proto(plan)
                telemetry.on_schedule(plan, step, scheduler)
                await call.write(step)
                in_flight.append(plan)
                self.written_at.append(time.monotonic())
            if in_flight and (
                len(in_flight) >= self.settings.max_steps_in_flight or not plan.num_scheduled_tokens
            ):
                result = await self._read(call)
                done = in_flight.popleft()
                self._measured(scheduler, done)
                self.step_returned.set()
                outputs = scheduler.update_from_output(done, outcome_from_result(result))
                telemetry.on_update(done, outputs, scheduler, hooks.num_queued_at_routers(),
                                    result)  # fmt: skip
                hooks.on_step(done, result, outputs)
            elif not in_flight:
                # Nothing runnable (e.g. all waiting on blocks held by nobody yet).
                self.wakeup.clear()
                await self.wakeup.wait()

    def _measured(self, scheduler: Scheduler, done: SchedulerOutput) -> None:
        """The step's time on the executor, for the step-cost model: from when it was
        sent, or the previous result when it queued behind that step."""
        now = time.monotonic()
        started = max(self.written_at.popleft(), self.last_result_at)
        self.last_result_at = now
        scheduler.policy_step.measured(done, now - started)
        self.cost_record.step_measured(scheduler.policy_step.cost)

    async def _idle(self, call) -> None:
        """Nothing to do: wait for work, probing the executor now and then."""
        self.wakeup.clear()
        try:
            await asyncio.wait_for(self.wakeup.wait(), HEARTBEAT_INTERVAL_S)
            return
        except TimeoutError:
            pass
        await call.write(executor_pb2.StepRequest(heartbeat=True))
        if not (await self._read(call)).heartbeat:
            raise ExecutorLost("a heartbeat got a step result")

    async def _read(self, call) -> executor_pb2.StepResult:
        """The next result; an executor silent past the heartbeat deadline (hung, or
        its host gone without a reset) counts as lost."""
        async with asyncio.timeout(self.settings.executor_heartbeat_timeout):
            result = await call.read()
        if result is grpc.aio.EOF:
            raise ExecutorLost("the executor closed the stream")
        return result
