"""Latent attention's cache and decode, side by side in one run.

1. KV bytes a token and requests resident at a fixed KV memory: a DeepSeek-V3-shaped
   model (make model ARCH=deepseek_v3) on its latent cache, against the same model with
   a pool sized for every head's K and V (what an engine without latent attention
   caches: H x (nope + rope + v) values a token a layer, the keys and values up-projected).
   Both run the same forward in one process (the scheduler core and the model runner);
   only the pool's bytes a block differ, which is all residency depends on. The real
   DeepSeek-V3's numbers, from its config, beside them.
2. The decode's torch path: the absorbed form (torch_mla.mla_decode, reading the
   latents) against the expanded form (up-projecting the cached latents to every
   head's K and V each step, as a prefill does), per layer-step, at DeepSeek-V3's
   per-rank shapes under TP=8 (16 heads, rank 512, rope 64, nope 128, v 128).

    python bench/mla_bench.py [--requests 16] [--prompt 768] [--kv-mib 6]
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.kernels import torch_mla
from flagstop.scheduler_svc.core.config import SchedulerConfig
from tools.inprocess import Job, run_engine
from tools.make_model import write_model

RESULTS = Path(__file__).parent / "results"
# DeepSeek-V3 (config.json): 61 layers, 128 heads, kv_lora_rank 512, rope 64, nope 128, v 128.
V3 = {"layers": 61, "heads": 128, "rank": 512, "rope": 64, "nope": 128, "v": 128}


def values_a_token(heads: int, rank: int, rope: int, nope: int, v: int) -> tuple[int, int]:
    """(latent, every head's K and V) values a token a layer."""
    return rank + rope, heads * (nope + rope + v)


def jobs(args) -> list[Job]:
    rng = random.Random(args.seed)
    return [Job([1, *(rng.randrange(3, 500) for _ in range(args.prompt - 1))], args.output,
                SamplingParams()) for _ in range(args.requests)]  # fmt: skip


def run(model: Path, args, full_head: bool) -> dict:
    runner = ModelRunner(ExecutorConfig(model=str(model), kv_cache_bytes=args.kv_mib << 20,
                                        block_size=16, max_num_seqs=args.requests))  # fmt: skip
    mla, mc = runner.model_config.mla, runner.model_config
    latent, expanded = values_a_token(mc.num_heads, mla.kv_lora_rank, mla.rope_dim,
                                      mla.nope_dim, mla.v_head_dim)  # fmt: skip
    bytes_a_token = (expanded if full_head else latent) * 4 * mc.num_layers
    num_blocks = (args.kv_mib << 20) // (bytes_a_token * 16)
    config = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.requests,
                             max_model_len=4096, block_size=16)  # fmt: skip
    resident: list[int] = []
    cpu, wall = time.process_time(), time.perf_counter()
    result = run_engine(runner, jobs(args), config, num_blocks=num_blocks,
                        on_step=lambda s: resident.append(len(s.running)))  # fmt: skip
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "variant": "every head's K and V (expanded)" if full_head else "latent (MLA)",
        "bytes_a_token": bytes_a_token, "num_blocks": num_blocks,
        "resident_max": max(resident), "resident_mean": statistics.fmean(resident),
        "preemptions": result.scheduler.num_preemptions, "steps": result.num_steps,
        "tok_s": sum(map(len, result.outputs)) / wall, "cpu_s": cpu,
    }  # fmt: skip


def decode_times(batch: int, context: int, repeats: int) -> tuple[float, float]:
    """ms per layer-step of the absorbed decode and of the expanded one."""
    heads, rank, rope, nope, v = 16, V3["rank"], V3["rope"], V3["nope"], V3["v"]
    g = torch.Generator().manual_seed(0)
    blocks_each = -(-context // 16)
    cache = torch.randn(batch * blocks_each, 16, rank + rope, generator=g)
    tables = torch.arange(batch * blocks_each, dtype=torch.int32).view(batch, blocks_each)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    w_uk, w_uv = (
        torch.randn(heads, nope, rank, generator=g),
        torch.randn(heads, v, rank, generator=g),
    )
    q_nope, q_pe = (
        torch.randn(batch, heads, nope, generator=g),
        torch.randn(batch, heads, rope, generator=g),
    )
    one_each = torch.arange(batch + 1, dtype=torch.int32)

    def absorbed():
        torch_mla.mla_decode(q_nope, q_pe, cache, tables, seq_lens, w_uk, w_uv, 0.1)

    def expanded():
        torch_mla.mla_prefill(q_nope, q_pe, cache, tables, one_each, seq_lens, w_uk, w_uv, 0.1)

    out = []
    for fn in (absorbed, expanded):
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        out.append((time.perf_counter() - start) / repeats * 1e3)
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=768)
    parser.add_argument("--output", type=int, default=48)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--kv-mib", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "mla.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "deepseek_v3", args.size, arch="deepseek_v3")
        rows = [run(model, args, full_head) for full_head in (False, True)]
    latent, expanded = values_a_token(V3["heads"], V3["rank"], V3["rope"], V3["nope"], V3["v"])
    header = ("| KV cache | bytes a token (all layers) | blocks | resident (max / mean) "
              "| preemptions | steps | tok/s | CPU s |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [f"| {r['variant']} | {r['bytes_a_token']:,} | {r['num_blocks']} | "
             f"{r['resident_max']} / {r['resident_mean']:.1f} | {r['preemptions']} | "
             f"{r['steps']} | {r['tok_s']:.1f} | {r['cpu_s']:.1f} |" for r in rows]  # fmt: skip
    lines.append(
        f"| DeepSeek-V3 (config), latent, bf16 | {latent * 2 * V3['layers']:,} | | | | | | |"
    )
    lines.append(f"| DeepSeek-V3 (config), every head's K and V, bf16 | "
                 f"{expanded * 2 * V3['layers']:,} | | | | | | |")  # fmt: skip
    decode_header = ("| decodes x context | absorbed (ms / layer-step) | expanded (ms) | "
                     "expanded / absorbed |\n|---|---:|---:|---:|")  # fmt: skip
    decode_rows, measured = [], []
    for batch, context in ((1, 1024), (16, 512), (16, 2048), (64, 1024)):
        a, e = decode_times(batch, context, args.repeats)
        measured.append({"batch": batch, "context": context, "absorbed_ms": a, "expanded_ms": e})
        decode_rows.append(f"| {batch} x {context} | {a:.2f} | {e:.2f} | {e / a:.1f}x |")
    setup = (
        f"(1) DeepSeek-V3-shaped {args.size} model (make model ARCH=deepseek_v3: 4 layers, "
        f"4 heads, latent 64 + rope 16, nope 32, v 32), fp32, {args.kv_mib} MiB of KV; "
        f"{args.requests} requests of {args.prompt} prompt tokens and {args.output} output "
        f"tokens at t=0, greedy; {args.budget}-token step budget, block size 16; the "
        "expanded row's pool holds what every head's K and V would take, the forward is "
        "the same. (2) torch path on the CPU, fp32, DeepSeek-V3's per-rank shapes at TP=8 "
        f"(16 heads, rank 512, rope 64, nope 128, v 128), best of {args.repeats} means."
    )
    print(header, *lines, "", decode_header, *decode_rows, sep="\n")
    write_result(args.out, "Latent attention: KV bytes, residency and the decode's form", setup,
                 "\n".join([header, *lines, "", decode_header, *decode_rows]),
                 {"rows": rows, "decode": measured})  # fmt: skip


if __name__ == "__main__":
    main()
