"""The executor simulator, a load-test tool: the persistent batch kept exactly as the
model runner keeps it, deterministic tokens, a step time from its cost model, and no
torch."""

import asyncio
import copy
import subprocess
import sys
import time

import pytest

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.executor.simulator import CostModel, SimulatedRunner
from tests.helpers.executor_harness import Harness
from tests.helpers.tp_scenarios import prompt
from tools.stack import ROOT


def scenario(harness: Harness) -> list:
    """Plans with chunked prefill, decodes, a preemption and a resume, as the real
    runner saw them (deep copies, to replay)."""
    plans = []
    original = harness.plan

    def recording(num_tokens):
        plan = original(num_tokens)
        plans.append(copy.deepcopy(plan))
        return plan

    harness.plan = recording
    harness.add("a", prompt(1, 14, 512))
    harness.add("b", prompt(2, 5, 512))
    harness.step({"a": 6, "b": 5})
    harness.step({"a": 8, "b": 1})
    harness.add("c", prompt(3, 9, 512), SamplingParams(temperature=0.7, seed=3))
    harness.step({"a": 1, "b": 1, "c": 9})
    harness.preempt("b")
    harness.step({"a": 1, "c": 1})
    harness.step({"b": len(harness.requests["b"].token_ids), "c": 1})
    harness.leave("a")
    harness.step({"b": 1, "c": 1})
    return plans


def rows_state(batch) -> dict:
    return {req_id: (int(batch.num_tokens[row]), int(batch.num_computed_tokens[row]),
                     list(batch.block_table[row, : batch.num_blocks[row]]))
            for req_id, row in batch.req_rows.items()}  # fmt: skip


def test_the_simulator_keeps_the_batch_as_the_runner_does(model_dir):
    config = ExecutorConfig(model=str(model_dir), num_blocks=64, block_size=4, max_num_seqs=8)
    real = ModelRunner(config)
    plans = scenario(Harness(real))
    real.reset()
    simulated = SimulatedRunner(config)
    for plan in plans:
        model = real.execute(copy.deepcopy(plan))
        sim = simulated.execute(copy.deepcopy(plan))
        assert len(sim.token_ids) == len(model.token_ids) and simulated.last_step_seconds > 0
        # Same rows sample; the simulator's token is appended where the model's is.
        assert rows_state(simulated.batch).keys() == rows_state(real.batch).keys()
        for req_id, (num_tokens, computed, blocks) in rows_state(real.batch).items():
            assert rows_state(simulated.batch)[req_id] == (num_tokens, computed, blocks)


def test_simulated_tokens_are_deterministic_and_a_step_takes_the_cost_models_time(model_dir):
    config = ExecutorConfig(model=str(model_dir), num_blocks=64, block_size=4, simulate=True,
                            simulate_base_ms=20, simulate_us_per_scheduled_token=100,
                            simulate_us_per_context_token=0)  # fmt: skip
    tokens = []
    for _ in range(2):
        runner = SimulatedRunner(config)
        harness = Harness(runner)
        harness.add("a", prompt(4, 10, 512))
        plan = harness.plan({"a": 10})
        started = time.monotonic()
        output = asyncio.run(runner.step(plan))
        elapsed = time.monotonic() - started
        assert 0.020 <= elapsed < 0.2  # 20 ms + 10 tokens x 100 us
        tokens.append(output.token_ids)
    assert tokens[0] == tokens[1] and len(tokens[0]) == 1
    assert CostModel(6, 8, 0.03).seconds(256, 256 * 1024) == 0.006 + (2048 + 7864.32) / 1e6


def test_the_simulator_ends_requests_with_their_stop_token_now_and_then(model_dir):
    config = ExecutorConfig(model=str(model_dir), num_blocks=256, block_size=4,
                            simulate_mean_output_tokens=5)  # fmt: skip
    runner = SimulatedRunner(config)
    harness = Harness(runner)
    eos = SamplingParams(stop_token_ids=(1,), min_tokens=3)
    for i in range(8):
        harness.add(f"r{i}", prompt(10 + i, 6, 512), eos)
    harness.add("free", prompt(30, 6, 512))  # no stop ids: never stops
    outputs = {r: [] for r in harness.requests}
    num_tokens = {r: 6 for r in harness.requests}
    for _ in range(30):
        for req_id, token in harness.step(num_tokens).items():
            outputs[req_id].append(token)
        num_tokens = dict.fromkeys(harness.requests, 1)
    ended = [r for r, tokens in outputs.items() if 1 in tokens]
    assert len(ended) >= 5 and "free" not in ended
    assert all(outputs[r].index(1) >= 3 for r in ended)  # never before min_tokens


@pytest.mark.processes
def test_the_simulated_executor_imports_no_torch():
    code = ("import sys, flagstop.executor.__main__, flagstop.executor.simulator; "
            "print('torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, check=True)  # fmt: skip
    assert done.stdout.strip() == "False"


@pytest.mark.processes
def test_two_thousand_streams_at_gpu_step_rates(model_dir, tmp_path):
    """One stack on the simulator (8 ms steps): 2,000 concurrent streams, twice; no
    errors, every block free after each, memory back, in bounded time."""
    from tools.load import many_streams, rss_kib
    from tools.stack import start_stack

    stack = start_stack(
        model_dir, tmp_path,
        executor_args=["--simulate", "--simulate-base-ms", "8", "--max-num-seqs", "2048",
                       "--max-num-batched-tokens", "16384"],
        scheduler_args=["--max-num-seqs", "2048", "--max-waiting-requests", "2048",
                        "--max-num-batched-tokens", "16384"],
        router_args=["--max-queued-requests", "4096"],
    )  # fmt: skip
    try:
        asyncio.run(many_streams(stack.router, 200))  # warm-up: the baseline is a used stack
        stack.wait_idle()
        rss = [{name: rss_kib(p.pid) for name, p in stack.processes.items()}]
        for _ in range(2):
            started = time.monotonic()
            assert asyncio.run(many_streams(stack.router, 2000)) == [4] * 2000
            assert time.monotonic() - started < 60
            stats = stack.wait_idle()
            assert stats.num_free_blocks == stats.num_total_blocks
            rss.append({name: rss_kib(p.pid) for name, p in stack.processes.items()})
        baseline, first, second = rss
        for name in baseline:
            assert second[name] - baseline[name] < 64 * 1024, (name, rss)
            assert second[name] - first[name] < 16 * 1024, (name, rss)
    finally:
        assert set(stack.stop().values()) == {0}


def test_the_simulators_drafts_give_the_same_tokens_in_fewer_steps(model_dir):
    """With a speculative config it accepts drafts by its acceptance rate: each request
    emits the tokens it would have emitted one a step, several a step."""
    from flagstop.scheduler_svc.core.config import SchedulerConfig
    from tools.inprocess import Job, run_engine

    jobs = [Job(prompt(i, 9, 512), 30) for i in range(4)]
    runs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        runner = SimulatedRunner(ExecutorConfig(
            model=str(model_dir), num_blocks=256, block_size=4, max_num_seqs=8,
            speculative_config=spec, simulate_acceptance_rate=0.7,
        ))  # fmt: skip
        config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=512, block_size=4,
                                 num_speculative_tokens=runner.num_speculative_tokens)  # fmt: skip
        runs[spec is None] = run_engine(runner, jobs, config)
    assert runs[False].outputs == runs[True].outputs
    assert runs[False].num_steps < 0.8 * runs[True].num_steps
    stats = runs[False].scheduler.drafts.stats
    assert 0.4 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.95
