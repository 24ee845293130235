"""Cost of the scheduler's hot path: one schedule() + update_from_output() per step.

    python bench/scheduler_bench.py [--steps 200] [--out bench/results/scheduler.md]
        [--variant LABEL=CHECKOUT ...] [--rounds 9]

--variant times other checkouts of the core under this file's loads, side by side in
one run: each round runs every variant in a process of its own (the same hash seed),
and a row's figure is the median over rounds of each process's median step (this
machine's processes differ by up to 1.8x from run to run: interleaved rounds put each
variant through the same). CHECKOUT: a checkout whose root imports as the flagstop
package (a worktree with router/, scheduler_svc/, executor/ and kernels/ linked under
its flagstop/); "." is this one.

Decode rows: N running requests, each gets one token per step (steady state, two
steps in flight as in the service). Mixed row: 256 decodes while 512-token prompts
keep arriving and are chunk-prefilled under a 2048-token budget, requests finishing
and being replaced. Prefix-heavy row: the same with 1,024-token prompts whose first
896 tokens are shared, found in the prefix cache at each admission. The executor's
side (building the sampled-token map) is not timed.

Admission under memory pressure: the same Poisson arrivals (5 % of prompts 2-4k
tokens, the rest 64-512; 16-128 output tokens) run to the end on a pool that holds
a fraction of them, once per admission rule: preemptions, recomputed tokens (those
scheduled again below a request's high-water mark: its prefix hits are not) and the
latency in steps from arrival to the last token.
"""

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from datetime import date
from pathlib import Path

# --tree CHECKOUT (a variant's own process): that checkout's core, this file's loads.
sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv
                else str(Path(__file__).resolve().parents[1]))  # fmt: skip

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
VOCAB = 32000


