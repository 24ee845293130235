"""What the router and the scheduler cost per token at GPU step rates: the real
router(s) and scheduler against the executor simulator (a load-test tool, not a
model), which answers each step after a fixed simulated step time.

    python bench/overhead_bench.py [--streams 64 256 1024] [--step-ms 8 30]
        [--routers 1] [--duration 8] [--out bench/results/overhead.md]
        [--variant 'LABEL|CHECKOUT|ROUTER FLAGS|EXECUTOR FLAGS|SCHEDULER FLAGS' ...]
        [--front grpc openai] [--floor grpcio native] [--profile DIR] [--rounds 1]

--front openai drives the same load through the OpenAI API (SSE; each event with the
usage so far, which costs the router a little per event); --floor adds rows of
bench/grpc_floor.py (the transport alone, same client) and, per row, the router's CPU
per token over the floor's of the same gRPC server and round; --rounds N starts every stack at
once and measures all rows in turn N times, the table showing medians (the ratio's
range beside it: run minutes apart, the floor and the router differ by the machine's drift as
much as by the router's work); --profile (first round) splits the router's
and the scheduler's CPU by part (py-spy, bench/profile_split.py).

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
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import profile_split
from bench.output import write_result
from bench.serve_bench import cpu_seconds
from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import ROOT, free_port, python, start_stack

PROMPT_TOKENS, MAX_TOKENS = 32, 256
RESULTS = Path(__file__).parent / "results"


@dataclass(slots=True)
class Window:
    """What the load saw between start and end (monotonic seconds)."""

    start: float = math.inf
    end: float = math.inf
    tokens: int = 0
    messages: int = 0
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
                    window.messages += 1
        except grpc.aio.AioRpcError as e:
            window.errors.append(e.code().name)
            await asyncio.sleep(0.1)


async def sse_loop(http: str, model: str, window: Window, stop: asyncio.Event, seed: int) -> None:
    """The same closed loop through the OpenAI front: /v1/completions streamed as SSE
    over a kept-alive HTTP/1.1 connection, read with asyncio's own streams (a client
    library would cost the shared machine more than the router does). Each event
    carries the usage so far (vLLM's continuous_usage_stats): its tokens, exactly."""
    rng, (host, port) = random.Random(seed), http.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        while not stop.is_set():
            prompt = [0] + [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS - 1)]
            options = {"include_usage": True, "continuous_usage_stats": True}
            body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": options}).encode()  # fmt: skip
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))  # fmt: skip
            await read_sse(reader, window, time.monotonic())
    finally:
        writer.close()


async def read_sse(reader: asyncio.StreamReader, window: Window, sent: float) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        window.errors.append(head.split(b"\r\n", 1)[0].decode())
        raise ConnectionError(head[:200])
    seen, first = 0, True
    while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):  # chunked
        data = await reader.readexactly(size + 2)
        now = time.monotonic()
        if first and window.open(sent):
            window.ttfts.append(now - sent)
        first = False
        for event in data.split(b"\n\n"):
            if event.startswith(b"data: {") and b'"choices":[]' not in event:
                so_far = json.loads(event[6:])["usage"]["completion_tokens"]
                if window.open(now):
                    window.tokens += so_far - seen
                    window.messages += 1
                seen = so_far
    await reader.readexactly(2)


async def drive(router: str, streams: int, args):
    """Streams over several connections, as many clients would open: router processes
    sharing a port (SO_REUSEPORT) share connections, not streams."""
    window, stop = Window(), asyncio.Event()
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(router, options=options)
                for _ in range(min(args.connections, streams))]  # fmt: skip
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    if args.front_now == "openai":
        tasks = [asyncio.create_task(sse_loop(router, args.model_name, window, stop, i))
                 for i in range(streams)]  # fmt: skip
    else:
        tasks = [asyncio.create_task(stream_loop(stubs[i % len(stubs)], window, stop, i))
                 for i in range(streams)]  # fmt: skip
    try:
        await asyncio.sleep(args.warmup)
        window.start = time.monotonic()
        window.end = window.start + args.duration
        yield window  # the caller reads the processes' counters at the window's edges
        await asyncio.sleep(max(0.0, window.end - time.monotonic()))
        yield window
    finally:  # the caller's aclose(): the streams end before the next row's start
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
    floor = isinstance(stack, FloorStack)
    return {
        "routers": tree_cpu_seconds(stack.processes["router"].pid),
        "scheduler": 0.0 if floor else cpu_seconds(stack.processes["scheduler"].pid),
        "client": time.process_time(),
        "steps": stack.steps() if floor else stack.stats().step_id,
    }


