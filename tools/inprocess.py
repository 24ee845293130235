"""The scheduler core and a Runner driven in one process, steps kept in flight as the
scheduler service keeps them (plan step N+1 before step N's tokens are applied): the
engine without gRPC, for tests and benchmarks of what the core and the runner do
together (speculative decoding's rollbacks against real verification, say)."""

import time
from collections import deque
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler


@dataclass(slots=True)
class Job:
    prompt: list[int]
    max_tokens: int
    sampling_params: object = None  # the executor's SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    num_speculative_tokens: int | None = None
    lora_name: str = ""  # the adapter it runs ("": the base model)
    media: tuple = ()  # its images' MediaPlaceholders (their pixels put to the runner)


@dataclass(slots=True)
class EngineRun:
    outputs: list[list[int]]
    num_steps: int = 0
    seconds: float = 0.0
    # Per step: how many tokens each sampling request emitted.
    tokens_per_request_step: list[int] = field(default_factory=list)
    scheduler: Scheduler | None = None
    # With timestamps: when each job's tokens were applied (perf_counter seconds).
    token_times: list[list[float]] = field(default_factory=list)


def run_engine(
    runner, jobs: list[Job], config: SchedulerConfig, steps_in_flight: int = 2,
    num_blocks: int | None = None, eos_token_ids: frozenset[int] = frozenset(),
    timestamps: bool = False, on_step=None, scheduler: Scheduler | None = None,
) -> EngineRun:  # fmt: skip
    """Every job to its end; outputs in job order. The runner starts from an empty
    batch (as on a new scheduler stream). on_step(scheduler): after each plan;
    scheduler: one to go on with (its caches as an earlier run left them)."""
    runner.reset()
    if scheduler is None:
        scheduler = Scheduler(config, num_blocks or runner.num_blocks,
                              kv_groups=runner.kv_groups)  # fmt: skip
    adapters = runner.lora_adapters()
    for i, job in enumerate(jobs):
        request = Request(
            f"r{i}", "engine", list(job.prompt),
            StopParams(job.max_tokens, ignore_eos=not eos_token_ids,
                       stop_token_ids=job.stop_token_ids),
            eos_token_ids=eos_token_ids, sampling_params=job.sampling_params,
            num_speculative_tokens=job.num_speculative_tokens, lora_name=job.lora_name,
            lora_id=adapters[job.lora_name].id if job.lora_name else "", media=job.media,
        )  # fmt: skip
        scheduler.add_request(request)
    run = EngineRun([[] for _ in jobs], scheduler=scheduler)
    if timestamps:
        run.token_times = [[] for _ in jobs]
    in_flight: deque = deque()
    started = time.perf_counter()
    while scheduler.has_unfinished_requests() or in_flight:
        plan = scheduler.schedule()
        if on_step is not None:
            on_step(scheduler)
        if not plan.is_empty:
            in_flight.append((plan, runner.execute(plan)))
            run.num_steps += 1
        if in_flight and (len(in_flight) >= steps_in_flight or not plan.num_scheduled_tokens):
            done, output = in_flight.popleft()
            outputs = scheduler.update_from_output(done, output)
            run.tokens_per_request_step += output.num_sampled_tokens or [1] * len(
                done.sampling_requests)  # fmt: skip
            now = time.perf_counter()
            for out in outputs.values():
                for req_id, token in zip(out.req_ids, out.new_token_ids, strict=True):
                    run.outputs[int(req_id[1:])].append(token)
                    if timestamps:
                        run.token_times[int(req_id[1:])].append(now)
    run.seconds = time.perf_counter() - started
    return run
