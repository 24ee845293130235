"""bench/RESULTS.md: the machine, then every table in bench/results/ (each names the
command that wrote it and its date), with the charts.

    python bench/report.py
"""

import os
import platform
import sys
from datetime import date
from pathlib import Path

import torch
import transformers

HERE = Path(__file__).parent
ORDER = [
    "peers", "serve", "serve_backends", "overhead", "overhead_router", "overhead_floor",
    "overhead_levers",
    "replicas", "scheduler", "slo", "fairness_live", "replay_check",
    "detokenizer", "tracing", "executor", "executor_moe", "executor_quant", "moe", "tp",
    "structured", "spec", "spec_trained", "overhead_spec", "lora", "kv_tier", "kv_disagg",
    "kv_groups", "mla",
    "multimodal_pixels", "multimodal_cache", "multimodal_budget", "sessions", "llm-d", "pooling",
]  # fmt: skip


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB; {platform.system()} "
        f"{platform.release()}; Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )


def main() -> None:
    results = HERE / "results"
    tables = sorted(results.glob("*.md"), key=lambda p: ([*ORDER, p.stem]).index(p.stem))
    sections = []
    for path in tables:
        text = path.read_text().strip()
        # Each file's title becomes a section of this one.
        sections.append(text.replace("# ", "## ", 1))
        if path.stem == "peers" and (results / "occupancy.png").exists():
            sections.append("![Batch slots over steps](results/occupancy.png)")
        if path.stem == "serve" and (results / "serving.png").exists():
            sections.append("![Throughput and p99 TTFT vs request rate](results/serving.png)")
        if path.stem == "slo" and (results / "slo.png").exists():
            sections.append("![Goodput against load, per policy](results/slo.png)")
        if path.stem == "slo" and (results / "fairness.png").exists():
            sections.append("![A light tenant's TTFT beside a heavy one, over alone, per "
                            "policy](results/fairness.png)")  # fmt: skip
        if path.stem == "spec" and (results / "spec.png").exists():
            sections.append(
                "![Speculative decoding: tok/s and tokens per forward](results/spec.png)"
            )
        if path.stem.startswith("overhead") and (results / f"{path.stem}.png").exists():
            sections.append(
                f"![Tokens/s and router CPU per token vs streams](results/{path.stem}.png)"
            )
    (HERE / "RESULTS.md").write_text(
        f"# Benchmark results\n\nWritten by `make bench` (`python bench/report.py`) on "
        f"{date.today()}. Machine: {machine()}. Each table names the command and the day "
        "that produced it; compare rows of one table only (they ran side by side in one "
        "run), as these machines vary by 15% or more from one run to the next.\n\n"
        + "\n\n".join(sections)
        + "\n"
    )
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
