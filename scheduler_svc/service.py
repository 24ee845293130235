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

from flagstop.health import Health
from flagstop.reconnect import Reconnect
from flagstop.scheduler_svc.convert import request_from_proto, step_to_proto
from flagstop.scheduler_svc.core.output import OwnerOutputs, SchedulerOutput
from flagstop.scheduler_svc.core.policy import RankedPolicy
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.scheduler_svc.core.scheduler import RequestRejected, Scheduler
from flagstop.scheduler_svc.policy_client import POLICY_SERVICE, RemotePolicyClient
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.server import StartupError, TLSConfig, channel
from flagstop.v1 import (
    executor_pb2,
    executor_pb2_grpc,
    generation_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

log = logging.getLogger("flagstop.scheduler")
SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
HEARTBEAT_INTERVAL_S = 1.0
# A router with nothing running here still hears the load this often (and when the
# replica goes idle), so that its replica choice does not rest on an old figure.
LOAD_REPORT_INTERVAL_S = 0.25
EMPTY_LOGPROB = generation_pb2.TokenLogprob()


class ExecutorLost(Exception):
    pass


class ExecutorMismatch(Exception):
    """The executor cannot honour this scheduler's settings; the message says which."""


@dataclass(slots=True, eq=False)
class RouterConnection:
    router_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    credits: int = 0  # granted, not yet used by an add
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
        self.executor_info = executor_pb2.DescribeExecutorResponse()
        self.eos_token_ids: frozenset[int] = frozenset()
        self.routers: dict[str, RouterConnection] = {}
        self.wakeup = asyncio.Event()
        self.executor_connected = False
        self.reconnect = Reconnect(give_up_after_s=settings.executor_timeout)
        self.accepting = True
        self.policy_client: RemotePolicyClient | None = None
        # Constrained requests waiting for the executor to compile their grammar
        # (vLLM's WAITING_FOR_FSM): by id, (owner, task). The step loop never waits.
        self.compiling: dict[str, tuple[str, asyncio.Task]] = {}

    # -- the executor --------------------------------------------------------

    async def connect_executor(self) -> None:
        """Describe the executor (waiting for it to come up) and size the pool from it;
        a configuration it cannot honour stops start-up (StartupError)."""
        s = self.settings
        self.executor = executor_pb2_grpc.ExecutorStub(channel(s.executor, self.tls))
        info = await self._describe()
        try:
            self._check_executor(info)
            config = s.core_config(info.max_model_len, info.block_size)
        except (ExecutorMismatch, ValueError) as e:
            raise StartupError(str(e)) from None
        self.executor_info = info
        self.telemetry.model_name = info.model_name
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.scheduler = Scheduler(config, info.num_blocks)
        if isinstance(self.scheduler.policy, RankedPolicy):
            self.policy_client = RemotePolicyClient(
                s.policy_addr, self.scheduler.policy, s.policy_deadline_ms / 1000,
                self._policy_changed, self.tls,
            )  # fmt: skip
        log.info("executor %s: %s, %d blocks of %d", s.executor, info.model_name,
                 info.num_blocks, info.block_size)  # fmt: skip

    def _check_executor(self, info: executor_pb2.DescribeExecutorResponse) -> None:
        """Refuse what the executor cannot honour now, not as a batch desync later."""
        s, known = self.settings, self.executor_info
        if known.model_name and (info.model_name, info.vocab_size, info.block_size) != (
            known.model_name, known.vocab_size, known.block_size,
        ):  # fmt: skip
            raise ExecutorMismatch(
                f"the executor came back with another model ({info.model_name}, block size "
                f"{info.block_size}); retry the request"
            )
        for flag, ours, theirs in (
            ("--max-num-seqs", s.max_num_seqs, info.max_num_seqs),
            ("--max-num-batched-tokens", s.max_num_batched_tokens, info.max_num_batched_tokens),
            ("--max-model-len", s.max_model_len or 0, info.max_model_len),
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
                return await self.executor.Describe(
                    executor_pb2.DescribeExecutorRequest(),
                    timeout=self.settings.executor_heartbeat_timeout,
                )
            except grpc.aio.AioRpcError as e:
                log.info("waiting for the executor at %s: %s", self.settings.executor, e.code())
            if self.reconnect.gave_up:
                self._fail_all(grpc.StatusCode.UNAVAILABLE, (
                    f"no executor for {self.settings.executor_timeout:g}s: retry the request"
                ))  # fmt: skip
            await self.reconnect.wait()

    async def run(self) -> None:
        """Connect to the executor, then the engine loop. When the executor is lost
        (dead, or silent past the heartbeat deadline) its KV cache is gone with it:
        every request is preempted for recompute and goes on, with the tokens it has,
        on the next executor."""
        await self.connect_executor()
        assert self.scheduler is not None
        while True:
            call = self.executor.Execute()
            self.executor_connected = True
            self.reconnect.connected()
            self.health.set_ready(self.accepting)
            try:
                await self._drive(call)
            except (grpc.aio.AioRpcError, ExecutorLost) as e:
                log.error("executor lost: %s", e)
            except TimeoutError:
                log.error("executor lost: silent for %gs", self.settings.executor_heartbeat_timeout)
            except Exception:  # a bug: fail what is in flight rather than hang forever
                log.exception("engine loop failed")
                self._fail_all(grpc.StatusCode.INTERNAL, "the scheduler failed; retry")
            finally:
                call.cancel()
            self.executor_connected = False
            self.reconnect.lost()
            self.health.set_ready(False)  # still live: the queue waits for the executor
            self.telemetry.executor_lost(self.scheduler)
            self.scheduler.reset_executor()
            await self._reconnect_executor()

    async def _reconnect_executor(self) -> None:
        """Until an executor that can serve the same requests answers."""
        while True:
            info = await self._describe()
            try:
                self._check_executor(info)
            except ExecutorMismatch as e:
                log.error("%s", e)
                self._fail_all(grpc.StatusCode.UNAVAILABLE, str(e))
                await self.reconnect.wait()
                continue
            self.scheduler.reset_executor(info.num_blocks)
            return

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
                len(in_flight) >= self.settings.max_steps_in_flight or not plan.num_scheduled_tokens
            ):
                result = await self._read(call)
                done = in_flight.popleft()
                outputs = scheduler.update_from_output(done, result.sampled_token_ids)
                self.telemetry.on_update(done, outputs, scheduler, self.num_queued_at_routers())
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
        async with asyncio.timeout(self.settings.executor_heartbeat_timeout):
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
        load, now = self._load(), time.monotonic()
        for owner, out in outputs.items():
            conn = self.routers.get(owner)
            if conn is None:
                continue
            conn.load_sent_at = now
            msg = scheduler_pb2.SchedulerMessage(
                step_id=plan.step_id, request_ids=out.req_ids, token_ids=out.new_token_ids,
                finished_ids=list(out.finished), finish_reasons=list(out.finished.values()),
                credits=self._take_credits(conn), load=load,
            )  # fmt: skip
            if logprobs:
                msg.logprobs.extend(logprobs.get(r, EMPTY_LOGPROB) for r in out.req_ids)
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

    def _load(self) -> scheduler_pb2.ReplicaLoad:
        scheduler = self.scheduler
        assert scheduler is not None
        return scheduler_pb2.ReplicaLoad(
            num_running=len(scheduler.running), num_waiting=self.num_waiting(),
            kv_cache_usage=scheduler.kv.pool.usage(),
        )  # fmt: skip

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
        """Keep the waiting queue short: hand out room for more requests only to the
        routers that have some queued, one at a time in turn."""
        if self.scheduler is None or not self.accepting:
            return
        outstanding = sum(c.credits for c in self.routers.values())
        waiting = len(self.scheduler.waiting) + len(self.compiling)
        room = self.settings.max_waiting_requests - waiting - outstanding
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
        errors = []
        if msg.aborts and scheduler is not None:
            self._cancel_compiles(msg.aborts)
            scheduler.abort(msg.aborts)
            for request_id in msg.aborts:
                self.telemetry.on_finish(request_id, FinishReason.ABORT)
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
        if not self.accepting or self.scheduler is None or self.reconnect.gave_up:
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

    async def _compile_then_add(self, conn: RouterConnection, add: scheduler_pb2.AddRequest):
        """The request waits for its grammar here, the batch does not. A grammar the
        executor refuses ends the request with INVALID_ARGUMENT; an executor that does
        not answer (lost, restarting) leaves the compile to the request's first step."""
        request = executor_pb2.PrepareGrammarRequest(
            structured_outputs=add.sampling.structured_outputs
        )
        error = None
        try:
            await self.executor.PrepareGrammar(request, timeout=self.settings.executor_timeout)
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
        self.wakeup.set()

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

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
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
        info = self.executor_info
        return scheduler_pb2.DescribeSchedulerResponse(
            model_name=info.model_name, vocab_size=info.vocab_size,
            max_model_len=self.scheduler.config.max_model_len,  # --max-model-len may lower it
            eos_token_ids=info.eos_token_ids, block_size=info.block_size,
            num_blocks=self.scheduler.num_total_blocks,
        )  # fmt: skip

    async def GetStats(self, request, context) -> scheduler_pb2.GetStatsResponse:
        if self.scheduler is None:
            return scheduler_pb2.GetStatsResponse()
        s = self.scheduler.make_stats()
        return scheduler_pb2.GetStatsResponse(
            step_id=s.step_id, num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
            num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
            kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            executor_connected=self.executor_connected,
            remote_policy_active=self.policy_client is not None and self.policy_client.active,
            remote_policy_failures=self.policy_client.num_failures if self.policy_client else 0,
            num_routers=len(self.routers),
        )  # fmt: skip

    # -- shutdown --------------------------------------------------------------

    async def drain(self) -> None:
        """Stop admitting, let the requests in flight finish (for a while), then abort
        what is left and close the router streams."""
        self.accepting = False
        self.health.set_ready(False)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while self.scheduler is not None and self.scheduler.has_unfinished_requests():
            if asyncio.get_running_loop().time() > deadline:
                self._fail_all(grpc.StatusCode.UNAVAILABLE, "the scheduler shut down")
                break
            await asyncio.sleep(0.05)
        for conn in self.routers.values():
            conn.outbox.put_nowait(None)
