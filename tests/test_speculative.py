"""Speculative decoding in process: the n-gram proposer, the rejection sampler's
distribution, the scheduler's draft budget and rollback, and the engine (scheduler
core + model runner, two steps in flight) token-exact with each proposer."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.rejection_sampler import verify
from flagstop.executor.sampling import SamplingMetadata
from flagstop.executor.sampling_params import SamplingParams
from flagstop.executor.speculative.config import SpeculativeConfig
from flagstop.executor.speculative.ngram import propose_ngram
from flagstop.executor.step_inputs import Drafts
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core.speculative import num_draft_slots
from tests.helpers.checkpoints import load_reference, prompt, reference_generate
from tools.inprocess import Job, run_engine

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

# -- the n-gram proposer (vLLM's tests/v1/spec_decode/test_ngram.py cases) ---------


@pytest.mark.parametrize(
    ("tokens", "k", "lo", "hi", "want"),
    [
        ([1, 2, 3, 4, 5], 2, 1, 3, []),  # nothing repeats
        ([1, 2, 3, 4, 1, 2, 3], 2, 1, 3, [4, 1]),  # [1 2 3] seen at 0
        ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 3, 1, 3, [4, 1, 2]),  # earliest of two
        ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 3, 4, 4, []),  # 4 tokens never repeat
        ([9, 1, 2, 7, 1, 2, 8, 2], 2, 1, 3, [7, 1]),  # only [2] repeats: earliest
        ([5, 5, 5, 5], 3, 1, 2, [5, 5]),  # runs to the end: fewer than k
        ([1, 2, 1, 2, 3, 1, 2], 1, 2, 2, [1]),  # n = 2 at its earliest (0)
    ],
)
def test_ngram_longest_suffix_earliest_occurrence(tokens, k, lo, hi, want):
    assert propose_ngram(np.array(tokens), k, lo, hi).tolist() == want


def test_speculative_config_defaults_and_refusals():
    config = SpeculativeConfig(method="ngram")
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(method="ngram", prompt_lookup_max=3).prompt_lookup_min == 3
    for bad in (
        {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        {"method": "draft_model"},
        {"method": "suffix", "model": "x"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "eagle"},
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)


def test_suffix_without_its_extra_is_refused_naming_it(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_arctic(name, *args):
        return None if name == "arctic_inference" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_arctic)
    with pytest.raises(ValueError, match=r"pip install 'flagstop\[suffix\]'"):
        SpeculativeConfig(method="suffix")


# -- the rejection sampler ------------------------------------------------------------

VOCAB, K = 8, 2


def _meta(num_rows: int, temperature: float = 1.0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature), top_p=torch.ones(num_rows),
        top_k=torch.full((num_rows,), VOCAB), all_greedy=temperature == 0,
        needs_top_k_top_p=False, seeded=[], banned=[], num_logprobs=None,
    )  # fmt: skip


def _chi_square(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft_probs", [False, True], ids=["one-hot q", "sampled q"])
def test_rejection_sampler_keeps_the_target_distribution_at_every_position(draft_probs):
    """Per position, among the requests whose tokens reach it, the emitted token
    follows the target's row there (drafts from another distribution q), by a
    chi-square test at p = 0.001 (seeded: the same draws each run)."""
    g = torch.Generator().manual_seed(7)
    target = torch.randn(K + 1, VOCAB, generator=g) * 1.5
    target[:, 3] = float("-inf")  # a token the target never emits, drafts do
    q = torch.softmax(torch.randn(K, VOCAB, generator=g), dim=-1)
    n = 60000
    torch.manual_seed(11)
    draft_tokens = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, K]
    logits = target.repeat(n, 1)
    drafts = Drafts(np.full(n, K), draft_tokens.reshape(-1).numpy().astype(np.int64),
                    q.repeat(n, 1) if draft_probs else None)  # fmt: skip
    out = verify(logits, _meta(n * (K + 1)), drafts)
    counts = np.array(out.num_sampled_tokens)
    tokens, ends = np.array(out.token_ids), np.cumsum(counts)
    p = torch.softmax(target, dim=-1).numpy()
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    for position in range(K + 1):
        reach = np.flatnonzero(counts > position)
        emitted = tokens[ends[reach] - counts[reach] + position]
        assert len(emitted) > 500, position
        assert _chi_square(emitted, p[position]) < critical, position
    assert counts.min() >= 1 and counts.max() == K + 1


def test_rejection_sampler_greedy_accepts_while_drafts_are_the_argmax():
    logits = torch.tensor([[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0]] * 2, dtype=torch.float32)
    drafts = Drafts(np.array([2, 2]), np.array([1, 2, 1, 3]))
    meta = SamplingMetadata(
        temperature=torch.zeros(6), top_p=torch.ones(6), top_k=torch.full((6,), 4),
        all_greedy=True, needs_top_k_top_p=False, seeded=[], banned=[], num_logprobs=[0] * 6,
    )  # fmt: skip
    out = verify(logits, meta, drafts)
    assert out.token_ids == [1, 2, 0, 1, 2]  # all accepted + bonus; first accepted, then argmax
    assert out.num_sampled_tokens == [3, 2]
    assert out.num_draft_tokens == [2, 2]
    assert len(out.logprobs) == 5


# -- the scheduler's drafts -----------------------------------------------------------


def _scheduler(k: int = 3, **config) -> Scheduler:
    base = dict(max_num_batched_tokens=64, max_model_len=128, block_size=4,
                num_speculative_tokens=k)  # fmt: skip
    return Scheduler(SchedulerConfig(**{**base, **config}), num_blocks=64)


def _add(scheduler, rid, n_prompt=5, max_tokens=20, stops=frozenset(), **kw):
    stop = StopParams(max_tokens, stop_token_ids=stops)
    scheduler.add_request(Request(rid, "o", list(range(10, 10 + n_prompt)), stop, **kw))


def test_drafts_budgeted_after_every_decode_and_truncated_by_the_budget():
    scheduler = _scheduler(k=4, max_num_batched_tokens=12)
    for rid in "abc":
        _add(scheduler, rid, n_prompt=3)
    plan = scheduler.schedule()  # prefills: no drafts
    assert not plan.num_draft_slots
    scheduler.update_from_output(plan, StepOutcome([7, 7, 7]))
    plan = scheduler.schedule()
    # 3 decode tokens first, then 9 budget left: 4 + 4 + 1.
    assert plan.num_draft_slots == {"a": 4, "b": 4, "c": 1}
    assert plan.total_num_scheduled_tokens == 12


def test_rejected_drafts_roll_back_and_give_blocks_back():
    scheduler = _scheduler(k=3)
    _add(scheduler, "a", n_prompt=4)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, StepOutcome([7]))  # 5 tokens, 4 computed
    plan = scheduler.schedule()
    assert plan.num_draft_slots == {"a": 3}
    request = scheduler.requests["a"]
    assert request.num_computed_tokens == 8 and len(scheduler.kv.block_ids("a")) == 2
    out = scheduler.update_from_output(plan, StepOutcome([8], [1], [3]))
    assert out["o"].new_token_ids == [8]
    assert request.num_computed_tokens == 5  # rolled back by 3
    assert len(scheduler.kv.block_ids("a")) == 2  # 6 tokens' slots: 2 blocks still
    plan = scheduler.schedule()  # the trim list is empty: nothing crossed a block
    assert not plan.trimmed_blocks


def test_trim_reaches_the_executor_in_the_next_plan():
    scheduler = _scheduler(k=4)
    _add(scheduler, "a", n_prompt=3)
    scheduler.update_from_output(scheduler.schedule(), StepOutcome([7]))  # 4 tokens, 3 computed
    plan = scheduler.schedule()  # 1 + 4 slots from 3: 8 -> 2 blocks
    assert len(scheduler.kv.block_ids("a")) == 2
    scheduler.update_from_output(plan, StepOutcome([8], [1], [4]))
    assert scheduler.requests["a"].num_computed_tokens == 4
    assert len(scheduler.kv.block_ids("a")) == 1 and scheduler.kv.pool.num_free_blocks == 63
    nxt = scheduler.schedule()
    assert nxt.trimmed_blocks == {"a": 1}
    assert len(scheduler.kv.block_ids("a")) == 1 + len(nxt.scheduled_cached_reqs.new_block_ids[0])
    assert not scheduler.schedule().trimmed_blocks  # sent once


def test_every_stop_rule_applies_at_each_emitted_token():
    scheduler = _scheduler(k=3)
    _add(scheduler, "a", n_prompt=4, max_tokens=20, stops=frozenset({99}))
    _add(scheduler, "b", n_prompt=4, max_tokens=3)
    scheduler.update_from_output(scheduler.schedule(), StepOutcome([7, 7]))
    plan = scheduler.schedule()
    assert plan.num_draft_slots == {"a": 3, "b": 1}  # b: two tokens left at most
    out = scheduler.update_from_output(plan, StepOutcome([5, 99, 6, 8, 9], [3, 2], [3, 1]))
    assert out["o"].req_ids == ["a", "a", "b", "b"]  # nothing past the stop token
    assert out["o"].new_token_ids == [5, 99, 8, 9]
    assert set(out["o"].finished) == {"a", "b"}
    assert scheduler.kv.pool.num_free_blocks == 64


def _one_token_each(scheduler, plan) -> None:
    """Apply a plan's result with every draft rejected: one token per request."""
    n, slots = len(plan.sampling_requests), plan.num_draft_slots
    proposed = [slots.get(r.request_id, 0) for r in plan.sampling_requests]
    scheduler.update_from_output(plan, StepOutcome([7] * n, [1] * n if slots else (), proposed))


