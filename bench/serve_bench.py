"""Online serving benchmark through the router's public APIs, in the manner of
`vllm bench serve`: latency and throughput at given request rates.

    python bench/serve_bench.py --router 127.0.0.1:50051 [--num-prompts 64]
        [--request-rate 2 4 inf] [--burstiness 1.0] [--max-concurrency N]
        [--slo-ttft-ms 1000] [--slo-tpot-ms 100] [--json bench/results/serve.json]
    python bench/serve_bench.py --backend openai --router 127.0.0.1:8000 ...
    python bench/serve_bench.py --size tiny --backend grpc openai ...   # a stack of its own
    python bench/serve_bench.py --backend openai --checkout 'before=/tmp/before' \
        --checkout 'after=' ...   # a stack per checkout (its own .venv), one table

--backend grpc: flagstop.v1.Generation/Generate; openai: POST /v1/completions with
stream=true, Server-Sent Events parsed as they arrive (TTFT at the first chunk with
text, the token count from the final usage chunk). With a stack of its own, every
backend runs on the same stack and load, and the router's CPU time per delivered
token (from /proc, the router process's own counters) is reported beside each.

Arrivals are Poisson at each rate (gamma with shape --burstiness: < 1 burstier, > 1
more even; inf sends all at t=0). Prompts and output lengths are the seeded skewed
workload of bench/peers.py, greedy with EOS ignored so every run asks the same work.
TTFT: send to first token; TPOT: (latency - TTFT) / (output tokens - 1); ITL: the
gaps between streamed chunks; goodput: requests/s that met both SLOs.
"""

import argparse
import asyncio
import contextlib
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
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peers import workload
from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import ROOT, start_stack

RESULTS = Path(__file__).parent / "results"


@dataclass(slots=True)
class RequestRecord:
    ttft: float = math.nan
    latency: float = math.nan
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_gaps(num: int, rate: float, burstiness: float, seed: int = 0) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1 / (rate * burstiness)) for _ in range(num)]


async def grpc_request(stub, prompt: list[int], max_tokens: int) -> RequestRecord:
    record, start = RequestRecord(), time.perf_counter()
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )
    last = start
    try:
        async for chunk in stub.Generate(request, timeout=3600):
            now = time.perf_counter()
            if not record.output_tokens:
                record.ttft = now - start
            else:
                record.itls.append(now - last)
            last, record.output_tokens = now, record.output_tokens + len(chunk.token_ids)
        record.latency = last - start
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    return record


async def sse_lines(reply: httpx.Response):
    """The stream's lines, split where SSE splits them (LF, CR LF): httpx's
    aiter_lines() also splits at U+2028, U+0085 and the like, which JSON strings carry
    unescaped (a random model writes them)."""
    buffer = ""
    async for text in reply.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.removesuffix("\r")


async def openai_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int):
    record, start = RequestRecord(), time.perf_counter()
    body = {"model": client.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    last = start
    try:
        async with client.stream("POST", "/completions", json=body) as reply:
            if reply.status_code != 200:
                error = json.loads(await reply.aread())["error"]
                record.error = f"HTTP {reply.status_code}: {error['message']}"
                return record
            async for line in sse_lines(reply):
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if math.isnan(record.ttft):
                        record.ttft = now - start
                    else:
                        record.itls.append(now - last)
                    last = now
        record.latency = last - start
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from its own counters."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Progress:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label = total, 0, label

    def advance(self) -> None:
        self.done += 1
        filled = 30 * self.done // self.total
        if filled == 30 * (self.done - 1) // self.total and self.done < self.total:
            return  # redraw only when the bar grows
        end = "\n" if self.done == self.total else ""
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                         f"{self.done}/{self.total}{end}")  # fmt: skip
        sys.stderr.flush()


@contextlib.asynccontextmanager
async def backend_sender(backend: str, address: str):
    """send(prompt, max_tokens) -> RequestRecord over the chosen API."""
    if backend == "grpc":
        async with channel(address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            yield lambda prompt, max_tokens: grpc_request(stub, prompt, max_tokens)
        return
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://{address}/v1", timeout=3600,
                                 limits=limits) as client:  # fmt: skip
        client.model = (await client.get("/models")).json()["data"][0]["id"]
        yield lambda prompt, max_tokens: openai_request(client, prompt, max_tokens)


async def run_rate(address: str, args, rate: float, backend: str):
    requests = workload(args.num_prompts, args.seed)
    gaps = arrival_gaps(len(requests), rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    progress = Progress(len(requests), f"{backend} rate {rate:>5}")
    async with backend_sender(backend, address) as one_request:

        async def send(prompt, max_tokens) -> RequestRecord:
            async with limit:
                record = await one_request(prompt, max_tokens)
            progress.advance()
            return record

        start, tasks = time.perf_counter(), []
        for gap, (prompt, max_tokens) in zip(gaps, requests, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(send(prompt, max_tokens)))
        records = await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def summarize(records: list[RequestRecord], duration: float, rate: float, args) -> dict:
    ok = [r for r in records if not r.error]
    ms = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.output_tokens > 1],
        "itl": [gap * 1e3 for r in ok for gap in r.itls],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and
            (r.output_tokens < 2 or r.tpot * 1e3 <= args.slo_tpot_ms)]  # fmt: skip
    result = {
        "request_rate": rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "completed": len(ok),
        "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if r.error}),
        "duration_s": duration, "output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": len(good) / duration, "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
    }  # fmt: skip
    for name, values in ms.items():
        values = sorted(values) or [math.nan]
        result[f"mean_{name}_ms"] = statistics.fmean(values)
        result[f"median_{name}_ms"] = statistics.median(values)
        result[f"p99_{name}_ms"] = values[min(len(values) - 1, int(0.99 * len(values)))]
    return result


