"""The executor scenarios of test_executor_model, run on any harness and recorded:
(context token ids, logits) of every sampled request. Run as a program it is rank 0 of
a tensor-parallel group (starting the other ranks as the executor does) and saves
what it recorded:

    python -m tests.helpers.tp_scenarios CHECKPOINT OUT.pt [--tensor-parallel-size 2]
        [--expert-parallel] [--kv-cache-dtype fp8]

With --tensor-parallel-size 1 it is a group of one (NCCL on a GPU, gloo on the CPU):
the group machinery with nothing split.
"""

import argparse
import random
import subprocess
import sys
from pathlib import Path

import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.distributed import join, start_group
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.tp_messages import STOP
from flagstop.scheduler_svc.core.kv_groups import kv_cache_groups
from tests.helpers.executor_harness import Harness

Record = list[tuple[list[int], torch.Tensor]]


def prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, vocab_size) for _ in range(length - 1)]


def record(harness: Harness, logits: dict[str, torch.Tensor], out: Record) -> None:
    for req_id, got in logits.items():
        out.append((harness.requests[req_id].token_ids[:-1], got.clone()))


def run_scenarios(harness: Harness, vocab_size: int, lora_name: str = "") -> Record:
    """Mixed prefills and decodes, a prompt in three chunks, prefix hits on another
    request's blocks, and a request recomputed after its blocks were reused. With
    lora_name, requests a, c, e, f (on e's blocks) and x run that adapter beside the
    others' base model."""
    out: Record = []
    p = lambda seed, n: prompt(seed, n, vocab_size)  # noqa: E731

    def join(req_id: str, tokens: list[int], **kw) -> None:
        harness.add(req_id, tokens, **kw, lora_name=lora_name if req_id in "acefx" else "")

    join("a", p(1, 9))
    join("b", p(2, 4))
    record(harness, harness.logits({"a": 9, "b": 4}), out)
    join("c", p(3, 13))
    join("d", p(4, 1))
    record(harness, harness.logits({"b": 1, "c": 13, "d": 1, "a": 1}), out)
    join("e", p(5, 14))
    record(harness, harness.logits({"e": 5, "a": 1}), out)
    record(harness, harness.logits({"e": 5, "b": 1}), out)
    record(harness, harness.logits({"e": 4, "c": 1}), out)
    shared = harness.requests["e"].token_ids[:12]
    join("f", [*shared, 9, 8, 7], shared_blocks=harness.prefix_blocks("e", 3))
    record(harness, harness.logits({"f": 3, "d": 1}), out)
    for req_id in ("a", "b", "c", "d"):
        harness.leave(req_id)
    # f stays, idle: its first blocks are e's, which the harness does not count twice.
    harness.preempt("e")
    join("x", p(9, 30))
    record(harness, harness.logits({"x": 30}), out)
    harness.leave("x")
    record(harness, harness.logits({"e": len(harness.requests["e"].token_ids)}), out)
    record(harness, harness.logits({"e": 1}), out)
    return out


def config(
    checkpoint: Path,
    tensor_parallel_size: int = 1,
    expert_parallel: bool = False,
    kv_cache_dtype: str = "auto",
    lora_modules: tuple[str, ...] = (),
) -> ExecutorConfig:
    # float32 on every device (CUDA's default is bf16): compared at 1e-4. 64 blocks a
    # KV cache group (a block position holds one id per group).
    mc = ModelConfig.from_pretrained(checkpoint)
    num_blocks = 64 * len(kv_cache_groups(mc.kv_layers(1, 1)))
    return ExecutorConfig(model=str(checkpoint), num_blocks=num_blocks, block_size=4,
                          max_num_seqs=16,
                          dtype="float32", tensor_parallel_size=tensor_parallel_size,
                          expert_parallel=expert_parallel,
                          kv_cache_dtype=kv_cache_dtype, lora_modules=list(lora_modules),
                          max_loras=2 if lora_modules else 0)  # fmt: skip


def run_group(path: Path, out: Path, size: int, expert_parallel: bool = False,
              kv_cache_dtype: str = "auto", lora: str = "") -> dict:  # fmt: skip
    """This module run as rank 0 of `size` ranks on `path`: context -> logits."""
    from tools.stack import ROOT

    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.tp_scenarios", str(path), str(out),
         "--tensor-parallel-size", str(size), *["--expert-parallel"] * expert_parallel,
         "--kv-cache-dtype", kv_cache_dtype, *["--lora", lora] * bool(lora)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {tuple(context): logits for context, logits in torch.load(out)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--lora", default="", help="name=DIR: requests a, c, e, f, x run it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = config(args.checkpoint, args.tensor_parallel_size, args.expert_parallel,
                      args.kv_cache_dtype, (args.lora,) if args.lora else ())  # fmt: skip
    group = start_group(settings, None)
    try:
        runner = ModelRunner(settings, group.tp, lambda: join(group), group.device)
        vocab = ModelConfig.from_pretrained(args.checkpoint).vocab_size
        lora_name = args.lora.partition("=")[0]
        records = run_scenarios(Harness(runner, group=group), vocab, lora_name)
        group.send(STOP)
    finally:
        group.stop_children()
    torch.save(records, args.out)


if __name__ == "__main__":
    main()
