"""Scheduling for SLOs and tenants, by replay of production traces on a virtual clock
(flagstop/replay.py: the real scheduler core, the executor simulator's cost model).

    python bench/slo_bench.py [--limit 3000] [--out bench/results/slo.md]

Each trace is time-scaled to 0.8x, 1.2x and 2x of the simulated executor's capacity
for it (its completions per second when every request of the sample arrives at
once, under FCFS), and replayed under fcfs, hrrn and slo. Targets (a request meets
its SLO when both hold):
- Azure LLM inference 2023, conversation (~1k prompt / ~200 output tokens):
  TTFT 1000 ms, TPOT 50 ms;
- Mooncake FAST'25, conversation (~12k prompt / ~340 output tokens, real prefix
  sharing): TTFT 3000 ms, TPOT 100 ms.
Fairness: each trace at 1.5x capacity split into a heavy tenant sending 10x the light
one's rate, under fcfs, VTC alone and fair (VTC with its reserve), against the light
tenant replayed alone.

Traces: Azure (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024) and Mooncake
(Apache-2.0; Qin et al., "Mooncake", FAST 2025), see shared/data/traces/README.md.
"""

import argparse
import bisect
import json
import math
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plots import fairness_chart, slo_chart
from flagstop.replay import (
    Replay,
    TraceRequest,
    load_trace,
    percentile,
    replay_config,
    report,
    scaled,
)
from flagstop.scheduler_svc.core.config import FAIR_HOLD, FAIR_RESERVE

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
WORKLOADS = {  # name: (file, TTFT ms, TPOT ms)
    "Azure conversation": ("azure_llm_2023_conv.csv", 1000.0, 50.0),
    "Mooncake conversation": ("mooncake_conversation.jsonl", 3000.0, 100.0),
}
LOADS = (0.8, 1.2, 2.0)
POLICIES = ("fcfs", "hrrn", "slo")
NUM_BLOCKS = 65536


def run(trace: list[TraceRequest], policy: str, ttft_ms: float, tpot_ms: float) -> dict:
    replay = Replay(trace, replay_config(policy), NUM_BLOCKS, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    return report(replay.run())


def capacity_rps(trace: list[TraceRequest]) -> float:
    """Completions per virtual second with every request arriving at once (FCFS)."""
    burst = scaled(trace, 1e9)
    result = run(burst, "fcfs", 1e12, 1e12)
    return result["served"] / result["virtual_s"]


def rate_rps(trace: list[TraceRequest]) -> float:
    return len(trace) / max(1e-9, trace[-1].arrival_s - trace[0].arrival_s)


def slo_rows(limit: int, results_out: dict) -> list[str]:
    """results_out: filled with {trace: {load: {policy: report}}} (the chart's)."""
    rows = []
    for name, (file, ttft_ms, tpot_ms) in WORKLOADS.items():
        trace = load_trace(TRACES / file)[:limit]
        capacity = capacity_rps(trace)
        for load in LOADS:
            at_load = scaled(trace, load * capacity / rate_rps(trace))
            results = {p: run(at_load, p, ttft_ms, tpot_ms) for p in POLICIES}
            results_out.setdefault(name, {})[str(load)] = results
            fcfs = results["fcfs"]
            for policy, r in results.items():
                rows.append(slo_row(name, f"{load}x ({load * capacity:.1f} req/s)", policy, r,
                                    r["goodput_rps"] / max(fcfs["goodput_rps"], 1e-9)))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def slo_row(trace: str, load: str, policy: str, r: dict, vs_fcfs: float) -> str:
    cells = [trace, load, policy, f"{r['goodput_rps']:.2f} ({vs_fcfs:.2f}x)",
             f"{r['attainment']:.0%}", f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
             f"{r['short_ttft_p99_ms']:.0f}", f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f}",
             f"{r['tpot_held']:.0%}", str(r["shed"]), str(r["preemptions"]),
             str(r["recomputed_tokens"])]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


