"""Embeddings on the engine against sentence-transformers on the same weights, on this
CPU (docs/pooling.md).

    python bench/pooling_bench.py [--size small] [--rounds 5] [--out bench/results/pooling.md]

Throughput: requests of 1, 32 and 256 inputs (64-token texts), one after another: a
flagstop stack (router, scheduler, executor; gRPC Embed) against sentence-transformers'
encode() of the same batch in this process, each side's embeddings a second and its
latency a request (median and worst over the rounds), side by side in one run; and the
largest difference between the two sides' embeddings.

Reranking's shape: one 192-token query before each of 100 short documents, in one
request, on stacks with the prefix cache on and off: the request's latency and the
prompt tokens the engine computed (the rest were found cached).
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import write_result  # noqa: E402
from flagstop.v1 import generation_pb2  # noqa: E402
from tools.make_pooling_model import write_pooling_model  # noqa: E402
from tools.stack import start_stack  # noqa: E402

WORDS = ["batch", "step", "token", "cache", "block", "prefix", "request", "stream", "engine",
         "model", "query", "document", "router", "scheduler", "executor", "kernel", "memory",
         "latency", "queue", "budget", "chunk"]  # fmt: skip
BATCHES = (1, 32, 256)


def texts(n: int, num_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(num_words)) for _ in range(n)]


def embed(stub, inputs: list[str]) -> tuple[np.ndarray, generation_pb2.EmbedResponse]:
    request = generation_pb2.EmbedRequest(inputs=[generation_pb2.EmbedInput(text=t)
                                                  for t in inputs])  # fmt: skip
    reply = stub.Embed(request, timeout=600)
    return np.array([e.values for e in reply.embeddings], np.float32), reply


def timed(run, rounds: int) -> list[float]:
    run()  # warm-up
    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return seconds


def throughput_rows(model: Path, tmp: Path, rounds: int) -> list[dict]:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model), device="cpu")
    stack = start_stack(model, tmp / "throughput",
                        executor_args=["--max-num-batched-tokens", "8192"],
                        scheduler_args=["--max-num-batched-tokens", "8192"])  # fmt: skip
    rows = []
    try:
        stub = stack.generation()
        for batch in BATCHES:
            inputs = texts(batch, 48, batch)
            ours = timed(lambda inputs=inputs: embed(stub, inputs), rounds)
            theirs = timed(lambda inputs=inputs, batch=batch: reference.encode(
                inputs, batch_size=batch), rounds)  # fmt: skip
            diff = np.abs(embed(stub, inputs)[0] - reference.encode(inputs)).max()
            for engine, seconds in (("flagstop", ours), ("sentence-transformers", theirs)):
                rows.append({"batch": batch, "engine": engine,
                             "per_s": batch / statistics.median(seconds),
                             "p50_ms": statistics.median(seconds) * 1e3,
                             "max_ms": max(seconds) * 1e3, "max_diff": float(diff)})  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        stack.stop(10)
    return rows


def rerank_rows(model: Path, tmp: Path, rounds: int) -> list[dict]:
    query = "query: " + texts(1, 190, 7)[0]
    documents = [f"{query} document: {d}" for d in texts(100, 12, 8)]
    rows = []
    for cached in (True, False):
        stack = start_stack(
            model,
            tmp / f"rerank-{cached}",
            scheduler_args=[] if cached else ["--no-prefix-caching"],
        )
        try:
            stub = stack.generation()
            replies = []

            def run(stub=stub, replies=replies) -> None:
                replies.append(embed(stub, documents)[1])

            seconds = timed(run, rounds)
            usage = replies[-1].usage
            rows.append({"prefix_cache": "on" if cached else "off",
                         "p50_ms": statistics.median(seconds) * 1e3,
                         "computed": usage.prompt_tokens - usage.cached_tokens,
                         "prompt_tokens": usage.prompt_tokens})  # fmt: skip
            print(rows[-1], flush=True)
        finally:
            stack.stop(10)
    return rows


def tables(throughput: list[dict], rerank: list[dict]) -> str:
    lines = [
        "| inputs a request | engine | embeddings a second | latency p50 ms | "
        "latency max ms | largest difference |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in throughput:
        lines.append(f"| {r['batch']} | {r['engine']} | {r['per_s']:,.1f} | {r['p50_ms']:,.1f} | "
                     f"{r['max_ms']:,.1f} | {r['max_diff']:.1e} |")  # fmt: skip
    lines += ["", "Reranking's shape (one 192-token query before each of 100 documents, one "
              "request):", "", "| prefix cache | latency p50 ms | prompt tokens computed | "
              "prompt tokens |", "|---|---:|---:|---:|"]  # fmt: skip
    for r in rerank:
        lines.append(
            f"| {r['prefix_cache']} | {r['p50_ms']:,.0f} | {r['computed']:,} | "
            f"{r['prompt_tokens']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pooling.md"))
    args = parser.parse_args()
    model = ROOT / "models" / f"flagstop-{args.size}-qwen3_embedding"
    if not (model / "config.json").exists():
        write_pooling_model(model, args.size)
    with tempfile.TemporaryDirectory() as tmp:
        throughput = throughput_rows(model, Path(tmp), args.rounds)
        rerank = rerank_rows(model, Path(tmp), args.rounds)
    table = tables(throughput, rerank)
    print(table)
    setup = (f"the {args.size} Qwen3-Embedding-shaped checkpoint (float32), {args.rounds} "
             f"rounds after a warm-up, 48-word inputs; {os.cpu_count()} cores shared by the "
             "stack's three processes, or by sentence-transformers alone")  # fmt: skip
    write_result(
        args.out,
        "Embeddings: flagstop against sentence-transformers",
        setup,
        table,
        {"throughput": throughput, "rerank": rerank},
    )


if __name__ == "__main__":
    main()
