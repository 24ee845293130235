"""DeepSeek's layout served (`make model ARCH=deepseek_v3`, `glm4_moe`): the checkpoints
make_model writes are what transformers reads; the latent cache holds one latent and
one rotated key a token, in the pool's own tensors, and in FP8 four times the blocks;
the whole stack on two expert-parallel ranks, its prediction layer drafting, streams
what transformers generates under preemption, chunked prefill and prefix hits. (Every
family's logits through prefill, chunks, prefix hits, preemption and joins:
test_executor_model; TP=2: test_tensor_parallel; the kernels: test_mla; mtp: test_mtp.)"""

import json
import shutil
import statistics

import pytest
import torch
from safetensors.torch import load_file, save_file

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from tests.helpers.checkpoints import assert_matches, load_reference, prompt
from tests.helpers.executor_harness import Harness
from tests.helpers.metrics import scrape
from tests.helpers.streams import assert_greedy_under_pressure
from tests.helpers.streams import short_greedy_workload as workload
from tools.make_model import SIZES, write_model
from tools.stack import start_stack

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

TINY = SIZES["tiny"]


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny-deepseek_v3", "tiny",
                       arch="deepseek_v3")  # fmt: skip


def runner(path, **overrides) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(path), **{"num_blocks": 64, **overrides}))


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_make_models_checkpoints_serve_what_transformers_serves(arch, tmp_path, deepseek_dir):
    path = deepseek_dir if arch == "deepseek_v3" else write_model(tmp_path / arch, "tiny",
                                                                    arch=arch)  # fmt: skip
    harness, reference = Harness(runner(path, block_size=4)), load_reference(path)
    harness.add("a", prompt(1, 13))
    harness.add("b", prompt(2, 3))
    assert_matches(reference, harness, harness.logits({"a": 13, "b": 3}))
    assert_matches(reference, harness, harness.logits({"a": 1, "b": 1}))


