"""In-process speculative decoding for the drafter tests (test_mtp.py, test_eagle.py):
a model runner drafting by a method, a seeded workload, the scheduler core driving it
with drafts on, the greedy reference check, and a recorder of every proposal."""

import random

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from tests.helpers.checkpoints import prompt, reference_generate
from tools.inprocess import Job, run_engine


def spec_runner(path, spec, **config) -> ModelRunner:
    base = dict(model=str(path), num_blocks=256, block_size=4, max_num_seqs=16)
    return ModelRunner(ExecutorConfig(**{**base, **config}, speculative_config=spec))


def spec_jobs(n: int, workload: int, **sampling) -> list[Job]:
    rng = random.Random(workload)
    return [Job(prompt(workload * 100 + i, rng.randrange(4, 30)), rng.randrange(10, 40),
                SamplingParams(**sampling)) for i in range(n)]  # fmt: skip


def spec_engine(runner, jobs, num_blocks=None, **config):
    base = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512, block_size=4,
                num_speculative_tokens=runner.num_speculative_tokens,
                speculative_min_gain=1e-12)  # fmt: skip
    return run_engine(runner, jobs, SchedulerConfig(**{**base, **config}), num_blocks=num_blocks)


def assert_greedy(reference, jobs: list[Job], outputs: list[list[int]]) -> None:
    for job, out in zip(jobs, outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)


def record_proposals(runner) -> list[tuple[list[int], list[int]]]:
    """Each request's known tokens and the drafts proposed after them, as proposed."""
    proposer, seen = runner.drafter.proposer, []
    propose = proposer.propose

    def recording(batch, rows, slots):
        drafts, probs = propose(batch, rows, slots)
        for row, row_drafts in zip(rows.tolist(), drafts, strict=True):
            known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
            seen.append((known, row_drafts.tolist()))
        return drafts, probs

    proposer.propose = recording
    return seen


def checked_proposals(seen: list[tuple[list[int], list[int]]], drafts_of) -> int:
    """Each recorded proposal's drafts against the reference's logits of each draft
    (drafts_of(known, k)), each the argmax up to the first near tie (the chain after
    it may rightly differ); how many drafts were checked."""
    checked = 0
    for known, drafts in seen:
        for ours, logits in zip(drafts, drafts_of(known, len(drafts)), strict=True):
            top = logits.topk(2).values
            if top[0] - top[1] < 1e-3:
                break
            assert ours == int(logits.argmax())
            checked += 1
    return checked
