"""Step time with one rank (2 threads) beside two tensor-parallel ranks (1 thread each,
gloo) on the CPU, and the time the two ranks spend in collectives per step.

    python bench/tp_bench.py [--size small] [--repeats 5] [--out bench/results/tp.md]

Decode rows: B requests with C tokens of context each compute one token (as in
bench/executor_bench.py); prefill row: one 512-token prompt. With two ranks, rank 0
(this benchmark's child process) broadcasts each step to rank 1 as the executor does;
"collectives" is rank 0's time inside all-reduces and the logits gather, "step
message" its broadcast of the step. On a 2-core machine two ranks split the same two
cores one thread each, so no speed-up is expected here: the table shows what the
split costs, not what it gains on GPUs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.convert import plan_from_proto, sampling_to_proto
from flagstop.executor.distributed import join, start_group
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.executor.tp_messages import STEP, STOP
from flagstop.scheduler_svc.convert import step_to_proto
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.utils import cdiv
from tools.make_model import write_model

BLOCK_SIZE, CONTEXT = 16, 256
BATCHES = (1, 16, 64)


class Stepper:
    """Runs plans as the executor service would: decoded from the scheduler's wire
    form, alone or as rank 0 of a group (which is sent the wire form first)."""

    def __init__(self, runner: ModelRunner, group=None) -> None:
        self.runner, self.group = runner, group
        self.message_s = 0.0

    def __call__(self, plan: SchedulerOutput) -> None:
        step = step_to_proto(plan)
        if self.group is not None:
            started = time.perf_counter()
            self.group.send(STEP, step.SerializeToString())
            self.message_s += time.perf_counter() - started
        output = self.runner.execute(plan_from_proto(step))
        if self.group is not None:
            self.group.set_sampled(output.token_ids, output.num_sampled_tokens)


def decode_plans(runner: ModelRunner, batch: int, repeats: int):
    """The plan that admits B requests with CONTEXT - 1 tokens cached, then the decode
    plan of the next step, rebuilt from the batch each time."""
    blocks_per_req = cdiv(CONTEXT + repeats + 4, BLOCK_SIZE)
    first = SchedulerOutput()
    for i in range(batch):
        blocks = list(range(i * blocks_per_req, (i + 1) * blocks_per_req))
        first.scheduled_new_reqs.append(NewRequestData(
            f"r{i}", [1] * CONTEXT, CONTEXT, sampling_to_proto(SamplingParams()), blocks,
            CONTEXT - 1,
        ))  # fmt: skip
        first.num_scheduled_tokens[f"r{i}"] = 1

    def decode() -> SchedulerOutput:
        plan = SchedulerOutput(num_scheduled_tokens={f"r{i}": 1 for i in range(batch)})
        c, rows = plan.scheduled_cached_reqs, runner.batch.req_rows
        c.req_ids = list(plan.num_scheduled_tokens)
        c.num_computed_tokens = [int(runner.batch.num_computed_tokens[rows[r]]) for r in c.req_ids]
        c.new_block_ids = [[] for _ in c.req_ids]
        return plan

    return first, decode


def timed(step: Stepper, runner: ModelRunner, plans, repeats: int) -> dict:
    tp, times = runner.tp, []
    step.message_s, collective_before = 0.0, tp.collective_s
    for plan in plans(repeats + 1):
        started = time.perf_counter()
        step(plan)
        times.append(time.perf_counter() - started)
    n = len(times)
    return {"step_ms": statistics.median(times[1:]) * 1e3,
            "collective_ms": (tp.collective_s - collective_before) * 1e3 / n,
            "message_ms": step.message_s * 1e3 / n}  # fmt: skip


def run_cases(step: Stepper, runner: ModelRunner, repeats: int) -> dict[str, dict]:
    results = {}
    for batch in BATCHES:
        first, decode = decode_plans(runner, batch, repeats)

        def plans(n, first=first, decode=decode, batch=batch):
            finished = SchedulerOutput(finished_req_ids={f"r{i}" for i in range(batch)})
            yield first
            for _ in range(n - 1):
                yield decode()
            step(finished)  # leave the batch empty for the next case

        results[f"decode B={batch} ctx={CONTEXT}"] = timed(step, runner, plans, repeats)

    def prefills(n):
        for i in range(n):
            blocks = list(range(cdiv(512, BLOCK_SIZE)))
            new = NewRequestData(f"p{i}", [1] * 512, 512, SamplingParams(), blocks)
            yield SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={f"p{i}": 512},
                                  finished_req_ids={f"p{i - 1}"} if i else set())  # fmt: skip

    results["prefill 512 tokens"] = timed(step, runner, prefills, repeats)
    return results


def config(model_dir: Path, tensor_parallel_size: int) -> ExecutorConfig:
    blocks = max(BATCHES) * cdiv(CONTEXT + 64, BLOCK_SIZE) + 64
    return ExecutorConfig(model=str(model_dir), num_blocks=blocks, block_size=BLOCK_SIZE,
                          max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
                          tensor_parallel_size=tensor_parallel_size)  # fmt: skip


def as_rank0(model_dir: Path, repeats: int) -> dict:
    """The two-rank run (this process is rank 0; it starts rank 1)."""
    torch.set_num_threads(1)
    settings = config(model_dir, 2)
    group = start_group(settings, None)
    try:
        runner = ModelRunner(settings, group.tp, lambda: join(group), group.device)
        results = run_cases(Stepper(runner, group), runner, repeats)
        group.send(STOP)
        return results
    finally:
        group.stop_children()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank0-json", help=argparse.SUPPRESS)  # the child's output
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp.md"))
    args = parser.parse_args()
    model_dir = Path("models") / f"flagstop-{args.size}"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, args.size)
    if args.rank0_json:
        Path(args.rank0_json).write_text(json.dumps(as_rank0(model_dir, args.repeats)))
        return
    torch.set_num_threads(2)
    runner = ModelRunner(config(model_dir, 1))
    single = run_cases(Stepper(runner), runner, args.repeats)
    out = Path(args.out).with_suffix(".json")
    subprocess.run([sys.executable, __file__, "--size", args.size, "--repeats",
                    str(args.repeats), "--rank0-json", str(out)], check=True)  # fmt: skip
    two = json.loads(out.read_text())
    out.unlink()
    lines = [
        "| step | 1 rank, 2 threads (ms) | 2 ranks, 1 thread each (ms) | of which "
        "collectives (ms) | of which step message (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, one in single.items():
        t = two[name]
        lines.append(f"| {name} | {one['step_ms']:.1f} | {t['step_ms']:.1f} | "
                     f"{t['collective_ms']:.1f} | {t['message_ms']:.2f} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    Path(args.out).write_text(
        f"# Tensor parallelism on the CPU\n\n`python bench/tp_bench.py --size {args.size} "
        f"--repeats {args.repeats}` on {date.today()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, fp32, gloo on loopback: median ms per step (collectives "
        f"and the step message are means). Two ranks share this machine's cores, one "
        f"thread each.\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
