"""What the router and the scheduler cost per token at GPU step rates: the real
router(s) and scheduler against the executor simulator (a load-test tool, not a
model), which answers each step after a fixed simulated step time.

    python bench/overhead_bench.py [--streams 64 256 1024] [--step-ms 8 30]
        [--routers 1] [--duration 8] [--out bench/results/overhead.md]
        [--variant 'LABEL|CHECKOUT|ROUTER FLAGS|EXECUTOR FLAGS|SCHEDULER FLAGS' ...]

Each --variant is a stack of its own, measured in the same run for a side-by-side
table: CHECKOUT another checkout of flagstop with its own .venv (a commit before a
lever; empty: this one), ROUTER FLAGS extra router flags (--stream-interval-ms 25,
--processes 2), EXECUTOR FLAGS and SCHEDULER FLAGS extra flags of those (the
simulator's speculative decoding: --speculative-config {"method":"ngram"}
--simulate-acceptance-rate 0.7, with the scheduler's
--speculative-disable-batch-size raised). --routers N is --processes N for every
variant.

Each stream is a closed loop of greedy requests (32-token prompt, 256 tokens, EOS
ignored) through the router's gRPC API. Over a window after a warm-up: delivered
tokens/s beside the ideal (every step back to back with every stream in it, streams x
1000 / step ms), tokens per step (delivered tokens / scheduler steps in the window),
CPU microseconds per delivered token of the router process(es) and of the scheduler
(their own /proc counters: the load client sharing the machine does not distort
them), TTFT p50/p99 of the requests sent in the window, and the load client's own CPU
per token, reported apart.
"""

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from bench.serve_bench import cpu_seconds
from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import ROOT, start_stack

PROMPT_TOKENS, MAX_TOKENS = 32, 256
RESULTS = Path(__file__).parent / "results"


@dataclass(slots=True)
class Window:
    """What the load saw between start and end (monotonic seconds)."""

    start: float = math.inf
    end: float = math.inf
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def open(self, now: float) -> bool:
        return self.start <= now < self.end


async def stream_loop(stub, window: Window, stop: asyncio.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = [0] + [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS - 1)]
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
        )
        sent, first = time.monotonic(), True
        try:
            async for chunk in stub.Generate(request, timeout=600):
                now = time.monotonic()
                if first and window.open(sent):
                    window.ttfts.append(now - sent)
                first = False
                if window.open(now):
                    window.tokens += len(chunk.token_ids)
        except grpc.aio.AioRpcError as e:
            window.errors.append(e.code().name)
            await asyncio.sleep(0.1)


async def drive(router: str, streams: int, args):
    """Streams over several connections, as many clients would open: router processes
    sharing a port (SO_REUSEPORT) share connections, not streams."""
    window, stop = Window(), asyncio.Event()
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(router, options=options)
                for _ in range(min(args.connections, streams))]  # fmt: skip
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    tasks = [asyncio.create_task(stream_loop(stubs[i % len(stubs)], window, stop, i))
             for i in range(streams)]  # fmt: skip
    warmup, duration = args.warmup, args.duration
    await asyncio.sleep(warmup)
    window.start = time.monotonic()
    window.end = window.start + duration
    yield window  # the caller reads the processes' counters at the window's edges
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    yield window
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in channels:
        await c.close()


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its descendants (a router's --processes)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
        todo += children.get(p, [])
    return total


def counters(stack) -> dict:
    return {
        "routers": tree_cpu_seconds(stack.processes["router"].pid),
        "scheduler": cpu_seconds(stack.processes["scheduler"].pid),
        "client": time.process_time(),
        "steps": stack.stats().step_id,
    }


async def measure(stack, variant: str, streams: int, args) -> dict:
    agen = drive(stack.router, streams, args)
    window = await agen.__anext__()
    before = counters(stack)
    await agen.__anext__()
    after = counters(stack)
    with_errors = list(window.errors)
    await agen.aclose()
    spent = {k: after[k] - before[k] for k in after}
    tokens = max(window.tokens, 1)
    ttfts = sorted(window.ttfts) or [math.nan]
    return {
        "variant": variant, "streams": streams, "step_ms": args.step_ms_now,
        "tok_s": window.tokens / args.duration,
        "ideal_tok_s": streams * 1000 / args.step_ms_now,
        "tokens_per_step": window.tokens / max(spent["steps"], 1),
        "router_us_per_token": spent["routers"] * 1e6 / tokens,
        "scheduler_us_per_token": spent["scheduler"] * 1e6 / tokens,
        "client_us_per_token": spent["client"] * 1e6 / tokens,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
        "errors": len(with_errors),
    }  # fmt: skip


def start(
    model_dir: Path, step_ms: float, max_streams: int, checkout: Path, extra: list, processes: int,
    executor_extra: list = (), scheduler_extra: list = (),
):  # fmt: skip
    """A stack on the simulator, of this checkout or another."""
    stack = start_stack(
        model_dir, Path(tempfile.mkdtemp(prefix="overhead-")), checkout=checkout,
        executor_args=["--simulate", "--simulate-base-ms", str(step_ms),
                       "--simulate-us-per-scheduled-token", "0",
                       "--simulate-us-per-context-token", "0",
                       "--max-num-seqs", str(max_streams), "--max-num-batched-tokens", "16384",
                       *executor_extra],
        scheduler_args=["--max-num-seqs", str(max_streams), "--max-num-batched-tokens", "16384",
                        "--max-waiting-requests", str(max_streams), *scheduler_extra],
        router_args=["--max-queued-requests", str(4 * max_streams), *extra],
    )  # fmt: skip
    if processes > 1:  # before the clients connect: SO_REUSEPORT spreads connections
        stack.wait_routers(processes)
    return stack


def table(rows: list[dict]) -> str:
    head = ("| variant | step (ms) | streams | tok/s | ideal tok/s | tokens / step | "
            "router CPU µs / token | scheduler CPU µs / token | TTFT p50 / p99 (ms) | "
            "client CPU µs / token | errors |")  # fmt: skip
    lines = [head, "|---|" + "---:|" * 10]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['step_ms']:g} | {r['streams']} | {r['tok_s']:.0f} | "
            f"{r['ideal_tok_s']:.0f} | {r['tokens_per_step']:.1f} | "
            f"{r['router_us_per_token']:.1f} | {r['scheduler_us_per_token']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['client_us_per_token']:.1f} | {r['errors']} |"
        )
    return "\n".join(lines)


