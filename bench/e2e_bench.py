"""Offline throughput of the 3-process stack vs the same engine in one process.

    python bench/e2e_bench.py [--size small] [--requests 32] [--out bench/results/e2e.md]

The same deterministic workload (prompts and output lengths drawn from a fixed seed,
greedy, EOS ignored so both generate exactly the same tokens) goes through (a) the
scheduler core and the model runner called directly in one process, and (b) router ->
scheduler -> executor over gRPC on loopback, every request sent at t=0. Useful output
tokens/s = generated tokens / wall time from the first request to the last token.
"""

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.config import ExecutorConfig
from executor.make_model import write_model
from executor.model_runner import ModelRunner
from executor.sampling import SamplingParams
from flagstop import wire
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.request import Request, StopParams
from scheduler_svc.scheduler import Scheduler
from tests.stack import start_stack

NUM_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, BUDGET = 1024, 16, 16, 512


def workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [0] + [rng.randrange(3, 512) for _ in range(rng.randrange(16, 128))],
            rng.randrange(16, 128),
        )
        for _ in range(num_requests)
    ]


def run_in_process(model_dir: Path, requests) -> tuple[float, int]:
    config = ExecutorConfig(
        model=str(model_dir),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
    )
    runner = ModelRunner(config)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE,
        max_model_len=runner.max_model_len,
    )  # fmt: skip
    scheduler = Scheduler(scheduler_config, NUM_BLOCKS)
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        scheduler.add_request(Request(
            f"r{i}", "bench", prompt, StopParams(max_tokens, ignore_eos=True),
            sampling_params=SamplingParams(),
        ))  # fmt: skip
    generated = 0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        output = runner.execute(plan)
        for out in scheduler.update_from_output(plan, output.token_ids).values():
            generated += len(out.new_token_ids)
    return time.perf_counter() - start, generated


async def run_stack(router: str, requests) -> tuple[float, int]:
    async with wire.channel(router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int], max_tokens: int) -> int:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
            return sum([len(c.token_ids) async for c in stub.Generate(request, timeout=3600)])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in requests))
        return time.perf_counter() - start, sum(counts)


def run_through_stack(model_dir: Path, requests, env: dict[str, str] | None = None):
    """(wall seconds, generated tokens) through a fresh 3-process stack."""
    stack = start_stack(
        model_dir, Path(tempfile.mkdtemp(prefix="bench-")),
        executor_args=["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)],
        scheduler_args=[
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(BUDGET)
        ],
        env=env,
    )  # fmt: skip
    try:
        return asyncio.run(run_stack(stack.router, requests))
    finally:
        stack.stop()


def parse_args(out_name: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / out_name))
    args = parser.parse_args()
    args.model_dir = Path("models") / f"flagstop-{args.size}"
    if not (args.model_dir / "config.json").exists():
        write_model(args.model_dir, args.size)
    return args


def main() -> None:
    args = parse_args("e2e.md")
    model_dir, requests = args.model_dir, workload(args.requests)
    with torch.inference_mode():
        in_process_s, in_process_tokens = run_in_process(model_dir, requests)
    stack_s, stack_tokens = run_through_stack(model_dir, requests)
    assert stack_tokens == in_process_tokens, (stack_tokens, in_process_tokens)
    rows = [("one process, no gRPC", in_process_s, in_process_tokens),
            ("router -> scheduler -> executor", stack_s, stack_tokens)]  # fmt: skip
    ratio = in_process_s / stack_s
    table = "\n".join([
        "| engine | wall (s) | output tokens | useful tokens/s |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {s:.1f} | {n} | {n / s:.1f} |" for name, s, n in rows),
    ])  # fmt: skip
    print(f"{table}\n\n3-process / in-process throughput: {ratio:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        f"# End-to-end throughput\n\n`python bench/e2e_bench.py --size {args.size} --requests "
        f"{args.requests}` on {date.today()}, {os.cpu_count()} CPU cores, {args.size} model, "
        f"fp32; {MAX_NUM_SEQS} seats, {BUDGET}-token budget, prompts of 17-128 and outputs of "
        f"16-127 tokens.\n\n{table}\n\nThe 3-process stack keeps **{ratio:.2f}** of the "
        "in-process throughput.\n"
    )


if __name__ == "__main__":
    main()
