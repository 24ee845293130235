"""The executor's gRPC shell: Describe, and the Execute stream of step diffs."""

import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Histogram

from flagstop.executor.convert import plan_from_proto, result_to_proto
from flagstop.executor.model_runner import ModelRunner
from flagstop.telemetry import LATENCY_BUCKETS, Telemetry, extract
from flagstop.v1 import executor_pb2, executor_pb2_grpc

log = logging.getLogger("flagstop.executor")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
STEP_SECONDS = Histogram(
    "flagstop:executor_step_seconds", "Input preparation, forward and sampling of one step",
    ["model_name"], buckets=LATENCY_BUCKETS,
)  # fmt: skip


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, model_name: str, telemetry: Telemetry) -> None:
        self.runner = runner
        self.tracer = telemetry.tracer
        self.model_name = model_name
        # Bumped by every new Execute stream: the newest scheduler wins, an older
        # stream still open (a scheduler that died) is ended at its next message.
        self.generation = 0

    async def Describe(self, request, context) -> executor_pb2.DescribeExecutorResponse:
        runner, mc = self.runner, self.runner.model_config
        return executor_pb2.DescribeExecutorResponse(
            model_name=self.model_name, vocab_size=mc.vocab_size,
            max_model_len=runner.max_model_len, eos_token_ids=list(mc.eos_token_ids),
            block_size=runner.block_size, num_blocks=runner.num_blocks,
            max_num_seqs=runner.config.max_num_seqs,
            max_num_batched_tokens=runner.config.max_num_batched_tokens,
        )  # fmt: skip

    async def Execute(
        self, request_iterator: AsyncIterator[executor_pb2.StepRequest], context
    ) -> AsyncIterator[executor_pb2.StepResult]:
        self.generation += 1
        generation = self.generation
        # The executor keeps no state across streams: a new scheduler starts afresh.
        self.runner.reset()
        log.info("scheduler stream %d opened", generation)
        async for step in request_iterator:
            if generation != self.generation:
                await context.abort(grpc.StatusCode.ABORTED, "a newer scheduler stream took over")
            if step.heartbeat:
                yield executor_pb2.StepResult(step_id=step.step_id, heartbeat=True)
                continue
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
                    output = self.runner.execute(plan)
                    STEP_SECONDS.labels(self.model_name).observe(time.perf_counter() - started)
            except Exception as e:  # the batch state is now unknown: end the stream
                log.exception("step %d failed", step.step_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {e}")
            yield result_to_proto(step.step_id, output)
