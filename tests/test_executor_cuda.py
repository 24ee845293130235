"""The CUDA path: skipped on machines without a GPU (CI), run where one is lent."""

import pytest
import torch

from executor.config import ExecutorConfig
from executor.make_model import write_model
from executor.model_runner import ModelRunner
from executor.sampling import SamplingParams
from tests.executor_harness import Harness

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
