"""KV cache groups at a fixed KV memory, side by side in one run: a long-context
workload on a gpt-oss-shaped model (window layers alternating with full ones), with
the hybrid manager's groups and with every layer treated as full attention
(--disable-hybrid-kv-cache-manager), on the real model on the CPU, in one process
(the scheduler core and the model runner, steps in flight as the service keeps them).

    python bench/kv_groups_bench.py [--size tiny] [--requests 16] [--prompt 1536]

The same KV bytes hold twice the blocks with two groups (a block spans a group's
layers, half the model's); a request holds blocks for every token in the full group
and a window's worth in the window group, so more requests fit at once and fewer are
preempted. Resident requests are the core's running count after each step; tok/s is
output tokens over the wall time; CPU s is the process's.
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_groups import describe_groups
from tools.inprocess import Job, run_engine
from tools.make_model import write_model

RESULTS = Path(__file__).parent / "results"


def jobs(args) -> list[Job]:
    rng = random.Random(args.seed)
    return [Job([1, *(rng.randrange(3, 500) for _ in range(args.prompt - 1))], args.output,
                SamplingParams()) for _ in range(args.requests)]  # fmt: skip


def run(model: Path, args, hybrid: bool) -> dict:
    runner = ModelRunner(ExecutorConfig(
        model=str(model), kv_cache_bytes=args.kv_mib << 20, block_size=16,
        max_num_seqs=args.requests, disable_hybrid_kv_cache_manager=not hybrid,
    ))  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.requests,
                             max_model_len=4096, block_size=16)  # fmt: skip
    resident: list[int] = []
    cpu, wall = time.process_time(), time.perf_counter()
    result = run_engine(runner, jobs(args), config, on_step=lambda s: resident.append(
        len(s.running)))  # fmt: skip
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    scheduler = result.scheduler
    return {
        "variant": f"groups ({describe_groups(runner.kv_groups)})" if hybrid
        else "every layer full (--disable-hybrid-kv-cache-manager)",
        "num_blocks": runner.num_blocks,
        "capacity_tokens": scheduler.kv_capacity_tokens,
        "resident_max": max(resident), "resident_mean": statistics.fmean(resident),
        "preemptions": scheduler.num_preemptions, "steps": result.num_steps,
        "output_tokens": sum(map(len, result.outputs)), "wall_s": wall, "cpu_s": cpu,
        "tok_s": sum(map(len, result.outputs)) / wall,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--kv-mib", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_groups.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "gpt-oss", args.size, arch="gpt_oss")
        rows = [run(model, args, hybrid) for hybrid in (True, False)]
    header = ("| KV layout | blocks | tokens a sequence | resident (max / mean) | preemptions "
              "| steps | tok/s | CPU s |\n|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [f"| {r['variant']} | {r['num_blocks']} | {r['capacity_tokens']} | "
             f"{r['resident_max']} / {r['resident_mean']:.1f} | {r['preemptions']} | "
             f"{r['steps']} | {r['tok_s']:.1f} | {r['cpu_s']:.1f} |" for r in rows]  # fmt: skip
    setup = (
        f"gpt-oss-shaped {args.size} model (make model ARCH=gpt_oss: window 128 "
        f"alternating with full attention), fp32, {args.kv_mib} MiB of KV; "
        f"{args.requests} requests of {args.prompt} prompt tokens and {args.output} "
        f"output tokens at t=0, greedy; {args.budget}-token step budget, block size 16."
    )
    print(header, *lines, sep="\n")
    write_result(args.out, "KV cache groups: a long-context workload at a fixed KV memory",
                 setup, "\n".join([header, *lines]), {"rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
