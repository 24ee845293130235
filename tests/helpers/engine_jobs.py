"""Greedy workloads for the in-process engine (tools/inprocess.py) on the tiny test
checkpoints (tests/helpers/checkpoints.py): the scheduler config they run under and
the check of their outputs against transformers."""

import random

from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from tests.helpers.checkpoints import prompt, reference_generate
from tools.inprocess import Job


def engine_config(**overrides) -> SchedulerConfig:
    """16-token steps past 4-token blocks: chunks everywhere."""
    base = dict(max_num_batched_tokens=16, max_num_seqs=6, max_model_len=512, block_size=4)
    return SchedulerConfig(**{**base, **overrides})


def greedy_jobs(n: int, seed: int = 0, shared: list[int] | None = None) -> list[Job]:
    """n prompts of 12-40 tokens (after `shared`, when given), 10-30 tokens out each."""
    rng = random.Random(seed)
    head = shared or []
    return [Job([*head, *prompt(seed * 100 + i, rng.randrange(12, 40))[len(head) > 0 :]],
                rng.randrange(10, 30), SamplingParams()) for i in range(n)]  # fmt: skip


def assert_equal_to_transformers(reference, jobs, outputs) -> None:
    for job, out in zip(jobs, outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)
    every = [t for out in outputs for t in out]
    assert len(set(every)) > 0.3 * len(every), "degenerate reference: the test could not fail"