class FloorStack:
    """bench/grpc_floor.py in a stack's place: its CPU is the router column, its steps
    come on a timer."""

    def __init__(self, kind: str, step_ms: float, checkout: Path) -> None:
        port = free_port()
        self.router, self.step_s = f"127.0.0.1:{port}", step_ms / 1000
        command = [python(checkout), str(ROOT / "bench" / "grpc_floor.py"),
                   "--server", kind, "--port", str(port), "--step-ms", str(step_ms)]  # fmt: skip
        self.processes = {"router": subprocess.Popen(command)}
        channel = grpc.insecure_channel(self.router)
        grpc.channel_ready_future(channel).result(timeout=60)
        channel.close()

    def steps(self) -> int:
        return int(time.monotonic() / self.step_s)

    def wait_idle(self, timeout: float) -> None:
        time.sleep(0.5)

    def stop(self) -> None:
        self.processes["router"].terminate()
        self.processes["router"].wait(30)


async def measure(stack, variant: str, streams: int, args) -> dict:
    agen = drive(stack.http if args.front_now == "openai" else stack.router, streams, args)
    window = await agen.__anext__()
    before = counters(stack)
    spies = profile(stack, variant, streams, args)
    await agen.__anext__()
    after = counters(stack)
    for spy in spies.values():
        spy.wait()
    with_errors = list(window.errors)
    await agen.aclose()
    spent = {k: after[k] - before[k] for k in after}
    tokens = max(window.tokens, 1)
    ttfts = sorted(window.ttfts) or [math.nan]
    return {
        "variant": variant, "front": args.front_now, "streams": streams,
        "step_ms": args.step_ms_now,
        "tok_s": window.tokens / args.duration,
        "ideal_tok_s": streams * 1000 / args.step_ms_now,
        "tokens_per_step": window.tokens / max(spent["steps"], 1),
        "tokens_per_message": window.tokens / max(window.messages, 1),
        "router_us_per_token": spent["routers"] * 1e6 / tokens,
        "scheduler_us_per_token": spent["scheduler"] * 1e6 / tokens,
        "client_us_per_token": spent["client"] * 1e6 / tokens,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3,
        "errors": len(with_errors),
        **({"profile": {name: profile_split.split(profile_files(variant, streams, args)[name],
                                                 PARTS[name]) for name in spies}}
           if spies else {}),
    }  # fmt: skip


PARTS = {"router": profile_split.ROUTER_PARTS, "scheduler": profile_split.SCHEDULER_PARTS}


def profile_files(variant: str, streams: int, args) -> dict[str, Path]:
    slug = "".join(c if c.isalnum() else "-" for c in variant)
    return {name: Path(args.profile) / f"{slug}-{streams}-{args.step_ms_now:g}ms.{name}.txt"
            for name in PARTS}  # fmt: skip


def profile(stack, variant: str, streams: int, args) -> dict:
    """--profile: py-spy on the router and the scheduler for the window."""
    if not args.profile_now:
        return {}
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    files = profile_files(variant, streams, args)
    return {name: profile_split.record(stack.processes[name].pid, args.duration - 0.5, path)
            for name, path in files.items() if name in stack.processes}  # fmt: skip


def profile_rows(rows: list[dict]) -> list[dict]:
    us = {"router": "router_us_per_token", "scheduler": "scheduler_us_per_token"}
    return [{"variant": r["variant"], "streams": r["streams"], "process": name,
             "us_per_token": r[us[name]], "split": shares}
            for r in rows for name, shares in r.get("profile", {}).items()]  # fmt: skip


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
            "tokens / message | router CPU µs / token | router / its server's floor | "
            "scheduler CPU µs / token | TTFT p50 / p99 (ms) | client CPU µs / token | "
            "errors |")  # fmt: skip
    lines = [head, "|---|" + "---:|" * 12]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['step_ms']:g} | {r['streams']} | {r['tok_s']:.0f} | "
            f"{r['ideal_tok_s']:.0f} | {r['tokens_per_step']:.1f} | "
            f"{r.get('tokens_per_message', math.nan):.2f} | "
            f"{r['router_us_per_token']:.1f} | {vs_floor(r)} | "
            f"{r['scheduler_us_per_token']:.1f} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['client_us_per_token']:.1f} | {r['errors']} |"
        )
    return "\n".join(lines)


