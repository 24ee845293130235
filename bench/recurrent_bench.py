"""Recurrent layers' states as a KV cache group, side by side in one run.

1. Requests resident at a fixed KV memory and tok/s on a long-context workload: a
   Qwen3-Next-shaped model (make model ARCH=qwen3_next: three gated DeltaNet layers to one
   full attention) against the same model with every layer full attention
   (full_attention_interval 1), both through the scheduler core and the model runner in
   one process, each pool sized from the same bytes.
2. The design choice, at Qwen3-Next-80B's own geometry (its config; bf16 KV, float32
   states, one rank): a state in the shared pool (flagstop's: a block's page holds one,
   so blocks of 1,072 tokens) against a pool of state slots of its own beside 16-token
   attention blocks (SGLang's; checkpoints every 256 tokens, its mamba-track-interval),
   on memory a request holds and on the prefix-hit rate of the Mooncake conversation
   trace replayed one request after another through the scheduler core's KVCacheManager
   (the own pool's checkpoints in an LRU of its slots: a model of that design, which
   flagstop does not run).

    python bench/recurrent_bench.py [--requests 12] [--prompt 1536] [--kv-mib 8]
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager
from flagstop.scheduler_svc.core.kv_groups import (
    LINEAR_ATTENTION,
    KVLayer,
    kv_cache_groups,
)
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.utils import cdiv
from tools.inprocess import Job, run_engine
from tools.make_model import write_model

RESULTS = Path(__file__).parent / "results"
TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_conversation.jsonl"
MIB = 1 << 20
# Qwen3-Next-80B-A3B (config.json): 48 layers, every 4th full attention (2 KV heads of
# 256), gated DeltaNet with 16 key heads and 32 value heads of 128, convolution of 4.
FULL_LAYERS, LINEAR_LAYERS = 12, 36
KV_A_TOKEN = 2 * 2 * 256 * 2  # one full-attention layer's K and V, bf16
STATE = 4 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3)  # one layer's, float32
SHARED_BLOCK = 16 * cdiv(STATE, 16 * KV_A_TOKEN)  # tokens: a page holds a state
TRACK_INTERVAL = 256  # SGLang's mamba-track-interval


def jobs(args) -> list[Job]:
    rng = random.Random(args.seed)
    return [Job([1, *(rng.randrange(3, 500) for _ in range(args.prompt - 1))], args.output,
                SamplingParams()) for _ in range(args.requests)]  # fmt: skip


def run(model: Path, args, label: str) -> dict:
    runner = ModelRunner(ExecutorConfig(model=str(model), kv_cache_bytes=args.kv_mib * MIB,
                                        block_size=32, max_num_seqs=args.requests,
                                        max_model_len=4096))  # fmt: skip
    config = SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.requests,
                             max_model_len=4096, block_size=runner.block_size)  # fmt: skip
    resident: list[int] = []
    cpu, wall = time.process_time(), time.perf_counter()
    result = run_engine(runner, jobs(args), config,
                        on_step=lambda s: resident.append(len(s.running)))  # fmt: skip
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    kv_a_token = sum(x.kv_bytes_per_token for x in runner.kv_layers)
    num_linear = runner.model_config.layer_types.count(LINEAR_ATTENTION)
    return {
        "variant": label, "kv_bytes_a_token": kv_a_token,
        "state_bytes": num_linear * runner.model_config.recurrent.state_bytes(),
        "block_size": runner.block_size, "num_blocks": runner.num_blocks,
        "resident_max": max(resident), "resident_mean": statistics.fmean(resident),
        "preemptions": result.scheduler.num_preemptions, "steps": result.num_steps,
        "tok_s": sum(map(len, result.outputs)) / wall, "cpu_s": cpu,
    }  # fmt: skip


# -- 2. the design: a state in the shared pool, or a pool of state slots -------------


def request_bytes(num_tokens: int, budget: int) -> dict:
    """Bytes one request holds at num_tokens, decoding (no chunk in flight), and how
    many such requests budget bytes hold in each design (the own pool split 10% / 30%
    for its state slots, fixed at start-up)."""
    shared_block = FULL_LAYERS * SHARED_BLOCK * KV_A_TOKEN  # 12 layers' pages a block id
    shared = (cdiv(num_tokens, SHARED_BLOCK) + LINEAR_LAYERS // FULL_LAYERS) * shared_block
    attention = cdiv(num_tokens, 16) * 16 * FULL_LAYERS * KV_A_TOKEN
    own = attention + LINEAR_LAYERS * STATE
    resident = {
        share: min(
            int(budget * share // (LINEAR_LAYERS * STATE)), int(budget * (1 - share) // attention)
        )
        for share in (0.1, 0.3)
    }
    return {"tokens": num_tokens, "shared": shared, "own": own,
            "shared_resident": budget // shared, "own_resident": resident}  # fmt: skip


def trace_prompts(limit: int) -> list[list[int]]:
    """The trace's prompts as tokens: each 512-token hash block a fixed random run."""
    prompts = []
    for line in TRACE.read_text().splitlines()[:limit]:
        row = json.loads(line)
        tokens = []
        for h in row["hash_ids"]:
            rng = random.Random(h)
            tokens += [rng.randrange(3, 150_000) for _ in range(512)]
        prompts.append(tokens[: row["input_length"]])
    return prompts