class Load:
    # What a step is timed by: wall time; bench/llm_d_bench.py takes the thread's CPU
    # time (a subscriber process beside it shares the cores).
    clock = staticmethod(time.perf_counter)

    def __init__(
        self, num_running: int, prompt_len: int, max_tokens: int, arrivals: int,
        shared_prefix: int = 0, kv_events=None,
    ) -> None:  # fmt: skip
        """kv_events: a KV event log for the core (bench/llm_d_bench.py); None, the
        core's own default (so that a --variant checkout from before it runs too)."""
        self.rng = random.Random(0)
        self.ids = itertools.count()
        self.prompt_len, self.max_tokens, self.arrivals = prompt_len, max_tokens, arrivals
        # Every prompt opens with the same shared_prefix tokens (a system prompt, an
        # agent's tools): admissions hit the prefix cache for them.
        self.prefix = [self.rng.randrange(VOCAB) for _ in range(shared_prefix)]
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=2048,
                max_num_seqs=max(num_running, 8) + arrivals * 4,
                max_model_len=8192,
                block_size=BLOCK_SIZE,
            ),
            num_blocks=(num_running + arrivals * 8) * ((prompt_len + max_tokens) // BLOCK_SIZE + 2),
            **({} if kv_events is None else {"kv_events": kv_events}),
        )
        for _ in range(num_running):
            self.add()
        self.in_flight: deque = deque()

    def add(self) -> None:
        unique = self.prompt_len - len(self.prefix)
        prompt = self.prefix + [self.rng.randrange(VOCAB) for _ in range(unique)]
        # Varied lengths so that requests finish (and free blocks) at different steps.
        max_tokens = self.rng.randrange(self.max_tokens // 2, self.max_tokens)
        self.scheduler.add_request(
            Request(
                f"r{next(self.ids)}", "router-0", prompt, StopParams(max_tokens, ignore_eos=True)
            )
        )

    def step(self) -> float:
        """One pipelined step; returns the seconds spent inside the scheduler."""
        clock = self.clock
        t0 = clock()
        plan = self.scheduler.schedule()
        elapsed = clock() - t0
        sampled = [self.rng.randrange(VOCAB) for _ in plan.sampling_requests]
        self.in_flight.append((plan, StepOutcome(sampled)))
        if len(self.in_flight) == 2:
            t0 = clock()
            outputs = self.scheduler.update_from_output(*self.in_flight.popleft())
            elapsed += clock() - t0
            num_finished = sum(len(o.finished) for o in outputs.values())
            for _ in range(num_finished + self.arrivals):
                self.add()
        return elapsed


def measure(load: Load, steps: int, warmup: int) -> tuple[float, int]:
    for _ in range(warmup):
        load.step()
    times, running = [], []
    for _ in range(steps):
        times.append(load.step())
        running.append(len(load.scheduler.running))
    return statistics.median(times), round(statistics.median(running))


PRESSURE_RULES = (
    ("first chunk fits (--no-reserve-full-isl)", False),
    ("whole sequence fits (default)", True),
)


def pressure(reserve_full_isl: bool, num_requests: int = 400, seed: int = 0) -> dict:
    """One memory-bound run to the end (0.5 arrivals a step, 768 blocks of 16)."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192,
                             block_size=BLOCK_SIZE, reserve_full_isl=reserve_full_isl)  # fmt: skip
    scheduler, arrivals, t = Scheduler(config, num_blocks=768), deque(), 0.0
    for i in range(num_requests):
        t += rng.expovariate(0.5)
        num_prompt = rng.randrange(2048, 4096) if rng.random() < 0.05 else rng.randrange(64, 512)
        prompt = [rng.randrange(VOCAB) for _ in range(num_prompt)]
        stop = StopParams(rng.randrange(16, 128), ignore_eos=True)
        arrivals.append((t, Request(f"r{i}", "o", prompt, stop)))
    arrived, latency, high_water, in_flight = {}, [], {}, deque()
    num_recomputed, cpu_s, step_id = 0, 0.0, 0
    while arrivals or scheduler.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step_id:
            request = arrivals.popleft()[1]
            scheduler.add_request(request)
            arrived[request.request_id] = step_id
        t0 = time.process_time()
        plan = scheduler.schedule()
        cpu_s += time.process_time() - t0
        for request_id, num in plan.num_scheduled_tokens.items():
            end = scheduler.requests[request_id].num_computed_tokens
            mark = high_water.get(request_id, 0)
            num_recomputed += max(0, min(end, mark) - (end - num))
            high_water[request_id] = max(mark, end)
        in_flight.append(
            (plan, StepOutcome([rng.randrange(VOCAB) for _ in plan.sampling_requests]))
        )
        while len(in_flight) == 2 or (in_flight and not plan.num_scheduled_tokens):
            for out in scheduler.update_from_output(*in_flight.popleft()).values():
                latency += [step_id - arrived[request_id] for request_id in out.finished]
        step_id += 1
    q = statistics.quantiles(latency, n=100)
    return {
        "preemptions": scheduler.num_preemptions,
        "recomputed": num_recomputed,
        "steps": step_id,
        "p50": q[49],
        "p99": q[98],
        "cpu_us": cpu_s / step_id * 1e6,
    }


def pressure_table() -> str:
    lines = ["| admission rule | preemptions | recomputed tokens | steps to drain | "
             "latency p50 / p99 (steps) | schedule() CPU µs a step |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, rule in PRESSURE_RULES:
        r = pressure(rule)
        lines.append(f"| {name} | {r['preemptions']} | {r['recomputed']} | {r['steps']} | "
                     f"{r['p50']:.0f} / {r['p99']:.0f} | {r['cpu_us']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def hot_path_rows(steps: int) -> dict[str, tuple[float, int]]:
    """Load name -> (median µs a step, median running requests)."""
    cases = [(f"decode {n}", Load(n, 128, 4096, 0), 40) for n in (64, 256, 1024)]
    # Warm-up lets the 256 decodes get past their own prefill before timing.
    cases.append(("mixed 256 + 512-token prefills", Load(256, 512, 256, 1), 40))
    # The same, each prompt 1,024 tokens of which the first 896 are shared.
    cases.append(("prefix-heavy 256 + 1024-token prompts, 896 shared",
                  Load(256, 1024, 256, 1, shared_prefix=896), 40))  # fmt: skip
    rows = {}
    for name, load, warmup in cases:
        median_s, running = measure(load, steps, warmup)
        rows[name] = (median_s * 1e6, running)
    return rows


def variant_rows(variants: list[str], steps: int, rounds: int) -> dict[str, dict]:
    """Label -> load name -> (median over rounds of µs a step, running), each variant
    in a process of its own per round, interleaved."""
    runs: dict[str, dict[str, list]] = {label: {} for label, _ in map(split_variant, variants)}
    for seed in range(rounds):
        for label, checkout in map(split_variant, variants):
            tree = ROOT if checkout == "." else Path(checkout).resolve()
            command = [sys.executable, __file__, "--rows", "--steps", str(steps),
                       "--tree", str(tree)]  # fmt: skip
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            for name, (us, running) in json.loads(out.stdout).items():
                runs[label].setdefault(name, []).append((us, running))
    return {label: {name: (statistics.median(u for u, _ in v), v[0][1]) for name, v in rows.items()}
            for label, rows in runs.items()}  # fmt: skip


def split_variant(text: str) -> tuple[str, str]:
    label, _, checkout = text.rpartition("=")
    if not label:
        raise SystemExit(f"--variant {text!r}: give LABEL=CHECKOUT")
    return label, checkout


def hot_path_table(by_label: dict[str, dict]) -> str:
    """A row per load; per variant its step and per-request cost, then the last
    variant against each other one."""
    labels, *earlier = list(by_label), *list(by_label)[:-1]
    head = "".join(f" | {label}: step (µs) | µs per running request" for label in labels)
    head += "".join(f" | {labels[-1]} vs {label}" for label in earlier)
    lines = [f"| load | running{head} |",
             "|---|---:|" + "---:|---:|" * len(labels) + "---:|" * len(earlier)]  # fmt: skip
    for name, (_, running) in by_label[labels[0]].items():
        us = {label: by_label[label][name][0] for label in labels}
        cells = [f"{us[label]:.0f} | {us[label] / running:.2f}" for label in labels]
        cells += [f"{us[labels[-1]] / us[label] - 1:+.0%}" for label in earlier]
        lines.append(f"| {name} | {running} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "scheduler.md"))
    parser.add_argument("--variant", action="append", default=[], help="LABEL=CHECKOUT")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows:  # one variant's process
        print(json.dumps(hot_path_rows(args.steps)))
        return
    if args.variant:
        by_label = variant_rows(args.variant, args.steps, args.rounds)
        how = (f"the median over {args.rounds} interleaved rounds (a process each) of the "
               "median of schedule() + update_from_output() per step")  # fmt: skip
    else:
        by_label = {"this checkout": hot_path_rows(args.steps)}
        how = "median of schedule() + update_from_output() per step"
    table = hot_path_table(by_label)
    print(table)
    admission = pressure_table()
    print(admission)
    command = " ".join(["python bench/scheduler_bench.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        f"# Scheduler hot path\n\n`{command}` on {date.today()}, {cpu_name()} "
        f"({os.cpu_count()} cores), Python {sys.version.split()[0]}: {how}."
        f"\n\n{table}\n\n## Admission under memory pressure\n\n400 requests, Poisson arrivals "
        "(0.5 a step; 5 % of prompts 2-4k tokens, the rest 64-512; 16-128 output tokens), "
        f"768 blocks of 16, FCFS, run to the end:\n\n{admission}\n"
    )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
