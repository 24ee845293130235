"""Agent sessions against other traffic: retention against plain LRU, side by side.

    python bench/session_bench.py [--part replay|simulator|cpu|all] [--size small]

The workload (`agent_sessions`): sessions of 10-50 turns. Each turn's prompt is the
session so far (a system prompt and tool definitions every session shares, the task,
every earlier turn's tool result and answer) plus a new tool result; the next turn
comes a tool call's gap after the turn ends. Gaps are lognormal, median 6 s, sigma
1.1 (99th percentile about 80 s): most tool calls take seconds, some (a build, a
search, a person) minutes. Tool results are lognormal (median 250 tokens), answers
uniform 20-300 tokens. Other traffic beside them: the Azure LLM inference 2023
conversation trace (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024), at 0.8, 1.0
and 1.2x the engine's capacity for it (its completions a second when a sample
arrives at once).

Three variants: plain LRU (no retention at all), the agent's client asking retention
for each turn (prompt_cache_retention: priority 50, 5 minutes), and no ask with the
slo policy retaining session turns itself (the policy contract, docs/sessions.md).

Three ways of running it:
- replay: flagstop-replay's virtual clock through the real scheduler core, each step
  timed by the executor simulator's cost model (an 8B model on an H200); each session
  closed loop there too (the workload record's after_s).
- simulator: real processes (router, scheduler, the executor simulator, a load-test
  tool) in real time, gaps scaled down (--time-scale), each session closed loop.
- cpu: the same on the real embedded model on this machine's CPU, small shapes.

Per variant: the session turns' cached-token share, prompt tokens computed (all
traffic), and the session turns' TTFT p50/p99; the other traffic's TTFT p99."""

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
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
from flagstop.scheduler_svc.core.request import Retention
from flagstop.scheduler_svc.core.session_retention import SESSION_PRIORITY, SESSION_TTL_S

RESULTS = Path(__file__).parent / "results"
GAP_MEDIAN_S, GAP_SIGMA = 6.0, 1.1
BLOCK = 512  # the replay's block of ids (TRACE_BLOCK_TOKENS)
VARIANTS = {  # label: (client asks retention, retention share, policy)
    "LRU": (False, 0.0, "fcfs"),
    "retention (client asks)": (True, 0.5, "fcfs"),
    "retention (slo policy)": (False, 0.5, "slo"),
}
ASKED = Retention(SESSION_PRIORITY, SESSION_TTL_S)


@dataclass(frozen=True, slots=True)
class Shape:
    """A workload's sizes: the shared system prompt, each session's task, a tool
    result's median, answers' range, turns' range, sessions."""

    system: int
    task: int
    tool_median: int
    answer: tuple[int, int]
    turns: tuple[int, int]
    sessions: int
    start_spread_s: float  # sessions start uniformly over this


SHAPES = {
    "replay": Shape(2048, 512, 250, (20, 300), (10, 50), 24, 30.0),
    "simulator": Shape(1024, 512, 150, (20, 300), (10, 20), 8, 10.0),
    "cpu": Shape(96, 32, 24, (4, 12), (10, 16), 4, 1.0),
}


def agent_sessions(shape: Shape, seed: int = 0, time_scale: float = 1.0) -> list[TraceRequest]:
    """Every turn of every session in the workload record's terms: a session's first
    turn at its start, each later one closed loop (after_s: its tool call's gap after
    the turn before ended); equal block ids where the session's text is equal."""
    rng = random.Random(seed)
    turns = []
    for s in range(shape.sessions):
        length = shape.system + shape.task
        start, after = rng.uniform(0, shape.start_spread_s) * time_scale, None
        for _ in range(rng.randint(*shape.turns)):
            length += min(10 * shape.tool_median, max(8, round(rng.lognormvariate(
                math.log(shape.tool_median), 1.0))))  # fmt: skip
            answer = rng.randint(*shape.answer)
            turns.append(TraceRequest(start, length, answer, _block_ids(shape, s, length),
                                      "agents", session=f"session-{s}", after_s=after))  # fmt: skip
            length += answer
            after = gap_s(rng) * time_scale
    return turns