def _prefill(kv: KVCacheManager, request: Request, hits) -> bool:
    """The prompt computed in 8k chunks after its hits (blocks cached as it goes, the
    recurrent ones let go behind it); False when the pool cannot hold it."""
    done, new = len(hits) * kv.block_size, hits
    while done < request.num_tokens:
        n = min(8192, request.num_tokens - done)
        if kv.allocate_slots(request, n, new) is None:
            return False
        done, new = done + n, None
        request.num_computed_tokens = done
    return True


def shared_pool_hits(prompts: list[list[int]], budget: int) -> tuple[int, int]:
    layers = [KVLayer(LINEAR_ATTENTION)] * 3 + [KVLayer(kv_bytes_per_token=KV_A_TOKEN)]
    groups = kv_cache_groups(layers * FULL_LAYERS)
    block_bytes = FULL_LAYERS * SHARED_BLOCK * KV_A_TOKEN
    kv = KVCacheManager(1 + budget // block_bytes, SHARED_BLOCK, groups=groups)
    return _replay(kv, prompts)


def own_pool_hits(prompts: list[list[int]], budget: int, state_share: float) -> tuple[int, int]:
    """Attention blocks of 16 in the KVCacheManager; the states' slots an LRU of
    checkpoints every TRACK_INTERVAL tokens (one slot kept for the running request)."""
    attention = budget * (1 - state_share)
    kv = KVCacheManager(int(attention // (16 * FULL_LAYERS * KV_A_TOKEN)), 16)
    slots = int(budget * state_share // (LINEAR_LAYERS * STATE)) - 1
    checkpoints: OrderedDict[bytes, None] = OrderedDict()
    hit_tokens = prompt_tokens = 0
    for i, tokens in enumerate(prompts):
        request = Request(f"r{i}", "bench", tokens, StopParams(1, 0, True), frozenset())
        kv.update_block_hashes(request)
        attention_hit = len(kv.get_computed_blocks(request)) * 16
        n = attention_hit // TRACK_INTERVAL * TRACK_INTERVAL
        while n and request.block_hashes[n // 16 - 1] not in checkpoints:
            n -= TRACK_INTERVAL
        if n:
            checkpoints.move_to_end(request.block_hashes[n // 16 - 1])
        hits = kv.get_computed_blocks(request)
        hits.groups = [g[: n // 16] for g in hits.groups]
        if _prefill(kv, request, hits):
            hit_tokens += n
        prompt_tokens += len(tokens)
        kv.free(request.request_id)
        for end in range(TRACK_INTERVAL, len(tokens), TRACK_INTERVAL):
            checkpoints[request.block_hashes[end // 16 - 1]] = None
            checkpoints.move_to_end(request.block_hashes[end // 16 - 1])
        while len(checkpoints) > slots:
            checkpoints.popitem(last=False)
    return hit_tokens, prompt_tokens


def _replay(kv: KVCacheManager, prompts: list[list[int]]) -> tuple[int, int]:
    hit_tokens = prompt_tokens = 0
    for i, tokens in enumerate(prompts):
        request = Request(f"r{i}", "bench", tokens, StopParams(1, 0, True), frozenset())
        kv.update_block_hashes(request)
        hits = kv.get_computed_blocks(request)
        if _prefill(kv, request, hits):
            hit_tokens += len(hits) * kv.block_size
        prompt_tokens += len(tokens)
        kv.free(request.request_id)
    return hit_tokens, prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--kv-mib", type=int, default=8)
    parser.add_argument("--trace-requests", type=int, default=1500)
    parser.add_argument("--trace-gib", type=float, default=16.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "recurrent.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hybrid = write_model(Path(tmp) / "hybrid", args.size, arch="qwen3_next")
        full = write_model(Path(tmp) / "full", args.size, arch="qwen3_next",
                           overrides={"full_attention_interval": 1})  # fmt: skip
        rows = [run(hybrid, args, "gated DeltaNet 3 : 1 full (Qwen3-Next)"),
                run(full, args, "every layer full attention")]  # fmt: skip
    header = ("| layers | KV bytes a token | state bytes a request | block | blocks "
              "| resident (max / mean) | preemptions | steps | tok/s | CPU s |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    lines = [f"| {r['variant']} | {r['kv_bytes_a_token']:,} | {r['state_bytes']:,} | "
             f"{r['block_size']} | {r['num_blocks']} | {r['resident_max']} / "
             f"{r['resident_mean']:.1f} | {r['preemptions']} | {r['steps']} | "
             f"{r['tok_s']:.1f} | {r['cpu_s']:.1f} |" for r in rows]  # fmt: skip
    budget = int(args.trace_gib * (1 << 30))
    memory = [request_bytes(n, budget) for n in (1024, 8192, 32768)]
    memory_header = (f"| tokens a request | shared pool (flagstop): MiB, resident in "
                     f"{args.trace_gib:g} GiB | own state pool: MiB, resident (10% / 30% "
                     "slots) |\n|---:|---:|---:|")  # fmt: skip
    memory_rows = [f"| {m['tokens']:,} | {m['shared'] / MIB:.1f}, {m['shared_resident']} | "
                   f"{m['own'] / MIB:.1f}, {m['own_resident'][0.1]} / {m['own_resident'][0.3]} |"
                   for m in memory]  # fmt: skip
    prompts = trace_prompts(args.trace_requests)
    designs = [("shared pool (flagstop)", shared_pool_hits(prompts, budget))]
    attention_only = KVCacheManager(1 << 20, 16)  # no states, no memory limit: the bound
    designs.append(("(bound: 16-token attention blocks, unbounded memory)",
                    _replay(attention_only, prompts)))  # fmt: skip
    for share in (0.1, 0.3):
        designs.append((f"own state pool, {share:.0%} of the bytes",
                        own_pool_hits(prompts, budget, share)))  # fmt: skip
    hit_header = (
        "| design | prefix-hit tokens | of prompt tokens | hit rate |\n|---|---:|---:|---:|"
    )
    hit_rows = [f"| {name} | {hit:,} | {total:,} | {hit / total:.1%} |"
                for name, (hit, total) in designs]  # fmt: skip
    setup = (
        f"(1) {args.size} Qwen3-Next-shaped model (make model ARCH=qwen3_next: 4 layers, "
        "3 gated DeltaNet to 1 full attention, 8 experts top-2 and a shared one), fp32, "
        f"{args.kv_mib} MiB of KV; {args.requests} requests of {args.prompt} prompt tokens "
        f"and {args.output} output tokens at t=0, greedy, {args.budget}-token steps; the "
        "other row the same model with every layer full attention. (2) Qwen3-Next-80B's "
        f"geometry, one rank: shared-pool blocks of {SHARED_BLOCK} tokens (a page = one "
        f"layer's state, {STATE:,} bytes); the first {args.trace_requests} requests of the "
        f"Mooncake conversation trace, one after another, in {args.trace_gib:g} GiB."
    )
    table = "\n".join([header, *lines, "", memory_header, *memory_rows, "", hit_header,
                       *hit_rows])  # fmt: skip
    print(table)
    write_result(
        args.out,
        "Recurrent layers: residency, memory and prefix hits",
        setup,
        table,
        {
            "rows": rows,
            "memory": memory,
            "hits": [{"design": n, "hit": h, "total": t} for n, (h, t) in designs],
        },
    )


if __name__ == "__main__":
    main()
