"""Hand-written step plans for the executor: a test says who joins, how many tokens
each request computes this step and who leaves; the harness keeps the block tables
and writes the diff, as the scheduler would."""

from dataclasses import dataclass, field

import torch

from flagstop.executor.convert import plan_from_proto, sampling_to_proto
from flagstop.executor.distributed import Group
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SampleOutput, SamplingParams
from flagstop.executor.tp_messages import STEP
from flagstop.scheduler_svc.convert import step_to_proto
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.utils import cdiv
from flagstop.v1 import executor_pb2


@dataclass
class Tracked:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int = 0
    sent: bool = False
    lora_name: str = ""


@dataclass
class Harness:
    runner: ModelRunner
    requests: dict[str, Tracked] = field(default_factory=dict)
    free_blocks: list[int] = field(default_factory=list)
    pending_drop: set[str] = field(default_factory=set)
    pending_preempt: set[str] = field(default_factory=set)
    params: dict[str, SamplingParams] = field(default_factory=dict)
    # Rank 0 of a tensor-parallel group: each plan goes to the other ranks first, as
    # the service sends it (through its wire form, which fixes the batch order).
    group: Group | None = None

    def __post_init__(self) -> None:
        self.free_blocks = list(range(self.runner.num_blocks))

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def num_groups(self) -> int:
        """KV cache groups: each block position holds one block id per group."""
        return len(self.runner.kv_groups)

    def prefix_blocks(self, req_id: str, num_positions: int) -> list[int]:
        """The block ids of a request's first num_positions blocks (every group's)."""
        return self.requests[req_id].block_ids[: num_positions * self.num_groups]

    def add(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams | None = None,
        shared_blocks: list[int] | None = None,
        lora_name: str = "",
    ) -> None:
        """shared_blocks: full blocks of another request holding this prompt's prefix;
        lora_name: the adapter it runs."""
        shared = list(shared_blocks or [])
        self.requests[req_id] = Tracked(
            list(prompt), len(prompt), shared, len(shared) // self.num_groups * self.block_size,
            lora_name=lora_name,
        )  # fmt: skip
        self.params[req_id] = params or SamplingParams()

    def leave(self, req_id: str) -> None:
        self.pending_drop.add(req_id)
        self._free(self.requests.pop(req_id))

    def preempt(self, req_id: str) -> None:
        """Drop the request's cache; it resumes with all its tokens on its next step."""
        tracked = self.requests[req_id]
        self._free(tracked)
        self.pending_preempt.add(req_id)
        tracked.block_ids, tracked.num_computed_tokens, tracked.sent = [], 0, False

    def _free(self, tracked: Tracked) -> None:
        self.free_blocks = tracked.block_ids[::-1] + self.free_blocks

    def plan(self, num_tokens: dict[str, int]) -> SchedulerOutput:
        """The executor's plan of the step, as the service decodes it."""
        return plan_from_proto(self.step_request(num_tokens))

    def step_request(self, num_tokens: dict[str, int]) -> executor_pb2.StepRequest:
        """The step on the wire, written as the scheduler service writes it (in batch
        order: the requests the executor holds, then those it gets now)."""
        plan = SchedulerOutput(
            finished_req_ids=self.pending_drop, preempted_req_ids=self.pending_preempt
        )
        self.pending_drop, self.pending_preempt = set(), set()
        joining = {}
        for req_id, n in num_tokens.items():
            tracked = self.requests[req_id]
            total = tracked.num_computed_tokens + n
            assert total <= len(tracked.token_ids)
            # Position-major, a block per group each (window groups keep theirs here:
            # the executor must read only the window however many it holds).
            num_positions = cdiv(total, self.block_size) - len(tracked.block_ids) // self.num_groups
            new_blocks = [self.free_blocks.pop(0) for _ in range(num_positions * self.num_groups)]
            tracked.block_ids += new_blocks
            if not tracked.sent:
                plan.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id,
                        list(tracked.token_ids),
                        tracked.num_prompt_tokens,
                        sampling_to_proto(self.params[req_id]),
                        list(tracked.block_ids),
                        tracked.num_computed_tokens,
                        tracked.lora_name,
                    )
                )
                tracked.sent = True
                joining[req_id] = n
            else:
                cached = plan.scheduled_cached_reqs
                cached.req_ids.append(req_id)
                cached.num_computed_tokens.append(tracked.num_computed_tokens)
                cached.new_block_ids.append(new_blocks)
                plan.num_scheduled_tokens[req_id] = n
            tracked.num_computed_tokens = total
        plan.num_scheduled_tokens.update(joining)
        return step_to_proto(plan)

    def sampling_ids(self, plan: SchedulerOutput) -> list[str]:
        requests = self.requests
        return [
            r
            for r in plan.num_scheduled_tokens
            if requests[r].num_computed_tokens == len(requests[r].token_ids)
        ]

    def _send(self, num_tokens: dict[str, int]) -> SchedulerOutput:
        step = self.step_request(num_tokens)
        if self.group is not None:
            self.group.send(STEP, step.SerializeToString())
        return plan_from_proto(step)

    def _sampled(self, tokens: list[int]) -> None:
        if self.group is not None:
            self.group.set_sampled(list(tokens))

    def step(self, num_tokens: dict[str, int]) -> dict[str, int]:
        plan = self._send(num_tokens)
        ids = self.sampling_ids(plan)
        output: SampleOutput = self.runner.execute(plan)
        self._sampled(output.token_ids)
        for req_id, token in zip(ids, output.token_ids, strict=True):
            self.requests[req_id].token_ids.append(token)
        return dict(zip(ids, output.token_ids, strict=True))

    def logits(self, num_tokens: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run the step; the logits of each request that samples, whose greedy token is
        appended as the next one."""
        plan = self._send(num_tokens)
        ids = self.sampling_ids(plan)
        result = self.runner.compute_logits(plan)
        if result is None:
            self._sampled([])
            return {}
        logits, inputs = result
        greedy = logits.argmax(-1).tolist()
        self.runner.advance(inputs, greedy)
        self._sampled(greedy)
        for req_id, token in zip(ids, greedy, strict=True):
            self.requests[req_id].token_ids.append(token)
        return dict(zip(ids, logits, strict=True))
