"""Windowed models through the real scheduler core and model runner (in one process,
steps in flight as the service keeps them): the core's KV cache groups free what
left the window while the executor reads only the window, and greedy outputs equal
transformers' through chunked prefill, prefix hits, preemption and speculative
decoding. Logits per step: tests/test_executor_model.py's window variants."""

import random

import pytest

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from tests.helpers.checkpoints import (
    load_reference,
    prompt,
    write_checkpoint,
)
from tests.helpers.engine_jobs import (
    assert_equal_to_transformers,
    engine_config,
    greedy_jobs,
)
from tools.inprocess import Job, run_engine

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

WINDOW = 8  # the checkpoints' (tests/helpers/checkpoints.py WINDOW_VARIANTS)


@pytest.fixture(
    scope="module", params=["mistral-window", "qwen2-window", "gemma2", "gemma3", "gpt-oss"]
)
def windowed(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def _runner(path, spec: dict | None = None, num_blocks: int = 256) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(path), num_blocks=num_blocks, block_size=4,
                                      max_num_seqs=16, speculative_config=spec))  # fmt: skip


def test_greedy_outputs_through_chunks_joins_and_leaves(windowed):
    path, reference = windowed
    runner = _runner(path)
    jobs = greedy_jobs(10)
    run = run_engine(runner, jobs, engine_config())  # 16-token chunks past an 8-token window
    assert_equal_to_transformers(reference, jobs, run.outputs)
    assert run.scheduler.kv.window_groups, "the window is not in the core's groups"


def test_prefix_hits_serve_only_what_every_group_can(windowed):
    path, reference = windowed
    shared = prompt(7, 25)
    jobs = greedy_jobs(6, seed=3, shared=shared)
    run = run_engine(_runner(path), jobs, engine_config(max_num_seqs=1))  # one after another
    assert_equal_to_transformers(reference, jobs, run.outputs)
    assert run.scheduler.kv.prefix_stats.num_hits >= 5 * 20


def test_a_small_pool_preempts_and_recomputes_token_exact(windowed):
    path, reference = windowed
    jobs = greedy_jobs(8, seed=5)
    # Every layer windowed (Mistral), a request holds a window and a chunk however
    # long it runs, so decodes never outgrow the pool: it waits to be admitted instead
    # (its preemptions: the state machine's "window" layout).
    windowed_only = "mistral" in path.name
    num_blocks = 14 if windowed_only else 40
    # Admitted as soon as a first chunk fits (not the default), these prompts outgrow
    # the pool and preempt one another: the recompute path is what is under test.
    config = engine_config(max_num_batched_tokens=32, reserve_full_isl=False)
    run = run_engine(_runner(path, num_blocks=num_blocks), jobs, config, num_blocks=num_blocks)
    assert windowed_only or run.scheduler.num_preemptions > 0
    assert_equal_to_transformers(reference, jobs, run.outputs)


def test_speculative_decoding_equals_plain_decoding(windowed):
    path, reference = windowed
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}  # fmt: skip
    rng = random.Random(9)
    jobs = []
    for i in range(6):  # spans that repeat: prompt lookup finds drafts
        span = prompt(900 + i, rng.randrange(6, 14))[1:]
        jobs.append(Job([0, *span, *span, *span[:3]], rng.randrange(10, 30), SamplingParams()))
    runner = _runner(path, spec)
    run = run_engine(runner, jobs, engine_config(num_speculative_tokens=3,
                                           speculative_min_gain=1e-12))  # fmt: skip
    assert run.scheduler.drafts.stats.num_drafts > 0
    assert_equal_to_transformers(reference, jobs, run.outputs)


def test_a_draft_model_on_a_model_without_full_attention_is_refused(tmp_path):
    path = write_checkpoint("mistral-window", tmp_path / "m")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(path)}
    with pytest.raises(ValueError, match="no full-attention layer"):
        _runner(path, spec)
