"""Recurrent models (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: gated DeltaNet beside gated
full attention) through the real scheduler core and model runner, in one process with
steps in flight as the service keeps them: the core's recurrent groups hold a state
block a request, prefix hits resume from the state at an aligned block boundary, and
greedy outputs equal transformers' through chunked prefill, prefix hits, preemption and
speculative decoding. Logits per step: tests/test_executor_model.py's recurrent
variants; the kernels: tests/test_gdn.py."""

import importlib.util
import random

import numpy as np
import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ConfigError, ModelConfig
from flagstop.executor.sampling_params import SamplingParams
from flagstop.executor.speculative.proposer import NoProposer
from tests.helpers.checkpoints import (
    RECURRENT_VARIANTS,
    load_reference,
    prompt,
    reference_generate,
    write_checkpoint,
    write_config,
)
from tests.helpers.engine_jobs import (
    assert_equal_to_transformers,
    engine_config,
    greedy_jobs,
)
from tools.inprocess import Job, run_engine

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


@pytest.fixture(scope="module", params=list(RECURRENT_VARIANTS))
def recurrent(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def _runner(path, spec: dict | None = None, num_blocks: int = 512, **config) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(path), num_blocks=num_blocks, block_size=4,
                                      max_num_seqs=16, speculative_config=spec,
                                      **config))  # fmt: skip


def test_greedy_outputs_through_chunks_joins_and_leaves(recurrent):
    path, reference = recurrent
    jobs = greedy_jobs(10)
    run = run_engine(_runner(path), jobs, engine_config())  # 16-token chunks across the states
    assert_equal_to_transformers(reference, jobs, run.outputs)
    assert [g for g, _ in run.scheduler.kv.window_groups] == [1, 2, 3]


def test_prefix_hits_resume_from_the_state_at_an_aligned_boundary(recurrent):
    path, reference = recurrent
    shared = prompt(7, 26)  # 6 whole blocks and 2 tokens: hits stop at 24
    jobs = greedy_jobs(6, seed=3, shared=shared)
    hits = []
    run = run_engine(_runner(path), jobs, engine_config(max_num_seqs=1),  # one after another
                     on_step=lambda s: hits.extend(r.num_cached_tokens for r in s.running
                                                   if r.num_cached_tokens > 0))  # fmt: skip
    assert_equal_to_transformers(reference, jobs, run.outputs)
    assert set(hits) == {24}, hits
    assert run.scheduler.kv.prefix_stats.num_hits == 5 * 24


def test_a_small_pool_preempts_and_recomputes_token_exact(recurrent):
    path, reference = recurrent
    jobs = greedy_jobs(8, seed=5)
    # Admitted as soon as a first chunk fits, these prompts outgrow the pool and
    # preempt one another: the recompute path (and its prefix hits) is under test.
    config = engine_config(max_num_batched_tokens=32, reserve_full_isl=False)
    num_blocks = 4 * 24
    run = run_engine(_runner(path, num_blocks=num_blocks), jobs, config, num_blocks=num_blocks)
    assert run.scheduler.num_preemptions > 0
    assert_equal_to_transformers(reference, jobs, run.outputs)


class _OracleProposer(NoProposer):
    """Drafts the reference's greedy continuation, each draft wrong (and the rest with
    it) on a seeded coin: verifications accept some drafts and reject others, so the
    recurrent states are rolled back to every point of a verification."""

    def __init__(self, sequences: list[list[int]], seed: int) -> None:
        self.sequences, self.rng = sequences, random.Random(seed)

    def propose(self, batch, rows, slots):
        drafts = []
        for row, k in zip(rows.tolist(), slots.tolist(), strict=True):
            known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
            full = next(s for s in self.sequences if s[: len(known)] == known)
            out = full[len(known) : len(known) + k]
            for i in range(len(out)):
                if self.rng.random() < 0.3:
                    out[i] = (out[i] + 1) % 512
            drafts.append(np.array(out, np.int64))
        return drafts, None


