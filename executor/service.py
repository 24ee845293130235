"""The executor's gRPC shell: Describe, and the Execute stream of step diffs."""

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from prometheus_client import Histogram

from flagstop.executor.convert import plan_from_proto, result_to_proto
from flagstop.executor.tp_messages import RESET, STEP, STOP
from flagstop.structured import GrammarError, spec_from_proto
from flagstop.telemetry import LATENCY_BUCKETS, Telemetry, extract
from flagstop.v1 import executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:  # the simulator runs this service without torch
    from flagstop.executor.distributed import Group
    from flagstop.executor.model_runner import ModelRunner

log = logging.getLogger("flagstop.executor")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
STEP_SECONDS = Histogram(
    "flagstop:executor_step_seconds", "Input preparation, forward and sampling of one step",
    ["model_name"], buckets=LATENCY_BUCKETS,
)  # fmt: skip


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(
        self,
        runner: "ModelRunner",
        model_name: str,
        telemetry: Telemetry,
        group: "Group | None" = None,
    ) -> None:
        """runner: a ModelRunner, or the SimulatedRunner (a load-test tool); group:
        the tensor-parallel ranks this process (rank 0) drives, if any."""
        self.runner = runner
        self.tracer = telemetry.tracer
        self.model_name = model_name
        self.group = group
        # Bumped by every new Execute stream: the newest scheduler wins, an older
        # stream still open (a scheduler that died) is ended at its next message.
        self.generation = 0
        self.compile_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")

    # -- the tensor-parallel group ---------------------------------------------

    def _to_group(self, kind: int, payload: bytes = b"") -> None:
        if self.group is not None:
            try:
                self.group.send(kind, payload)
            except Exception as e:
                self.group_lost(e)

    def group_lost(self, error: Exception) -> None:
        """A rank died or hung, or a step failed with the ranks out of step: the group
        cannot go on. Down it goes, at once and loudly; the scheduler sees a lost
        executor and recomputes when a supervisor has restarted it."""
        log.critical("tensor-parallel group lost (%s): exiting for a restart", error)
        if self.group is not None:
            self.group.stop_children()
        os._exit(1)

    async def keep_group_alive(self) -> None:
        """Ping the other ranks while idle: a dead one is found before the next step,
        and a waiting one is not mistaken for a hung rank 0."""
        while self.group is not None:
            await asyncio.sleep(self.group.timeout_s / 8)
            if self.group is None:
                return  # stopped meanwhile
            try:
                self.group.ping_if_idle()
            except Exception as e:
                self.group_lost(e)

    def stop_group(self) -> None:
        """On shutdown: the other ranks exit with this one, and nothing pings them."""
        group, self.group = self.group, None
        if group is not None:
            try:
                group.send(STOP)
            except Exception as e:
                log.warning("the tensor-parallel ranks did not take the stop: %s", e)
            group.stop_children(grace_s=5.0)

    async def Describe(self, request, context) -> executor_pb2.DescribeExecutorResponse:
        runner, mc = self.runner, self.runner.model_config
        return executor_pb2.DescribeExecutorResponse(
            model_name=self.model_name, vocab_size=mc.vocab_size,
            max_model_len=runner.max_model_len, eos_token_ids=list(mc.eos_token_ids),
            block_size=runner.block_size, num_blocks=runner.num_blocks,
            max_num_seqs=runner.config.max_num_seqs,
            max_num_batched_tokens=runner.config.max_num_batched_tokens,
            tensor_parallel_size=runner.tensor_parallel_size,
        )  # fmt: skip

    async def PrepareGrammar(self, request, context) -> executor_pb2.PrepareGrammarResponse:
        prepare = getattr(self.runner, "prepare_grammar", None)
        if prepare is None:  # the simulator: its tokens are not sampled from a model
            return executor_pb2.PrepareGrammarResponse()
        try:
            spec = spec_from_proto(request.structured_outputs)
            # On a thread: llguidance compiles without the GIL, beside the step loop.
            seconds = await asyncio.get_running_loop().run_in_executor(
                self.compile_pool, prepare, spec
            )
        except GrammarError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return executor_pb2.PrepareGrammarResponse(compile_seconds=seconds)

    async def Execute(
        self, request_iterator: AsyncIterator[executor_pb2.StepRequest], context
    ) -> AsyncIterator[executor_pb2.StepResult]:
        self.generation += 1
        generation = self.generation
        # The executor keeps no state across streams: a new scheduler starts afresh.
        self.runner.reset()
        self._to_group(RESET)
        log.info("scheduler stream %d opened", generation)
        async for step in request_iterator:
            if generation != self.generation:
                await context.abort(grpc.StatusCode.ABORTED, "a newer scheduler stream took over")
            if step.heartbeat:
                yield executor_pb2.StepResult(step_id=step.step_id, heartbeat=True)
                continue
            self._to_group(STEP, step.SerializeToString())
            try:
                plan = plan_from_proto(step)
                # On the event loop's own thread: the next step waits in gRPC's buffers
                # anyway, and a forward on a worker thread ran ~20% slower on the CPU
                # (measured with bench/peers.py), its threads contending with the loop.
                with self.tracer.start_as_current_span(
                    "executor.step", context=extract(step.traceparent),
                    attributes={"flagstop.step": step.step_id},
                ):  # fmt: skip
                    started = time.perf_counter()
                    output = await self.runner.step(plan)
                    STEP_SECONDS.labels(self.model_name).observe(time.perf_counter() - started)
                if self.group is not None:
                    self.group.sampled = output.token_ids  # sent with the next step
            except Exception as e:  # the batch state is now unknown: end the stream
                if self.group is not None:
                    self.group_lost(e)
                log.exception("step %d failed", step.step_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {e}")
            yield result_to_proto(step.step_id, output)
