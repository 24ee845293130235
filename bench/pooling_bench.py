"""Embeddings on the engine against sentence-transformers on the same weights, on this
CPU, and reranking with the prefix cache on and off (docs/pooling.md).

    python bench/pooling_bench.py [--size small] [--out bench/results/pooling.md]

Throughput: requests of 1, 32 and 256 inputs (48-word texts, ~150 tokens), one after
another: a flagstop stack (router, scheduler, executor; gRPC Embed; its prefix cache
off, so that every round computes every token as sentence-transformers does) against
sentence-transformers' encode() of the same batch in this process, side by side in
one run: each side's embeddings a second and its latency a request (p50 and p99 over
ROUNDS[batch] rounds after a warm-up), and the largest difference between the two
sides' embeddings.

Reranking: one query (Qwen3-Reranker's instruction and a 96-word question) against
100 short documents in one /rerank-shaped request (gRPC Score, ranked), a new query
and new documents each round, on the reranker checkpoint of the same size, on stacks
with the prefix cache on and off: the request's latency and the prompt tokens the
engine computed (the rest were found cached: the query's, after its first document,
and the instruction's).
"""

import argparse
import json
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
from tools.make_pooling_model import (  # noqa: E402
    RERANKER,
    RERANKER_OVERRIDES,
    rerank_document,
    rerank_query,
    write_pooling_model,
)
from tools.stack import start_stack  # noqa: E402

WORDS = ["batch", "step", "token", "cache", "block", "prefix", "request", "stream", "engine",
         "model", "query", "document", "router", "scheduler", "executor", "kernel", "memory",
         "latency", "queue", "budget", "chunk"]  # fmt: skip
# Requests timed at each batch size: as many as a minute or so of either side allows
# on 2 cores with the small checkpoint (a 256-input request takes ~50 s).
ROUNDS = {1: 40, 32: 4, 256: 2}
RERANK_ROUNDS = 3


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


def p99(seconds: list[float]) -> float:
    return float(np.percentile(seconds, 99))


def throughput_rows(model: Path, tmp: Path) -> list[dict]:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model), device="cpu")
    stack = start_stack(model, tmp / "throughput",
                        executor_args=["--max-num-batched-tokens", "8192"],
                        scheduler_args=["--max-num-batched-tokens", "8192",
                                        "--no-prefix-caching"])  # fmt: skip
    rows = []
    try:
        stub = stack.generation()
        for batch, rounds in ROUNDS.items():
            inputs = texts(batch, 48, batch)
            ours = timed(lambda inputs=inputs: embed(stub, inputs), rounds)
            theirs = timed(lambda inputs=inputs, batch=batch: reference.encode(
                inputs, batch_size=batch), rounds)  # fmt: skip
            diff = np.abs(embed(stub, inputs)[0] - reference.encode(inputs)).max()
            for engine, seconds in (("flagstop", ours), ("sentence-transformers", theirs)):
                rows.append({"batch": batch, "engine": engine, "rounds": rounds,
                             "per_s": batch / statistics.median(seconds),
                             "p50_ms": statistics.median(seconds) * 1e3,
                             "p99_ms": p99(seconds) * 1e3, "max_diff": float(diff)})  # fmt: skip
                print(rows[-1], flush=True)
    finally:
        stack.stop(10)
    return rows


def score(stub, query: str, documents: list[str]) -> generation_pb2.ScoreResponse:
    return stub.Score(generation_pb2.ScoreRequest(
        queries=[generation_pb2.EmbedInput(text=query)],
        documents=[generation_pb2.EmbedInput(text=d) for d in documents], ranked=True,
    ), timeout=600)  # fmt: skip


def rerank_request(seed: int) -> tuple[str, list[str]]:
    """A new query and 100 new documents each round: what one request shares is its
    query (and with earlier ones, the instruction), never a document seen before."""
    query = rerank_query(texts(1, 96, seed)[0])
    return query, [rerank_document(d) for d in texts(100, 12, 1000 + seed)]


def rerank_rows(model: Path, tmp: Path) -> list[dict]:
    overrides = ["--hf-overrides", json.dumps(RERANKER_OVERRIDES)]
    rows = []
    for cached in (True, False):
        stack = start_stack(
            model,
            tmp / f"rerank-{cached}",
            executor_args=[*overrides, "--max-num-batched-tokens", "8192"],
            scheduler_args=["--max-num-batched-tokens", "8192",
                            *([] if cached else ["--no-prefix-caching"])],
        )  # fmt: skip
        try:
            stub = stack.generation()
            replies = []

            def run(stub=stub, replies=replies) -> None:
                replies.append(score(stub, *rerank_request(len(replies))))

            seconds = timed(run, RERANK_ROUNDS)
            usage = replies[-1].usage
            rows.append({"prefix_cache": "on" if cached else "off",
                         "p50_ms": statistics.median(seconds) * 1e3,
                         "per_s": 100 / statistics.median(seconds),
                         "computed": usage.prompt_tokens - usage.cached_tokens,
                         "prompt_tokens": usage.prompt_tokens})  # fmt: skip
            print(rows[-1], flush=True)
        finally:
            stack.stop(10)
    return rows


def tables(throughput: list[dict], rerank: list[dict]) -> str:
    lines = [
        "| inputs a request | engine | requests timed | embeddings a second | "
        "latency p50 ms | latency p99 ms | largest difference |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in throughput:
        lines.append(
            f"| {r['batch']} | {r['engine']} | {r['rounds']} | {r['per_s']:,.1f} | "
            f"{r['p50_ms']:,.1f} | {r['p99_ms']:,.1f} | {r['max_diff']:.1e} |"
        )
    lines += ["", "Reranking (one query against 100 documents, one request, "
              f"{RERANK_ROUNDS} rounds after a warm-up):", "",
              "| prefix cache | latency p50 ms | documents a second | prompt tokens computed | "
              "prompt tokens |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rerank:
        lines.append(
            f"| {r['prefix_cache']} | {r['p50_ms']:,.0f} | {r['per_s']:,.1f} | "
            f"{r['computed']:,} | {r['prompt_tokens']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pooling.md"))
    args = parser.parse_args()
    models = {}
    for arch in ("qwen3_embedding", RERANKER):
        models[arch] = ROOT / "models" / f"flagstop-{args.size}-{arch}"
        if not (models[arch] / "config.json").exists():
            write_pooling_model(models[arch], args.size, arch=arch)
    with tempfile.TemporaryDirectory() as tmp:
        throughput = throughput_rows(models["qwen3_embedding"], Path(tmp))
        rerank = rerank_rows(models[RERANKER], Path(tmp))
    table = tables(throughput, rerank)
    print(table)
    setup = (f"the {args.size} Qwen3-Embedding- and Qwen3-Reranker-shaped checkpoints "
             "(float32), after a warm-up request, 48-word inputs; the throughput stack's "
             f"prefix cache off; {os.cpu_count()} cores shared by the stack's three "
             "processes, or used by sentence-transformers alone")  # fmt: skip
    write_result(
        args.out,
        "Pooling: embeddings against sentence-transformers, reranking with the prefix cache",
        setup,
        table,
        {"throughput": throughput, "rerank": rerank},
    )


if __name__ == "__main__":
    main()