def test_speculative_decoding_equals_plain_decoding(recurrent):
    path, reference = recurrent
    jobs = greedy_jobs(6, seed=11)
    expected = [reference_generate(reference, j.prompt, j.max_tokens) for j in jobs]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    runner = _runner(path, spec)
    runner.drafter.proposer = _OracleProposer(
        [[*j.prompt, *out] for j, out in zip(jobs, expected, strict=True)], seed=4
    )
    run = run_engine(runner, jobs, engine_config(num_speculative_tokens=3,
                                           speculative_min_gain=1e-12))  # fmt: skip
    stats = run.scheduler.drafts.stats
    # Drafts kept and drafts rejected, at every place of a verification.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(stats.accepted_per_pos), stats
    assert run.outputs == expected


def test_a_request_holds_constant_state_bytes_from_100_to_8k_tokens(tmp_path):
    config = RECURRENT_VARIANTS["qwen3-next"]()
    config.max_position_embeddings = 8448
    path = write_config(config, tmp_path / "long")
    runner = _runner(path, num_blocks=3000, max_model_len=8448)
    block_bytes = runner.block_bytes
    held: dict[int, int] = {}  # computed tokens -> bytes of state blocks held

    def on_step(scheduler) -> None:
        kv = scheduler.kv
        for request in scheduler.running:
            state = kv.req_blocks[request.request_id]
            blocks = [b for g, _ in kv.window_groups for b in state.blocks[g]
                      if b is not kv.pool.null_block]  # fmt: skip
            held[request.num_computed_tokens] = len(blocks) * block_bytes

    jobs = [Job(prompt(1, 100), 8, SamplingParams()), Job(prompt(2, 8000), 8, SamplingParams())]
    run_engine(runner, jobs, engine_config(max_num_batched_tokens=1024, max_model_len=8448,
                                     max_num_seqs=1), num_blocks=3000, on_step=on_step)  # fmt: skip
    short = {b for n, b in held.items() if n in range(101, 109)}
    long = {b for n, b in held.items() if n > 8000}
    # Three recurrent groups, a block each holding its layers' states, and while a step
    # crosses into a new block the one it writes too: the same at 100 and at 8k tokens.
    assert short == long == {3 * block_bytes, 6 * block_bytes}, held


def test_states_larger_than_a_block_raise_the_block_size(tmp_path):
    config = RECURRENT_VARIANTS["qwen3.5"]()
    config.linear_key_head_dim = config.linear_value_head_dim = 32
    path = write_config(config, tmp_path / "wide")
    runner = _runner(path)
    mc = ModelConfig.from_pretrained(path)
    page = 2 * 2 * 32 * 4  # a full-attention layer's K and V, a token (2 KV heads, fp32)
    assert runner.block_size == 4 * -(-mc.recurrent.state_bytes() // (page * 4))
    assert runner.block_size > 4
    assert mc.recurrent.state_bytes() <= page * runner.block_size


def test_a_recurrent_model_refuses_one_kv_cache_group_in_one_line(recurrent):
    path, _ = recurrent
    with pytest.raises(ConfigError, match="disable-hybrid-kv-cache-manager: this model's"):
        _runner(path, disable_hybrid_kv_cache_manager=True)


@torch.no_grad()
def test_tensor_parallel_linear_heads_split_by_head():
    # Each rank's slice of a layer's convolution channels: its key heads' queries and
    # keys and its value heads' values (tests/test_tensor_parallel.py runs TP=2).
    from flagstop.executor.models.gdn import GatedDeltaNet
    from flagstop.executor.parallel import Shard

    mc = ModelConfig.from_hf({**RECURRENT_VARIANTS["qwen3-next"]().to_dict(),
                              "architectures": ["Qwen3NextForCausalLM"]})  # fmt: skip

    class _TP:
        size, rank, shard = 2, 1, Shard(1, 2)

    with torch.device("meta"):
        layer = GatedDeltaNet(mc, _TP(), "model.layers.0.linear_attn")
    key = 2 * 8  # the queries' (and the keys') channels: 2 key heads of 8
    assert layer.channels().tolist() == [*range(8, 16), *range(key + 8, key + 16),
                                         *range(2 * key + 16, 2 * key + 32)]  # fmt: skip
    assert layer.shape.num_k_heads == 1 and layer.shape.num_v_heads == 2


def test_the_triton_backend_without_flash_linear_attention_is_refused_in_one_line(tmp_path):
    pytest.importorskip("triton")
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: its kernels run on a GPU")
    path = write_checkpoint("qwen3-next", tmp_path / "m")
    with pytest.raises(ConfigError, match=r"pip install 'flagstop\[fla\]'"):
        _runner(path, attention_backend="triton")
