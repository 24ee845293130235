"""What the router and the scheduler cost per token at GPU step rates: the real
router(s) and scheduler against the executor simulator (a load-test tool, not a
model), which answers each step after a fixed simulated step time.

    python bench/overhead_bench.py [--streams 64 256 1024] [--step-ms 8 30]
        [--routers 1] [--duration 8] [--out bench/results/overhead.md]

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
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_bench import cpu_seconds
from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import free_port, spawn, start_stack, wait_serving

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


async def drive(routers: list[str], streams: int, warmup: float, duration: float):
    window, stop = Window(), asyncio.Event()
    channels = [channel(r) for r in routers]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    tasks = [asyncio.create_task(stream_loop(stubs[i % len(stubs)], window, stop, i))
             for i in range(streams)]  # fmt: skip
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


def counters(stack, routers: list) -> dict:
    return {
        "routers": sum(cpu_seconds(p.pid) for p in routers),
        "scheduler": cpu_seconds(stack.processes["scheduler"].pid),
        "client": time.process_time(),
        "steps": stack.stats().step_id,
    }


async def measure(stack, routers: list, addresses: list[str], streams: int, args) -> dict:
    agen = drive(addresses, streams, args.warmup, args.duration)
    window = await agen.__anext__()
    before = counters(stack, routers)
    await agen.__anext__()
    after = counters(stack, routers)
    with_errors = list(window.errors)
    await agen.aclose()
    spent = {k: after[k] - before[k] for k in after}
    tokens = max(window.tokens, 1)
    ttfts = sorted(window.ttfts) or [math.nan]
    return {
        "streams": streams, "step_ms": args.step_ms_now, "routers": len(routers),
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


def start(model_dir: Path, step_ms: float, num_routers: int, max_streams: int, extra: list):
    """A stack on the simulator; extra routers on the same scheduler."""
    log_dir = Path(tempfile.mkdtemp(prefix="overhead-"))
    stack = start_stack(
        model_dir, log_dir,
        executor_args=["--simulate", "--simulate-base-ms", str(step_ms),
                       "--simulate-us-per-scheduled-token", "0",
                       "--simulate-us-per-context-token", "0",
                       "--max-num-seqs", str(max_streams), "--max-num-batched-tokens", "16384"],
        scheduler_args=["--max-num-seqs", str(max_streams), "--max-num-batched-tokens", "16384",
                        "--max-waiting-requests", str(max_streams)],
        router_args=["--max-queued-requests", str(4 * max_streams), *extra],
    )  # fmt: skip
    routers, addresses = [stack.processes["router"]], [stack.router]
    for i in range(1, num_routers):
        port = free_port()
        args = ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler", stack.scheduler,
                "--port", str(port), "--http-port", "0", "--metrics-port", "0",
                "--max-queued-requests", str(4 * max_streams), *extra]  # fmt: skip
        routers.append(spawn(f"router{i}", args, log_dir))
        addresses.append(f"127.0.0.1:{port}")
        wait_serving(stack.channel(addresses[-1]), routers[-1])
    return stack, routers, addresses


def table(rows: list[dict]) -> str:
    head = ("| step (ms) | streams | routers | tok/s | ideal tok/s | tokens / step | "
            "router CPU µs / token | scheduler CPU µs / token | TTFT p50 / p99 (ms) | "
            "client CPU µs / token | errors |")  # fmt: skip
    lines = [head, "|" + "---:|" * 11]
    for r in rows:
        lines.append(
            f"| {r['step_ms']:g} | {r['streams']} | {r['routers']} | {r['tok_s']:.0f} | "
            f"{r['ideal_tok_s']:.0f} | {r['tokens_per_step']:.1f} | "
            f"{r['router_us_per_token']:.1f} | {r['scheduler_us_per_token']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['client_us_per_token']:.1f} | {r['errors']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[8.0, 30.0])
    parser.add_argument("--routers", type=int, default=1)
    parser.add_argument("--router-args", default="", help="extra router flags, quoted")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--label", default="", help="a name for this run in the output")
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"))
    args = parser.parse_args()
    model_dir = Path("models/flagstop-tiny")
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "tiny")
    rows = []
    for step_ms in args.step_ms:
        args.step_ms_now = step_ms
        stack, routers, addresses = start(model_dir, step_ms, args.routers, max(args.streams),
                                          args.router_args.split())  # fmt: skip
        try:
            for streams in args.streams:
                rows.append(asyncio.run(measure(stack, routers, addresses, streams, args)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                stack.wait_idle(timeout=60)
        finally:
            for extra in routers[1:]:
                extra.terminate()
                extra.wait(30)
            stack.stop()
    text = table(rows)
    print(text)
    label = f" ({args.label})" if args.label else ""
    Path(args.out).with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}))
    Path(args.out).write_text(
        f"# Router and scheduler overhead{label}\n\n`python bench/overhead_bench.py "
        f"{' '.join(sys.argv[1:])}` on {date.today()}, {os.cpu_count()} CPU cores: the "
        f"executor simulator (fixed step time), closed-loop gRPC streams of "
        f"{PROMPT_TOKENS}-token prompts and {MAX_TOKENS} tokens, {args.warmup:g} s warm-up, "
        f"{args.duration:g} s window.\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
