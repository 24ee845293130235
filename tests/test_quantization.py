"""Quantized checkpoints (tools/quantize_model.py: compressed-tensors' own compressor, and
the documented layouts of transformers' FP8, GPTQ and AWQ) against their references:
the weights bitwise against each format's decompressor, the logits against transformers
running the checkpoint (compressed-tensors' quantized forward, activations included),
greedy tokens, two ranks against one, and the configs refused at start-up."""

import json
import shutil
import subprocess
import sys

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
from tests.helpers.tp_scenarios import run_scenarios
from tools import quantize_model
from tools.stack import ROOT

CT_SCHEMES = list(quantize_model.CT_PRESETS)
WEIGHT_ONLY = {"w8a16", "w4a16", "w4a16-asym", "gptq", "awq"}
# Activations quantized per token or group: a value a hair from a rounding boundary can
# round the other way in our forward and the reference's (their attention and the TP
# all-reduce sum in another order), which moves the logits by a step of the 8-bit grid,
# and a flipped value in the KV cache stays for the request's later steps. Measured
# here: most comparisons agree within 1e-5 (at least 5 of 8, fp8 static), the others by
# 0.7-4.3 % of the logits' norm (fp8-block, fp8, fp8-hf, w8a8). So: half within TOL (a
# near miss in every step, as 127 for 127.5 in the int8 scale gives, fails), all
# within ACT_REL_TOL.
ACT_REL_TOL = 0.10
ACT_EXACT_SHARE = 0.5


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
    return ModelRunner(ExecutorConfig(model=str(path), num_blocks=64, block_size=4,
                                      max_num_seqs=16, **kw))  # fmt: skip


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
                    target.register_forward_pre_hook(fp8_groups_of_128)
    return reference


def fp8_groups_of_128(_module, args):
    """transformers' fine-grained FP8 quantizes a layer's input per token and 128-column
    group (dynamic): compressed-tensors' fake quantization of that same scheme."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    act = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).input_activations
    scale, zero = compute_dynamic_scales_and_zp(args[0], act, None)
    return (fake_quantize(args[0], scale, zero, act),)


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


@pytest.mark.processes
@pytest.mark.parametrize("scheme", ["w4a16-asym"])
def test_two_ranks_give_the_logits_of_one_on_quantized_weights(scheme, quantized, tmp_path):
    """Scales and zero points sliced with their weights (by output rows, and by groups of
    inputs for the row-parallel layers). (fp8-block passes it too, within ACT_REL_TOL:
    the all-reduce sums in another order than one rank, so a few activations round the
    other way; left out of the suite for its 12 s.)"""
    path = quantized(scheme)
    single = run_scenarios(Harness(runner(path)), 512)
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.tp_scenarios", str(path), str(tmp_path / "tp.pt"),
         "--tensor-parallel-size", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    parallel = {tuple(c): logits for c, logits in torch.load(tmp_path / "tp.pt")}
    assert len(parallel) == len(single) >= 10
    assert_close(scheme, [(parallel[tuple(context)], one) for context, one in single])


def assert_close(scheme: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """(got, expected) logits: within TOL for weight-only schemes; see ACT_REL_TOL."""
    if scheme in WEIGHT_ONLY:
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
        return
    exact = [(got - expected).abs().max() <= TOL for got, expected in pairs]
    relative = [((got - expected).norm() / expected.norm()).item() for got, expected in pairs]
    assert sum(exact) >= ACT_EXACT_SHARE * len(pairs), relative
    assert max(relative) < ACT_REL_TOL, relative


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


def test_a_quantized_moe_checkpoint_and_a_partly_quantized_qkv_are_refused(tmp_path, source):
    moe = {"architectures": ["MixtralForCausalLM"], "vocab_size": 512, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_local_experts": 4, "num_experts_per_tok": 2,
           "quantization_config": ct()}  # fmt: skip
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        ModelConfig.from_hf(moe)
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
