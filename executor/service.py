"""The executor's gRPC shell: Describe, and the Execute stream of step diffs."""

import logging
import time
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Histogram

from executor.model_runner import ModelRunner
from executor.plan import CachedRequests, NewRequest, StepPlan
from executor.sampling import SampleOutput, SamplingParams
from flagstop.telemetry import Telemetry, extract
from flagstop.v1 import executor_pb2, executor_pb2_grpc, generation_pb2

log = logging.getLogger("flagstop.executor")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
STEP_SECONDS = Histogram(
    "flagstop:executor_step_seconds", "Input preparation, forward and sampling of one step",
    ["model_name"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)  # fmt: skip


def sampling_from_proto(p: executor_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        min_tokens=p.min_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def plan_from_proto(step: executor_pb2.StepRequest) -> StepPlan:
    c = step.cached
    req_ids = list(c.request_ids)
    new_block_ids: list[list[int]] = [[] for _ in req_ids]
    if c.new_block_ids:
        flat, start = list(c.new_block_ids), 0
        for i, n in enumerate(c.num_new_blocks):
            new_block_ids[i], start = flat[start : start + n], start + n
    plan = StepPlan(
        scheduled_cached_reqs=CachedRequests(req_ids, list(c.num_computed_tokens), new_block_ids),
        num_scheduled_tokens=dict(zip(req_ids, c.num_scheduled_tokens, strict=True)),
        finished_req_ids=set(step.finished_ids),
        preempted_req_ids=set(step.preempted_ids),
    )
    for r in step.new_requests:
        plan.scheduled_new_reqs.append(
            NewRequest(
                r.request_id, list(r.token_ids), r.num_prompt_tokens,
                sampling_from_proto(r.sampling), list(r.block_ids), r.num_computed_tokens,
            )
        )  # fmt: skip
        plan.num_scheduled_tokens[r.request_id] = r.num_scheduled_tokens
    return plan


def result_to_proto(step_id: int, output: SampleOutput) -> executor_pb2.StepResult:
    result = executor_pb2.StepResult(step_id=step_id, sampled_token_ids=output.token_ids)
    for token_id, row in zip(output.token_ids, output.logprobs or (), strict=False):
        entry = result.logprobs.add(token_id=token_id)
        if row is not None:
            entry.logprob = row[0]
            entry.top.extend(
                generation_pb2.TopLogprob(token_id=t, logprob=lp)
                for t, lp in zip(row[1], row[2], strict=True)
            )
    return result


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, runner: ModelRunner, model_name: str, telemetry: Telemetry) -> None:
        self.runner = runner
        self.tracer = telemetry.tracer
        self.model_name = model_name
        # Bumped by every new Execute stream: the newest scheduler wins, an older
        # stream still open (a scheduler that died) is ended at its next message.
        self.generation = 0

    async def Describe(self, request, context) -> generation_pb2.ModelInfo:
        mc = self.runner.model_config
        return generation_pb2.ModelInfo(
            model_name=self.model_name,
            vocab_size=mc.vocab_size,
            max_model_len=self.runner.max_model_len,
            eos_token_ids=list(mc.eos_token_ids),
            block_size=self.runner.block_size,
            num_blocks=self.runner.num_blocks,
        )

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