FAIR_LOAD = 1.5
FAIR_POLICIES = {  # label: (policy, config overrides)
    "fcfs": ("fcfs", {}),
    "vtc (--fair-reserve 0 --fair-hold 0)": ("fair", {"fair_reserve": 0.0, "fair_hold": 0.0}),
    "vtc + reserve (--fair-hold 0)": ("fair", {"fair_hold": 0.0}),
    "fair (VTC + reserve + hold)": ("fair", {}),
}


def lag_ms(spans: list[tuple[float, float]], arrival_s: float) -> float:
    """How long a request arriving at arrival_s waits before its first step can start:
    the service plans a step when the one before starts, so one arriving during step k
    rides step k+2 at the earliest (none when the engine is idle)."""
    k = bisect.bisect_right(spans, (arrival_s, math.inf)) - 1
    if k < 0 or spans[k][1] <= arrival_s:
        return 0.0
    return (spans[min(k + 1, len(spans) - 1)][1] - arrival_s) * 1e3


def light_floor_ms(solo: Replay, beside: Replay) -> list[float]:
    """Each light request's TTFT floor beside the heavy tenant: the lag its steps force
    on it, plus what its own steps took alone (its solo TTFT less its solo lag). No order
    of the waiting queue, reserve or hold beats it without shortening the heavy steps."""

    def light(replay: Replay) -> list:
        return sorted((s for s in replay.served.values() if s.tenant == "light" and s.first_s),
                      key=lambda s: s.arrival_s)  # fmt: skip

    return [lag_ms(beside.step_spans, b.arrival_s) + a.ttft - lag_ms(solo.step_spans, a.arrival_s)
            for a, b in zip(light(solo), light(beside), strict=True)]  # fmt: skip


def fairness_rows(limit: int, results_out: dict) -> list[str]:
    """Each trace at FAIR_LOAD x capacity split in two tenants, the heavy one sending 10
    of every 11 requests; the light tenant's TTFT against its own replay alone, and the
    floor the heavy tenant's steps set (light_floor_ms)."""
    rows = []
    for name, (file, ttft_ms, tpot_ms) in WORKLOADS.items():
        trace = load_trace(TRACES / file)[:limit]
        trace = scaled(trace, FAIR_LOAD * capacity_rps(trace) / rate_rps(trace))
        tenants = [TraceRequest(r.arrival_s, r.prompt_tokens, r.output_tokens, r.block_hashes,
                                "light" if i % 11 == 0 else "heavy")
                   for i, r in enumerate(trace)]  # fmt: skip
        solo_replay = Replay([r for r in tenants if r.tenant == "light"], replay_config("fcfs"),
                             NUM_BLOCKS, ttft_ms=ttft_ms, tpot_ms=tpot_ms).run()  # fmt: skip
        solo = report(solo_replay)
        by_policy = results_out.setdefault(name, {"light alone": solo})
        for label, (policy, overrides) in FAIR_POLICIES.items():
            replay = Replay(tenants, replay_config(policy, **overrides), NUM_BLOCKS,
                            ttft_ms=ttft_ms, tpot_ms=tpot_ms).run()  # fmt: skip
            floor = light_floor_ms(solo_replay, replay)
            by_policy[label] = {**report(replay), "light_floor_mean_ms": statistics.fmean(floor),
                                "light_floor_p99_ms": percentile(floor, 99)}  # fmt: skip
            rows.append(fairness_row(name, label, solo, by_policy[label], by_policy["fcfs"]))
            print(rows[-1], flush=True)
    return rows


