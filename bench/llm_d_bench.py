"""What llm-d reads of a flagstop pod, and what it costs the pod (docs/llm-d.md).

    python bench/llm_d_bench.py [--part core|stack|all] [--seconds 10] [--rounds 3]
        [--out bench/results/llm-d.md]

core: the scheduler's step (schedule + update_from_output, scheduler_bench's loads)
with KV events on (the core's event log and the publisher's flush: msgspec encoding
and a ZMQ PUB send to a subscriber in another process) against the same step with
events off, in one process, the two interleaved step for step: the step loop's CPU
µs a step each (its thread's CPU time: the subscriber shares this machine's cores),
the difference, and the events and bytes a step.

stack: real processes on the executor simulator (a LOAD-TEST TOOL, not a model: it
waits the time an 8B model's step takes on an H200 and returns hashed tokens), so
that the scheduler runs at GPU step rates. Two loads:
- decode-heavy: 192 streams of 128-token prompts and 512-token answers;
- prefix-heavy: 48 streams of 1,024-token prompts sharing their first 896 tokens, and
  16-token answers, on a pool small enough to evict.
For each, rounds of a stack with events off and one with them on: the events a
second a ZMQ subscriber receives, and the scheduler process's CPU a step (user +
system, from /proc) with and without them.

Then /metrics, as llm-d's endpoint picker scrapes it (20 times a second, every 50 ms)
under the decode-heavy load: the scrape's latency and size, and the router's CPU a
second in windows with and without the scrapes, alternating on one stack.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scheduler_bench import Load, cpu_name  # noqa: E402
from tools.stack import free_port  # noqa: E402

SUBSCRIBER = """
import sys, zmq
socket = zmq.Context().socket(zmq.SUB)
socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
socket.connect(sys.argv[1])
print("ready", flush=True)
while socket.poll(30000):
    socket.recv_multipart()
