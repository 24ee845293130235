"""gpt-oss' MXFP4 experts: dequantized bitwise as transformers does it, and a
checkpoint holding them serves what transformers serves from those values. (The
model itself: test_executor_model.py, test_sliding_window.py, test_tensor_parallel.py.)"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from flagstop.executor.models.quant_formats import dequantize_mxfp4
from tests.helpers.checkpoints import load_reference, prompt, write_checkpoint
from tests.helpers.executor_harness import Harness
from tests.test_executor_model import make_harness

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., G, 16] of every nibble and scales [..., G] around 2^-3."""
    g = torch.Generator().manual_seed(seed)
    *prefix, columns = shape
    blocks = torch.randint(0, 256, (*prefix, columns // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 127, (*prefix, columns // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantizes_as_transformers_does(dtype):
    blocks, scales = _random_mxfp4((3, 10, 64), seed=1)
    ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """(an MXFP4 gpt-oss checkpoint, the same with its experts dequantized by
    transformers: the reference's weights)."""
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    plain = write_checkpoint("gpt-oss", root / "plain")
    weights = load_file(plain / "model.safetensors")
    quantized, dequantized = dict(weights), dict(weights)
    for seed, name in enumerate(n for n in weights if n.endswith(("gate_up_proj", "down_proj"))):
        rows_first = weights[name].transpose(1, 2)  # [E, out, in]: the blocks' layout
        blocks, scales = _random_mxfp4(tuple(rows_first.shape), seed)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = json.loads((plain / "config.json").read_text())
    for out, tensors, extra in (
        ("mxfp4", quantized, {"quantization_config": {"quant_method": "mxfp4"}}),
        ("dequantized", dequantized, {}),
    ):
        (root / out).mkdir()
        for f in plain.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (root / out / f.name).write_bytes(f.read_bytes())
        save_file(tensors, root / out / "model.safetensors", metadata={"format": "pt"})
        (root / out / "config.json").write_text(json.dumps({**config, **extra}))
    return root / "mxfp4", root / "dequantized"


def test_an_mxfp4_checkpoint_serves_what_transformers_serves_from_its_values(mxfp4_pair):
    mxfp4, dequantized = mxfp4_pair
    harness: Harness = make_harness(mxfp4)
    reference = load_reference(dequantized)
    experts = harness.runner.model.layers[0].mlp.experts
    theirs = reference.model.layers[0].mlp.experts.gate_up_proj.detach()  # [E, H, 2I]
    assert torch.equal(experts.w13[:, : theirs.shape[2] // 2], theirs[:, :, 0::2].transpose(1, 2))
    harness.add("a", prompt(1, 20))
    logits = harness.logits({"a": 20})["a"]
    expected = reference(torch.tensor([harness.requests["a"].token_ids[:-1]])).logits[0, -1]
    torch.testing.assert_close(logits, expected.float(), atol=1e-4, rtol=0)
