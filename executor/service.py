"""The executor's gRPC shell: Describe, PrepareGrammar, and the Execute stream of step
diffs, over a Runner (executor/runner.py) and, under tensor parallelism, the group of
ranks this process drives (executor/distributed.py)."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
from prometheus_client import Histogram

from flagstop.adapters import LoadedAdapter, already_loaded, name_refusal
from flagstop.executor.convert import plan_from_proto, result_to_proto
from flagstop.executor.kv_transfers.base import LayoutMismatch
from flagstop.executor.tp_messages import LORA_LOAD, LORA_UNLOAD, MEDIA
from flagstop.scheduler_svc.convert import layers_to_proto
from flagstop.structured import GrammarError, constraint_from_proto
from flagstop.telemetry import LATENCY_BUCKETS, Telemetry, extract
from flagstop.v1 import executor_pb2, executor_pb2_grpc, generation_pb2

if TYPE_CHECKING:  # the simulator runs this service without torch
    from flagstop.executor.distributed import GroupDriver
    from flagstop.executor.runner import Runner

log = logging.getLogger("flagstop.executor")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
STEP_SECONDS = Histogram(
    "flagstop:executor_step_seconds", "Input preparation, forward and sampling of one step",
    ["model_name"], buckets=LATENCY_BUCKETS,
)  # fmt: skip
EXPERT_IMBALANCE = Histogram(
    "flagstop:executor_moe_expert_imbalance",
    "A Mixture-of-Experts step's busiest expert's tokens over the mean expert's "
    "(1: balanced; under expert parallelism the busiest rank waits for its experts)",
    ["model_name"], buckets=(1, 1.25, 1.5, 2, 3, 4, 6, 8, 16, 32),
)  # fmt: skip


class ExecutorService(executor_pb2_grpc.ExecutorServicer):
    def __init__(
        self,
        runner: "Runner",
        model_name: str,
        telemetry: Telemetry,
        group: "GroupDriver | None" = None,
        kv_endpoint: str = "",
    ) -> None:
        """group: the tensor-parallel ranks this process (rank 0) drives, if any;
        kv_endpoint: where decode executors reach this one (--kv-role prefill)."""
        self.runner, self.kv_endpoint = runner, kv_endpoint
        self.tracer = telemetry.tracer
        self.model_name = model_name
        self.group = group
        # Bumped by every new Execute stream: the newest scheduler wins, an older
        # stream still open (a scheduler that died) is ended at its next message.
        self.generation = 0
        self.compile_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.lora_pool = ThreadPoolExecutor(1, thread_name_prefix="lora")

    async def Describe(self, request, context) -> executor_pb2.DescribeExecutorResponse:
        runner, mc = self.runner, self.runner.model_config
        model = generation_pb2.ModelInfo(
            model_name=self.model_name, vocab_size=mc.vocab_size,
            max_model_len=runner.max_model_len, eos_token_ids=list(mc.eos_token_ids),
            block_size=runner.block_size, num_blocks=runner.num_blocks,
            max_loras=runner.max_loras, num_host_blocks=runner.num_host_blocks,
            lora_adapters=[generation_pb2.LoRAAdapter(name=name, path=a.path, id=a.id)
                           for name, a in runner.lora_adapters().items()],
            kv_role=generation_pb2.KVRole.Value(f"KV_ROLE_{runner.config.kv_role.upper()}"),
            kv_layout=runner.kv_layout, kv_layers=layers_to_proto(runner.kv_layers),
            accepts_images=mc.vision is not None,
            pixel_dtype=str(runner.dtype).removeprefix("torch.") if mc.vision else "",
            bidirectional_images=mc.vision is not None and mc.vision.layout.bidirectional,
        )  # fmt: skip
        if (pooling := mc.pooling) is not None:
            model.pooling_tasks.extend(pooling.tasks)
            model.embedding_size = pooling.embedding_size
            model.matryoshka_dimensions.extend(pooling.matryoshka_dimensions)
            model.matryoshka_any = pooling.matryoshka_any
            if pooling.classifier is not None:
                model.labels.extend(pooling.classifier.labels)
        return executor_pb2.DescribeExecutorResponse(
            model=model, max_num_seqs=runner.config.max_num_seqs,
            max_num_batched_tokens=runner.config.max_num_batched_tokens,
            tensor_parallel_size=runner.tensor_parallel_size,
            num_speculative_tokens=runner.num_speculative_tokens,
            speculative_method=runner.speculative_method,
            kv_endpoint=self.kv_endpoint, kv_engine_id=runner.kv_engine_id,
        )  # fmt: skip

    # -- prefill/decode disaggregation: a prefill executor's side ------------------

    async def KVHandshake(self, request, context) -> executor_pb2.KVHandshakeResponse:
        if (side := self.runner.kv_worker.prefill_side()) is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "not a prefill executor (--kv-role prefill)")  # fmt: skip
        try:
            return side.handshake(request.kv_layout)
        except LayoutMismatch as e:
            log.error("refused a decode executor: %s", e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def RenewKVLease(self, request, context) -> executor_pb2.RenewKVLeaseResponse:
        side = self.runner.kv_worker.prefill_side(request.engine_id)
        held = side is not None and await side.leases.renew(request.transfer_id)
        return executor_pb2.RenewKVLeaseResponse(held=held)

    async def ReleaseKVLease(self, request, context) -> executor_pb2.ReleaseKVLeaseResponse:
        side = self.runner.kv_worker.prefill_side(request.engine_id)
        held = side is not None and await side.leases.release(request.transfer_id)
        return executor_pb2.ReleaseKVLeaseResponse(held=held)

    async def PrepareGrammar(self, request, context) -> executor_pb2.PrepareGrammarResponse:
        try:
            constraint = constraint_from_proto(request.structured_outputs)
            # On a thread: llguidance compiles without the GIL, beside the step loop.
            seconds = await asyncio.get_running_loop().run_in_executor(
                self.compile_pool, self.runner.prepare_grammar, constraint
            )
        except GrammarError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return executor_pb2.PrepareGrammarResponse(compile_seconds=seconds)

    async def PrepareMedia(self, request, context) -> executor_pb2.PrepareMediaResponse:
        try:
            for item in request.items:
                self.runner.prepare_media(item.hash, item.pixel_values, list(item.shape),
                                          item.dtype, list(item.grid))  # fmt: skip
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.group is not None:  # every rank runs the (replicated) vision tower
            self.group.broadcast(MEDIA, request.SerializeToString())
        return executor_pb2.PrepareMediaResponse()

    async def LoadLoRAAdapter(self, request, context) -> generation_pb2.LoadLoRAAdapterResponse:
        name = request.lora_name
        if not self.runner.max_loras:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is off: start the executor with --max-loras")  # fmt: skip
        if refusal := name_refusal(name, self.model_name) or (
            None if request.lora_path else f"LoRA adapter {name!r}: lora_path is required"
        ):  # fmt: skip
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        try:  # read on a thread: the step loop goes on meanwhile
            loaded = await asyncio.get_running_loop().run_in_executor(
                self.lora_pool, self._load_lora, request
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"LoRA adapter {name!r}: {e}")
        if loaded is None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, already_loaded(name))
        if self.group is not None:  # back on the loop's thread, between two steps
            self.group.broadcast(LORA_LOAD, request.SerializeToString())
        log.info("LoRA adapter %s %s from %s (rank %d: %s; %s)", name,
                 "replaced" if request.load_inplace else "loaded", request.lora_path,
                 loaded.rank, ", ".join(loaded.modules), loaded.id[:12])  # fmt: skip
        return generation_pb2.LoadLoRAAdapterResponse(
            rank=loaded.rank, modules=loaded.modules, id=loaded.id
        )

    def _load_lora(self, request) -> LoadedAdapter | None:
        """On the one LoRA thread, so that two loads of a name cannot both pass the
        check: None when the name is taken and the request does not replace it."""
        if request.lora_name in self.runner.lora_adapters() and not request.load_inplace:
            return None
        return self.runner.load_lora(request.lora_name, request.lora_path)

    async def UnloadLoRAAdapter(self, request, context) -> generation_pb2.UnloadLoRAAdapterResponse:
        if not self.runner.unload_lora(request.lora_name):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no LoRA adapter {request.lora_name!r} is loaded")  # fmt: skip
        if self.group is not None:
            self.group.broadcast(LORA_UNLOAD, request.SerializeToString())
        log.info("LoRA adapter %s unloaded", request.lora_name)
        return generation_pb2.UnloadLoRAAdapterResponse()

    async def Execute(
        self, request_iterator: AsyncIterator[executor_pb2.StepRequest], context
    ) -> AsyncIterator[executor_pb2.StepResult]:
        self.generation += 1
        generation = self.generation
        # The executor keeps no state across streams: a new scheduler starts afresh.
        self.runner.reset()
        if self.group is not None:
            self.group.reset()
        log.info("scheduler stream %d opened", generation)
        try:
            async for step in request_iterator:
                if generation != self.generation:
                    await context.abort(grpc.StatusCode.ABORTED,
                                        "a newer scheduler stream took over")  # fmt: skip
                if step.heartbeat:
                    yield executor_pb2.StepResult(step_id=step.step_id, heartbeat=True)
                    continue
                yield await self._step(step, context)
        except asyncio.CancelledError:
            # The scheduler left while this process stops (both drained on one Ctrl-C):
            # the stream ends here, not as a traceback of grpc's.
            log.info("scheduler stream %d ended", generation)

    async def _step(self, step: executor_pb2.StepRequest, context) -> executor_pb2.StepResult:
        if self.group is not None:
            self.group.step(step.SerializeToString())
        try:
            plan = plan_from_proto(step)
            with self.tracer.start_as_current_span(
                "executor.step", context=extract(step.traceparent),
                attributes={"flagstop.step": step.step_id},
            ) as span:  # fmt: skip
                started = time.perf_counter()
                output = await self.runner.step(plan)
                STEP_SECONDS.labels(self.model_name).observe(time.perf_counter() - started)
                if (expert_tokens := self.runner.take_expert_tokens()) is not None:
                    self._record_expert_tokens(span, expert_tokens)
            if self.group is not None:
                self.group.sampled(output.token_ids, output.num_sampled_tokens)
        except Exception as e:  # the batch state is now unknown: end the stream
            if self.group is not None:
                self.group.lost(e)
            log.exception("step %d failed", step.step_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {e}")
        return result_to_proto(step.step_id, output)

    def _record_expert_tokens(self, span, expert_tokens: list[int]) -> None:
        """The step's tokens per expert (summed over the sparse layers) on its span, and
        how unevenly they fell: the busiest expert's over the mean."""
        total = sum(expert_tokens)
        if not total:
            return
        imbalance = max(expert_tokens) * len(expert_tokens) / total
        span.set_attribute("flagstop.moe.expert_tokens", expert_tokens)
        span.set_attribute("flagstop.moe.imbalance", round(imbalance, 3))
        EXPERT_IMBALANCE.labels(self.model_name).observe(imbalance)

    async def keep_group_alive(self) -> None:
        if self.group is not None:
            await self.group.keep_alive()

    def stop_group(self) -> None:
        if self.group is not None:
            self.group.stop()
