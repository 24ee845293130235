"""The cost of tracing: the peers workload through the 3-process stack with tracing
off and with every request and step traced (100% sampling) into an OTLP collector.

    python bench/tracing_bench.py [--size small] [--requests 24]
"""

import os
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peers import parse_args, run_through_stack, workload
from tools.otlp_collector import start_collector


def main() -> None:
    args = parse_args("tracing.md", 24)
    requests = workload(args.requests)
    server, collector, port = start_collector()
    traced_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    off_s, off_tokens = run_through_stack(args.model_dir, requests)
    on_s, on_tokens = run_through_stack(args.model_dir, requests, traced_env)
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
        f"{args.requests}` on {date.today()}, {os.cpu_count()} CPU cores: the peers workload "
        f"through the 3-process stack.\n\n{table}\n\nTraced throughput is **{ratio:.2f}** of "
        "untraced.\n"
    )


if __name__ == "__main__":
    main()
