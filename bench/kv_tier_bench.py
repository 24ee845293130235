"""KV beyond one pool, side by side in one run: the prefix cache's host tier, and
prefill/decode disaggregation.

    python bench/kv_tier_bench.py [--part tier|pd|all] [--size small]

The host tier (results/kv_tier.md): a multi-turn workload whose conversations together
outgrow the KV pool, on the real model on the CPU, with the pool alone and with the
pool plus a host tier. Two workloads: prefill-heavy (long user turns, short answers)
and decode-heavy (the reverse). Each turn's prompt is the conversation so far (a
shared system prompt, the earlier turns and answers) plus a new user message; every
conversation's turn t is sent before any turn t+1, so between two turns of one
conversation the others evict its blocks from the pool. With the tier, those blocks
load back from host memory instead of being prefilled again. Prefilled tokens and
tier hits are the scheduler's own counters (GetStats: tokens admitted minus pool hits
minus tier hits); TTFT and tok/s are the client's. Each variant gets a fresh stack
(empty caches).

Disaggregation (results/kv_disagg.md): a mixed workload, decode-heavy streams (short
prompts, long answers) running while long prompts arrive, on two executors either
way: two colocated replicas, or a prefill and a decode replica (--pd-threshold below
the long prompts, above the short ones). Once on the executor simulator (its GPU-like
cost model, a load-test tool: what the scheduling does at GPU step rates) and once on
the real model on the CPU. The decode streams' inter-token latency (per token, from
the client's chunk times) and both kinds' TTFT, the client's.
"""

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from tools.make_model import write_model
from tools.stack import Stack, start_stack

RESULTS = Path(__file__).parent / "results"


def conversations(args) -> list[list[list[int]]]:
    """Per conversation, each turn's new user tokens (after a shared system prompt)."""
    rng = random.Random(args.seed)
    return [[[rng.randrange(3, 512) for _ in range(args.user_tokens)] for _ in range(args.turns)]
            for _ in range(args.conversations)]  # fmt: skip


