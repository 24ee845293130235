"""The executor scenarios of test_executor_model, run on any harness and recorded:
(context token ids, logits) of every sampled request. Run as a program it is rank 0 of
a tensor-parallel group (starting the other ranks as the executor does) and saves
what it recorded:

    python -m tests.helpers.tp_scenarios CHECKPOINT OUT.pt [--tensor-parallel-size 2]
        [--expert-parallel]

With --tensor-parallel-size 1 it is a group of one (NCCL on a GPU, gloo on the CPU):
the group machinery with nothing split.
"""

import argparse
import random
from pathlib import Path

import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.distributed import join, start_group
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.tp_messages import STOP
from tests.helpers.executor_harness import Harness

Record = list[tuple[list[int], torch.Tensor]]


def prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(2, vocab_size) for _ in range(length - 1)]


def record(harness: Harness, logits: dict[str, torch.Tensor], out: Record) -> None:
    for req_id, got in logits.items():
        out.append((harness.requests[req_id].token_ids[:-1], got.clone()))


def run_scenarios(harness: Harness, vocab_size: int) -> Record:
    """Mixed prefills and decodes, a prompt in three chunks, prefix hits on another
    request's blocks, and a request recomputed after its blocks were reused."""
    out: Record = []
    p = lambda seed, n: prompt(seed, n, vocab_size)  # noqa: E731
    harness.add("a", p(1, 9))
    harness.add("b", p(2, 4))
    record(harness, harness.logits({"a": 9, "b": 4}), out)
    harness.add("c", p(3, 13))
    harness.add("d", p(4, 1))
    record(harness, harness.logits({"b": 1, "c": 13, "d": 1, "a": 1}), out)
    harness.add("e", p(5, 14))
    record(harness, harness.logits({"e": 5, "a": 1}), out)
    record(harness, harness.logits({"e": 5, "b": 1}), out)
    record(harness, harness.logits({"e": 4, "c": 1}), out)
    shared = harness.requests["e"].token_ids[:12]
    harness.add("f", [*shared, 9, 8, 7], shared_blocks=harness.requests["e"].block_ids[:3])
    record(harness, harness.logits({"f": 3, "d": 1}), out)
    for req_id in ("a", "b", "c", "d"):
        harness.leave(req_id)
    # f stays, idle: its first blocks are e's, which the harness does not count twice.
    harness.preempt("e")
    harness.add("x", p(9, 30))
    record(harness, harness.logits({"x": 30}), out)
    harness.leave("x")
    record(harness, harness.logits({"e": len(harness.requests["e"].token_ids)}), out)
    record(harness, harness.logits({"e": 1}), out)
    return out


def config(
    checkpoint: Path, tensor_parallel_size: int = 1, expert_parallel: bool = False
) -> ExecutorConfig:
    # float32 on every device (CUDA's default is bf16): compared at 1e-4.
    return ExecutorConfig(model=str(checkpoint), num_blocks=64, block_size=4, max_num_seqs=16,
                          dtype="float32", tensor_parallel_size=tensor_parallel_size,
                          expert_parallel=expert_parallel)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--expert-parallel", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = config(args.checkpoint, args.tensor_parallel_size, args.expert_parallel)
    group = start_group(settings, None)
    try:
        runner = ModelRunner(settings, group.tp, lambda: join(group), group.device)
        vocab = ModelConfig.from_pretrained(args.checkpoint).vocab_size
        records = run_scenarios(Harness(runner, group=group), vocab)
        group.send(STOP)
    finally:
        group.stop_children()
    torch.save(records, args.out)


if __name__ == "__main__":
    main()
