"""Does the replay lab predict a running stack? The same trace slice replayed twice:
on flagstop-replay's virtual clock, and in real time against the whole stack (router,
scheduler, the executor simulator) by a gRPC client sending each request at its
arrival; their TTFT and TPOT side by side.

    python bench/replay_check.py [--requests 300] [--load 0.5] [--out bench/results/replay_check.md]

The virtual clock has no router, no gRPC, no pipelining of two steps and no step the
machine runs late: what it leaves out is what the comparison measures. Stated
tolerance (the check's verdict): the stack's TTFT p50 within 25 % or 15 ms of the
prediction, its TPOT p50 within 20 %, SLO attainment within 5 points.
"""

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from bench.slo_bench import TRACES, capacity_rps, rate_rps
from flagstop.replay import (
    Replay,
    TraceRequest,
    load_trace,
    percentile,
    prompt_of,
    replay_config,
    report,
    scaled,
)
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import start_stack

TTFT_MS, TPOT_MS = 1000.0, 50.0
MAX_MODEL_LEN = 16384
NUM_BLOCKS = 65536


def stack_config(model_dir: Path, out: Path) -> Path:
    """The embedded model's files with a long context: the simulator reads only its
    config (vocabulary, EOS, length)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (out / "config.json").write_text(json.dumps(config))
    return out


async def drive(address: str, trace: list[TraceRequest], vocab: int) -> list[tuple]:
    """Each request at its arrival, with its tenant: (arrival, first token, end,
    tokens) in seconds, in the trace's order."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter() + 0.5

        async def one(i: int, r: TraceRequest) -> tuple:
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=[t % vocab for t in prompt_of(r, i)],
                max_tokens=r.output_tokens, ignore_eos=True, tenant=r.tenant,
            )  # fmt: skip
            sent, first, num = time.perf_counter(), 0.0, 0
            async for chunk in stub.Generate(request, timeout=600):
                first = first or time.perf_counter()
                num += len(chunk.token_ids)
            return sent - start, first - start, time.perf_counter() - start, num

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))


def azure_trace(num_requests: int, load: float) -> list[TraceRequest]:
    """The first requests of the Azure conversation trace that fit the context, at
    load x the simulator's capacity."""
    trace = [r for r in load_trace(TRACES / "azure_llm_2023_conv.csv")
             if r.prompt_tokens + r.output_tokens <= MAX_MODEL_LEN][:num_requests]  # fmt: skip
    return scaled(trace, load * capacity_rps(trace) / rate_rps(trace))


def run_on_stack(model_dir: Path, logs: Path, trace: list[TraceRequest],
                 scheduler_flags: list[str]) -> list[tuple]:  # fmt: skip
    """The trace driven in real time through router, scheduler and the executor
    simulator with the replay's limits (drive's rows)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    stack = start_stack(
        model_dir, logs,
        executor_args=["--simulate", "--max-num-batched-tokens", "8192",
                       "--simulate-num-blocks", str(NUM_BLOCKS)],
        scheduler_args=[*scheduler_flags, "--max-num-batched-tokens", "8192",
                        "--max-num-seqs", "256", "--max-waiting-requests", "4096"],
        router_args=["--max-queued-requests", "8192"],
    )  # fmt: skip
    try:
        return asyncio.run(drive(stack.router, trace, vocab))
    finally:
        stack.stop()


def summary(rows: list[tuple]) -> dict:
    ttft = [(f - a) * 1e3 for a, f, _, _ in rows]
    tpot = [(e - f) * 1e3 / (n - 1) for _, f, e, n in rows if n > 1]
    good = sum((f - a) * 1e3 <= TTFT_MS and (n < 2 or (e - f) * 1e3 / (n - 1) <= TPOT_MS)
               for a, f, e, n in rows)  # fmt: skip
    return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
            "attainment": good / len(rows)}  # fmt: skip


def within_tolerance(virtual: dict, real: dict) -> bool:
    """The stated tolerance: the stack's TTFT p50 within 25 % or 15 ms of the
    prediction, its TPOT p50 within 20 %, SLO attainment within 5 points."""
    return (abs(real["ttft_p50_ms"] - virtual["ttft_p50_ms"])
            <= max(15.0, 0.25 * virtual["ttft_p50_ms"])
            and abs(real["tpot_p50_ms"] - virtual["tpot_p50_ms"]) <= 0.2 * virtual["tpot_p50_ms"]
            and abs(real["attainment"] - virtual["attainment"]) <= 0.05)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--load", type=float, default=0.5, help="x the simulator's capacity")
    parser.add_argument("--policy", default="fcfs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "replay_check.md"))  # fmt: skip
    args = parser.parse_args()
    trace = azure_trace(args.requests, args.load)
    config = replay_config(args.policy, max_model_len=MAX_MODEL_LEN,
                           max_num_batched_tokens=8192, max_num_seqs=256)  # fmt: skip
    virtual = report(Replay(trace, config, NUM_BLOCKS, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS).run())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = stack_config(write_model(tmp / "tiny", "tiny"), tmp / "long")
        real = summary(run_on_stack(model_dir, tmp / "logs", trace, ["--policy", args.policy]))
    rows = []
    for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                       ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
                       ("attainment", "SLO attained")):  # fmt: skip
        v, r = virtual[key], real[key]
        rows.append(f"| {label} | {v:.3g} | {r:.3g} | {(r - v) / v:+.0%} |")
    verdict = "within" if within_tolerance(virtual, real) else "NOT within"
    table = "\n".join(["| | virtual clock (flagstop-replay) | real time (the stack) | "
                       "difference |", "|---|---:|---:|---:|", *rows])  # fmt: skip
    print(table, f"\n{verdict} the stated tolerance")
    Path(args.out).write_text(
        f"# The replay's prediction against a running stack\n\n`python bench/replay_check.py "
        f"--requests {args.requests} --load {args.load}` on {date.today()}: the first "
        f"{len(trace)} requests of the Azure conversation trace at {args.load}x the "
        f"simulator's capacity, policy {args.policy}, replayed on the virtual clock and in "
        "real time against router, scheduler and the executor simulator (same cost model, "
        f"same scheduler limits).\n\n{table}\n\nVerdict: {verdict} the stated tolerance "
        "(TTFT p50 within 25 % or 15 ms, TPOT p50 within 20 %, attainment within 5 "
        "points).\n"
    )


if __name__ == "__main__":
    main()
