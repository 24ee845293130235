"""The CUDA path: skipped on machines without a GPU (CI), run where one is lent."""

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from tests.helpers.executor_harness import Harness
from tools.make_model import write_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_kv_capacity_is_measured_and_greedy_decoding_runs_in_bf16(tmp_path):
    model_dir = write_model(tmp_path / "tiny", "tiny")
    runner = ModelRunner(ExecutorConfig(model=str(model_dir), gpu_memory_utilization=0.5))
    assert runner.dtype == torch.bfloat16 and runner.device.type == "cuda"
    total = torch.cuda.mem_get_info()[1]
    assert 0 < runner.num_blocks * runner.block_bytes <= 0.5 * total
    harness = Harness(runner)
    harness.add("a", [0, 5, 6, 7, 8], SamplingParams())
    tokens = [harness.step({"a": 5})["a"]] + [harness.step({"a": 1})["a"] for _ in range(8)]
    assert len(set(tokens)) > 4


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])  # MoE: the fused experts' kernel
def test_greedy_decoding_on_the_gpu_with_triton_kernels_equals_generate(tmp_path, arch):
    from tests.helpers.checkpoints import load_reference, prompt, reference_generate

    model_dir = write_model(tmp_path / "tiny", "tiny", arch=arch)
    config = ExecutorConfig(
        model=str(model_dir), num_blocks=256, dtype="float32", attention_backend="triton"
    )
    harness = Harness(ModelRunner(config))
    reference = load_reference(model_dir).cuda()
    prompts = {f"r{i}": prompt(50 + i, n) for i, n in enumerate((3, 17, 40, 64))}
    for req_id, tokens in prompts.items():
        harness.add(req_id, tokens)
    outputs = {r: [] for r in prompts}
    num_tokens = {r: len(t) for r, t in prompts.items()}
    for _ in range(24):
        for req_id, token in harness.step(num_tokens).items():
            outputs[req_id].append(token)
        num_tokens = dict.fromkeys(prompts, 1)
    for req_id, tokens in prompts.items():
        expected = reference_generate(reference, tokens, 24)
        assert outputs[req_id] == expected, req_id


@pytest.mark.parametrize("scheme", ["gptq", "fp8-hf"])  # W4A16, FP8 block-scaled
def test_a_quantized_checkpoint_on_the_gpu_gives_the_cpus_greedy_tokens(tmp_path, scheme):
    """Triton's quantized GEMMs on the device against the torch kernels on the CPU;
    fp8-hf's activations round to e4m3, so a few tokens may differ (counted)."""
    from tests.helpers.checkpoints import prompt
    from tools.quantize_model import quantize

    path = quantize(write_model(tmp_path / "tiny", "tiny"), scheme, tmp_path / scheme)
    outputs = {}
    for device, backend in (("cuda", "triton"), ("cpu", "torch")):
        config = ExecutorConfig(model=str(path), num_blocks=256, dtype="float32",
                                device=device, attention_backend=backend)  # fmt: skip
        harness = Harness(ModelRunner(config))
        harness.add("a", prompt(7, 12))
        tokens = [harness.step({"a": 12})["a"]] + [harness.step({"a": 1})["a"] for _ in range(23)]
        outputs[device] = tokens
    same = sum(a == b for a, b in zip(outputs["cuda"], outputs["cpu"], strict=True))
    print(f"{scheme}: {same} of 24 greedy tokens equal on the GPU and the CPU")
    assert same == 24 if scheme == "gptq" else same >= 12


def test_flash_linear_attentions_kernels_equal_the_torch_path():
    # kernels/fla_gdn.py against kernels/torch_gdn.py: a chunk from a state, then a step
    # of decodes, states carried (FLA's autotuned kernels need a GPU, not the interpreter).
    pytest.importorskip("fla")
    from flagstop.kernels import fla_gdn, torch_gdn

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = torch_gdn.normalize(rand(100, 8, 128), rand(100, 8, 128))
    v, g, beta = rand(100, 8, 128), -torch.rand(100, 8, device="cuda"), rand(100, 8).sigmoid()
    ours = rand(8, 128, 128) * 0.1
    theirs = ours.clone()
    want = torch_gdn.chunked(q, k, v, g, beta, ours)
    got = fla_gdn.chunked(q, k, v, g, beta, theirs)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(theirs, ours, atol=2e-2, rtol=2e-2)
    step = [x[:4, None] for x in (q, k, v, g, beta)]
    states = ours[None].repeat(4, 1, 1, 1)
    want = torch_gdn.recurrent(*step, states.clone())
    got = fla_gdn.recurrent(*step, states)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