def one_turn(stack: Stack, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(TTFT s, answer) of one streamed greedy request."""
    from flagstop.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    start, ttft, answer = time.perf_counter(), None, []
    for chunk in stack.generation().Generate(request, timeout=600):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        answer += chunk.token_ids
    return ttft, answer


def run_variant(model_dir: Path, log_dir: Path, tier_bytes: int, args) -> dict:
    executor_args = ["--num-blocks", str(args.num_blocks)]
    if tier_bytes:
        executor_args += ["--kv-offload-bytes", str(tier_bytes)]
    stack = start_stack(model_dir, log_dir, executor_args=executor_args)
    try:
        return drive(stack, args)
    finally:
        stack.stop(10)


def drive(stack: Stack, args) -> dict:
    system = [0] + [random.Random(1).randrange(3, 512) for _ in range(args.system_tokens - 1)]
    users = conversations(args)
    history = [list(system) for _ in users]
    ttfts, num_tokens = [], 0
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):
            prompts = [h + u[turn] for h, u in zip(history, users, strict=True)]
            replies = list(pool.map(lambda p: one_turn(stack, p, args.max_tokens), prompts))
            for i, (ttft, answer) in enumerate(replies):
                ttfts.append(ttft)
                num_tokens += len(answer)
                history[i] = prompts[i] + answer
    wall = time.perf_counter() - start
    stats = stack.wait_idle(60)
    admitted = stats.prefix_cache_queries
    return {
        "prefilled_tokens": admitted - stats.prefix_cache_hits - stats.external_prefix_cache_hits,
        "pool_hit_tokens": stats.prefix_cache_hits,
        "tier_hit_tokens": stats.external_prefix_cache_hits,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * statistics.quantiles(ttfts, n=100)[98],
        "tok_s": num_tokens / wall,
        "wall_s": wall,
        "host_blocks": stats.num_host_blocks,
    }


# (name, turns, user tokens a turn, answer tokens a turn): the history a turn carries
# is what the tier saves, the answer is what it cannot.
WORKLOADS = [("prefill-heavy", 6, 128, 8), ("decode-heavy", 5, 48, 24)]


def table(rows: list[tuple[str, str, dict]]) -> str:
    lines = ["| workload | variant | prefilled tokens | pool hits | tier hits | TTFT p50 ms "
             "| TTFT p99 ms | tok/s | wall s |", "|---" * 9 + "|"]  # fmt: skip
    for workload, name, r in rows:
        lines.append(
            f"| {workload} | {name} | {r['prefilled_tokens']} | {r['pool_hit_tokens']} "
            f"| {r['tier_hit_tokens']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} "
            f"| {r['tok_s']:.1f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="all", choices=["tier", "pd", "all"])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=64, help="the KV pool (16 tokens each)")
    parser.add_argument("--kv-offload-mib", type=int, default=512, help="the host tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "kv_tier.md"))
    parser.add_argument("--pd-out", default=str(RESULTS / "kv_disagg.md"))
    parser.add_argument("--pd-backends", nargs="+", default=["simulator", "cpu"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / f"flagstop-{args.size}", args.size)
        if args.part in ("tier", "all"):
            bench_tier(model_dir, Path(tmp), args)
        if args.part in ("pd", "all"):
            bench_disaggregation(model_dir, Path(tmp), args)


def bench_tier(model_dir: Path, tmp: Path, args) -> None:
    rows, shapes = [], []
    variants = [("pool only", 0), (f"pool + {args.kv_offload_mib} MiB host tier",
                                   args.kv_offload_mib << 20)]  # fmt: skip
    for workload, turns, user_tokens, max_tokens in WORKLOADS:
        shape = argparse.Namespace(**vars(args), turns=turns, user_tokens=user_tokens,
                                   max_tokens=max_tokens)  # fmt: skip
        total = args.system_tokens + turns * (user_tokens + max_tokens)
        shapes.append(f"{workload}: {turns} turns of {user_tokens} user + {max_tokens} "
                      f"answer tokens ({total} at the last turn)")  # fmt: skip
        for name, tier_bytes in variants:
            log_dir = tmp / f"{workload}-{tier_bytes}"
            log_dir.mkdir()
            rows.append((workload, name, run_variant(model_dir, log_dir, tier_bytes, shape)))
            print(table(rows[-1:]), flush=True)
    setup = (
        f"model {args.size} on the CPU; {args.conversations} conversations after a "
        f"{args.system_tokens}-token system prompt, {args.concurrency} at a time, "
        f"{'; '.join(shapes)}; a pool of {args.num_blocks} blocks "
        f"({args.num_blocks * 16} tokens), which the conversations outgrow. Prefilled = "
        "tokens admitted - pool hits - tier hits (GetStats). A loaded request waits for "
        "its copy and the step that reports it (about two steps with two in flight), so "
        "where answers dominate the tier saves prefill but not time."
    )
    data = {"rows": [{"workload": w, "variant": n, **r} for w, n, r in rows]}
    write_result(args.out, "KV tiers: the host tier on multi-turn workloads", setup,
                 table(rows), data)  # fmt: skip
    print(table(rows))


# -- prefill/decode disaggregation ------------------------------------------------------

# (backend, executor flags, long prompt tokens, long prompts, decode streams, their
# answer tokens, seconds between long prompts). The simulator's costs are those of an
# 8B model on an H200 (executor/simulator.py): a long prompt's prefill steps are what
# colocated decodes wait behind. On the CPU the model is small and the prompts shorter.
PD_BACKENDS = [
    ("simulator", ["--simulate", "--max-num-batched-tokens", "8192"], 6000, 16, 24, 256, 0.25),
    ("cpu", [], 768, 6, 4, 48, 1.0),
]
# mixed: the long prompts arrive while the decodes run; decode only: none does, and
# twice the decode streams (what the prefill replica's executor is idle for).
PD_WORKLOADS = ("mixed", "decode only")


def bench_disaggregation(model_dir: Path, tmp: Path, args) -> None:
    rows = []
    for backend, executor_args, long_tokens, num_long, num_decode, decode_tokens, gap in (
        PD_BACKENDS
    ):  # fmt: skip
        if backend not in args.pd_backends:
            continue
        served = model_dir
        if backend == "simulator":  # it lends only config.json: a GPU model's length
            served = long_context_config(model_dir, tmp / "simulated")
        for workload in PD_WORKLOADS:
            mixed = workload == "mixed"
            shape = dict(long_tokens=long_tokens, num_long=num_long if mixed else 0,
                         num_decode=num_decode if mixed else 2 * num_decode,
                         decode_tokens=decode_tokens, gap=gap)  # fmt: skip
            for layout in ("colocated", "disaggregated"):
                log_dir = tmp / f"pd-{backend}-{workload.replace(' ', '-')}-{layout}"
                result = run_pd_variant(served, log_dir, executor_args, layout,
                                        long_tokens // 2, shape)  # fmt: skip
                rows.append((f"{backend}, {workload}", layout, result))
                print(pd_table(rows[-1:]), flush=True)
    setup = (
        "two executors either way: two colocated replicas behind the router (prefix "
        "routing), or a prefill and a decode replica (--pd-threshold half the long "
        "prompt). Decode streams (32-token prompts) start first; in the mixed workload "
        "long prompts (8 answer tokens) arrive at a fixed gap while they run, in the "
        "decode-only one none does and there are twice the decode streams. "
        + "; ".join(f"{b}: {n} long prompts of {t} tokens every {g} s, {d} decode streams "
                    f"of {k} tokens" for b, _, t, n, d, k, g in PD_BACKENDS)
        + ". Each stack warms up with one round of the shapes first. The simulator is a "
        "load-test tool: its cost model (an 8B model on an H200, KV reads at 5 us a "
        "token) stands for the GPU; the cpu rows run the small model, one thread an "
        "executor (OMP_NUM_THREADS=1) on this machine's two cores, which the router and "
        "schedulers share."
    )  # fmt: skip
    data = {"rows": [{"backend": b, "layout": n, **r} for b, n, r in rows]}
    write_result(args.pd_out, "KV tiers: prefill/decode disaggregation, colocated side by side",
                 setup, pd_table(rows), data)  # fmt: skip
    print(pd_table(rows))


def long_context_config(model_dir: Path, out: Path) -> Path:
    if not out.exists():
        shutil.copytree(model_dir, out)
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = 32768
        (out / "config.json").write_text(json.dumps(config))
    return out


def run_pd_variant(model_dir, log_dir, executor_args, layout, threshold, shape) -> dict:
    from tools.stack import start_disaggregated, start_replicas

    # One core an executor: two executors of torch's default threads on these two cores
    # would measure their contention, not the layout.
    env = {"OMP_NUM_THREADS": "1"}
    if layout == "colocated":
        stack = start_replicas(model_dir, log_dir, 2, executor_args=executor_args, env=env)
    else:
        stack = start_disaggregated(model_dir, log_dir, executor_args=executor_args, env=env,
                                    router_args=["--pd-threshold", str(threshold)])  # fmt: skip
    try:
        return drive_mixed(stack, **shape)
    finally:
        stack.stop(10)


def timed_stream(stack: Stack, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
    """(seconds since the request, tokens) of each chunk of one greedy stream."""
    from flagstop.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    start, chunks = time.perf_counter(), []
    for chunk in stack.generation().Generate(request, timeout=900):
        if chunk.token_ids:
            chunks.append((time.perf_counter() - start, len(chunk.token_ids)))
    return chunks


def warm_up(stack, long_tokens: int, num_decode: int) -> None:
    """Every executor's first steps of each shape are slow on the CPU (oneDNN builds its
    primitives): a round of the workload's shapes first, on every replica."""
    rng = random.Random(99)
    prompts = [([0] + [rng.randrange(3, 512) for _ in range(n - 1)], 4)
               for n in [32] * num_decode + [long_tokens] * 2]  # fmt: skip
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: timed_stream(stack, *p), prompts))