def fairness_row(trace: str, label: str, solo: dict, r: dict, fcfs: dict) -> str:
    alone = [solo["ttft_mean_ms_by_tenant"]["light"], solo["ttft_p99_ms_by_tenant"]["light"]]
    beside = [r["ttft_mean_ms_by_tenant"]["light"], r["ttft_p99_ms_by_tenant"]["light"]]
    floor = [r["light_floor_mean_ms"], r["light_floor_p99_ms"]]
    cells = [trace, label, f"{alone[0]:.0f} / {alone[1]:.0f}",
             *(f"{b:.0f} ({b / a:.2f}x)" for a, b in zip(alone, beside, strict=True)),
             " / ".join(f"{f:.0f} ({f / a:.2f}x)" for a, f in zip(alone, floor, strict=True)),
             f"{r['ttft_mean_ms_by_tenant']['heavy']:.0f}",
             f"{r['goodput_rps']:.2f} ({r['goodput_rps'] / fcfs['goodput_rps']:.2f}x)",
             f"{r['output_tps']:.0f} ({r['output_tps'] / fcfs['output_tps']:.3f}x)",
             str(r["preemptions"]), f"{r['max_fairness_gap']:.0f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def replay_speed() -> str:
    trace = load_trace(TRACES / WORKLOADS["Mooncake conversation"][0])
    t0 = time.perf_counter()
    r = run(trace, "slo", *WORKLOADS["Mooncake conversation"][1:])
    wall = time.perf_counter() - t0
    return (f"{len(trace)} requests of the Mooncake conversation trace (slo, at its own rate): "
            f"{wall:.1f} s of wall time for {r['virtual_s']:.0f} s of virtual time, "
            f"{len(trace) / wall:.0f} requests per wall second, {r['steps']} steps")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=3000, help="requests of each trace")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "slo.md"))
    args = parser.parse_args()
    header = ("| trace | load | policy | goodput req/s (vs fcfs) | SLO attained | "
              "TTFT p50 / p99 ms | shortest quarter's TTFT p99 ms | TPOT p50 / p99 ms | "
              "TPOT held | shed | preempted | recomputed tokens |\n"
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    print(header)
    results: dict = {}
    out_dir = Path(args.out).parent
    slo = "\n".join([header, *slo_rows(args.limit, results)])
    fair_header = ("| trace | policy | light tenant alone: TTFT mean / p99 ms | beside the "
                   "heavy one: mean | p99 | its floor beside it: mean / p99 | heavy tenant's "
                   "TTFT mean ms | goodput req/s (vs fcfs) | output tok/s (vs fcfs) | "
                   "preempted | largest counter gap |\n"
                   "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    fairness: dict = {}
    fair = "\n".join([fair_header, *fairness_rows(args.limit, fairness)])
    fairness_chart(fairness, out_dir / "fairness.png")
    speed = replay_speed()
    print(speed)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"slo": results, "fairness": fairness},
                                                   indent=1))  # fmt: skip
    slo_chart(results, out.with_suffix(".png"))
    Path(args.out).write_text(
        f"# Scheduling for SLOs and tenants (replay)\n\n`python bench/slo_bench.py --limit "
        f"{args.limit}` on {date.today()}: the first {args.limit} requests of each trace, "
        "replayed on a virtual clock through the scheduler core with the executor "
        "simulator's cost model (6 ms + 8 µs a scheduled token + 0.03 µs a context token; "
        "65,536 blocks of 16; 8,192 tokens a step). Targets: Azure TTFT 1000 ms / TPOT "
        "50 ms, Mooncake TTFT 3000 ms / TPOT 100 ms. Traces: Azure LLM inference 2023 "
        "(CC-BY 4.0; Patel et al., Splitwise, ISCA 2024), Mooncake (Apache-2.0; Qin et al., "
        f"FAST 2025).\n\n{slo}\n\n## Tenant fairness\n\nEach trace at {FAIR_LOAD}x capacity, "
        "one tenant sending 10x the other's rate; the light tenant's TTFT beside the heavy "
        "one against its replay alone (`fair`: VTC, prefill weight 1, output weight 2, "
        f"reserve {FAIR_RESERVE:.3g} of seats and KV blocks, hold on at most {FAIR_HOLD:.3g} of "
        "the steps; docs/policy.md). Its floor: per light request, the lag the heavy steps of "
        "that run force on it plus its own steps as they took alone; no order beats it without "
        f"shortening the heavy steps:\n\n{fair}\n\n"
        f"## Replay speed\n\n{speed}\n"
    )


if __name__ == "__main__":
    main()
