"""Quantized checkpoints (tools/quantize_model.py: compressed-tensors' own compressor, and
the documented layouts of transformers' FP8, GPTQ and AWQ) against their references:
the weights bitwise against each format's decompressor, the logits against transformers
running the checkpoint (compressed-tensors' quantized forward, activations included),
greedy tokens, two ranks against one, and the configs refused at start-up."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.linear import QuantLinear
from flagstop.executor.models.quant_formats import FormatError, pack_int4, unpack_int32
from flagstop.executor.models.quantization import ConfigError, QuantConfig
from tests.helpers.checkpoints import (
    TOL,
    prompt,
    reference_generate,
    reference_logits,
    write_checkpoint,
)
from tests.helpers.executor_harness import Harness
from tools import quantize_model

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

CT_SCHEMES = list(quantize_model.CT_PRESETS)
WEIGHT_ONLY = {"w8a16", "w4a16", "w4a16-asym", "gptq", "awq"}
# Activations quantized per token or group: a value a hair from a rounding boundary can
# round the other way in our forward and the reference's (their attention and the TP
# all-reduce sum in another order), which moves the logits by a step of the 8-bit grid,
# and a flipped value in the KV cache stays for the request's later steps. How many
# flip is the CPU's float kernels' doing: on one machine most comparisons agreed within
# 1e-5 (5 of 8 or more), on a Sapphire Rapids one (AVX-512, AMX) 0-2 of 8, the others
# by 0.6-2.6 % of the logits' norm, every run alike. So the logits are held only within
# ACT_REL_TOL, and the quantized layers themselves to the reference's on its own inputs
# (test_quantized_layers_equal_the_references_on_its_inputs: bitwise here): a wrong
# scale (127 for 127.5) fails that at every layer, whatever the CPU.
ACT_REL_TOL = 0.10


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """scheme -> its checkpoint, made on first use."""
    made: dict[str, object] = {}

    def get(scheme: str):
        if scheme not in made:
            made[scheme] = quantize_model.quantize(
                source, scheme, tmp_path_factory.mktemp(scheme) / scheme
            )
        return made[scheme]

    return get


def runner(path, **kw) -> ModelRunner:
    return ModelRunner(ExecutorConfig(**{"model": str(path), "num_blocks": 64, "block_size": 4,
                                         "max_num_seqs": 16, **kw}))  # fmt: skip


def quant_layers(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_weights_dequantize_bitwise_as_compressed_tensors_decompresses_them(scheme, quantized):
    path = quantized(scheme)
    ours = quant_layers(runner(path).model)["layers.1.mlp.gate_up_proj"].dequantize()
    theirs = (
        AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
        .model.layers[1]
        .mlp
    )
    expected = torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight])
    assert torch.equal(ours, expected)


def test_fp8_blocks_dequantize_bitwise_as_transformers_does(quantized):
    path = quantized("fp8-hf")
    ours = quant_layers(runner(path).model)["layers.0.self_attn.o_proj"].dequantize()
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.layers.0.self_attn.o_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.o_proj.weight_scale_inv")
    assert torch.equal(ours, _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32))


@pytest.mark.parametrize("scheme", ["gptq", "awq"])
def test_int4_packings_round_trip_to_the_values_they_packed(scheme, quantized, source):
    """GPTQ and AWQ have no installable writer here: the packer follows the documented
    layout, and the loader must recover exactly the (q - zero) * scale it packed."""
    w = AutoModelForCausalLM.from_pretrained(source).model.layers[0].self_attn.k_proj.weight
    q, scale, zero = quantize_model.int4_groups(w.detach(), symmetric=scheme == "gptq")
    expected = ((q.float() - zero.float().repeat_interleave(128, 1))
                * scale.half().float().repeat_interleave(128, 1))  # fmt: skip
    qkv = quant_layers(runner(quantized(scheme)).model)["layers.0.self_attn.qkv_proj"]
    assert torch.equal(qkv.dequantize()[256:384], expected)


def test_int4_words_unpack_as_they_were_packed():
    values = torch.randint(0, 16, (6, 40), dtype=torch.uint8)
    words = pack_int4(values)
    assert words.shape == (6, 5) and words.dtype == torch.int32
    assert torch.equal(unpack_int32(words, 4, dim=1), values)
    assert torch.equal(unpack_int32(words.t().contiguous(), 4, dim=0), values.t())


def dequantized_reference(path, scheme: str, source):
    """transformers on the checkpoint: compressed-tensors' quantized forward where it
    quantizes activations, its decompressed weights where it does not (transformers
    cannot run its packed int4 layers here: the zero points' packed shape mismatches);
    for the other formats the source model with each linear weight replaced by
    flagstop's dequantized one (bitwise the formats', tested above)."""
    if scheme in CT_SCHEMES:
        # (quantization_config=None is not the same as none passed: it runs no quantization)
        decompress = {"quantization_config": CompressedTensorsConfig(dequantize=True)}
        return AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float32,
            attn_implementation="eager",
            **(decompress if scheme in WEIGHT_ONLY else {}),
        ).eval()
    reference = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    ours = quant_layers(runner(path).model)
    with torch.no_grad():
        for layer in ours.values():
            weight, start = layer.dequantize(), 0
            for hf in layer.layers:
                target = reference.get_submodule(hf)
                rows = target.weight.shape[0]
                target.weight.copy_(weight[start : start + rows])
                start += rows
                if scheme == "fp8-hf":
                    target.register_forward_pre_hook(fp8_groups(layer.scheme.act.group))
    return reference


def fp8_groups(group: int):
    """A forward pre-hook: transformers' fine-grained FP8 quantizes a layer's input per
    token and `group`-column group (dynamic): compressed-tensors' fake quantization of
    that same scheme."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    act = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).input_activations
    act = act.model_copy(update={"group_size": group})

    def hook(_module, args):
        scale, zero = compute_dynamic_scales_and_zp(args[0], act, None)
        return (fake_quantize(args[0], scale, zero, act),)

    return hook


