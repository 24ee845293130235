"""DeepSeek's multi-token prediction layer as the speculative method `mtp`: drafting
never changes what is emitted (greedy: transformers' tokens; seeded: the plain run's),
through chunked prefill and preemption; on a checkpoint whose prediction layer is a copy
of its last layer that sees only the next token's embedding, most drafts are accepted,
so the catch-up and the chaining feed it the right tokens at the right positions."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.server import StartupError
from tests.helpers.checkpoints import (
    COMMON,
    load_reference,
    prompt,
    reference_generate,
    write_checkpoint,
    write_config,
)
from tools.inprocess import Job, run_engine

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

MTP = {"method": "mtp", "num_speculative_tokens": 3}


def add_prediction_layer(path, echo: bool) -> None:
    """model.layers.{L}: a copy of the last layer, its head and norm the model's.
    echo: eh_proj passes only the token's embedding (the hidden state's half zero) and
    the embeddings are of unit RMS, so that with one layer the prediction layer is the
    model itself, run over the tokens from position 1 on: its drafts mostly agree."""
    config = json.loads((path / "config.json").read_text())
    last, index = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    tensors = load_file(path / "model.safetensors")
    hidden = config["hidden_size"]
    if echo:
        embed = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"layers.{last}.", f"layers.{index}.")] = tensors[name].clone()
    g = torch.Generator().manual_seed(3)
    eh = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1) if echo else \
        torch.randn(hidden, 2 * hidden, generator=g) * 0.05  # fmt: skip
    p = f"model.layers.{index}."
    own = {
        "shared_head.norm": "model.norm",
        "shared_head.head": "lm_head",
        "embed_tokens": "model.embed_tokens",
    }  # the model's, copied
    tensors |= {p + f"{ours}.weight": tensors[f"{theirs}.weight"].clone()
                for ours, theirs in own.items()}  # fmt: skip
    tensors |= {p + "enorm.weight": torch.ones(hidden), p + "hnorm.weight": torch.ones(hidden),
                p + "eh_proj.weight": eh}  # fmt: skip
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """A one-layer DeepSeek-V3 (latent attention, a sparse layer) with an echo layer."""
    path = write_config(DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 1, "num_key_value_heads": 4}, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, q_lora_rank=48,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        n_shared_experts=1, first_k_dense_replace=0, n_group=4, topk_group=2,
    ), tmp_path_factory.mktemp("mtp-echo"))  # fmt: skip
    add_prediction_layer(path, echo=True)
    return path, load_reference(path)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-4.5's layout, its prediction layer a copy of the last with a random eh_proj."""
    path = write_checkpoint("glm4-moe", tmp_path_factory.mktemp("mtp-glm"))
    add_prediction_layer(path, echo=False)
    return path, load_reference(path)


def _runner(path, spec, **config) -> ModelRunner:
    base = dict(model=str(path), num_blocks=256, block_size=4, max_num_seqs=16)
    return ModelRunner(ExecutorConfig(**{**base, **config}, speculative_config=spec))


def _jobs(n: int, workload: int, **sampling) -> list[Job]:
    rng = random.Random(workload)
    return [Job(prompt(workload * 100 + i, rng.randrange(4, 30)), rng.randrange(10, 40),
                SamplingParams(**sampling)) for i in range(n)]  # fmt: skip


def _engine(runner, jobs, num_blocks=None, **config):
    base = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512, block_size=4,
                num_speculative_tokens=runner.num_speculative_tokens,
                speculative_min_gain=1e-12)  # fmt: skip
    return run_engine(runner, jobs, SchedulerConfig(**{**base, **config}), num_blocks=num_blocks)


def assert_greedy(reference, jobs: list[Job], outputs: list[list[int]]) -> None:
    for job, out in zip(jobs, outputs, strict=True):
        assert out == reference_generate(reference, job.prompt, job.max_tokens)


def test_greedy_drafts_of_the_echo_layer_are_mostly_accepted_and_change_nothing(echo):
    path, reference = echo
    jobs = _jobs(6, 1)
    run = _engine(_runner(path, MTP), jobs)
    assert_greedy(reference, jobs, run.outputs)
    stats = run.scheduler.drafts.stats
    # Measured: 0.64 of drafts accepted (0.80 at k = 1; the layer misses the first
    # token's context).
    assert stats.num_accepted_tokens > 0.3 * stats.num_draft_tokens > 0
    assert max(run.tokens_per_request_step) == 4  # all three drafts and the bonus, once


def test_preempted_and_chunked_requests_keep_greedy_outputs(echo):
    path, reference = echo
    jobs = _jobs(6, 2)
    run = _engine(_runner(path, MTP, num_blocks=24), jobs, num_blocks=24,
                  max_num_batched_tokens=16)  # fmt: skip
    assert run.scheduler.num_preemptions > 0
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_accepted_tokens > 0


def test_seeded_sampling_with_mtp_drafts_emits_what_it_would_without(echo):
    path, _ = echo
    jobs = _jobs(5, 3, temperature=0.9, top_k=40, seed=7)
    plain = _engine(_runner(path, None), jobs).outputs
    run = _engine(_runner(path, MTP), jobs)
    assert run.outputs == plain
    assert run.scheduler.drafts.stats.num_accepted_tokens > 0


def test_glms_prediction_layer_drafts_on_gqa_and_changes_nothing(glm):
    path, reference = glm
    jobs = _jobs(4, 4)
    run = _engine(_runner(path, MTP), jobs)
    assert_greedy(reference, jobs, run.outputs)
    assert run.scheduler.drafts.stats.num_draft_tokens > 0


def test_mtp_without_a_prediction_layer_is_refused_in_one_line(tmp_path):
    """transformers writes num_nextn_predict_layers=1 without the layer's tensors."""
    path = write_checkpoint("deepseek-v3", tmp_path / "plain")
    with pytest.raises(StartupError, match="has no tensors of its prediction layer"):
        _runner(path, MTP)
    llama = write_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(StartupError, match="speculative method mtp: DeepSeek's layout"):
        _runner(llama, MTP)


def test_under_tensor_parallelism_a_layer_without_its_own_head_is_refused(echo, tmp_path):
    """The model's embedding and head are split over the ranks, the layer runs on one:
    it needs its own (DeepSeek's and GLM's checkpoints have them)."""
    from types import SimpleNamespace

    from flagstop.executor.spec.mtp import load_mtp

    path = shutil.copytree(echo[0], tmp_path / "headless")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.shared_head.head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    target = _runner(path, None).model
    one_rank = SimpleNamespace(model=target, config=SimpleNamespace(model=str(path)),
                               tp=SimpleNamespace(size=1), dtype=torch.float32,
                               device=torch.device("cpu"), attention_backend=target.layers[0]
                               .self_attn.backend)  # fmt: skip
    assert load_mtp(one_rank).layer.shared_head.head is None  # the model's head serves
    two_ranks = SimpleNamespace(**{**vars(one_rank), "tp": SimpleNamespace(size=2)})
    with pytest.raises(StartupError, match=r"no embed_tokens or shared_head\.head of its own"):
        load_mtp(two_ranks)
