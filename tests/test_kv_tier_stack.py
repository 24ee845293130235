"""The host tier on real processes: a conversation whose prefix the pool evicted loads
it back from host memory (or a file), token-exact against transformers, on one rank
and on two, with every block free afterwards."""

import random
import time

import pytest

from tests.helpers.checkpoints import load_reference, reference_generate
from tests.helpers.metrics import scrape
from tests.helpers.streams import Streams, assert_token_exact
from tools.make_model import write_model
from tools.stack import generate, start_stack

NUM_BLOCKS = 24  # 384 slots of 16 tokens: three flush prompts evict everything


def _turns(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A first turn, and prompts that together fill the pool (the flush)."""
    rng = random.Random(seed)
    first = [[0] + [rng.randrange(3, 512) for _ in range(n)] for n in (70, 9)]
    flush = [[0] + [rng.randrange(3, 512) for _ in range(150)] for _ in range(3)]
    return first, flush


def _first_turns_then_flush(stack, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each conversation's first turn and its answer, then enough other prompts to
    evict them from the pool (the tier keeps them)."""
    first, flush = _turns(seed)
    answers = [_greedy(stack, prompt, 12) for prompt in first]
    for prompt in flush:
        _greedy(stack, prompt, 4)
    return first, answers


def _greedy(stack, prompt: list[int], max_tokens: int) -> list[int]:
    tokens, _, last = generate(stack, prompt_token_ids=prompt, max_tokens=max_tokens,
                               temperature=0, ignore_eos=True)  # fmt: skip
    assert last.usage.completion_tokens == max_tokens
    return tokens


@pytest.mark.processes
@pytest.mark.parametrize("variant", ["host", "file", "tp2", "latent"])
def test_a_prefix_the_pool_evicted_loads_back_token_exact(variant, model_dir, tmp_path, reference):
    """latent: DeepSeek-V3's latent blocks (make model ARCH=deepseek_v3) in the tier."""
    args = ["--num-blocks", str(NUM_BLOCKS), "--kv-offload-bytes", str(64 << 20)]
    if variant == "file":
        args += ["--kv-offload-path", str(tmp_path / "tier.bin")]
    if variant == "tp2":
        args += ["--tensor-parallel-size", "2"]
    if variant == "latent":
        model_dir = write_model(tmp_path / "flagstop-tiny-deepseek_v3", "tiny", arch="deepseek_v3")
        reference = load_reference(model_dir)
    stack = start_stack(model_dir, tmp_path, executor_args=args)
    try:
        first, answers = _first_turns_then_flush(stack, 7)
        before = stack.stats()
        assert before.num_host_blocks > NUM_BLOCKS and before.num_host_cached_blocks > 0
        # The next turn of each: its prompt is the last prompt and answer and more; a
        # prompt shorter than a block, too (nothing to load: a pool-only miss).
        follow_ups = [p + a + [5, 6, 7] for p, a in zip(first, answers, strict=True)] + [[0, 4]]
        for prompt in follow_ups:
            assert _greedy(stack, prompt, 10) == reference_generate(reference, prompt, 10)
        stats = stack.wait_idle()
        # The 70-token turn's four full blocks came from the tier, not recomputed.
        assert stats.external_prefix_cache_hits - before.external_prefix_cache_hits >= 64
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_loading == 0
        metrics = scrape(stack.metrics_ports["scheduler"])

        def metric(name: str) -> float:
            [value] = [v for k, v in metrics.items() if k.startswith(name + "[")]
            return value

        assert metric("vllm:external_prefix_cache_hits_total") == stats.external_prefix_cache_hits
        assert 0 < metric("vllm:cpu_cache_usage_perc") <= 1
        assert metric("flagstop:num_requests_loading_kv") == 0
    finally:
        stack.stop(10)


@pytest.mark.processes
def test_a_killed_executor_with_a_host_tier_is_replaced_token_exact(model_dir, tmp_path, reference):
    args = ["--num-blocks", str(NUM_BLOCKS), "--kv-offload-bytes", str(64 << 20)]
    stack = start_stack(model_dir, tmp_path, executor_args=args)
    try:
        first, answers = _first_turns_then_flush(stack, 11)
        # The follow-ups load their prefixes from the tier; the executor dies as soon as
        # a load is seen (or a token, when the copies beat the poll), taking its loads
        # and its tier with it, and the new one recomputes them.
        follow_ups = [(p + a + [5, 6, 7], 24) for p, a in zip(first, answers, strict=True)]
        streams = Streams(stack, follow_ups)
        deadline = time.monotonic() + 30
        while not stack.stats().num_loading and not any(streams.tokens):
            assert time.monotonic() < deadline, "the follow-ups did not start"
        stack.kill("executor")
        stack.restart("executor")
        assert_token_exact(reference, streams)
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_loading == 0
        assert stats.executor_connected and stats.num_host_blocks > 0
    finally:
        stack.stop(10)
