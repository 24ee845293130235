"""The cost of tracing: the e2e workload through the 3-process stack with tracing off
and with every request and step traced (100% sampling) into an OTLP collector.

    python bench/tracing_bench.py [--size small] [--requests 32]
"""

import argparse
import asyncio
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e_bench import BLOCK_SIZE, BUDGET, MAX_NUM_SEQS, NUM_BLOCKS, run_stack, workload
from executor.make_model import write_model
from tests.otlp_collector import start_collector
from tests.stack import start_stack


def measure(model_dir: Path, requests, env: dict[str, str]) -> tuple[float, int]:
    stack = start_stack(
        model_dir, Path(tempfile.mkdtemp(prefix="tracing-bench-")),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tracing.md"))
    args = parser.parse_args()
    model_dir = Path("models") / f"flagstop-{args.size}"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, args.size)
    requests = workload(args.requests)
    server, collector, port = start_collector()
    traced_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    off_s, off_tokens = measure(model_dir, requests, {})
    on_s, on_tokens = measure(model_dir, requests, traced_env)
    server.stop(0)
    assert off_tokens == on_tokens
    ratio = off_s / on_s
    table = "\n".join([
        "| tracing | wall (s) | useful tokens/s |",
        "|---|---:|---:|",
        f"| off | {off_s:.1f} | {off_tokens / off_s:.1f} |",
        f"| 100% sampled ({len(collector.spans)} spans) | {on_s:.1f} | {on_tokens / on_s:.1f} |",
    ])  # fmt: skip
    print(f"{table}\n\nthroughput traced / untraced: {ratio:.2f}")
    Path(args.out).write_text(
        f"# The cost of tracing\n\n`python bench/tracing_bench.py --size {args.size} --requests "
        f"{args.requests}` on {date.today()}, {os.cpu_count()} CPU cores: the e2e workload "
        f"through the 3-process stack.\n\n{table}\n\nTraced throughput is **{ratio:.2f}** of "
        "untraced.\n"
    )


if __name__ == "__main__":
    main()