@pytest.mark.parametrize("scheme", quantize_model.SCHEMES)
def test_logits_match_transformers_on_the_quantized_checkpoint(scheme, quantized, source):
    path = quantized(scheme)
    harness = Harness(runner(path))
    reference = dequantized_reference(path, scheme, source)
    harness.add("a", prompt(1, 11))
    harness.add("b", prompt(2, 5))
    pairs = []
    for step in ({"a": 11, "b": 5}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        for req_id, got in harness.logits(step).items():
            pairs.append(
                (got, reference_logits(reference, harness.requests[req_id].token_ids[:-1]))
            )
    assert_close(scheme, pairs)


@pytest.mark.parametrize("scheme", ["w4a16", "gptq"])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(scheme, quantized, source):
    path = quantized(scheme)
    reference = dequantized_reference(path, scheme, source)
    harness = Harness(runner(path))
    prompts = {"a": prompt(3, 7), "b": prompt(4, 12)}
    for req_id, ids in prompts.items():
        harness.add(req_id, ids)
    harness.logits({req_id: len(ids) for req_id, ids in prompts.items()})
    for _ in range(23):
        harness.logits(dict.fromkeys(prompts, 1))
    for req_id, ids in prompts.items():
        assert harness.requests[req_id].token_ids[len(ids):] == \
            reference_generate(reference, ids, 24)  # fmt: skip


def test_weights_stay_quantized_in_memory(quantized):
    """Against 4 bytes a weight in float32: 1 byte and a scale a row (or a row's group of
    128) for 8 bits, half a byte and a scale and zero a group for int4."""
    for scheme, most in (("w8a8", 0.26), ("w4a16", 0.15), ("fp8-block", 0.27)):
        layers = quant_layers(runner(quantized(scheme)).model).values()
        dense = sum(layer.in_features * layer.out_features * 4 for layer in layers)
        held = sum(layer.resident_bytes() for layer in layers)
        assert held < most * dense, (scheme, held, dense)


def assert_close(scheme: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """(got, expected) logits: within TOL for weight-only schemes; see ACT_REL_TOL."""
    if scheme in WEIGHT_ONLY:
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
        return
    relative = [((got - expected).norm() / expected.norm()).item() for got, expected in pairs]
    assert max(relative) < ACT_REL_TOL, relative


@pytest.mark.parametrize("scheme", [s for s in quantize_model.SCHEMES if s not in WEIGHT_ONLY])
def test_quantized_layers_equal_the_references_on_its_inputs(scheme, quantized, source):
    """Every quantized linear layer (q, k and v packed as one, gate and up too) fed the
    inputs the reference's layers saw in its forward over a prompt gives their outputs:
    the activations quantize alike, so only the GEMMs' sum order may differ."""
    path = quantized(scheme)
    reference = dequantized_reference(path, scheme, source)
    ours = quant_layers(runner(path).model)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in (hf for layer in ours.values() for hf in layer.layers):
        reference.get_submodule(name).register_forward_hook(
            lambda _m, args, out, name=name: seen.__setitem__(name, (args[0][0], out[0]))
        )
    with torch.no_grad():
        reference(torch.tensor([prompt(1, 11)]))
        for layer in ours.values():
            got = layer(seen[layer.layers[0]][0])
            expected = torch.cat([seen[hf][1] for hf in layer.layers], dim=-1)
            torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@pytest.mark.processes
def test_greedy_streams_on_two_ranks_of_a_quantized_checkpoint_equal_transformers(
    quantized, source, tmp_path
):
    """The whole stack on W4A16 (asymmetric) weights over two tensor-parallel ranks, a
    pool small enough to preempt and prompts that share prefixes: every greedy stream is
    transformers' on the dequantized weights (compressed-tensors' decompressor)."""
    from tests.helpers.streams import assert_greedy_under_pressure
    from tests.helpers.streams import short_greedy_workload as workload
    from tools.stack import start_stack

    path = quantized("w4a16-asym")
    stack = start_stack(
        path, tmp_path, executor_args=["--num-blocks", "24", "--tensor-parallel-size", "2"],
        # Admission as soon as a first chunk fits: whole-sequence admission preempted
        # this burst or not by its arrival order (two runs in three preempted none).
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8",
                        "--no-reserve-full-isl"],
    )  # fmt: skip
    try:
        reference = dequantized_reference(path, "w4a16-asym", source)
        assert_greedy_under_pressure(stack, reference, workload(7, n=12, shared_prefix=True))
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    from tools.make_model import write_model

    return write_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "tiny", arch="qwen3_moe")


