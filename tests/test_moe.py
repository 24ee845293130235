"""A Mixture-of-Experts checkpoint (`make model ARCH=qwen3_moe`) through the whole stack,
its experts placed whole on two tensor-parallel ranks (--expert-parallel): greedy
streams under preemption, chunked prefill and prefix hits equal transformers; seeded
sampling and prompt logprobs equal one rank's; every step's span counts the tokens
each expert took. (The model's logits, each family, TP and EP against one rank:
test_executor_model, test_tensor_parallel; the kernels: test_kernels.)"""

import pytest
import torch

from tests.helpers.checkpoints import TOL, load_reference
from tests.helpers.streams import assert_greedy_under_pressure
from tests.helpers.streams import short_greedy_workload as workload
from tools.make_model import EXPERTS_PER_TOKEN, NUM_EXPERTS, SIZES, write_model
from tools.otlp_collector import attributes, start_collector, wait_for
from tools.stack import generate, start_stack

pytestmark = pytest.mark.processes  # every test here runs processes


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "flagstop-tiny-qwen3_moe"
    return write_model(out, "tiny", arch="qwen3_moe")


@pytest.fixture(scope="module")
def traced_ep_stack(moe_dir, tmp_path_factory):
    """Two expert-parallel ranks, a 384-token pool and a 32-token budget, traced."""
    server, collector, port = start_collector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "always_on",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    stack = start_stack(
        moe_dir, tmp_path_factory.mktemp("ep"), env=env,
        executor_args=["--num-blocks", "24", "--tensor-parallel-size", "2", "--expert-parallel"],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
    )  # fmt: skip
    yield stack, collector
    assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()
    server.stop(0)


def test_greedy_streams_on_two_expert_parallel_ranks_equal_transformers(traced_ep_stack, moe_dir):
    stack, _ = traced_ep_stack
    requests = workload(5, n=12, shared_prefix=True)
    assert_greedy_under_pressure(stack, load_reference(moe_dir), requests)


def test_every_step_span_counts_the_tokens_each_expert_took(traced_ep_stack):
    """Each token goes to EXPERTS_PER_TOKEN experts in each layer (all sparse)."""
    stack, collector = traced_ep_stack
    pairs_per_token = EXPERTS_PER_TOKEN * SIZES["tiny"]["num_hidden_layers"]
    generate(stack, prompt_token_ids=[0, 5, 6, 7, 8], max_tokens=6, ignore_eos=True)
    stack.wait_idle()

    def executed_steps():  # spans reach the collector in batches, after the stream ends
        steps = {(s.trace_id, s.span_id): s for s in collector.named("scheduler.step")}
        executed = [(e, attributes(steps[(e.trace_id, e.parent_span_id)]))
                    for e in collector.named("executor.step")
                    if (e.trace_id, e.parent_span_id) in steps]  # fmt: skip
        computing = [(e, step) for e, step in executed if step["flagstop.scheduled_tokens"]]
        return executed if len(computing) >= 6 else None

    for span, step in wait_for(executed_steps):
        ours = attributes(span)
        if not step["flagstop.scheduled_tokens"]:  # a step that only ends requests
            assert "flagstop.moe.expert_tokens" not in ours
            continue
        counts = list(ours["flagstop.moe.expert_tokens"])
        assert len(counts) == NUM_EXPERTS
        assert sum(counts) == step["flagstop.scheduled_tokens"] * pairs_per_token
        assert ours["flagstop.moe.imbalance"] == round(max(counts) * NUM_EXPERTS / sum(counts), 3)


def test_seeded_sampling_and_prompt_logprobs_are_those_of_one_rank(
    traced_ep_stack, moe_dir, tmp_path
):
    stack, _ = traced_ep_stack
    sampled = dict(prompt_token_ids=[0, 9, 33, 71], max_tokens=24, temperature=0.9, top_p=0.95,
                   seed=11, ignore_eos=True)  # fmt: skip
    scored = dict(prompt_token_ids=[0] + [(i * 37) % 500 + 2 for i in range(40)], max_tokens=1,
                  prompt_logprobs=1)  # fmt: skip
    two = generate(stack, **sampled)[0], generate(stack, **scored)[2].prompt_logprobs
    one_rank = start_stack(moe_dir, tmp_path, executor_args=["--num-blocks", "64"])
    try:
        one = generate(one_rank, **sampled)[0], generate(one_rank, **scored)[2].prompt_logprobs
    finally:
        one_rank.stop()
    assert one[0] == two[0] and len(set(one[0])) > 5
    logprobs = [torch.tensor([lp.logprob for lp in side]) for side in (one[1], two[1])]
    torch.testing.assert_close(logprobs[1], logprobs[0], atol=TOL, rtol=0)
