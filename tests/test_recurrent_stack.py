"""Qwen3-Next served (`make model ARCH=qwen3_next`, `make serve ARCH=qwen3_next`): the
checkpoint make_model writes is transformers' model, the three processes describe its
recurrent groups, a long prompt comes back token-exact, a prefix the pool evicted loads
back from the host tier with its states (the blocks carry them), and disaggregation,
which does not move states, stops start-up in one line."""

import httpx
import pytest
import torch

from tests.helpers.checkpoints import load_reference, prompt, reference_logits
from tests.helpers.executor_harness import Harness
from tests.helpers.streams import assert_evicted_prefix_loads_back
from tools.make_model import write_model
from tools.stack import scheduler_refusal, start_stack

NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny-qwen3_next", "tiny",
                       arch="qwen3_next")  # fmt: skip


@pytest.fixture(scope="module")
def reference(qwen3_next):
    return load_reference(qwen3_next)


@pytest.mark.numeric
def test_make_models_checkpoint_serves_what_transformers_serves(qwen3_next, reference):
    from flagstop.executor.config import ExecutorConfig
    from flagstop.executor.model_runner import ModelRunner

    harness = Harness(ModelRunner(ExecutorConfig(model=str(qwen3_next), num_blocks=256)))
    # A 32-token block holds a layer's state (19,456 bytes; K and V: 1,024 a token).
    assert harness.block_size == 32
    harness.add("a", prompt(1, 40))
    harness.add("b", prompt(2, 3))
    for _ in range(3):
        logits = harness.logits({r: len(t.token_ids) - t.num_computed_tokens
                                 for r, t in harness.requests.items()})  # fmt: skip
        for rid, got in logits.items():
            want = reference_logits(reference, harness.requests[rid].token_ids[:-1])
            # Wide random weights: logits of std ~4, float32 sums in another order.
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


@pytest.mark.processes
def test_served_with_a_host_tier_its_states_load_back_token_exact(qwen3_next, reference,
                                                                   tmp_path):  # fmt: skip
    args = ["--num-blocks", str(NUM_BLOCKS), "--kv-offload-bytes", str(64 << 20)]
    stack = start_stack(qwen3_next, tmp_path, executor_args=args)
    try:
        [card] = httpx.get(f"{stack.base_url}/models", timeout=30).json()["data"]
        assert card["kv_cache_groups"] == "full x1 + linear x1 + linear x1 + linear x1"
        assert card["kv_bytes_per_token"] == 1024  # full attention's only: states are not
        # 200 + 16 tokens: 6 whole blocks of 32 from the tier, the states at 192 with them.
        assert_evicted_prefix_loads_back(stack, reference, 200, 151, 192, seed=3, answer_len=16)
    finally:
        stack.stop(10)


@pytest.mark.processes
def test_disaggregation_stops_start_up_in_one_line(qwen3_next):
    args = ["--num-blocks", "64", "--kv-role", "prefill", "--kv-transfer-host", "127.0.0.1"]
    returncode, last_line = scheduler_refusal(qwen3_next, args)
    assert returncode != 0
    assert "serve it without --kv-role" in last_line
