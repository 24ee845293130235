"""Useful output tokens/s of our engine beside transformers' static and continuous
batching, on the same checkpoint and the same deterministic workload.

    python bench/peers.py [--size small] [--requests 64] [--out bench/results/peers.md]

Every request is sent at t=0, greedy, EOS ignored, so each system generates exactly
the tokens asked for. 16 slots everywhere. "limit" is the cost of the model forwards
alone for a perfect 16-slot schedule: every prompt prefilled in 512-token steps, every
decode step full. The per-step slot occupancy of the static and of our continuous run
goes to peers.json for bench/plots.py.
"""

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.executor_bench import median_time, our_decode
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import start_stack

NUM_BLOCKS, BLOCK_SIZE, SLOTS, BUDGET = 1024, 16, 16, 512
Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def skewed(rng: random.Random, low: int, high: int, power: float) -> int:
    """Mostly short, sometimes long: low + (high - low) * u**power."""
    return low + int((high - low) * rng.random() ** power)


def workload(num_requests: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return [
        ([0] + [rng.randrange(3, 512) for _ in range(skewed(rng, 16, 510, 2.5))],
         skewed(rng, 8, 296, 2.0))
        for _ in range(num_requests)
    ]  # fmt: skip


def new_runner(model_dir: Path) -> ModelRunner:
    config = ExecutorConfig(
        model=str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=SLOTS,
        max_num_batched_tokens=BUDGET,
    )  # fmt: skip
    return ModelRunner(config)


@torch.inference_mode()
def run_in_process(
    model_dir: Path, requests: Workload, on_step: Callable[[list[str]], None] | None = None
) -> tuple[float, int]:
    """The scheduler core and the model runner called directly: (wall s, tokens)."""
    runner = new_runner(model_dir)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS, block_size=BLOCK_SIZE,
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
        if on_step:
            on_step(list(plan.num_scheduled_tokens))
        output = runner.execute(plan)
        for out in scheduler.update_from_output(plan, output.token_ids).values():
            generated += len(out.new_token_ids)
    return time.perf_counter() - start, generated


async def run_stack(router: str, requests: Workload) -> tuple[float, int]:
    async with channel(router) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(prompt: list[int], max_tokens: int) -> int:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
            return sum([len(c.token_ids) async for c in stub.Generate(request, timeout=3600)])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in requests))
        return time.perf_counter() - start, sum(counts)


def run_through_stack(model_dir: Path, requests: Workload, env: dict[str, str] | None = None):
    """(wall seconds, generated tokens) through a fresh 3-process stack."""
    stack = start_stack(
        model_dir, Path(tempfile.mkdtemp(prefix="bench-")),
        executor_args=["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)],
        scheduler_args=["--max-num-seqs", str(SLOTS), "--max-num-batched-tokens", str(BUDGET)],
        env=env,
    )  # fmt: skip
    try:
        return asyncio.run(run_stack(stack.router, requests))
    finally:
        stack.stop()


def load_hf(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    return model


def run_hf_static(model_dir: Path, requests: Workload, occupancy: list) -> tuple[float, int]:
    """generate() on left-padded batches of 16 in arrival order; a batch runs until its
    longest request ends, and a slot whose request ended sits idle until then."""
    model = load_hf(model_dir)
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(requests), SLOTS):
        batch = requests[first : first + SLOTS]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, eos_token_id=None,
        )  # fmt: skip
        steps = out.shape[1] - width
        occupancy += [[f"r{first + i}" for i, (_, n) in enumerate(batch) if n > t]
                      for t in range(steps)]  # fmt: skip
        generated += sum(min(n, steps) for _, n in batch)
    return time.perf_counter() - start, generated


def run_hf_continuous(model_dir: Path, requests: Workload) -> tuple[float, int]:
    """transformers' own continuous batching manager (paged cache, FIFO scheduler),
    given per-request output lengths."""
    model = load_hf(model_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in requests))
    config.eos_token_id = -1
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_tokens=BUDGET,
        max_requests_per_batch=SLOTS,
    )  # fmt: skip
    generated = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):
            manager.add_request(prompt, f"r{i}", max_new_tokens=max_tokens, eos_token_id=-1)
        for _ in requests:
            while (result := manager.get_result(timeout=1)) is None or not result.is_finished():
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
            generated += len(result.generated_tokens)
        return time.perf_counter() - start, generated