def test_the_latent_cache_holds_a_latent_and_a_rotated_key_a_token(deepseek_dir):
    """Asserted from the pool's tensors: kv_lora_rank + qk_rope_head_dim values a token
    a layer, one tensor a layer (no V), the same on every head; the same model with
    every head's K and V would hold (48 + 32) x 4 heads = 320 values, 4x the latent's 80."""
    plain = runner(deepseek_dir, num_blocks=None, kv_cache_bytes=1 << 22, block_size=16)
    mla = plain.model_config.mla
    assert (mla.kv_lora_rank, mla.rope_dim) == (TINY["hidden_size"] // 4, 16)
    assert all(len(tensors) == 1 for tensors in plain.kv_caches)
    cache = plain.kv_caches[0][0]
    assert cache.shape == (plain.num_blocks, 16, mla.kv_lora_rank + mla.rope_dim)
    pool_bytes = sum(t.numel() * t.element_size() for pair in plain.kv_pairs for t in pair)
    per_token = pool_bytes // (plain.num_blocks * 16)
    assert per_token == TINY["num_hidden_layers"] * (mla.kv_lora_rank + mla.rope_dim) * 4
    assert per_token == sum(x.kv_bytes_per_token for x in plain.kv_layers)
    full_head = TINY["num_attention_heads"] * (mla.nope_dim + mla.rope_dim + mla.v_head_dim)
    assert full_head == 4 * (mla.kv_lora_rank + mla.rope_dim)
    fp8 = runner(deepseek_dir, num_blocks=None, kv_cache_bytes=1 << 22, block_size=16,
                 kv_cache_dtype="fp8")  # fmt: skip
    assert fp8.num_blocks // 4 == plain.num_blocks  # (the bytes are not a multiple)
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_an_fp8_latent_cache_stays_as_close_as_an_fp8_kv_cache_does(deepseek_dir, tmp_path):
    """The latent and rotated key stored as e4m3 over the checkpoint's k_scale (0.5
    here), the queries and output scaled back. The relative logit error against the
    float32 cache's, over 16 prompts: median 0.08 (the tiny Llama's FP8 K/V cache: 0.15;
    the output left unscaled: 0.83), a few contexts far more sensitive than the rest.
    The absorbed decode reads the FP8 latents as the expanded prefill does: a decode
    gives the logits of a prefill of the same context on the same cache: within 2e-6,
    except where a token the prefill recomputes (its batch rounds differently from the
    decode's, by ~1e-7) has a latent value at an e4m3 rounding midpoint and stores the
    neighbouring FP8 value: seed 3 on an AVX512-FP16/AMX CPU, 1.1e-4, the same contexts
    on the float32 cache 2e-6. A scale left out of the absorbed path would be ~0.8."""
    path = shutil.copytree(deepseek_dir, tmp_path / "k-scale")
    tensors = load_file(path / "model.safetensors")
    for layer in range(TINY["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([0.5])
    save_file(tensors, path / "model.safetensors")
    plain, fp8 = (Harness(runner(path, kv_cache_dtype=d)) for d in ("auto", "fp8"))
    assert fp8.runner.model.layers[0].self_attn.kv_scale == 0.5
    errors = []
    for seed in range(16):
        for harness in (plain, fp8):
            harness.add(f"r{seed}", prompt(seed, 25))
        want, got = (h.logits({f"r{seed}": 25})[f"r{seed}"] for h in (plain, fp8))
        errors.append(relative_error(want, got))
    assert 0 < statistics.median(errors) < 0.2, errors
    for seed in range(4):  # a decode on FP8 latents, then a prefill of its context
        decoded = fp8.logits({f"r{seed}": 1})[f"r{seed}"]
        fp8.add(f"p{seed}", fp8.requests[f"r{seed}"].token_ids[:26])
        assert relative_error(fp8.logits({f"p{seed}": 26})[f"p{seed}"], decoded) < 1e-3


def relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.processes
def test_the_stack_on_two_expert_parallel_ranks_streams_what_transformers_generates(
    deepseek_dir, tmp_path
):
    """With the checkpoint's prediction layer drafting (mtp, on rank 0): its random
    weights' drafts are mostly rejected, and verification keeps the tokens exact. A pool
    of 10 blocks (160 tokens) for 10 concurrent requests: at 16, drafting requests
    finished fast enough that one CI run's arrival order never preempted."""
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    stack = start_stack(
        deepseek_dir, tmp_path,
        executor_args=["--num-blocks", "10", "--tensor-parallel-size", "2", "--expert-parallel",
                       "--speculative-config", mtp],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
    )  # fmt: skip
    try:
        requests = workload(7, n=10, shared_prefix=True)
        assert_greedy_under_pressure(stack, load_reference(deepseek_dir), requests)
        drafts = scrape(stack.metrics_ports["scheduler"])
        assert sum(v for k, v in drafts.items() if "spec_decode_num_draft_tokens" in k) > 0
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


def test_fp8_block_weights_as_deepseek_ships_them_serve_the_dequantized_model(
    deepseek_dir, tmp_path
):
    """transformers' fine-grained FP8 (quant_method fp8, e4m3 weights and a
    weight_scale_inv per 32 x 32 block here, activations per token and 32-column group),
    the routers and the prediction layer's embedding, head and eh_proj left in float:
    every latent projection and expert stays FP8 in memory; W_uk and W_uv are kv_b_proj's
    dequantized weight; prefill logits are transformers' on the dequantized weights with
    the same activations quantized, within the tolerance of test_quantization (0.10;
    measured 0.027-0.049 over 8 prompts: the experts' down projections quantize their
    inputs here and not there, and a random model's routing amplifies it)."""
    from flagstop.executor.models.linear import QuantLinear
    from flagstop.executor.models.moe import QuantExperts
    from tests.test_quantization import ACT_REL_TOL, expert_weight, fp8_groups
    from tools import quantize_model

    path = quantize_model.quantize(deepseek_dir, "fp8-hf", tmp_path / "fp8")
    model = runner(path).model
    attention = model.layers[1].self_attn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert getattr(attention, name).weight.dtype == torch.float8_e4m3fn, name
    assert isinstance(model.layers[1].mlp.experts, QuantExperts)
    assert model.layers[1].mlp.e_score_correction_bias.dtype == torch.float32
    w = attention.kv_b_proj.dequantize().view(attention.num_heads, -1, attention.w_uk.shape[-1])
    assert torch.equal(torch.cat((attention.w_uk, attention.w_uv), 1), w)
    reference = load_reference(deepseek_dir)
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, QuantLinear) and "layers.4." not in name:
                weight, start = layer.dequantize(), 0
                for hf in layer.layers:  # gate and up packed in one
                    target = reference.get_submodule(hf)
                    rows = target.weight.shape[0]
                    target.weight.copy_(weight[start : start + rows])
                    start += rows
                    if "kv_b_proj" not in hf:  # its weight is used as is: W_uk, W_uv
                        target.register_forward_pre_hook(fp8_groups(layer.scheme.act.group))
            elif isinstance(layer, QuantExperts):
                theirs = reference.get_submodule(f"model.{name}")
                for e in range(layer.num_experts):
                    theirs.gate_up_proj[e] = expert_weight(layer, "w13", e)
                    theirs.down_proj[e] = expert_weight(layer, "w2", e)
                # Each token's input quantized as ours are (not the down projection's:
                # transformers' fused experts have no seam there).
                quantize = fp8_groups(layer.scheme.act.group)
                theirs.register_forward_pre_hook(lambda m, a, q=quantize: (*q(m, a), *a[1:]))
    harness, errors = Harness(runner(path)), []
    for seed in range(8):
        harness.add(f"r{seed}", prompt(seed, 6 + 3 * seed))
        got = harness.logits({f"r{seed}": 6 + 3 * seed})[f"r{seed}"]
        want = reference(torch.tensor([prompt(seed, 6 + 3 * seed)])).logits[0, -1]
        errors.append(relative_error(want.float(), got))
    assert max(errors) < ACT_REL_TOL, errors


def test_lora_on_latent_attention_is_refused_in_one_line(deepseek_dir):
    from flagstop.executor.lora.adapter import AdapterError

    with pytest.raises(AdapterError, match="--max-loras: LoRA on a model with latent attention"):
        runner(deepseek_dir, max_loras=1)
