"""The host tier of the prefix cache, side by side in one run: a multi-turn workload
whose conversations together outgrow the KV pool, on the real model on the CPU, with
the pool alone and with the pool plus a host tier.

    python bench/kv_tier_bench.py [--conversations 6 --num-blocks 64 --size small]

Two workloads: prefill-heavy (long user turns, short answers) and decode-heavy (the
reverse). Each turn's prompt is the conversation so far (a shared system prompt, the earlier
turns and answers) plus a new user message; every conversation's turn t is sent before
any turn t+1, so between two turns of one conversation the others evict its blocks
from the pool. With the tier, those blocks load back from host memory instead of being
prefilled again. Prefilled tokens and tier hits are the scheduler's own counters
(GetStats: tokens admitted minus pool hits minus tier hits); TTFT and tok/s are the
client's. Each variant gets a fresh stack (empty caches).
"""

import argparse
import random
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
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=64, help="the KV pool (16 tokens each)")
    parser.add_argument("--kv-offload-mib", type=int, default=512, help="the host tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "kv_tier.md"))
    args = parser.parse_args()
    rows, shapes = [], []
    variants = [("pool only", 0), (f"pool + {args.kv_offload_mib} MiB host tier",
                                   args.kv_offload_mib << 20)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / f"flagstop-{args.size}", args.size)
        for workload, turns, user_tokens, max_tokens in WORKLOADS:
            shape = argparse.Namespace(**vars(args), turns=turns, user_tokens=user_tokens,
                                       max_tokens=max_tokens)  # fmt: skip
            total = args.system_tokens + turns * (user_tokens + max_tokens)
            shapes.append(f"{workload}: {turns} turns of {user_tokens} user + {max_tokens} "
                          f"answer tokens ({total} at the last turn)")  # fmt: skip
            for name, tier_bytes in variants:
                log_dir = Path(tmp) / f"{workload}-{tier_bytes}"
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


if __name__ == "__main__":
    main()