def test_request_cap_and_batch_rule():
    scheduler = _scheduler(k=3, speculative_disable_batch_size=3)
    _add(scheduler, "a", num_speculative_tokens=0)
    _add(scheduler, "b", num_speculative_tokens=1)
    _one_token_each(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.num_draft_slots == {"b": 1}  # two decodes: each drafts within its cap
    _one_token_each(scheduler, plan)
    _add(scheduler, "c")
    _add(scheduler, "d")
    plan = scheduler.schedule()
    assert plan.num_draft_slots == {"b": 1}  # the prefills of c and d carry none
    _one_token_each(scheduler, plan)
    plan = scheduler.schedule()
    assert len(plan.sampling_requests) == 4 and not plan.num_draft_slots  # 4 >= 3: none
    assert num_draft_slots(0.1, 3, 0.25) == 0 and num_draft_slots(0.99, 5, 0.25) == 5
    assert num_draft_slots(0.6, 5, 0.25) == 2  # 0.6^2 = 0.36 >= 0.25 > 0.6^3


def test_a_request_whose_drafts_fail_decodes_plainly_and_probes():
    scheduler = _scheduler(k=3)
    _add(scheduler, "a", max_tokens=100)
    scheduler.update_from_output(scheduler.schedule(), StepOutcome([7]))
    slots = []
    for _ in range(40):
        plan = scheduler.schedule()
        k = plan.num_draft_slots.get("a", 0)
        slots.append(k)
        counts = [1] if k else []
        scheduler.update_from_output(plan, StepOutcome([7], counts, [k] if k else []))
    assert slots[:3] == [3, 2, 1]  # the prior drafts k; nothing accepted, k falls
    assert slots[10:26].count(0) == 15 and slots[10:26].count(1) == 1  # a probe in 16


# -- the engine, in process -----------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.helpers.checkpoints import write_checkpoint

    path = write_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return path, load_reference(path)


def _runner(path: Path, spec: dict | None, **config) -> ModelRunner:
    base = dict(model=str(path), num_blocks=256, block_size=4, max_num_seqs=16)
    return ModelRunner(ExecutorConfig(**{**base, **config}, speculative_config=spec))


def _jobs(n: int = 6, workload: int = 0, **sampling) -> list[Job]:
    rng = random.Random(workload)
    return [Job(prompt(workload * 100 + i, rng.randrange(4, 30)), rng.randrange(10, 40),
                SamplingParams(**sampling)) for i in range(n)]  # fmt: skip


# A gain no acceptance estimate falls below within a test: every decode drafts.
ALWAYS_DRAFT = 1e-12


def _repeating_jobs(n: int = 6, workload: int = 0) -> list[Job]:
    """Prompts that repeat a span: prompt lookup and suffix trees find matches (the
    drafts are proposed; a random model rarely continues the span)."""
    rng = random.Random(workload)
    jobs = []
    for i in range(n):
        span = prompt(workload * 100 + i, rng.randrange(6, 14))[1:]
        jobs.append(Job([0, *span, *span, *span[:3]], rng.randrange(10, 40), SamplingParams()))
    return jobs


def _engine(runner: ModelRunner, jobs, **config):
    base = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512, block_size=4,
                num_speculative_tokens=runner.num_speculative_tokens)  # fmt: skip
    return run_engine(runner, jobs, SchedulerConfig(**{**base, **config}))