def moe_reference(path, source):
    """transformers' Qwen3-MoE with flagstop's dequantized weights in its fused experts
    (and its attention's), so that it runs exactly the weights flagstop holds."""
    from flagstop.executor.models.moe import QuantExperts

    reference = dequantized_reference(path, "gptq", source)  # the dense layers'
    model = runner(path).model
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            experts = layer.mlp.experts
            assert isinstance(experts, QuantExperts)
            theirs = reference.model.layers[i].mlp.experts
            for e in range(experts.num_experts):
                for which, param in (("w13", theirs.gate_up_proj), ("w2", theirs.down_proj)):
                    param[e] = expert_weight(experts, which, e)
    return reference


def expert_weight(experts, which: str, e: int) -> torch.Tensor:
    from flagstop.kernels import torch_quant

    p = {n.removeprefix(f"{which}_"): t[e] for n, t in experts.named_parameters()
         if n.startswith(f"{which}_")}  # fmt: skip
    if "qweight" in p:
        columns = p["qweight"].shape[1] * 8
        return torch_quant.dequantize_int4(p["qweight"], p["scales"], p["zeros"], columns)
    return torch_quant.dequantize_w8(p["weight"], p["weight_scale"])


@pytest.mark.parametrize("scheme", ["gptq", "awq", "fp8-hf"])
def test_quantized_moe_experts_match_transformers_on_their_dequantized_weights(
    scheme, moe_source, tmp_path
):
    """Qwen3-MoE with its experts quantized (GPTQ and AWQ int4, FP8 blocks, by 64: the
    experts have 192 inputs): logits against transformers running the same dequantized
    weights; the router stays in float32 (the formats' tools leave it). FP8's experts
    quantize their inputs, which transformers' fused experts cannot be hooked to do: for
    it, the experts' weights bitwise transformers' FP8 dequantization of the checkpoint's,
    and the experts weight-only against the fused MoE on those weights."""
    path = quantize_model.quantize(moe_source, scheme, tmp_path / scheme)
    if scheme == "fp8-hf":
        return check_fp8_experts(path)
    harness = Harness(runner(path))
    reference = moe_reference(path, moe_source)
    harness.add("a", prompt(1, 11))
    harness.add("b", prompt(2, 5))
    pairs = []
    for step in ({"a": 11, "b": 5}, {"a": 1, "b": 1}):
        for req_id, got in harness.logits(step).items():
            pairs.append(
                (got, reference_logits(reference, harness.requests[req_id].token_ids[:-1]))
            )
    assert_close(scheme, pairs)


