"""Memory over many loads: does each process plateau, or grow with every load?

    python bench/soak.py [--loads 12] [--streams 1000] [--variant 'LABEL|ENV|EXECUTOR FLAGS' ...]
        [--out bench/results/soak.md]

A real 3-process stack on the embedded model (tools/stack.py); a warm-up load, then
--loads loads of --streams concurrent 4-token streams (tools/load.py), each followed
by the stack going idle (every KV block free again). After each: the resident memory
(VmRSS, from /proc) of the executor, the scheduler and the router, and the executor's
CPU time for the load (its own counters). A leak grows every
load alike; a cache that fills grows for a few loads and then stays flat. Each
--variant is a stack of its own with extra environment variables (NAME=VALUE,
space-separated) and executor flags, run one after another in the same invocation.
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from bench.serve_bench import cpu_seconds
from tools.load import many_streams, rss_kib
from tools.make_model import write_model
from tools.stack import start_stack

PROCESSES = ("executor", "scheduler", "router")
RESULTS = Path(__file__).parent / "results"


def soak(model_dir: Path, log_dir: Path, env: dict, executor_args: list[str], args) -> dict:
    stack = start_stack(model_dir, log_dir, env=env or None, executor_args=executor_args)
    series: dict[str, list[int]] = {name: [] for name in PROCESSES}
    executor = stack.processes["executor"].pid
    cpu: list[float] = []  # the executor's CPU seconds per load, the warm-up's first
    try:
        for load in range(args.loads + 1):
            started = cpu_seconds(executor)
            # The warm-up (load 0) is a tenth of a load.
            n = args.streams if load else args.streams // 10
            assert asyncio.run(many_streams(stack.router, n)) == [4] * n, "a stream failed"
            stats = stack.wait_idle()
            assert stats.num_free_blocks == stats.num_total_blocks
            cpu.append(cpu_seconds(executor) - started)
            for name in PROCESSES:
                series[name].append(rss_kib(stack.processes[name].pid) // 1024)
            print(f"  load {load}: " + ", ".join(f"{n} {series[n][-1]} MiB" for n in PROCESSES)
                  + f", executor CPU {cpu[-1]:.2f} s")  # fmt: skip
    finally:
        stack.stop()
    return {**series, "executor_cpu_s": cpu}


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    label, env, flags = ([*text.split("|"), "", ""])[:3]
    pairs = dict(item.split("=", 1) for item in env.split())
    return label, pairs, flags.split()


def table(results: dict[str, dict[str, list[int]]]) -> str:
    loads = len(next(iter(next(iter(results.values())).values())))
    head = "| variant | process | " + " | ".join(str(i) for i in range(loads))
    head += " | last 5 loads (max - min) |\n|---|---|" + "---:|" * (loads + 1)
    rows = []
    for label, series in results.items():
        for name in PROCESSES:
            values = series[name]
            spread = max(values[-5:]) - min(values[-5:])
            cells = " | ".join(str(v) for v in values)
            rows.append(f"| {label} | {name} | {cells} | {spread} |")
    return head + "\n" + "\n".join(rows)


def cpu_table(results: dict[str, dict]) -> str:
    """The executor's CPU per load, after the warm-up: what a smaller cache costs."""
    lines = ["| variant | executor CPU s per load (median of loads 1-) | first load | last load |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for label, series in results.items():
        cpu = series["executor_cpu_s"][1:]
        lines.append(f"| {label} | {statistics.median(cpu):.2f} | {cpu[0]:.2f} | {cpu[-1]:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=12)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--variant", action="append", help="'LABEL|NAME=VALUE ...|FLAGS'")
    parser.add_argument("--out", default=str(RESULTS / "soak.md"))
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["defaults||"]]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "flagstop-tiny", "tiny")
        for label, env, flags in variants:
            print(f"{label}:")
            log_dir = Path(tmp) / f"logs-{len(results)}"
            log_dir.mkdir()
            results[label] = soak(model_dir, log_dir, env, flags, args)
    text = table(results) + "\n\n" + cpu_table(results)
    print(text)
    setup = (f"RSS in MiB after a warm-up (column 0) and after each of {args.loads} loads of "
             f"{args.streams} concurrent 4-token streams, the stack idle again")  # fmt: skip
    write_result(args.out, "Memory over many loads", setup, text, results)


if __name__ == "__main__":
    main()
