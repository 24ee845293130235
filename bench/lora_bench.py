"""Many LoRA adapters in one batch on the CPU, side by side in interleaved rounds:

    python bench/lora_bench.py [--size tiny] [--rounds 3] [--out bench/results/lora.md]

The engine in process (the scheduler core and the model runner, steps in flight as
the service keeps them: tools/inprocess.py), 32 requests of 32 prompt tokens and 64
greedy output tokens each, all in one batch. Rows: the base model on an executor
without LoRA; the same with --max-loras 16 and 16 adapters registered but no request
naming one (what the slots cost when unused); then 1, 4 and 16 distinct adapters in the
batch, the requests spread over them in turn. Adapters: rank 16 on all seven modules
(tools/make_adapter.py). Decode tok/s (wall) and the process's CPU us per output token,
median over the rounds; then the cost of a load: reading and checking an adapter into
host memory (LoadLoRAAdapter, off the step loop) and filling a slot with it (on the
step that first runs it); and speculative decoding's acceptance when the base model
drafts for itself (k = 3) without an adapter and under one (the draft runs none)."""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import write_result  # noqa: E402 (needs the path above)
from flagstop.executor.config import ExecutorConfig  # noqa: E402
from flagstop.executor.model_runner import ModelRunner  # noqa: E402
from flagstop.executor.sampling_params import SamplingParams  # noqa: E402
from flagstop.scheduler_svc.core.config import SchedulerConfig  # noqa: E402
from tools.inprocess import Job, run_engine  # noqa: E402
from tools.make_adapter import write_adapter  # noqa: E402
from tools.make_model import write_model  # noqa: E402

NUM_REQUESTS, PROMPT, OUTPUT, MAX_LORAS, RANK = 32, 32, 64, 16, 16
ROWS = {"base model, no LoRA": None, "LoRA on, 0 adapters in the batch": 0,
        "1 adapter": 1, "4 adapters": 4, "16 adapters": 16}  # fmt: skip


def jobs(num_adapters: int | None) -> list[Job]:
    out = []
    for i in range(NUM_REQUESTS):
        prompt = [0] + [(i * 37 + j * 11) % 500 + 3 for j in range(PROMPT - 1)]
        name = f"a{i % num_adapters}" if num_adapters else ""
        out.append(Job(prompt, OUTPUT, SamplingParams(temperature=0), lora_name=name))
    return out


def runner(base: Path, adapters: list[Path], lora: bool) -> ModelRunner:
    modules = [f"a{i}={path}" for i, path in enumerate(adapters)] if lora else []
    return ModelRunner(ExecutorConfig(
        model=str(base), num_blocks=1024, block_size=16, max_num_seqs=NUM_REQUESTS,
        max_loras=MAX_LORAS if lora else 0, max_lora_rank=RANK, lora_modules=modules,
    ))  # fmt: skip


def run(engine: ModelRunner, num_adapters: int | None) -> tuple[float, float]:
    """(output tok/s, CPU us per output token) of one whole run."""
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=NUM_REQUESTS,
                             max_model_len=512, block_size=16,
                             max_loras=MAX_LORAS if num_adapters is not None else 0)  # fmt: skip
    cpu, wall = time.process_time(), time.perf_counter()
    result = run_engine(engine, jobs(num_adapters), config)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = sum(map(len, result.outputs))
    return tokens / wall, cpu / tokens * 1e6


def load_costs(engine: ModelRunner, adapters: list[Path], repeats: int = 5) -> tuple[float, float]:
    """(ms to read and check one adapter, ms to fill a slot with it)."""
    reads, fills = [], []
    manager = engine.lora
    for i in range(repeats):
        started = time.perf_counter()
        manager.register(f"probe{i}", str(adapters[i % len(adapters)]))
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        manager._fill(0, manager.pieces[f"probe{i}"])
        fills.append(time.perf_counter() - started)
        manager.unregister(f"probe{i}")
    return statistics.median(reads) * 1e3, statistics.median(fills) * 1e3


def spec_acceptance(base: Path, adapters: list[Path]) -> dict[str, float]:
    """Accepted draft tokens over drafted, for 8 requests of 48 tokens, base and a0."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(base)}
    engine = ModelRunner(ExecutorConfig(
        model=str(base), num_blocks=512, block_size=16, max_num_seqs=8, max_loras=1,
        max_lora_rank=RANK, lora_modules=[f"a0={adapters[0]}"], speculative_config=spec,
    ))  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=512,
                             block_size=16, num_speculative_tokens=3, max_loras=1,
                             speculative_min_gain=1e-12)  # fmt: skip
    out = {}
    for name in ("", "a0"):
        jobs = [Job([0, *range(3 + 9 * i, 20 + 9 * i)], 48, SamplingParams(temperature=0),
                    lora_name=name) for i in range(8)]  # fmt: skip
        stats = run_engine(engine, jobs, config).scheduler.drafts.stats
        out[name or "base"] = stats.num_accepted_tokens / max(1, stats.num_draft_tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench/results/lora.md"))
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        base = write_model(Path(tmp) / f"flagstop-{args.size}", args.size)
        adapters = [write_adapter(base, Path(tmp) / f"a{i}", RANK, seed=i)
                    for i in range(MAX_LORAS)]  # fmt: skip
        plain, lora = runner(base, adapters, False), runner(base, adapters, True)
        results: dict[str, list[tuple[float, float]]] = {row: [] for row in ROWS}
        for _ in range(args.rounds):
            for row, num_adapters in ROWS.items():
                engine = plain if num_adapters is None else lora
                results[row].append(run(engine, num_adapters))
        read_ms, fill_ms = load_costs(lora, adapters)
        adapter_mb = lora.lora.adapters["a0"].nbytes / 2**20
        acceptance = spec_acceptance(base, adapters)
    medians = {row: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
               for row, runs in results.items()}  # fmt: skip
    base_tps = medians["base model, no LoRA"][0]
    lines = ["| batch | tok/s | vs base | CPU us / token |", "|---|---:|---:|---:|"]
    for row, (tps, cpu_us) in medians.items():
        lines.append(f"| {row} | {tps:.0f} | {tps / base_tps:.2f}x | {cpu_us:.0f} |")
    read = f"read and check one adapter ({adapter_mb:.1f} MB, LoadLoRAAdapter)"
    lines += ["", "| a load | ms |", "|---|---:|", f"| {read} | {read_ms:.1f} |",
              f"| fill a slot with it (the first step that runs it) | {fill_ms:.2f} |",
              "", "| speculative decoding, the base model drafting (k = 3) | accepted |",
              "|---|---:|", f"| requests of the base model | {acceptance['base']:.0%} |",
              f"| requests under an adapter | {acceptance['a0']:.0%} |"]  # fmt: skip
    setup = (
        f"model {args.size}, {NUM_REQUESTS} requests x ({PROMPT} prompt + {OUTPUT} output) "
        f"tokens in one batch, adapters of rank {RANK} on all seven modules, "
        f"--max-loras {MAX_LORAS}, median of {args.rounds} interleaved rounds."
    )
    table = "\n".join(lines)
    write_result(
        args.out,
        "LoRA adapters in the batch (CPU)",
        setup,
        table,
        {"rows": medians, "read_ms": read_ms, "fill_ms": fill_ms, "acceptance": acceptance},
    )
    print(table)


if __name__ == "__main__":
    main()