@pytest.mark.processes
@pytest.mark.parametrize(("scheme", "group", "expert_parallel"),
                         [("gptq", 32, False), ("awq", None, True)],
                         ids=["gptq-sliced", "awq-expert-parallel"])  # fmt: skip
def test_quantized_experts_on_two_ranks_give_the_logits_of_one(
    scheme, group, expert_parallel, tmp_path
):
    """Qwen3-MoE (8 experts of 64, a dense layer among them) with int4 experts over two
    ranks: sliced (each rank a half of every expert, its scales and zeros cut with the
    weights between groups of 32) and placed whole (four experts a rank, the others'
    tensors never read): the logits of one rank, through prefills, prefix hits and a
    recompute."""
    from tests.helpers.checkpoints import write_checkpoint
    from tests.helpers.tp_scenarios import config, run_group, run_scenarios

    source = write_checkpoint("qwen3-moe", tmp_path / "source")
    path = quantize_model.quantize(source, scheme, tmp_path / scheme, group)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    single = run_scenarios(Harness(ModelRunner(config(path))), vocab)
    parallel = run_group(path, tmp_path / "tp2.pt", 2, expert_parallel)
    assert len(parallel) == len(single) >= 10
    for context, one in single:
        torch.testing.assert_close(parallel[tuple(context)], one, atol=TOL, rtol=0)


