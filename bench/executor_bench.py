"""Executor step time vs batch size, against a transformers forward on the same batch.

    python bench/executor_bench.py [--sizes tiny small] [--out bench/results/executor.md]

Decode rows: B requests with C tokens of context compute one token each (one step of
ours; one transformers forward with a C-token DynamicCache). The caches hold random
values: a step's cost does not depend on them, and filling them by real prefills
would take longer than the measurement. Prefill row: one 512-token prompt.
"""

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.output import NewRequestData, SchedulerOutput
from flagstop.utils import cdiv
from tools.make_model import write_model

BLOCK_SIZE = 16
CASES = {  # model size -> (contexts, batch sizes)
    "tiny": ((128, 512, 1536), (1, 4, 16, 64, 256)),
    "small": ((128, 512), (1, 4, 16, 64, 256)),
}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def our_decode(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    """B requests whose first context-1 tokens count as cached; each step decodes one."""
    runner.batch = runner._new_batch()
    blocks_per_req = cdiv(context + repeats + 2, BLOCK_SIZE)
    plan = SchedulerOutput()
    for i in range(batch):
        req_id = f"r{i}"
        blocks = list(range(i * blocks_per_req, (i + 1) * blocks_per_req))
        plan.scheduled_new_reqs.append(
            NewRequestData(req_id, [1] * context, context, SamplingParams(), blocks, context - 1)
        )
        plan.num_scheduled_tokens[req_id] = 1
    runner.execute(plan)

    def step():
        cached = SchedulerOutput(num_scheduled_tokens={f"r{i}": 1 for i in range(batch)})
        cached.scheduled_cached_reqs.req_ids = list(cached.num_scheduled_tokens)
        cached.scheduled_cached_reqs.num_computed_tokens = [
            int(runner.batch.num_computed_tokens[runner.batch.req_rows[r]])
            for r in cached.num_scheduled_tokens
        ]
        cached.scheduled_cached_reqs.new_block_ids = [[] for _ in range(batch)]
        runner.execute(cached)

    return median_time(step, repeats)


def hf_decode(model, batch: int, context: int, repeats: int) -> float:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (batch, c.num_key_value_heads, context - 1, head_dim)
    tokens = torch.ones(batch, 1, dtype=torch.long)

    def step():
        cache = DynamicCache()
        for layer in range(c.num_hidden_layers):
            cache.update(torch.randn(shape), torch.randn(shape), layer)
        start = time.perf_counter()
        model(tokens, past_key_values=cache, use_cache=True)
        return time.perf_counter() - start

    step()
    return statistics.median(step() for _ in range(repeats))


def bench_model(size: str, repeats: int) -> list[tuple]:
    model_dir = Path("models") / f"flagstop-{size}"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, size)
    contexts, batches = CASES[size]
    max_tokens = max(contexts) + repeats + 2
    num_blocks = max(batches) * cdiv(max_tokens, BLOCK_SIZE)
    runner = ModelRunner(
        ExecutorConfig(
            model=str(model_dir),
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=max(batches),
            max_num_batched_tokens=4096,
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    rows = []
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                ours = our_decode(runner, batch, context, repeats)
                theirs = hf_decode(hf, batch, context, repeats)
                rows.append((size, f"decode B={batch} ctx={context}", ours, theirs))
                print(
                    f"{rows[-1][1]:>24} ours {ours * 1e3:8.1f} ms  hf {theirs * 1e3:8.1f} ms",
                    flush=True,
                )
        rows.append(
            (size, "prefill 512 tokens", our_prefill(runner, repeats), hf_prefill(hf, repeats))
        )
    return rows


def our_prefill(runner: ModelRunner, repeats: int) -> float:
    def step():
        runner.batch = runner._new_batch()
        blocks = list(range(cdiv(512, BLOCK_SIZE)))
        request = NewRequestData("p", [1] * 512, 512, SamplingParams(), blocks)
        runner.execute(
            SchedulerOutput(scheduled_new_reqs=[request], num_scheduled_tokens={"p": 512})
        )

    return median_time(step, repeats)


def hf_prefill(model, repeats: int) -> float:
    tokens = torch.ones(1, 512, dtype=torch.long)
    return median_time(lambda: model(tokens), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "executor.md"))
    args = parser.parse_args()
    rows = [row for size in args.sizes for row in bench_model(size, args.repeats)]
    lines = [
        "| model | step | ours (ms) | transformers (ms) | speed-up |",
        "|---|---|---:|---:|---:|",
        *(f"| {m} | {s} | {o * 1e3:.1f} | {t * 1e3:.1f} | {t / o:.2f}x |" for m, s, o, t in rows),
    ]
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        f"# Executor step time\n\n`python bench/executor_bench.py --repeats {args.repeats}` on "
        f"{date.today()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, fp32, torch "
        f"reference attention. Median seconds of one step.\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