@pytest.mark.parametrize(
    "spec",
    [
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        {"method": "suffix", "num_speculative_tokens": 4},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": "SELF"},
    ],
    ids=["ngram", "suffix", "draft_model"],
)
def test_greedy_outputs_with_each_proposer_equal_transformers(llama, spec):
    path, reference = llama
    spec = {**spec, "model": str(path)} if spec.get("model") == "SELF" else spec
    jobs = _repeating_jobs()
    run = _engine(_runner(path, spec), jobs, speculative_min_gain=ALWAYS_DRAFT)
    for job, out in zip(jobs, run.outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)
    assert run.scheduler.drafts.stats.num_drafts > 0


def test_a_checkpoint_drafting_for_itself_is_accepted_and_takes_k_plus_1(llama):
    path, _ = llama
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}
    run = _engine(_runner(path, spec), _jobs(4, 3))
    stats = run.scheduler.drafts.stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens >= 0.98
    assert max(run.tokens_per_request_step) == 4
    assert 1 + stats.num_accepted_tokens / stats.num_drafts > 3.5  # vLLM's acceptance length


def test_a_random_small_draft_keeps_greedy_outputs(llama, tmp_path):
    from tools.make_model import write_model

    path, reference = llama
    draft = write_model(tmp_path / "draft", "tiny", seed=5)  # other weights, same vocabulary
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(draft)}
    jobs = _jobs(5, 4)
    run = _engine(_runner(path, spec), jobs)
    stats = run.scheduler.drafts.stats
    assert stats.num_accepted_tokens < 0.5 * stats.num_draft_tokens  # rollback most steps
    for job, out in zip(jobs, run.outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)