@torch.inference_mode()
def limit(model_dir: Path, requests: Workload) -> tuple[float, int]:
    """Forward time of a perfect schedule: prompt tokens in full 512-token prefill steps,
    then decode steps with all 16 slots busy at the workload's mean decode context."""
    runner = new_runner(model_dir)
    blocks = list(range(BUDGET // BLOCK_SIZE))

    def prefill_step():
        runner.batch = runner._new_batch()
        request = NewRequestData("p", [1] * BUDGET, BUDGET, SamplingParams(), blocks)
        runner.execute(
            SchedulerOutput(scheduled_new_reqs=[request], num_scheduled_tokens={"p": BUDGET})
        )

    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    decode_tokens = output_tokens - len(requests)  # the first comes with the prefill
    mean_context = sum(len(p) * (n - 1) + n * (n - 1) // 2 for p, n in requests) / decode_tokens
    decode_s = our_decode(new_runner(model_dir), SLOTS, round(mean_context), repeats=5)
    prefill_s = prompt_tokens / BUDGET * median_time(prefill_step, 3)
    return prefill_s + decode_tokens / SLOTS * decode_s, output_tokens


def idle_fraction(occupancy: list[list[str]]) -> float:
    return 1 - sum(map(len, occupancy)) / (SLOTS * len(occupancy))


def parse_args(out_name: str, requests: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / out_name))
    args = parser.parse_args()
    args.model_dir = Path("models") / f"flagstop-{args.size}"
    if not (args.model_dir / "config.json").exists():
        write_model(args.model_dir, args.size)
    return args


def run_all(model_dir: Path, requests: Workload) -> tuple[list[tuple[str, float, int]], dict]:
    static_steps: list[list[str]] = []
    continuous_steps: list[list[str]] = []
    rows = []
    for name, run, *extra in [
        ("flagstop, one process", run_in_process, continuous_steps.append),
        ("flagstop, router -> scheduler -> executor", run_through_stack),
        ("transformers generate(), static batches", run_hf_static, static_steps),
        ("transformers generate_batch(), continuous", run_hf_continuous),
        ("limit: model forwards of a perfect schedule", limit),
    ]:
        seconds, tokens = run(model_dir, requests, *extra)
        print(
            f"{name:>46}: {tokens} tokens in {seconds:6.1f} s = {tokens / seconds:6.1f} tok/s",
            flush=True,
        )
        rows.append((name, seconds, tokens))
    return rows, {"static": static_steps, "continuous": continuous_steps}


def main() -> None:
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    transformers.utils.logging.disable_progress_bar()
    args = parse_args("peers.md", 64)
    requests = workload(args.requests)
    rows, occupancy = run_all(args.model_dir, requests)
    expected = sum(n for _, n in requests)
    assert all(tokens == expected for _, _, tokens in rows), rows
    ours = rows[1][2] / rows[1][1]
    table = "\n".join([
        "| system | wall (s) | output tokens | useful tokens/s | ours (3 processes) / it |",
        "|---|---:|---:|---:|---:|",
        *(f"| {name} | {s:.1f} | {n} | {n / s:.1f} | {ours / (n / s):.2f} |"
          for name, s, n in rows),
    ])  # fmt: skip
    idle = {kind: idle_fraction(steps) for kind, steps in occupancy.items()}
    summary = (
        f"Idle slot-steps: static batching {idle['static']:.0%}, ours {idle['continuous']:.0%}. "
        f"The 3-process stack reaches **{rows[4][1] / rows[1][1]:.2f}** of the "
        f"limit, **{ours / (rows[2][2] / rows[2][1]):.1f}x** transformers' static batching and "
        f"**{ours / (rows[3][2] / rows[3][1]):.1f}x** its continuous batching."
    )
    print(f"\n{table}\n\n{summary}")
    prompt_lens, output_lens = [len(p) for p, _ in requests], [n for _, n in requests]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# Beside the peers\n\n`python bench/peers.py --size {args.size} --requests "
        f"{args.requests}` on {date.today()}, {os.cpu_count()} CPU cores, {args.size} model, "
        f"fp32, torch {torch.__version__}; {args.requests} requests at t=0, prompts of "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens, outputs of {min(output_lens)}-"
        f"{max(output_lens)} tokens (skewed short, seeded), greedy, EOS ignored; {SLOTS} slots, "
        f"{BUDGET}-token step budget.\n\n{table}\n\n{summary}\n"
    )
    out.with_suffix(".json").write_text(json.dumps({"occupancy": occupancy, "idle": idle}))


if __name__ == "__main__":
    main()