def vs_floor(row: dict) -> str:
    """The router's CPU per token over its gRPC server's floor's of the same round
    (median, range)."""
    if math.isnan(ratio := row.get("vs_floor", math.nan)):
        return ""
    spread = row.get("vs_floor_range")
    return f"{ratio:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")


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
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every row this many times, interleaved; medians",
    )
    parser.add_argument(
        "--front",
        nargs="+",
        default=["grpc"],
        choices=["grpc", "openai"],
        help="the load through the gRPC API, the OpenAI HTTP API or both",
    )
    parser.add_argument(
        "--floor",
        nargs="*",
        default=[],
        choices=["grpcio", "native"],
        help="rows of bench/grpc_floor.py on these servers, same client",
    )
    parser.add_argument(
        "--profile",
        default="",
        metavar="DIR",
        help="py-spy the router and scheduler in each window: raw stacks "
        "in DIR, the split by part under the table",
    )
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"))
    args = parser.parse_args()
    model_dir = ROOT / "models" / "flagstop-tiny"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "tiny")
    rows = asyncio.run(run_all(model_dir, args))
    text = table(summary(rows))
    if split := profile_rows([r for r in rows if r["round"] == 0]):
        text += "\n\nWhere the CPU per token goes (py-spy, bench/profile_split.py):\n\n"
        text += profile_split.table(split)
    print(text)
    rounds = f", the median of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    write_result(
        args.out, f"Router and scheduler overhead{f': {args.label}' if args.label else ''}",
        f"the executor simulator (fixed step time), closed-loop gRPC streams of "
        f"{PROMPT_TOKENS}-token prompts and {MAX_TOKENS} tokens over {args.connections} "
        f"connections, {args.warmup:g} s warm-up, {args.duration:g} s window{rounds}.",
        text, {"args": vars(args), "rows": rows},
    )  # fmt: skip


async def run_all(model_dir: Path, args) -> list[dict]:
    """Every step time's rows in one event loop: grpc.aio's client binds its poller to
    the first loop it meets, and a later asyncio.run's would find it closed."""
    rows = []
    for step_ms in args.step_ms:
        args.step_ms_now = step_ms
        rows += await run_rounds(model_dir, args)
    return rows


async def run_rounds(model_dir: Path, args) -> list[dict]:
    """Every floor and variant of one step time, all started at once and measured in
    turn, --rounds times: a round puts each row beside the floor minutes apart at
    most, where these machines swing between runs by more than the gap measured."""
    stacks = []
    try:
        for kind in args.floor:
            stacks.append((f"grpc floor ({kind})", FloorStack(kind, args.step_ms_now, ROOT),
                           ["grpc"], kind))  # fmt: skip
        for label, checkout, flags, executor, scheduler in variants(args):
            server = "native" if "native" in flags else "grpcio"  # --grpc-server's
            stacks.append((label, start_variant(model_dir, checkout, flags, args, executor,
                                                scheduler), args.front, server))  # fmt: skip
        return [row for i in range(args.rounds) for row in await one_round(stacks, i, args)]
    finally:
        for _, stack, *_ in stacks:
            stack.stop()


async def one_round(stacks: list, index: int, args) -> list[dict]:
    rows = []
    for front in args.front:
        args.front_now = front
        for streams in args.streams:
            for label, stack, fronts, server in stacks:
                if front not in fronts:
                    continue
                name = label if front == "grpc" else f"{label} (OpenAI SSE)"
                args.profile_now = args.profile if index == 0 else ""
                rows.append({**await measure(stack, name, streams, args),
                             "round": index, "server": server})  # fmt: skip
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                stack.wait_idle(timeout=60)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per variant, front, step time and streams: the median over rounds of each
    figure, and of the round's router CPU per token over the floor's of its gRPC
    server (the gRPC front's rows)."""
    floor = {(r["round"], r["step_ms"], r["streams"], r["server"]): r["router_us_per_token"]
             for r in rows if r["variant"].startswith("grpc floor")}  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["front"], r["step_ms"], r["streams"]), []).append(r)
    out = []
    for group in groups.values():
        first = group[0]
        row = {k: statistics.median(r[k] for r in group) if isinstance(v, float) else v
               for k, v in first.items() if k not in ("profile", "round", "server")}  # fmt: skip
        keys = [(r["round"], r["step_ms"], r["streams"], r["server"]) for r in group]
        ratios = [r["router_us_per_token"] / floor[key] for r, key in zip(group, keys, strict=True)
                  if r["front"] == "grpc" and key in floor]  # fmt: skip
        row["errors"] = sum(r["errors"] for r in group)
        row["vs_floor"] = statistics.median(ratios) if ratios else math.nan
        row["vs_floor_range"] = (min(ratios), max(ratios)) if len(ratios) > 1 else None
        out.append(row)
    return out


def start_variant(
    model_dir: Path, checkout: Path, flags: list[str], args,
    executor_extra: list[str] = (), scheduler_extra: list[str] = (),
):  # fmt: skip
    processes = args.routers
    if "--processes" in flags:
        processes = int(flags[flags.index("--processes") + 1])
    elif processes > 1:
        flags = [*flags, "--processes", str(processes)]
    stack = start(model_dir, args.step_ms_now, max(args.streams), checkout, flags, processes,
                  executor_extra, scheduler_extra)  # fmt: skip
    info = stack.generation().GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    args.model_name = info.model.model_name
    return stack


if __name__ == "__main__":
    main()