def check_fp8_experts(path) -> None:
    import dataclasses

    from safetensors import safe_open

    from flagstop.kernels import torch_moe

    experts = runner(path).model.layers[1].mlp.experts
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        name = "model.layers.1.mlp.experts.5.down_proj.weight"
        weight, scale = f.get_tensor(name), f.get_tensor(f"{name}_scale_inv")
    expected = _dequantize_fp8_weight(weight, scale, [64, 64], torch.float32)
    assert torch.equal(expert_weight(experts, "w2", 5), expected)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=g)
    ids = torch.randint(0, experts.num_experts, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    w13, w2 = (torch.stack([expert_weight(experts, which, e) for e in range(experts.num_experts)])
               for which in ("w13", "w2"))  # fmt: skip
    dense = torch_moe.fused_moe(x, w13, w2, weights, ids)
    with_act = experts(x, weights, ids)  # inputs quantized by groups of 64: close
    assert (with_act - dense).norm() / dense.norm() < 0.05
    experts.scheme = dataclasses.replace(experts.scheme, act=None)
    torch.testing.assert_close(experts(x, weights, ids), dense, atol=1e-4, rtol=1e-4)


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["Linear"],
                              "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                          "group_size": 128}}}}  # fmt: skip


def ct(**weights) -> dict:
    group = {**CT["config_groups"]["g"], "weights": {**CT["config_groups"]["g"]["weights"],
                                                      **weights}}  # fmt: skip
    return {**CT, "config_groups": {"g": group}}


@pytest.mark.parametrize(("quantization", "field"), [
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act=True"),
    ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head=True"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "weight_block_size=[128, 128]"),
    (ct(num_bits=2), "config_groups.g.weights='int2'"),
    (ct(strategy="tensor_group"), "strategy='tensor_group'"),
    (ct(actorder="group"), "actorder='group'"),
    ({**ct(), "format": "marlin-24"}, "format='marlin-24'"),
    ({**ct(), "sparsity_config": {"format": "sparse-24"}}, "sparsity_config"),
])  # fmt: skip
def test_quantization_configs_flagstop_cannot_run_are_refused_naming_the_field(quantization, field):
    with pytest.raises(ConfigError, match="quantization_config") as error:
        QuantConfig.from_hf({"quantization_config": quantization})
    assert field in str(error.value)


def test_layers_in_the_ignore_list_stay_in_the_models_dtype():
    ignore = ["lm_head", "re:.*down_proj", "model.layers.0.self_attn.q_proj"]
    config = QuantConfig.from_hf({"quantization_config": {**ct(), "ignore": ignore}})
    assert config.scheme_for("lm_head") is None
    assert config.scheme_for("model.layers.3.mlp.down_proj") is None
    assert config.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert config.scheme_for("model.layers.1.self_attn.q_proj").kind == "int4"
    assert QuantConfig.from_hf({"quantization_config": {"quant_method": "awq", "bits": 4}}) \
        .scheme_for("lm_head") is None  # fmt: skip


def test_partly_quantized_experts_and_a_partly_quantized_qkv_are_refused(tmp_path, source):
    from flagstop.executor.models.decoder import Decoder

    moe = {"architectures": ["MixtralForCausalLM"], "vocab_size": 512, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    moe["quantization_config"] = {**ct(), "ignore": ["lm_head", "re:.*experts\\.3\\.w2"]}
    with pytest.raises(ConfigError, match="more than one scheme"), torch.device("meta"):
        Decoder(ModelConfig.from_hf(moe))
    path = shutil.copytree(source, tmp_path / "partial")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**ct(), "ignore": ["lm_head", "re:.*k_proj"]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="need one scheme"):
        runner(path)


def test_a_checkpoint_missing_its_scales_names_the_layer(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(quantized("w8a8"), tmp_path / "broken")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj"):
        runner(path)


def test_gptq_groups_out_of_column_order_are_refused(quantized, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(quantized("gptq"), tmp_path / "act-order")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(FormatError, match="desc_act"):
        runner(path)


@pytest.mark.parametrize("scheme", ["gptq", "fp8-hf"])
def test_the_triton_backend_reaches_every_quantized_layer(scheme, quantized):
    """Each layer runs kernels/triton_quant.py's GEMM (W4A16, FP8 block-scaled; held to
    their twins in test_kernels.py) and gives the torch kernel's output. The whole model
    under the interpreter takes ~20 s a scheme: on a GPU, test_executor_cuda.py runs it."""
    from flagstop.kernels import triton_quant

    path = quantized(scheme)
    on_triton = quant_layers(runner(path, attention_backend="triton", block_size=16).model)
    on_torch = quant_layers(runner(path).model)
    kernel = triton_quant.int4_linear if scheme == "gptq" else triton_quant.w8_linear
    assert all(getattr(layer.kernels, kernel.__name__) is kernel for layer in on_triton.values())
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for name in ("layers.0.self_attn.qkv_proj", "layers.3.mlp.down_proj"):
        layer = on_triton[name]
        x_in = x if layer.in_features == 256 else torch.randn(5, layer.in_features)
        torch.testing.assert_close(layer(x_in), on_torch[name](x_in), atol=1e-4, rtol=1e-4)


# -- the FP8 KV cache -----------------------------------------------------------------


def greedy(path, prompts: dict[str, list[int]], n: int, **kw) -> dict[str, list[int]]:
    harness = Harness(runner(path, num_blocks=256, block_size=16, **kw))
    for req_id, ids in prompts.items():
        harness.add(req_id, ids)
    harness.logits({req_id: len(ids) for req_id, ids in prompts.items()})
    for _ in range(n - 1):
        harness.logits(dict.fromkeys(prompts, 1))
    return {r: harness.requests[r].token_ids[len(ids) :] for r, ids in prompts.items()}


def teacher_forced_top1(path, tokens: list[int], **kw) -> list[int]:
    """The top token after each prefix of `tokens` (one prefill, its prompt logprobs):
    the greedy choice at every position given the same context."""
    from flagstop.executor.sampling_params import SamplingParams

    harness = Harness(runner(path, num_blocks=256, block_size=16, **kw))
    harness.add("p", tokens, SamplingParams(prompt_logprobs=1))
    plan = harness._send({"p": len(tokens)})
    (part,) = harness.runner.execute(plan).prompt_logprobs
    return [top_ids[0] for _, top_ids, _ in part.entries]


def test_an_fp8_kv_cache_agrees_with_the_models_dtype_on_greedy_tokens(model_dir):
    """Given the same context (teacher-forced), the FP8 cache's greedy token is the
    float32 cache's at most positions: measured 133 of 192 (69 %) on the tiny model,
    whose random weights make near-ties common; with scales 100x too small (the cache
    saturates) 91 (47 %), hence the 60 % floor. Free-running, that model diverges
    within a few tokens on any cache but float32's: a bfloat16 cache's first difference
    comes at 2-64 tokens here, a float16 one's at 23-64, FP8's at 0-3."""
    prompts = {f"r{i}": prompt(100 + i, 5 + 7 * i) for i in range(4)}
    outputs = greedy(model_dir, prompts, 48)
    agree = {"auto": 0, "fp8": 0}
    for req_id, ids in prompts.items():
        for dtype in agree:
            forced = teacher_forced_top1(model_dir, ids + outputs[req_id], kv_cache_dtype=dtype)
            # The top token after each prefix, from the prompt on: what greedy chose.
            generated = forced[len(ids) - 1 :]
            agree[dtype] += sum(a == b for a, b in zip(generated, outputs[req_id], strict=True))
    total = 48 * len(prompts)
    print(f"fp8 KV cache: {agree['fp8']} of {total} teacher-forced greedy tokens equal float32's")
    assert agree["auto"] == total  # the measure itself
    assert agree["fp8"] >= 0.6 * total


def test_an_fp8_kv_cache_holds_four_times_the_float32_blocks_in_the_same_bytes(model_dir):
    plain = runner(model_dir, num_blocks=None, kv_cache_bytes=1 << 24)
    fp8 = runner(model_dir, num_blocks=None, kv_cache_bytes=1 << 24, kv_cache_dtype="fp8")
    assert fp8.num_blocks == 4 * plain.num_blocks  # 2x bfloat16's on a GPU
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.kv_caches[0][0].numel() == 4 * plain.kv_caches[0][0].numel()


@pytest.mark.processes
def test_an_fp8_cache_on_two_ranks_keeps_each_ranks_heads_scales(model_dir, tmp_path):
    """Per-head K scales, one so small that its head saturates at 448 x scale: each
    rank must quantize its own KV head by that head's scale, or its K values land on
    another grid and clip elsewhere. Two ranks' logits against one rank's on the same
    FP8 cache. Measured: 12 of 15 within 1e-4, the others off by a K value rounded to
    the neighbouring e4m3 step (the ranks' GEMMs differ in the last float bit), at most
    9.4e-5 of the logits' norm; with rank 1 quantizing by rank 0's scale, 1.18 of the
    norm and 7 of 15 greedy contexts lost."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.tp_scenarios import config, run_group, run_scenarios

    path = shutil.copytree(model_dir, tmp_path / "kv-scales")
    tensors = load_file(path / "model.safetensors")
    for layer in (0, 1):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([[[0.002]], [[1.0]]])
    save_file(tensors, path / "model.safetensors")
    vocab = ModelConfig.from_pretrained(path).vocab_size
    single = run_scenarios(Harness(ModelRunner(config(path, kv_cache_dtype="fp8"))), vocab)
    parallel = run_group(path, tmp_path / "tp2.pt", 2, kv_cache_dtype="fp8")
    assert len(parallel) == len(single) >= 10
    for context, one in single:
        assert ((parallel[tuple(context)] - one).norm() / one.norm()) < 1e-3


def test_the_checkpoints_kv_scales_are_the_fp8_caches(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(model_dir, tmp_path / "kv-scales")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor([0.5])  # per tensor
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([[[0.25]], [[0.75]]])  # per head
    save_file(tensors, path / "model.safetensors")
    model = runner(path, kv_cache_dtype="fp8").model
    scales = [model.layers[i].self_attn.fp8_scales for i in (0, 1)]
    assert torch.equal(scales[1].key.flatten(), torch.tensor([0.5, 0.5]))
    assert torch.equal(scales[1].value.flatten(), torch.tensor([0.25, 0.75]))
    # Each KV head's scale on its query heads (4 heads, 2 KV heads).
    assert torch.equal(scales[1].output.flatten(), torch.tensor([0.25, 0.25, 0.75, 0.75]))
    assert torch.equal(scales[0].key, torch.ones(1, 2, 1))
    assert runner(path).model.layers[1].self_attn.fp8_scales is None  # unused without fp8