def table(results: list[dict]) -> str:
    variants = any("variant" in r for r in results)
    head = ("| backend | rate (req/s) | done | failed | req/s | out tok/s | goodput (req/s) | "
            "TTFT (ms) mean / p50 / p99 | TPOT (ms) | ITL (ms) | E2E latency (ms) | "
            "router CPU µs / token |")  # fmt: skip
    lines = [("| checkout " if variants else "") + head,
             ("|---" if variants else "") + "|---|" + "---:|" * 11]  # fmt: skip
    for r in results:
        cpu = r.get("router_cpu_us_per_token")
        cells = [r["variant"]] if variants else []
        cells += [r["backend"], f"{r['request_rate']}", str(r["completed"]), str(r["failed"]),
                 f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                 f"{r['goodput']:.2f}"]  # fmt: skip
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats = (r[f"{s}_{name}_ms"] for s in ("mean", "median", "p99"))
            cells.append(" / ".join(f"{v:.0f}" for v in stats))
        cells.append("-" if cpu is None else f"{cpu:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", help="a running router (gRPC address, or HTTP for "
                        "--backend openai); otherwise a stack is started")  # fmt: skip
    parser.add_argument("--backend", nargs="+", choices=["grpc", "openai"], default=["grpc"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"],
                        help="model of the stack started without --router")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf])
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=0, help="0: unlimited")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkout", action="append", default=[],
                        help="LABEL=DIR: a stack of that checkout (its own .venv; empty DIR: "
                        "this one), each measured in turn")  # fmt: skip
    parser.add_argument("--json", default=str(RESULTS / "serve.json"))
    parser.add_argument("--out", default=str(RESULTS / "serve.md"))
    return parser.parse_args()


async def warm_up(backend: str, address: str) -> None:
    """A few requests first: the first steps of a fresh stack run slower (allocations,
    lazy imports, CPU caches), which would be charged to whichever backend runs first."""
    async with backend_sender(backend, address) as one_request:
        await asyncio.gather(*(one_request(p, n) for p, n in workload(8, seed=99)))


def run(addresses: dict[str, str], args, router_pid: int | None = None) -> list[dict]:
    """Each rate, each backend on it in turn."""
    for backend in args.backend:
        asyncio.run(warm_up(backend, addresses[backend]))
    results = []
    for rate in args.request_rate:
        for backend in args.backend:
            cpu_before = cpu_seconds(router_pid) if router_pid else 0.0
            records, duration = asyncio.run(run_rate(addresses[backend], args, rate, backend))
            result = {"backend": backend, **summarize(records, duration, rate, args)}
            if router_pid and result["output_tokens"]:
                spent = cpu_seconds(router_pid) - cpu_before
                result["router_cpu_us_per_token"] = spent * 1e6 / result["output_tokens"]
            results.append(result)
    return results


def main() -> None:
    args = parse_args()
    if args.router:
        results = run(dict.fromkeys(args.backend, args.router), args)
    else:
        model_dir = (Path("models") / f"flagstop-{args.size}").resolve()
        if not (model_dir / "config.json").exists():
            write_model(model_dir, args.size)
        results = []
        for label, checkout in (c.split("=", 1) for c in args.checkout or ["="]):
            stack = start_stack(model_dir, Path(tempfile.mkdtemp(prefix="serve-bench-")),
                                checkout=Path(checkout) if checkout else ROOT)  # fmt: skip
            try:
                addresses = {"grpc": stack.router, "openai": stack.http}
                measured = run(addresses, args, stack.processes["router"].pid)
            finally:
                stack.stop()
            results += [{"variant": label, **r} if args.checkout else r for r in measured]
    print(table(results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    target = args.router or f"a local stack on the {args.size} model with default flags"
    title = "Online serving"
    if len(set(args.backend)) > 1:
        title = "The same load through gRPC and through the OpenAI HTTP API"
    Path(args.out).write_text(
        f"# {title}\n\n`python bench/serve_bench.py {' '.join(sys.argv[1:])}` on "
        f"{date.today()}, {os.cpu_count()} CPU cores, against {target}: {args.num_prompts} "
        f"requests per rate, Poisson arrivals (burstiness {args.burstiness}), SLOs TTFT <= "
        f"{args.slo_ttft_ms:.0f} ms and TPOT <= {args.slo_tpot_ms:.0f} ms.\n\n{table(results)}\n"
    )


if __name__ == "__main__":
    main()