def variants(args) -> list[tuple[str, Path, list[str], list[str], list[str]]]:
    """(label, checkout, router, executor and scheduler flags) for each --variant; one
    of this checkout without."""
    found = []
    for text in args.variant or [f"{args.label}||{args.router_args}"]:
        label, checkout, flags, executor, scheduler = [*text.split("|"), "", "", "", ""][:5]
        found.append((label, Path(checkout).resolve() if checkout else ROOT, flags.split(),
                      executor.split(), scheduler.split()))  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[8.0, 30.0])
    parser.add_argument("--routers", type=int, default=1, help="router --processes")
    parser.add_argument("--router-args", default="", help="extra router flags, quoted")
    parser.add_argument("--variant", action="append", help="'LABEL|CHECKOUT|ROUTER FLAGS'")
    parser.add_argument("--connections", type=int, default=8, help="client connections")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--label", default="", help="a name for this run in the output")
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"))
    args = parser.parse_args()
    model_dir = ROOT / "models" / "flagstop-tiny"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "tiny")
    rows = []
    for step_ms in args.step_ms:
        args.step_ms_now = step_ms
        for label, checkout, flags, executor, scheduler in variants(args):
            rows += run_variant(model_dir, label, checkout, flags, args, executor, scheduler)
    text = table(rows)
    print(text)
    write_result(
        args.out, f"Router and scheduler overhead{f': {args.label}' if args.label else ''}",
        f"the executor simulator (fixed step time), closed-loop gRPC streams of "
        f"{PROMPT_TOKENS}-token prompts and {MAX_TOKENS} tokens over {args.connections} "
        f"connections, {args.warmup:g} s warm-up, {args.duration:g} s window.",
        text, {"args": vars(args), "rows": rows},
    )  # fmt: skip


def run_variant(
    model_dir: Path, label: str, checkout: Path, flags: list[str], args,
    executor_extra: list[str] = (), scheduler_extra: list[str] = (),
) -> list:  # fmt: skip
    processes = args.routers
    if "--processes" in flags:
        processes = int(flags[flags.index("--processes") + 1])
    elif processes > 1:
        flags = [*flags, "--processes", str(processes)]
    stack = start(model_dir, args.step_ms_now, max(args.streams), checkout, flags, processes,
                  executor_extra, scheduler_extra)  # fmt: skip
    rows = []
    try:
        for streams in args.streams:
            rows.append(asyncio.run(measure(stack, label, streams, args)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            stack.wait_idle(timeout=60)
    finally:
        stack.stop()
    return rows


if __name__ == "__main__":
    main()