def test_seeded_sampling_with_drafts_is_reproducible(llama):
    path, _ = llama
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path),
            "draft_sample_method": "probabilistic"}  # fmt: skip
    runs = [
        _engine(_runner(path, spec), _jobs(4, 6, temperature=0.8, seed=1234)).outputs
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert len({tuple(o) for o in runs[0]}) > 1


def test_seeded_sampling_with_drafts_emits_what_it_would_without(llama):
    """Drafts without a distribution are checked against the plain sampler's own draw
    at each position: a seeded request's tokens do not depend on its drafts."""
    path, _ = llama
    jobs = _jobs(5, 7, temperature=0.9, top_k=40, seed=99)
    plain = _engine(_runner(path, None), jobs).outputs
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}
    run = _engine(_runner(path, spec), jobs, speculative_min_gain=ALWAYS_DRAFT)
    assert run.outputs == plain
    stats = run.scheduler.drafts.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts lost the draw


def test_preemption_with_drafts_keeps_greedy_outputs(llama):
    path, reference = llama
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}
    jobs = _jobs(6, 8)
    runner = _runner(path, spec, num_blocks=24)
    run = run_engine(runner, jobs, SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512, block_size=4,
        num_speculative_tokens=3), num_blocks=24)  # fmt: skip
    assert run.scheduler.num_preemptions > 0
    for job, out in zip(jobs, run.outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)


def test_an_fp8_kv_cache_with_drafts_emits_what_it_would_without(llama):
    """Verified drafts write their K/V in the target's one-byte cache and rejected ones
    are overwritten there: greedy outputs on an FP8 cache, preempted too, are those of
    the same cache without drafts (the draft model keeps its own cache in its dtype)."""
    path, _ = llama
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}
    jobs = _jobs(6, 9)
    cache = dict(num_blocks=24, kv_cache_dtype="fp8")
    plain = _engine(_runner(path, None, **cache), jobs, max_num_batched_tokens=64)
    run = _engine(_runner(path, spec, **cache), jobs, max_num_batched_tokens=64)
    assert run.outputs == plain.outputs
    assert run.scheduler.num_preemptions > 0
    stats = run.scheduler.drafts.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_json_schema_request_with_drafts_stays_valid(llama):
    from flagstop.structured import JSON_SCHEMA, Constraint

    path, _ = llama
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 2}  # fmt: skip
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"], "additionalProperties": False})  # fmt: skip
    grammar = Constraint(JSON_SCHEMA, schema)
    jobs = [Job(prompt(50 + i, 10), 40, SamplingParams(grammar=grammar)) for i in range(3)]
    outputs, drafted = {}, {}
    for spec in (None, ngram):
        runner = _runner(path, spec)
        eos = frozenset(runner.model_config.eos_token_ids)
        base = dict(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512,
                    block_size=4, num_speculative_tokens=runner.num_speculative_tokens,
                    speculative_min_gain=ALWAYS_DRAFT)  # fmt: skip
        run = run_engine(runner, jobs, SchedulerConfig(**base), eos_token_ids=eos)
        outputs[bool(spec)], drafted[bool(spec)] = run.outputs, run.scheduler.drafts.stats
    assert outputs[True] == outputs[False]
    assert drafted[True].num_drafts > 0
