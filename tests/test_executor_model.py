"""Our forward on the paged cache against transformers on the same weights."""

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.scheduler_svc.core.kv_groups import kv_cache_groups
from tests.helpers.checkpoints import (
    DEEPSEEK_VARIANTS,
    MOE_VARIANTS,
    RECURRENT_VARIANTS,
    WINDOW_VARIANTS,
    assert_matches,
    load_reference,
    prompt,
    reference_generate,
    write_checkpoint,
)
from tests.helpers.executor_harness import Harness

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "granite", "llama3-rope-tied", *MOE_VARIANTS,
                 *WINDOW_VARIANTS, *DEEPSEEK_VARIANTS, *RECURRENT_VARIANTS]  # fmt: skip


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def make_harness(path, num_blocks: int = 64, block_size: int = 4) -> Harness:
    """num_blocks per KV cache group (a block position holds one id per group)."""
    mc = ModelConfig.from_pretrained(path)
    num_groups = len(kv_cache_groups(mc.kv_layers(1, 1)))
    config = ExecutorConfig(
        model=str(path), num_blocks=num_blocks * num_groups, block_size=block_size,
        max_num_seqs=16,
    )  # fmt: skip
    return Harness(ModelRunner(config))


def test_one_prefill(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path)
    harness.add("a", prompt(1, 11))
    assert_matches(reference, harness, harness.logits({"a": 11}))


def test_prefills_of_different_lengths_mixed_with_decodes(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path)
    harness.add("a", prompt(1, 9))
    harness.add("b", prompt(2, 4))
    assert_matches(reference, harness, harness.logits({"a": 9, "b": 4}))
    harness.add("c", prompt(3, 13))
    harness.add("d", prompt(4, 1))
    # b's decode, then two prefills, then a's decode: the runner reorders decodes first.
    assert_matches(reference, harness, harness.logits({"b": 1, "c": 13, "d": 1, "a": 1}))
    assert_matches(reference, harness, harness.logits({"a": 1, "b": 1, "c": 1, "d": 1}))


def test_prompt_prefilled_in_three_chunks(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path)
    harness.add("a", prompt(5, 14))
    harness.add("b", prompt(6, 3))
    assert harness.logits({"a": 5}) == {}
    assert set(harness.logits({"a": 5, "b": 3})) == {"b"}
    assert_matches(reference, harness, harness.logits({"a": 4, "b": 1}))
    assert_matches(reference, harness, harness.logits({"a": 1}))


def test_prefix_from_another_requests_cached_blocks(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path)
    shared = prompt(7, 12)
    harness.add("a", [*shared, 5, 6])
    harness.logits({"a": 14})
    # b's first 3 blocks (12 tokens) are a's: only its own 5 tokens are computed.
    harness.add("b", [*shared, 9, 8, 7, 6, 5], shared_blocks=harness.prefix_blocks("a", 3))
    assert_matches(reference, harness, harness.logits({"b": 5}))
    assert_matches(reference, harness, harness.logits({"a": 1, "b": 1}))


def test_request_recomputed_after_its_cache_was_dropped(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path, num_blocks=8)
    harness.add("a", prompt(8, 10))
    harness.logits({"a": 10})
    harness.logits({"a": 1})
    harness.preempt("a")
    # Another request takes (and overwrites) the freed blocks first.
    harness.add("x", prompt(9, 12))
    harness.logits({"x": 12})
    harness.leave("x")
    num_tokens = len(harness.requests["a"].token_ids)
    assert_matches(reference, harness, harness.logits({"a": num_tokens}))
    assert_matches(reference, harness, harness.logits({"a": 1}))


def test_greedy_requests_joining_and_leaving_equal_generate(checkpoint):
    path, reference = checkpoint
    harness = make_harness(path, num_blocks=128)
    lengths = [3, 17, 8, 1, 25, 6, 12, 30]
    max_new = [12, 5, 20, 9, 14, 3, 18, 7]
    join_step = [0, 0, 1, 2, 2, 4, 6, 9]
    prompts = {f"r{i}": prompt(20 + i, n) for i, n in enumerate(lengths)}
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    for step in range(60):
        num_tokens = {}
        for i, req_id in enumerate(prompts):
            if join_step[i] == step:
                harness.add(req_id, prompts[req_id])
            if req_id in harness.requests:
                tracked = harness.requests[req_id]
                # The longest prompts are prefilled in two chunks.
                remaining = len(tracked.token_ids) - tracked.num_computed_tokens
                num_tokens[req_id] = min(remaining, 16)
        for req_id, token in harness.step(num_tokens).items():
            outputs[req_id].append(token)
            if len(outputs[req_id]) == max_new[int(req_id[1:])]:
                harness.leave(req_id)
        if not harness.requests and step > max(join_step):
            break
    assert not harness.requests
    for i, (req_id, tokens) in enumerate(prompts.items()):
        expected = reference_generate(reference, tokens, max_new[i])
        assert outputs[req_id] == expected, req_id
    every = [t for tokens in outputs.values() for t in tokens]
    assert len(set(every)) > 0.5 * len(every), "degenerate reference: the test could not fail"


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_moe_experts_on_onednn_prepacked_weights_match_transformers(name, tmp_path, monkeypatch):
    """The test models' experts are too small to be packed by default (they run
    torch_attention.fused_moe): here every weight is, as a real model's experts are."""
    from flagstop.executor.models import onednn

    if not onednn.usable(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch")
    monkeypatch.setattr(onednn, "PACK_MIN_ELEMENTS", 0)
    path = write_checkpoint(name, tmp_path / name)
    harness, reference = make_harness(path), load_reference(path)
    assert all(block.experts.packed is not None for block in harness.runner.model.moe_blocks)
    harness.add("a", prompt(1, 13))
    harness.add("b", prompt(2, 3))
    assert_matches(reference, harness, harness.logits({"a": 13, "b": 3}))
    assert_matches(reference, harness, harness.logits({"a": 1, "b": 1}))