def span_s(turns: list[TraceRequest]) -> float:
    """When the last session should end, unloaded (50 ms + 30 ms an answer token a
    turn): how long the other traffic runs."""
    ends: dict[str, float] = {}
    for r in turns:
        begun = ends.get(r.session, r.arrival_s) + (r.after_s or 0.0)
        ends[r.session] = begun + 0.05 + 0.03 * r.output_tokens
    return max(ends.values(), default=0.0)


def gap_s(rng: random.Random) -> float:
    return rng.lognormvariate(math.log(GAP_MEDIAN_S), GAP_SIGMA)


def _block_ids(shape: Shape, session: int, length: int) -> tuple[int, ...]:
    """The shared system prompt's blocks, then the session's own."""
    shared = shape.system // BLOCK
    return tuple(i + 1 if i < shared else (session + 1) * 1_000_000 + i
                 for i in range(length // BLOCK))  # fmt: skip


def with_retention(turns: list[TraceRequest], asked: bool) -> list[TraceRequest]:
    return [replace(r, retention=ASKED if asked else None) for r in turns]


def other_traffic(load: float, duration_s: float, limit: int) -> list[TraceRequest]:
    """The Azure conversation trace at load x its capacity, over duration_s."""
    trace = [r for r in load_trace(TRACES / "azure_llm_2023_conv.csv")
             if r.prompt_tokens + r.output_tokens <= 16384][:limit]  # fmt: skip
    trace = scaled(trace, load * capacity_rps(trace) / rate_rps(trace))
    out, offset = [], 0.0
    while trace and offset < duration_s:  # the sample again, until the sessions end
        out += [replace(r, arrival_s=r.arrival_s + offset, tenant="other") for r in trace
                if r.arrival_s + offset < duration_s]  # fmt: skip
        offset += trace[-1].arrival_s + 1e-3
    return out


# -- replay ----------------------------------------------------------------------------


def replay_rows(args) -> list[dict]:
    turns = agent_sessions(SHAPES["replay"], args.seed)
    duration = span_s(turns)
    rows = []
    for load in args.loads:
        others = other_traffic(load, duration, args.limit)
        for label, (asked, share, policy) in VARIANTS.items():
            trace = sorted(with_retention(turns, asked) + others, key=lambda r: r.arrival_s)
            config = replay_config(policy, retention_share=share, no_shed=True)
            served = Replay(trace, config, args.num_blocks).run()
            rows.append({"run": "replay", "load": load, "variant": label,
                         **replay_summary(served)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def replay_summary(replay: Replay) -> dict:
    r = report(replay)
    other = [s.ttft for s in replay.served.values() if s.end_s and not s.session]
    return {"cached_share": r["session_cached_share"], "prefill_tokens": r["prefill_tokens"],
            "turn_ttft_p50_ms": r["session_ttft_p50_ms"],
            "turn_ttft_p99_ms": r["session_ttft_p99_ms"],
            "other_ttft_p99_ms": percentile(other, 99),
            "turns": sum(1 for s in replay.served.values() if s.session)}  # fmt: skip


# -- a running stack -------------------------------------------------------------------


async def drive(stack, turns: list[TraceRequest], others: list[TraceRequest], asked: bool,
                vocab: int, system: int = 0) -> dict:  # fmt: skip
    """Each session closed loop (a turn, its gap, the next), the other traffic at its
    arrivals; usage's cached tokens and the client's TTFT per request. system: the
    shared system prompt's tokens."""
    import grpc

    from flagstop.v1 import generation_pb2, generation_pb2_grpc

    by_session: dict[str, list[tuple[int, TraceRequest]]] = {}
    for i, r in enumerate(turns):
        by_session.setdefault(r.session, []).append((i, r))
    rows: list[tuple[bool, float, int, int]] = []  # (session turn, TTFT, prompt, cached)

    async with grpc.aio.insecure_channel(stack.router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter() + 0.2

        async def one(r: TraceRequest, prompt: list[int]) -> list[int]:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=[t % vocab for t in prompt],
                max_tokens=r.output_tokens, ignore_eos=True, session_id=r.session,
            )  # fmt: skip
            if asked and r.session:
                request.retention.priority, request.retention.ttl_s = ASKED.priority, ASKED.ttl_s
            sent, first, cached, answer = time.perf_counter(), 0.0, 0, []
            async for chunk in stub.Generate(request, timeout=600):
                first = first or time.perf_counter()
                answer += chunk.token_ids
                cached = chunk.usage.cached_tokens if chunk.HasField("usage") else cached
            rows.append((bool(r.session), first - sent, len(prompt), cached))
            return answer

        async def session(entries: list[tuple[int, TraceRequest]]) -> None:
            """Each turn resends the session so far, the answers as the model gave
            them, and a new tool result."""
            await asyncio.sleep(max(0.0, start + entries[0][1].arrival_s - time.perf_counter()))
            context, fresh = [], session_tokens(entries[0][1].session, system, vocab)
            for _, r in entries:
                await asyncio.sleep(r.after_s or 0.0)
                context += [next(fresh) for _ in range(r.prompt_tokens - len(context))]
                context += await one(r, context)

        async def other(i: int, r: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
            await one(r, prompt_of(r, len(turns) + i))

        await asyncio.gather(*(session(e) for e in by_session.values()),
                             *(other(i, r) for i, r in enumerate(others)))  # fmt: skip
    turn_rows = [row for row in rows if row[0]]
    ttfts = [row[1] * 1e3 for row in turn_rows]
    return {"cached_share": sum(r[3] for r in turn_rows) / max(1, sum(r[2] for r in turn_rows)),
            "prefill_tokens": sum(r[2] - r[3] for r in rows),
            "turn_ttft_p50_ms": percentile(ttfts, 50), "turn_ttft_p99_ms": percentile(ttfts, 99),
            "other_ttft_p99_ms": percentile([r[1] * 1e3 for r in rows if not r[0]], 99),
            "turns": len(turn_rows)}  # fmt: skip


STACKS = {  # backend: (executor flags, step budget, pool blocks of 16, other traffic's shape)
    "simulator": (["--simulate"], 8192, 4096, None),
    "cpu": ([], 2048, 192, (160, 4)),
}


def stack_rows(backend: str, model_dir: Path, tmp: Path, args) -> list[dict]:
    from tools.stack import start_stack

    executor_flags, budget, num_blocks, other_shape = STACKS[backend]
    shape = SHAPES[backend]
    turns = agent_sessions(shape, args.seed, args.time_scale)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rows, rate = [], None
    for label, (asked, share, policy) in VARIANTS.items():
        pool = ["--simulate-num-blocks" if backend == "simulator" else "--num-blocks",
                str(num_blocks)]  # fmt: skip
        stack = start_stack(model_dir, tmp / f"{backend}-{len(rows)}",
                            executor_args=[*executor_flags, *pool,
                                           "--max-num-batched-tokens", str(budget)],
                            scheduler_args=["--policy", policy, "--retention-share", str(share),
                                            "--no-shed", "--max-waiting-requests", "4096",
                                            "--max-num-batched-tokens", str(budget)],
                            router_args=["--max-queued-requests", "8192"])  # fmt: skip
        try:
            # Once, on the first stack: every variant meets the same other traffic.
            rate = rate or calibrate(stack, other_shape, vocab) * args.stack_load
            duration = span_s(turns)
            others = poisson_others(rate, duration, other_shape, args.seed)
            result = asyncio.run(drive(stack, turns, others, asked, vocab, shape.system))
        finally:
            stack.stop(10)
        rows.append({"run": backend, "load": args.stack_load, "variant": label, **result})
        print(rows[-1], flush=True)
    return rows


def session_tokens(session: str, system: int, vocab: int) -> Iterator[int]:
    """A session's new tokens: the shared system prompt's, then its own (its task and
    tool results)."""
    shared, own = random.Random("system"), random.Random(session)
    yield from (shared.randrange(3, vocab) for _ in range(system))
    while True:
        yield own.randrange(3, vocab)


def poisson_others(rate: float, duration: float, shape, seed: int) -> list[TraceRequest]:
    """Other traffic at rate a second: the Azure trace's shapes (or a fixed small one
    on the CPU), Poisson arrivals."""
    rng = random.Random(seed + 1)
    sample = load_trace(TRACES / "azure_llm_2023_conv.csv")[:2000] if shape is None else None
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        r = rng.choice(sample) if sample else TraceRequest(0.0, *shape)
        out.append(TraceRequest(t, min(8192, r.prompt_tokens), min(512, r.output_tokens)))


def calibrate(stack, shape, vocab: int, num: int = 48) -> float:
    """The stack's capacity for the other traffic: completions a second of a burst."""
    others = [replace(r, arrival_s=0.0) for r in poisson_others(1e3, num / 1e3, shape, 7)]
    began = time.perf_counter()
    asyncio.run(drive(stack, [], others, False, vocab))
    return len(others) / (time.perf_counter() - began)


def table(rows: list[dict]) -> str:
    lines = ["| run | other traffic | variant | session turns' cached share | prompt tokens "
             "computed | turn TTFT p50 ms | turn TTFT p99 ms | other TTFT p99 ms |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['run']} | {r['load']}x | {r['variant']} | {r['cached_share']:.1%} | "
                     f"{r['prefill_tokens']:,} | {r['turn_ttft_p50_ms']:.0f} | "
                     f"{r['turn_ttft_p99_ms']:.0f} | {r['other_ttft_p99_ms']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["replay", "simulator", "cpu", "all"], default="all")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    parser.add_argument("--limit", type=int, default=3000, help="Azure requests sampled")
    parser.add_argument("--num-blocks", type=int, default=32768,
                        help="the replay's pool (blocks of 16)")  # fmt: skip
    parser.add_argument("--stack-load", type=float, default=0.8)
    parser.add_argument("--time-scale", type=float, default=0.1,
                        help="the stacks' gaps and starts, x real")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "sessions.md"))
    args = parser.parse_args()
    rows = []
    if args.part in ("replay", "all"):
        rows += replay_rows(args)
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("simulator", "cpu"):
            if args.part in (backend, "all"):
                rows += stack_rows(backend, model_for(backend, Path(tmp)), Path(tmp), args)
    setup = (
        f"{SHAPES['replay'].sessions} agent sessions (replay; {SHAPES['simulator'].sessions} "
        f"on the simulator stack, {SHAPES['cpu'].sessions} small ones on the CPU) beside other "
        f"traffic (the Azure conversation trace; on the CPU, 160-token prompts) at the load "
        f"shown. Replay: pool {args.num_blocks} blocks of 16, virtual clock, the cost model of "
        f"an 8B model on an H200. Stacks: real processes, gaps x{args.time_scale}, the other "
        f"traffic's rate from a burst's completions a second; the simulator is a load-test "
        f"tool, the cpu rows run the embedded model. LRU: --retention-share 0; the client "
        f"asks priority {ASKED.priority} for {ASKED.ttl_s:.0f} s; the slo policy retains "
        f"session turns itself (no ask)."
    )  # fmt: skip
    write_result(args.out, "Agent sessions: retention against plain LRU", setup, table(rows),
                 {"rows": rows})  # fmt: skip
    print(table(rows))


def model_for(backend: str, tmp: Path) -> Path:
    """The embedded model (its config alone for the simulator, with a long context)."""
    from bench.kv_tier_bench import long_context_config
    from tools.make_model import write_model

    model_dir = tmp / "tiny" if (tmp / "tiny").exists() else write_model(tmp / "tiny", "tiny")
    return model_dir if backend == "cpu" else long_context_config(model_dir, tmp / "long")


if __name__ == "__main__":
    main()
