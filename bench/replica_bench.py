"""Routing across replicas, side by side in one run: flagstop's router tier (prefix
affinity + load) vs an existing cache-aware router (sglang-router, cache_aware, in
front of each replica's own OpenAI port) vs round-robin, on the same replicas and the
same prefix-grouped workload.

    python bench/replica_bench.py [--groups 16 --per-group 16 --concurrency 16]

Each variant gets fresh replicas (empty prefix caches). The replicas are the executor
simulator (a load-test tool, not a model: the bench is about where requests go), with
a cost model in which prefill matters: --us-per-prefill-token per scheduled token on
top of a --step-ms step. Hit rate and prefilled tokens are the schedulers' own prefix
cache counters (GetStats), summed over the replicas; tok/s and TTFT are the client's.
sglang-router is a benchmark-only dependency: pip install -e '.[bench]'.
"""

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from tools.make_model import write_model
from tools.stack import Stack, free_port, spawn, start_replicas, wait_serving

RESULTS = Path(__file__).parent / "results"
WORDS = [f"w{i}" for i in range(400)]


def workload(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[str]:
    """Prompts sharing a long text prefix per group (a system prompt, a document),
    each with its own question, the groups interleaved in a seeded random order."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    return [f"{prefixes[g]} question {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
            for i, g in enumerate(order)]  # fmt: skip


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT s, tokens) of one streamed completion."""
    body = {"model": "flagstop-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, ttft, tokens = time.perf_counter(), math.nan, 0
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif math.isnan(ttft) and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    return ttft, tokens


async def drive(base_url: str, prompts: list[str], args) -> tuple[list, float]:
    queue, results = list(reversed(prompts)), []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def worker() -> None:
            while queue:
                results.append(await one(client, queue.pop(), args.max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results, time.perf_counter() - start


def replicas(model_dir: Path, log_dir: Path, routing: str, args) -> Stack:
    return start_replicas(
        model_dir, log_dir, args.replicas,
        executor_args=["--simulate", "--simulate-base-ms", str(args.step_ms),
                       "--simulate-us-per-scheduled-token", str(args.us_per_prefill_token),
                       "--num-blocks", str(args.num_blocks)],
        router_args=["--routing", routing],
    )  # fmt: skip


def own_routers(stack: Stack, model_dir: Path, args) -> list[str]:
    """A router per replica (its OpenAI port), for a router of someone else's in front."""
    urls = []
    for i in range(args.replicas):
        name, port, http = f"router-{i}", free_port(), free_port()
        stack.addresses[name] = f"127.0.0.1:{port}"
        stack.processes[name] = spawn(name, [
            "-m", "flagstop.router", "--model", str(model_dir), "--port", str(port),
            "--http-port", str(http), "--metrics-port", "0",
            "--scheduler", stack.addresses[f"scheduler-{i}"],
        ], stack.log_dir)  # fmt: skip
        wait_serving(stack.channel(stack.addresses[name]), stack.processes[name])
        urls.append(f"http://127.0.0.1:{http}")
    return urls


def sglang_router(worker_urls: list[str], log_dir: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--policy", "cache_aware", "--worker-urls", *worker_urls,
               "--prometheus-port", str(free_port()), *args.sglang_args.split()]  # fmt: skip
    log = (log_dir / "sglang-router.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"sglang-router exited; see {log_dir}/sglang-router.log"
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"sglang-router not up; see {log_dir}/sglang-router.log")


def cache_counters(stack: Stack, args) -> list[tuple[int, int]]:
    """(prompt tokens looked up, found cached) per replica so far."""
    stats = [stack.stats(f"scheduler-{i}") for i in range(args.replicas)]
    return [(s.prefix_cache_queries, s.prefix_cache_hits) for s in stats]


def measure(stack: Stack, base_url: str, prompts: list[str], label: str, args) -> dict:
    before = cache_counters(stack, args)
    results, duration = asyncio.run(drive(base_url, prompts, args))
    per_replica = [(q - q0, h - h0) for (q, h), (q0, h0) in zip(
        cache_counters(stack, args), before, strict=True)]  # fmt: skip
    queries, hits = sum(q for q, _ in per_replica), sum(h for _, h in per_replica)
    ttfts = sorted(t * 1e3 for t, _ in results)
    return {
        "router": label, "hit_rate": hits / queries, "prefilled_tokens": queries - hits,
        "requests_per_replica": [round(q / queries, 3) for q, _ in per_replica],
        "tok_s": sum(n for _, n in results) / duration,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }  # fmt: skip


def variant(model_dir: Path, label: str, prompts: list[str], args) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="replica-bench-"))
    routing = {"flagstop prefix": "prefix"}.get(label, "round-robin")
    stack = replicas(model_dir, log_dir, routing, args)
    sglang = None
    try:
        url = f"http://{stack.http}"
        if label.startswith("sglang"):
            sglang, url = sglang_router(own_routers(stack, model_dir, args), log_dir, args)
        # Warm-up on prompts of their own (nothing the workload will find cached).
        warm_up = workload(args.concurrency, 1, args.prefix_words, seed=99)
        asyncio.run(drive(url, warm_up, args))
        return measure(stack, url, prompts, label, args)
    finally:
        if sglang is not None:
            sglang.terminate()
            sglang.wait(10)
        stack.stop(10)


def table(rows: list[dict]) -> str:
    lines = [
        "| router | prefix-cache hit rate | prefilled tokens | share of prompt tokens "
        "per replica | tok/s | TTFT p50 / p99 (ms) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        shares = " / ".join(f"{s:.0%}" for s in r["requests_per_replica"])
        lines.append(f"| {r['router']} | {r['hit_rate']:.1%} | {r['prefilled_tokens']} | "
                     f"{shares} | {r['tok_s']:.0f} | {r['ttft_p50_ms']:.0f} / "
                     f"{r['ttft_p99_ms']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--us-per-prefill-token", type=float, default=100.0)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=400,
        help="KV blocks per replica: about half the groups' prefixes",
    )
    parser.add_argument("--sglang-args", default="", help="extra sglang-router flags, quoted")
    parser.add_argument("--out", default=str(RESULTS / "replicas.md"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model_dir = Path("models/flagstop-tiny")
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "tiny")
    labels = ["flagstop prefix", "sglang-router cache_aware", "round-robin"]
    if shutil.which("sglang-router") is None and not _importable("sglang_router"):
        print("sglang-router is not installed (pip install -e '.[bench]'): skipping it")
        labels.remove("sglang-router cache_aware")
    prompts = workload(args.groups, args.per_group, args.prefix_words)
    rows = [variant(model_dir, label, prompts, args) for label in labels]
    print(table(rows))
    write_result(
        args.out, "Routing across replicas",
        f"{args.replicas} replicas (the executor simulator, {args.step_ms:g} ms steps + "
        f"{args.us_per_prefill_token:g} µs per scheduled token, {args.num_blocks} KV blocks "
        f"each), {args.groups} groups x {args.per_group} requests sharing a "
        f"{args.prefix_words}-word prefix per group, interleaved, {args.concurrency} "
        f"concurrent, {args.max_tokens} tokens each; fresh replicas per router.",
        table(rows), {"args": vars(args), "rows": rows},
    )  # fmt: skip


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
