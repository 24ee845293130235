"""The scheduler's gRPC shell: router streams in, the executor stream out, and the
engine loop between them keeping up to two steps in flight."""

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from flagstop import wire
from flagstop.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    generation_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.output import OwnerOutputs, SchedulerOutput
from scheduler_svc.policy import RankedPolicy
from scheduler_svc.policy_client import POLICY_SERVICE, RemotePolicyClient
from scheduler_svc.request import RequestStatus
from scheduler_svc.scheduler import RequestRejected, Scheduler
from scheduler_svc.telemetry import SchedulerTelemetry
from scheduler_svc.wire import FINISH_TO_PROTO, request_from_proto, step_to_proto

log = logging.getLogger("flagstop.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
HEARTBEAT_INTERVAL_S = 1.0


class ExecutorLost(Exception):
    pass


@dataclass(slots=True, eq=False)
class RouterConnection:
    router_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    credits: int = 0  # granted, not yet used by an add
    num_queued: int = 0  # requests waiting at the router, as it last said


@dataclass(slots=True)
class ServiceOptions:
    executor_address: str
    max_model_len: int | None = None  # None: the executor's
    # Requests waiting here beyond this are left queued at the routers (credits).
    max_waiting_requests: int = 256
    # 2: step N+1 is scheduled and sent while step N runs, so the executor never waits
    # for us. 1: strictly one at a time.
    max_steps_in_flight: int = 2
    policy_address: str = "127.0.0.1:50060"  # with --policy remote
    policy_deadline_s: float = 0.020
    drain_timeout_s: float = 30.0
    # A step or heartbeat unanswered this long means the executor is hung.
    heartbeat_timeout_s: float = 30.0
    # Requests wait this long for a lost executor to come back, then fail.
    executor_timeout_s: float = 60.0
    tls: wire.TLSConfig | None = None


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        config: SchedulerConfig,
        options: ServiceOptions,
        health,
        telemetry: SchedulerTelemetry,
    ) -> None:
        self.config = config
        self.options = options
        self.health = health
        self.telemetry = telemetry
        self.scheduler: Scheduler | None = None
        self.model_info = generation_pb2.ModelInfo()
        self.eos_token_ids: frozenset[int] = frozenset()
        self.routers: dict[str, RouterConnection] = {}
        self.wakeup = asyncio.Event()
        self.executor_connected = False
        self.executor_lost_since: float | None = None
        self.accepting = True
        self.policy_client: RemotePolicyClient | None = None

    # -- the executor --------------------------------------------------------

    async def connect_executor(self) -> None:
        """Describe the executor (waiting for it to come up) and size the pool from it."""
        self.channel = wire.channel(self.options.executor_address, self.options.tls)
        self.executor = executor_pb2_grpc.ExecutorStub(self.channel)
        info = await self._describe()
        self.model_info = info
        self.telemetry.model_name = info.model_name
        self.eos_token_ids = frozenset(info.eos_token_ids)
        max_model_len = min(self.options.max_model_len or info.max_model_len, info.max_model_len)
        self.config = SchedulerConfig(
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs, max_model_len=max_model_len,
            block_size=info.block_size,
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
            enable_chunked_prefill=self.config.enable_chunked_prefill,
            enable_prefix_caching=self.config.enable_prefix_caching, policy=self.config.policy,
        )  # fmt: skip
        self.scheduler = Scheduler(self.config, info.num_blocks)
        if isinstance(self.scheduler.policy, RankedPolicy):
            self.policy_client = RemotePolicyClient(
                self.options.policy_address, self.scheduler.policy,
                self.options.policy_deadline_s, self._policy_changed, self.options.tls,
            )  # fmt: skip
        log.info("executor %s: %s, %d blocks of %d", self.options.executor_address,
                 info.model_name, info.num_blocks, info.block_size)  # fmt: skip

    async def _describe(self) -> generation_pb2.ModelInfo:
        """Describe with backoff until an executor answers; requests that outwait
        --executor-timeout meanwhile end with UNAVAILABLE."""
        delay = 0.1
        while True:
            try:
                return await self.executor.Describe(
                    executor_pb2.DescribeRequest(), timeout=self.options.heartbeat_timeout_s
                )
            except grpc.aio.AioRpcError as e:
                log.info("waiting for the executor at %s: %s", self.options.executor_address,
                         e.code())  # fmt: skip
            if self._executor_timed_out():
                self._fail_all(grpc.StatusCode.UNAVAILABLE, (
                    f"no executor for {self.options.executor_timeout_s:g}s: retry the request"
                ))  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _executor_timed_out(self) -> bool:
        lost_since = self.executor_lost_since
        return lost_since is not None and (
            time.monotonic() - lost_since > self.options.executor_timeout_s
        )

    async def run(self) -> None:
        """The engine loop. When the executor is lost (dead, or silent past the
        heartbeat deadline) its KV cache is gone with it: every request is preempted
        for recompute and goes on, with the tokens it has, on the next executor."""
        while True:
            call = self.executor.Execute()
            self.executor_connected, self.executor_lost_since = True, None
            wire.set_serving(self.health, [SERVICE_NAME], True)
            try:
                await self._drive(call)
            except (grpc.aio.AioRpcError, ExecutorLost) as e:
                log.error("executor lost: %s", e)
            except TimeoutError:
                log.error("executor lost: silent for %gs", self.options.heartbeat_timeout_s)
            except Exception:  # a bug: fail what is in flight rather than hang forever
                log.exception("engine loop failed")
                self._fail_all(grpc.StatusCode.INTERNAL, "the scheduler failed; retry")
            finally:
                call.cancel()
            self.executor_connected, self.executor_lost_since = False, time.monotonic()
            wire.set_serving(self.health, [SERVICE_NAME], False)
            self.telemetry.executor_lost(self.scheduler)
            self.scheduler.reset_executor(self.scheduler.kv.pool.num_blocks)
            info = await self._describe()
            if (info.model_name, info.vocab_size) != (
                self.model_info.model_name,
                self.model_info.vocab_size,
            ):
                self._fail_all(grpc.StatusCode.UNAVAILABLE, "the executor came back with "
                               f"another model ({info.model_name}); retry the request")  # fmt: skip
            self.scheduler.reset_executor(info.num_blocks)

    async def _drive(self, call) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        in_flight: deque[SchedulerOutput] = deque()
        while True:
            if not scheduler.has_unfinished_requests() and not in_flight:
                await self._idle(call)
                continue
            if self.policy_client is not None:
                self.policy_client.maybe_query(scheduler)
            plan = scheduler.schedule()
            if not plan.is_empty:
                step = step_to_proto(plan)
                self.telemetry.on_schedule(plan, step, scheduler)
                await call.write(step)
                in_flight.append(plan)
            if in_flight and (
                len(in_flight) >= self.options.max_steps_in_flight or not plan.num_scheduled_tokens
            ):
                result = await self._read(call)
                done = in_flight.popleft()
                outputs = scheduler.update_from_output(done, result.sampled_token_ids)
                self.telemetry.on_update(done, outputs, scheduler)
                self._dispatch(done, result, outputs)
            elif not in_flight:
                # Nothing runnable (e.g. all waiting on blocks held by nobody yet).
                self.wakeup.clear()
                await self.wakeup.wait()

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
        async with asyncio.timeout(self.options.heartbeat_timeout_s):
            result = await call.read()
        if result is grpc.aio.EOF:
            raise ExecutorLost("the executor closed the stream")
        return result

    def _dispatch(
        self,
        plan: SchedulerOutput,
        result: executor_pb2.StepResult,
        outputs: dict[str, OwnerOutputs],
    ) -> None:
        logprobs = {}
        if result.logprobs:
            logprobs = {
                r.request_id: lp
                for r, lp in zip(plan.sampling_requests, result.logprobs, strict=True)
            }
        self._grant_credits()
        for owner, out in outputs.items():
            conn = self.routers.get(owner)
            if conn is None:
                continue
            msg = scheduler_pb2.SchedulerMessage(
                step_id=plan.step_id, request_ids=out.req_ids, token_ids=out.new_token_ids,
                finished_ids=list(out.finished),
                finish_reasons=[FINISH_TO_PROTO[r] for r in out.finished.values()],
                credits=self._take_credits(conn),
            )  # fmt: skip
            if logprobs:
                msg.logprobs.extend(
                    logprobs.get(r, generation_pb2.TokenLogprob()) for r in out.req_ids
                )
            conn.outbox.put_nowait(msg)
        for conn in self.routers.values():
            if conn.credits and conn.router_id not in outputs:
                conn.outbox.put_nowait(
                    scheduler_pb2.SchedulerMessage(credits=self._take_credits(conn))
                )

    # -- the remote policy -----------------------------------------------------

    def _policy_changed(self, active: bool, failure: str) -> None:
        if failure:
            self.telemetry.event("policy fallback", {"flagstop.reason": failure})
        # Health detail: the policy's own entry is SERVING while its rankings are used;
        # the scheduler as a whole keeps serving (FCFS) either way.
        wire.set_serving(self.health, [POLICY_SERVICE], active, overall=False)

    # -- credits ---------------------------------------------------------------

    def _grant_credits(self) -> None:
        """Keep the waiting queue short: hand out room for more requests only to the
        routers that have some queued, one at a time in turn."""
        if self.scheduler is None or not self.accepting:
            return
        outstanding = sum(c.credits for c in self.routers.values())
        room = self.options.max_waiting_requests - len(self.scheduler.waiting) - outstanding
        wanting = [c for c in self.routers.values() if c.num_queued > c.credits]
        while room > 0 and wanting:
            for conn in list(wanting):
                if room == 0:
                    break
                conn.credits += 1
                room -= 1
                if conn.credits >= conn.num_queued:
                    wanting.remove(conn)

    @staticmethod
    def _take_credits(conn: RouterConnection) -> int:
        # Credits are sent once; the router spends them and we count its adds down.
        sent, conn.credits = conn.credits, 0
        conn.num_queued = max(0, conn.num_queued - sent)
        return sent

    # -- routers ---------------------------------------------------------------

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.RouterMessage], context
    ) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        conn = RouterConnection(router_id=uuid.uuid4().hex)
        reader = asyncio.create_task(self._read_router(conn, request_iterator))
        try:
            while True:
                get = asyncio.create_task(conn.outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break  # the router closed its side
                msg = get.result()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            self._drop_router(conn)

    async def _read_router(self, conn: RouterConnection, request_iterator) -> None:
        registered = False
        async for msg in request_iterator:
            if not registered:
                if msg.router_id in self.routers:
                    log.error("refused a second router calling itself %s", msg.router_id)
                    conn.outbox.put_nowait(None)
                    return
                conn.router_id = msg.router_id or conn.router_id
                self.routers[conn.router_id] = conn
                registered = True
            self._apply(conn, msg)

    def _apply(self, conn: RouterConnection, msg: scheduler_pb2.RouterMessage) -> None:
        conn.num_queued = msg.num_queued
        scheduler = self.scheduler
        errors = []
        if msg.aborts and scheduler is not None:
            scheduler.abort(msg.aborts)
            for request_id in msg.aborts:
                self.telemetry.on_finish(request_id, "abort")
        for add in msg.adds:
            error = self._add(conn, add)
            if error is not None:
                errors.append(error)
        self._grant_credits()
        if errors or conn.credits:
            conn.outbox.put_nowait(
                scheduler_pb2.SchedulerMessage(errors=errors, credits=self._take_credits(conn))
            )
        self.wakeup.set()

    def _add(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        # While a lost executor may still come back, new requests wait with the rest.
        if not self.accepting or self.scheduler is None or self._executor_timed_out():
            return scheduler_pb2.RequestError(
                request_id=add.request_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                message="the scheduler is not serving (starting, stopping, or no executor)",
            )  # fmt: skip
        try:
            self.scheduler.add_request(request_from_proto(add, conn.router_id, self.eos_token_ids))
            self.telemetry.on_add(add.request_id, len(add.prompt_token_ids), add.traceparent)
        except RequestRejected as e:
            return scheduler_pb2.RequestError(
                request_id=add.request_id,
                code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                message=str(e),
            )
        return None

    def _drop_router(self, conn: RouterConnection) -> None:
        """Its clients are gone with it: nobody is left to stream these tokens to."""
        if self.routers.get(conn.router_id) is conn:
            del self.routers[conn.router_id]
        if self.scheduler is not None:
            owned = [
                r.request_id for r in self.scheduler.requests.values() if r.owner == conn.router_id
            ]
            self.scheduler.abort(owned)
            for request_id in owned:
                self.telemetry.on_finish(request_id, "abort")

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        if self.scheduler is None:
            return
        by_owner: dict[str, list[str]] = {}
        for request in self.scheduler.requests.values():
            by_owner.setdefault(request.owner, []).append(request.request_id)
        for owner, ids in by_owner.items():
            self.scheduler.abort(ids, RequestStatus.FINISHED_ERROR)
            for request_id in ids:
                self.telemetry.on_finish(request_id, "error")
            conn = self.routers.get(owner)
            if conn is not None:
                errors = [
                    scheduler_pb2.RequestError(request_id=r, code=code.value[0], message=message)
                    for r in ids
                ]
                conn.outbox.put_nowait(scheduler_pb2.SchedulerMessage(errors=errors))
        # A new executor stream starts from an empty batch: forget what the old one held.
        self.scheduler.finished_req_ids.clear()

    # -- unary -----------------------------------------------------------------

    async def Describe(self, request, context) -> generation_pb2.ModelInfo:
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "waiting for the executor")
        info = generation_pb2.ModelInfo()
        info.CopyFrom(self.model_info)
        info.max_model_len = self.config.max_model_len  # --max-model-len may lower it
        return info

    async def GetStats(self, request, context) -> scheduler_pb2.SchedulerStats:
        if self.scheduler is None:
            return scheduler_pb2.SchedulerStats()
        s = self.scheduler.make_stats()
        return scheduler_pb2.SchedulerStats(
            step_id=s.step_id, num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            executor_connected=self.executor_connected,
            remote_policy_active=self.policy_client is not None and self.policy_client.active,
            remote_policy_failures=self.policy_client.num_failures if self.policy_client else 0,
        )  # fmt: skip

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting, let the requests in flight finish (for a while), then abort
        what is left and close the router streams."""
        self.accepting = False
        wire.set_serving(self.health, [SERVICE_NAME], False)
        deadline = asyncio.get_running_loop().time() + self.options.drain_timeout_s
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                self._fail_all(grpc.StatusCode.UNAVAILABLE, "the scheduler shut down")
                break
            await asyncio.sleep(0.05)
        for conn in self.routers.values():
            conn.outbox.put_nowait(None)