"""


# -- core ---------------------------------------------------------------------------


def core_loads() -> dict:
    return {
        "decode 256": lambda events: Load(256, 128, 4096, 0, kv_events=events),
        "prefix-heavy 256 + 1024-token prompts, 896 shared": lambda events: Load(
            256, 1024, 256, 1, shared_prefix=896, kv_events=events),
    }  # fmt: skip


def core_rows(steps: int, rounds: int) -> list[dict]:
    """Per load, the median over rounds (fresh loads each) of each round's figures."""
    rows = []
    for name, make in core_loads().items():
        runs = [_core_round(make, steps) for _ in range(rounds)]
        rows.append({"load": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
        print(rows[-1], flush=True)
    return rows


def _core_round(make, steps: int) -> dict:
    from flagstop.scheduler_svc.core.kv_events import NO_KV_EVENTS
    from flagstop.scheduler_svc.kv_event_publisher import KVEventPublisher, KVEventsConfig

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KVEventPublisher(KVEventsConfig(endpoint=endpoint, replay_endpoint=None), "b")
    subscriber = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        subscriber.stdout.readline()
        time.sleep(0.3)  # the subscription reaches the publisher
        return _interleaved(make(NO_KV_EVENTS), make(publisher.log), publisher, steps)
    finally:
        subscriber.kill()
        publisher.close()


def _interleaved(off: Load, on: Load, publisher, steps: int, warmup: int = 40) -> dict:
    """Each load's step, one after the other, step for step (the same noise for both)."""
    sent = []
    original = publisher._send

    def counted(events: list) -> None:
        sent.append(len(events))
        original(events)

    publisher._send = counted
    off.clock = on.clock = clock = time.thread_time
    for _ in range(warmup):
        off.step()
        on.step()
        publisher.flush()
    sent.clear()
    off_s, on_s, flush_s, nbytes = [], [], [], 0
    for _ in range(steps):
        off_s.append(off.step())
        elapsed = on.step()
        began = clock()
        publisher.flush()
        flush_s.append(clock() - began)
        on_s.append(elapsed + flush_s[-1])
        nbytes += len(publisher.buffer[-1][1]) if publisher.buffer else 0
    # The two loads are the same work step for step (the same seeds) but the events:
    # the median of the steps' differences is the events' cost.
    paired = statistics.median(b - a for a, b in zip(off_s, on_s, strict=True))
    return {"off_us": statistics.median(off_s) * 1e6, "on_us": statistics.median(on_s) * 1e6,
            "difference_us": paired * 1e6, "flush_us": statistics.median(flush_s) * 1e6,
            "events_per_step": sum(sent) / steps, "bytes_per_step": nbytes / steps}  # fmt: skip


# -- stack --------------------------------------------------------------------------

STACK_LOADS = {  # name: (streams, prompt tokens, shared prefix, answer tokens, pool blocks)
    "decode-heavy": (192, 128, 0, 512, 8192),
    "prefix-heavy": (48, 1024, 896, 16, 2048),
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))  # fmt: skip


class Counter(threading.Thread):
    """A fleet router's subscriber: counts the events it receives."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        super().__init__(daemon=True)
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(endpoint)
        self.events = self.batches = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        import msgspec

        decoder = msgspec.msgpack.Decoder()
        while not self.stopped.is_set():
            if self.socket.poll(100):
                _, _, payload = self.socket.recv_multipart()
                self.events += len(decoder.decode(payload)[1])
                self.batches += 1

    def close(self) -> None:
        self.stopped.set()
        self.join(5)
        self.socket.close(linger=0)


async def drive(stack, load: tuple, vocab: int, seconds: float, window) -> dict:
    """The load's streams, each starting another request when one ends, for seconds;
    window(): what to measure over the last seconds (the first 2 warm up)."""
    import grpc

    from flagstop.v1 import generation_pb2, generation_pb2_grpc

    streams, prompt_len, shared, answer, _ = load
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    stop = time.monotonic() + seconds + 2

    async with grpc.aio.insecure_channel(stack.router) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def stream() -> None:
            while time.monotonic() < stop:
                prompt = prefix + [rng.randrange(3, vocab) for _ in range(prompt_len - shared)]
                request = generation_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=answer, ignore_eos=True
                )
                async for _ in stub.Generate(request, timeout=600):
                    pass

        tasks = [asyncio.create_task(stream()) for _ in range(streams)]
        await asyncio.sleep(2)
        result = await window(seconds)
        await asyncio.gather(*tasks)
    return result


def stack_rows(model_dir: Path, tmp: Path, seconds: float, rounds: int) -> list[dict]:
    from tools.stack import start_stack

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    runs: dict[tuple[str, bool], list[dict]] = {}
    for round_ in range(rounds):
        for name, load in STACK_LOADS.items():
            for events in (False, True):
                pub = free_port()
                config = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": None}
                stack = start_stack(
                    model_dir, tmp / f"{name}-{events}-{round_}",
                    executor_args=["--simulate", "--simulate-num-blocks", str(load[4])],
                    scheduler_args=(["--kv-events-config", json.dumps(config)] if events
                                    else []) + ["--max-waiting-requests", "4096"],
                )  # fmt: skip
                counter = Counter(f"tcp://127.0.0.1:{pub}")
                counter.start()
                try:
                    run = asyncio.run(drive(stack, load, vocab, seconds,
                                            _scheduler_window(stack, counter)))  # fmt: skip
                finally:
                    counter.close()
                    stack.stop(10)
                runs.setdefault((name, events), []).append(run)
                print(name, "events" if events else "off", run, flush=True)
    return [{"load": name, "events": events, **{k: statistics.median(r[k] for r in rs)
                                                for k in rs[0]}}
            for (name, events), rs in runs.items()]  # fmt: skip


def _scheduler_window(stack, counter: Counter):
    pid, port = stack.processes["scheduler"].pid, stack.metrics_ports["scheduler"]
    steps_name = "flagstop:step_duration_seconds_count"

    async def window(seconds: float) -> dict:
        cpu, steps, events = cpu_seconds(pid), metric(port, steps_name), counter.events
        began = time.monotonic()
        await asyncio.sleep(seconds)
        elapsed = time.monotonic() - began
        num_steps = metric(port, steps_name) - steps
        return {"steps_per_s": num_steps / elapsed,
                "cpu_us_per_step": (cpu_seconds(pid) - cpu) / num_steps * 1e6,
                "cpu_share": (cpu_seconds(pid) - cpu) / elapsed,
                "events_per_s": (counter.events - events) / elapsed}  # fmt: skip

    return window


def scrape_rows(model_dir: Path, tmp: Path, seconds: float, rounds: int) -> list[dict]:
    """On one decode-heavy stack: windows without scrapes and with 20 a second, in turn."""
    from tools.stack import start_stack

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    load = STACK_LOADS["decode-heavy"]
    stack = start_stack(model_dir, tmp / "scrapes",
                        executor_args=["--simulate", "--simulate-num-blocks", str(load[4])],
                        scheduler_args=["--max-waiting-requests", "4096"])  # fmt: skip
    try:
        result = asyncio.run(drive(stack, load, vocab, seconds * 2 * rounds,
                                   _scrape_windows(stack, seconds, rounds)))  # fmt: skip
    finally:
        stack.stop(10)
    return result


def _scrape_windows(stack, seconds: float, rounds: int):
    pid, url = stack.processes["router"].pid, f"http://{stack.http}/metrics"

    async def scraping(until: float, latencies: list, sizes: list) -> None:
        next_at = time.monotonic()
        while next_at < until:
            began = time.perf_counter()
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
            latencies.append(time.perf_counter() - began)
            sizes.append(len(body))
            next_at += 0.05
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def windows(_: float) -> list[dict]:
        cpu = {False: [], True: []}
        latencies, sizes = [], []
        for _ in range(rounds):
            for scraped in (False, True):
                before, began = cpu_seconds(pid), time.monotonic()
                if scraped:
                    await scraping(began + seconds, latencies, sizes)
                else:
                    await asyncio.sleep(seconds)
                cpu[scraped].append((cpu_seconds(pid) - before) / (time.monotonic() - began))
        latencies.sort()
        return [{"scrapes_per_s": 20 if scraped else 0,
                 "router_cpu_share": statistics.median(cpu[scraped]),
                 "scrape_ms_p50": latencies[len(latencies) // 2] * 1e3 if scraped else None,
                 "scrape_ms_p99": latencies[int(len(latencies) * 0.99)] * 1e3 if scraped else None,
                 "scrape_bytes": statistics.median(sizes) if scraped else None,
                 "scrapes": len(latencies) if scraped else 0}
                for scraped in (False, True)]  # fmt: skip

    return windows


# -- report -------------------------------------------------------------------------


def core_table(rows: list[dict]) -> str:
    lines = ["| load | events off: µs a step | events on: µs a step | difference (median of "
             "the steps') | of which the flush | events a step | bytes a step |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['load']} | {r['off_us']:.0f} | {r['on_us']:.0f} | "
                     f"{r['difference_us']:+.0f} µs ({r['difference_us'] / r['off_us']:+.1%}) | "
                     f"{r['flush_us']:.0f} µs | {r['events_per_step']:.1f} | "
                     f"{r['bytes_per_step']:,.0f} |")  # fmt: skip
    return "\n".join(lines)


def stack_table(rows: list[dict]) -> str:
    lines = ["| load | KV events | steps a second | events a second | scheduler CPU µs a step "
             "| scheduler CPU share |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['load']} | {'on' if r['events'] else 'off'} | "
                     f"{r['steps_per_s']:.0f} | {r['events_per_s']:,.0f} | "
                     f"{r['cpu_us_per_step']:,.0f} | {r['cpu_share']:.0%} |")  # fmt: skip
    return "\n".join(lines)


def scrape_table(rows: list[dict]) -> str:
    lines = ["| /metrics scrapes a second | router CPU share | scrape ms p50 | scrape ms p99 | "
             "bytes a scrape |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        cells = (
            ("-", "-", "-")
            if r["scrapes_per_s"] == 0
            else (
                f"{r['scrape_ms_p50']:.1f}",
                f"{r['scrape_ms_p99']:.1f}",
                f"{r['scrape_bytes']:,.0f}",
            )
        )
        lines.append(f"| {r['scrapes_per_s']} | {r['router_cpu_share']:.1%} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["core", "stack", "all"], default="all")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=str(ROOT / "models" / "flagstop-tiny"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "llm-d.md"))
    args = parser.parse_args()
    sections = []
    if args.part in ("core", "all"):
        table = core_table(core_rows(args.steps, args.rounds * 3))
        sections.append(f"## KV events in the scheduler's step\n\nThe median over "
                        f"{args.rounds * 3} rounds of the median of {args.steps} steps, the "
                        "two loads interleaved step for step, each step's CPU time:"
                        f"\n\n{table}")  # fmt: skip
    if args.part in ("stack", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            rows = stack_rows(Path(args.model), Path(tmp), args.seconds, args.rounds)
            scrapes = scrape_rows(Path(args.model), Path(tmp), args.seconds, args.rounds)
        sections.append(f"## KV events on a live stack (executor simulator)\n\nMedian of "
                        f"{args.rounds} rounds of {args.seconds:.0f} s each:\n\n"
                        f"{stack_table(rows)}")  # fmt: skip
        sections.append(f"## /metrics at llm-d's scrape rate\n\nThe decode-heavy load on one "
                        f"stack, {args.rounds} windows of {args.seconds:.0f} s of each, in "
                        f"turn:\n\n{scrape_table(scrapes)}")  # fmt: skip
    command = " ".join(["python bench/llm_d_bench.py", *sys.argv[1:]])
    text = (f"# What llm-d reads of a pod, and its cost\n\n`{command}` on {date.today()}, "
            f"{cpu_name()} ({os.cpu_count()} cores), Python {sys.version.split()[0]}.\n\n"
            + "\n\n".join(sections) + "\n")  # fmt: skip
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