def drive_mixed(stack, long_tokens, num_long, num_decode, decode_tokens, gap) -> dict:
    warm_up(stack, long_tokens, num_decode)
    rng = random.Random(3)
    short = [[0] + [rng.randrange(3, 512) for _ in range(31)] for _ in range(num_decode)]
    long = [[0] + [rng.randrange(3, 512) for _ in range(long_tokens - 1)] for _ in range(num_long)]
    start = time.perf_counter()
    with ThreadPoolExecutor(num_decode + num_long) as pool:
        decodes = [pool.submit(timed_stream, stack, p, decode_tokens) for p in short]
        time.sleep(gap)
        longs = []
        for p in long:
            longs.append(pool.submit(timed_stream, stack, p, 8))
            time.sleep(gap)
        decode_chunks = [f.result() for f in decodes]
        long_chunks = [f.result() for f in longs]
    wall = time.perf_counter() - start
    itl = [(t1 - t0) / n for chunks in decode_chunks
           for (t0, _), (t1, n) in itertools.pairwise(chunks)]  # fmt: skip
    num_tokens = sum(n for chunks in decode_chunks + long_chunks for _, n in chunks)
    q = lambda xs, p: 1000 * statistics.quantiles(xs, n=100)[p - 1]  # noqa: E731
    return {
        "itl_p50_ms": q(itl, 50), "itl_p99_ms": q(itl, 99),
        "long_ttft_p50_ms": q([c[0][0] for c in long_chunks], 50) if long_chunks else None,
        "long_ttft_p99_ms": q([c[0][0] for c in long_chunks], 99) if long_chunks else None,
        "decode_ttft_p50_ms": q([c[0][0] for c in decode_chunks], 50),
        "tok_s": num_tokens / wall, "wall_s": wall,
    }  # fmt: skip


def pd_table(rows: list[tuple[str, str, dict]]) -> str:
    lines = ["| backend, workload | layout | decode ITL p50 ms | decode ITL p99 ms "
             "| long TTFT p50 ms | long TTFT p99 ms | decode TTFT p50 ms | tok/s |",
             "|---" * 8 + "|"]  # fmt: skip
    ms = lambda value: "-" if value is None else f"{value:.0f}"  # noqa: E731
    for backend, layout, r in rows:
        lines.append(
            f"| {backend} | {layout} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} "
            f"| {ms(r['long_ttft_p50_ms'])} | {ms(r['long_ttft_p99_ms'])} "
            f"| {r['decode_ttft_p50_ms']:.0f} | {r['tok_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
