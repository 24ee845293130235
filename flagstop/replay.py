"""flagstop-replay: a workload replayed on a virtual clock through the real scheduler
core, each step timed by the executor simulator's cost model (a LOAD-TEST MODEL, not
a GPU): what a policy would have done with that traffic, at far more than real time,
deterministically (same trace, policy, scale and seed: the same report).

    flagstop-replay TRACE [--policy slo] [--load 1.2] [--ttft-ms 2000] [--tpot-ms 80]
                          [--cost-model FITTED.json] [--simulate-base-ms 6 ...]

TRACE: a workload record (one JSON object a line: arrival_s, prompt_tokens,
output_tokens, and optionally block_hashes, tenant, class, ttft_ms, tpot_ms, session,
retention {priority, ttl_s, num_tokens}, after_s; see docs/policy.md and docs/sessions.md), a
Mooncake trace (timestamp ms, input_length, output_length, hash_ids per 512 tokens)
or an Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens).
Prompts are made of their block hashes (equal ids, equal tokens), so prefix-cache hits
are those of the trace; retentions and their lifetimes run on the virtual clock
(--retention-share 0: plain LRU).
"""

import argparse
import csv
import heapq
import json
import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from flagstop.executor.simulator import CostModel
from flagstop.scheduler_svc.core.config import MAX_RETENTION_S, RETENTION_SHARE, SchedulerConfig
from flagstop.scheduler_svc.core.fair_policy import tenant_of
from flagstop.scheduler_svc.core.objectives import Objectives, seconds_of
from flagstop.scheduler_svc.core.output import StepOutcome
from flagstop.scheduler_svc.core.policy import POLICIES, policy_for
from flagstop.scheduler_svc.core.request import Request, Retention, StopParams
from flagstop.scheduler_svc.core.scheduler import RequestRejected, Scheduler

VOCAB = 32000
# The executor simulator's defaults (an 8B model on an H200): base ms, µs a scheduled
# token, µs a context token.
DEFAULT_COST = (6.0, 8.0, 0.03)
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: one per 512 prompt tokens


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()
    tenant: str = ""
    request_class: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    # The agent session it is a turn of, and the retention it asked (docs/sessions.md).
    session: str = ""
    retention: Retention | None = None
    # A session's later turn, closed loop: it arrives after_s after the turn before it
    # ended (its arrival_s unused); None: at arrival_s.
    after_s: float | None = None


def _retention(entry: dict | None) -> Retention | None:
    """A record's {priority, ttl_s, num_tokens} (num_tokens 0: the whole prompt)."""
    if not entry or entry.get("priority", 0) <= 0:
        return None
    return Retention(min(100, int(entry["priority"])), float(entry.get("ttl_s", 0.0)),
                     int(entry.get("num_tokens", 0)))  # fmt: skip


def load_trace(path: Path) -> list[TraceRequest]:
    """A workload record, a Mooncake trace or an Azure trace, by its contents."""
    text = Path(path).read_text()
    if text.startswith("TIMESTAMP"):
        return list(_azure(text))
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if rows and "timestamp" in rows[0]:
        return [TraceRequest(r["timestamp"] / 1e3, r["input_length"], max(1, r["output_length"]),
                             tuple(r.get("hash_ids", ()))) for r in rows]  # fmt: skip
    # A router's record is in wall-clock seconds, its lines in the order requests ended.
    rows.sort(key=lambda r: r["arrival_s"])
    start = rows[0]["arrival_s"] if rows else 0.0
    return [TraceRequest(r["arrival_s"] - start, r["prompt_tokens"], max(1, r["output_tokens"]),
                         tuple(r.get("block_hashes", ())), r.get("tenant", ""),
                         r.get("class", ""), r.get("ttft_ms"), r.get("tpot_ms"),
                         r.get("session", ""), _retention(r.get("retention")),
                         r.get("after_s"))
            for r in rows]  # fmt: skip


def _azure(text: str) -> Iterator[TraceRequest]:
    reader = csv.reader(text.splitlines()[1:])
    start = None
    for stamp, context, generated in reader:
        t = datetime.fromisoformat(stamp[:26]).timestamp()
        start = t if start is None else start
        yield TraceRequest(t - start, max(1, int(context)), max(1, int(generated)))


def scaled(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals factor times as fast (factor 2: twice the request rate)."""
    return [replace(r, arrival_s=r.arrival_s / factor) for r in trace]


def prompt_of(r: TraceRequest, index: int) -> list[int]:
    """Tokens made of the trace's block hashes (equal ids, equal tokens); without
    any, tokens of the request's own."""
    ids = r.block_hashes or (-(index + 1),)
    tokens: list[int] = []
    for h in ids:
        base = (h * 2654435761) % VOCAB
        tokens += [(base + j * 40503) % VOCAB for j in range(TRACE_BLOCK_TOKENS)]
    while len(tokens) < r.prompt_tokens:
        tokens += [(index * 7919 + len(tokens)) % VOCAB]
    return tokens[: r.prompt_tokens]


class Arrivals:
    """The trace's requests as they arrive: each at its arrival_s, but a session's
    later turn with after_s (closed loop) after_s after the turn before it ended (or
    was refused), as an agent's next call follows its tool's."""

    def __init__(self, trace: list[TraceRequest]) -> None:
        self.heap: list[tuple[float, int, TraceRequest]] = []
        self.followers: dict[str, deque[tuple[int, TraceRequest]]] = {}
        sessions = set()
        for index, r in enumerate(trace):
            if r.after_s is not None and r.session and r.session in sessions:
                self.followers.setdefault(r.session, deque()).append((index, r))
            else:
                heapq.heappush(self.heap, (r.arrival_s, index, r))
            sessions.add(r.session)

    def __bool__(self) -> bool:
        return bool(self.heap)

    def next_at(self) -> float:
        return self.heap[0][0]

    def due(self, now: float) -> Iterator[tuple[int, TraceRequest]]:
        while self.heap and self.heap[0][0] <= now:
            _, index, r = heapq.heappop(self.heap)
            yield index, r

    def ended(self, session: str, now: float) -> None:
        """A turn of the session ended: its next, if it follows, is due."""
        if (queue := self.followers.get(session)) and queue:
            index, r = queue.popleft()
            arrival = now + r.after_s
            heapq.heappush(self.heap, (arrival, index, replace(r, arrival_s=arrival)))


@dataclass(slots=True)
class Served:
    arrival_s: float
    tenant: str
    request_class: str
    ttft_ms: float
    tpot_ms: float
    prompt_tokens: int
    session: str = ""
    # Prompt tokens its first admission found cached (the usage's cached_tokens).
    cached_tokens: int = 0
    first_s: float = 0.0
    end_s: float = 0.0
    num_output: int = 0
    shed: bool = False

    @property
    def ttft(self) -> float:
        return (self.first_s - self.arrival_s) * 1e3

    @property
    def tpot(self) -> float:
        return (self.end_s - self.first_s) * 1e3 / max(1, self.num_output - 1)

    @property
    def good(self) -> bool:
        return not self.shed and self.ttft <= self.ttft_ms and self.tpot <= self.tpot_ms


@dataclass(slots=True)
class Replay:
    """One policy over one trace: feed arrivals, plan, time the step by the cost
    model, hand back one token per sampling request, until all have ended."""

    trace: list[TraceRequest]
    config: SchedulerConfig
    num_blocks: int
    cost: CostModel = field(default_factory=lambda: CostModel(*DEFAULT_COST))
    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    now: float = 0.0
    served: dict[str, Served] = field(default_factory=dict)
    num_steps: int = 0
    num_recomputed: int = 0
    num_preemptions: int = 0
    num_shed: int = 0
    num_prefix_hit_tokens: int = 0
    # Prompt tokens the steps computed (a prefix hit's are not; a recompute's are).
    num_prefill_tokens: int = 0
    num_retention_hits: int = 0
    gaps: list[float] = field(default_factory=list)
    # Each step's (start, end) in virtual seconds (what a request arriving waits for).
    step_spans: list[tuple[float, float]] = field(default_factory=list)
    arrivals: "Arrivals | None" = None

    def run(self) -> "Replay":
        scheduler = Scheduler(self.config, self.num_blocks, policy_for(self.config),
                              clock=lambda: self.now)  # fmt: skip
        self.arrivals, high_water = Arrivals(self.trace), {}
        # The service plans step N+1 when step N starts (two steps in flight): a request
        # joins the plan made at the start of the step before (one step's lag).
        planned_at = 0.0
        while self.arrivals or scheduler.has_unfinished_requests():
            for index, r in self.arrivals.due(planned_at):
                self._add(scheduler, index, r)
            plan = scheduler.schedule()
            self._take_shed(scheduler)
            if not plan.num_scheduled_tokens:
                if not self.arrivals and not scheduler.has_unfinished_requests():
                    break
                idle_until = self.arrivals.next_at() if self.arrivals else self.now + 1e-3
                self.now = planned_at = max(self.now, idle_until)  # idle: it plans at once
                continue
            step_s = self.cost.seconds(plan.total_num_scheduled_tokens, plan.num_context_tokens)
            for request_id, num in plan.num_scheduled_tokens.items():
                end = scheduler.requests[request_id].num_computed_tokens
                mark = high_water.get(request_id, 0)
                self.num_recomputed += max(0, min(end, mark) - (end - num))
                num_prompt = scheduler.requests[request_id].num_prompt_tokens
                self.num_prefill_tokens += max(0, min(end, num_prompt) - (end - num))
                high_water[request_id] = max(mark, end)
            planned_at = self.now
            self.step_spans.append((self.now, self.now + step_s))
            self.now += step_s
            scheduler.policy_step.measured(plan, step_s)
            outcome = StepOutcome([1] * len(plan.sampling_requests))
            for out in scheduler.update_from_output(plan, outcome).values():
                for request_id, cached in zip(out.finished, out.num_cached_tokens, strict=True):
                    self.served[request_id].cached_tokens = cached
                for request_id in out.req_ids:
                    served = self.served[request_id]
                    served.num_output += 1
                    if served.num_output == 1:
                        served.first_s = self.now
                for request_id in out.finished:
                    self.served[request_id].end_s = self.now
                    self.arrivals.ended(self.served[request_id].session, self.now)
            self.num_steps += 1
            self._fairness(scheduler)
        self.num_preemptions, self.num_shed = (
            scheduler.num_preemptions,
            scheduler.policy_step.num_shed,
        )
        self.num_prefix_hit_tokens = scheduler.kv.prefix_stats.num_hits
        self.num_retention_hits = scheduler.kv.pool.retention_stats.num_hits
        return self

    def _add(self, scheduler: Scheduler, index: int, r: TraceRequest) -> None:
        request_id = f"r{index}"
        ttft, tpot = r.ttft_ms or self.ttft_ms, r.tpot_ms or self.tpot_ms
        objectives = Objectives(seconds_of(ttft), seconds_of(tpot), r.tenant, r.request_class)
        request = Request(request_id, "replay", prompt_of(r, index),
                          StopParams(r.output_tokens, ignore_eos=True), arrival_time=r.arrival_s,
                          objectives=objectives, labels={"tenant": r.tenant},
                          session_id=r.session,
                          retention=self._whole(r.retention, r.prompt_tokens))  # fmt: skip
        try:
            scheduler.add_request(request)
        except RequestRejected:  # longer than this engine serves: not part of the replay
            self.arrivals.ended(r.session, self.now)
            return
        self.served[request_id] = Served(r.arrival_s, r.tenant, r.request_class, ttft, tpot,
                                         r.prompt_tokens, r.session)  # fmt: skip

    @staticmethod
    def _whole(retention: Retention | None, num_prompt: int) -> Retention | None:
        if retention is None or retention.num_tokens:
            return retention
        return replace(retention, num_tokens=num_prompt)

    def _take_shed(self, scheduler: Scheduler) -> None:
        for request, _ in scheduler.policy_step.take_shed():
            served = self.served[request.request_id]
            served.shed = True
            self.arrivals.ended(served.session, self.now)

    def _fairness(self, scheduler: Scheduler) -> None:
        counters = scheduler.policy_step.policy.service_by_tenant()
        if not counters or self.num_steps % 50:
            return
        backlogged = {tenant_of(r) for r in scheduler.waiting}
        values = [counters[t] for t in backlogged if t in counters]
        self.gaps.append(max(values) - min(values) if len(values) > 1 else 0.0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def report(replay: Replay) -> dict:
    served = list(replay.served.values())
    done = [s for s in served if not s.shed and s.end_s]
    duration = max((s.end_s for s in done), default=replay.now) - min(
        (s.arrival_s for s in served), default=0.0)  # fmt: skip
    ttfts, tpots = [s.ttft for s in done], [s.tpot for s in done if s.num_output > 1]
    short_cut = percentile([s.prompt_tokens for s in served], 25)
    short = [s.ttft for s in done if s.prompt_tokens <= short_cut]
    turns = [s for s in done if s.session]
    num_prompt = sum(s.prompt_tokens for s in done)
    by_tenant = {
        t: [s.ttft for s in done if s.tenant == t] for t in sorted({s.tenant for s in done})
    }
    return {
        "requests": len(served), "served": len(done), "shed": replay.num_shed,
        "goodput_rps": sum(s.good for s in served) / duration if duration > 0 else 0.0,
        "output_tps": sum(s.num_output for s in done) / duration if duration > 0 else 0.0,
        "attainment": sum(s.good for s in served) / max(1, len(served)),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "short_ttft_p99_ms": percentile(short, 99),
        "tpot_p50_ms": percentile(tpots, 50), "tpot_p99_ms": percentile(tpots, 99),
        "tpot_held": sum(s.tpot <= s.tpot_ms for s in done) / max(1, len(done)),
        "preemptions": replay.num_preemptions, "recomputed_tokens": replay.num_recomputed,
        "steps": replay.num_steps, "virtual_s": replay.now,
        "prefix_hit_tokens": replay.num_prefix_hit_tokens,
        "cached_share": replay.num_prefix_hit_tokens / max(1, num_prompt),
        "prefill_tokens": replay.num_prefill_tokens,
        "retention_hits": replay.num_retention_hits,
        "session_cached_share": sum(s.cached_tokens for s in turns)
        / max(1, sum(s.prompt_tokens for s in turns)),
        "session_ttft_p50_ms": percentile([s.ttft for s in turns], 50),
        "session_ttft_p99_ms": percentile([s.ttft for s in turns], 99),
        "ttft_p99_ms_by_tenant": {t: percentile(v, 99) for t, v in by_tenant.items()},
        "ttft_mean_ms_by_tenant": {t: statistics.fmean(v) for t, v in by_tenant.items() if v},
        "max_fairness_gap": max(replay.gaps, default=0.0),
    }  # fmt: skip


def replay_config(policy: str, max_model_len: int = 131072, **overrides) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=max_model_len,
                block_size=16, policy=policy)  # fmt: skip
    return SchedulerConfig(**{**base, **overrides})


def positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {text}")
    return value


def count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 0, got {text}")
    return value


def blocks(text: str) -> int:
    value = count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1 block")
    return value


# The cost model's figures: the executor simulator's flags, and the names of the file
# a scheduler writes with --step-cost-out (scheduler_svc/cost_record.py).
COST_FLAGS = {"base_ms": "--simulate-base-ms",
              "us_per_scheduled_token": "--simulate-us-per-scheduled-token",
              "us_per_context_token": "--simulate-us-per-context-token"}  # fmt: skip


def cost_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> CostModel:
    """The step-cost figures: a fitted file's (--cost-model), each overridden by its
    flag; the simulator's defaults where neither gives one."""
    figures = dict(zip(COST_FLAGS, DEFAULT_COST, strict=True))
    if args.cost_model is not None:
        try:
            fitted = json.loads(args.cost_model.read_text())
            figures.update({k: non_negative(str(fitted[k])) for k in COST_FLAGS})
        except (OSError, ValueError, KeyError, TypeError, argparse.ArgumentTypeError) as e:
            parser.error(f"--cost-model {args.cost_model}: not a step-cost file "
                         f"(--step-cost-out's JSON with {', '.join(COST_FLAGS)}): {e}")  # fmt: skip
    for key in COST_FLAGS:
        if (value := getattr(args, key)) is not None:
            figures[key] = value
    return CostModel(**figures)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="flagstop-replay", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--policy", default="fcfs", choices=sorted(set(POLICIES) - {"remote"}))
    parser.add_argument("--load", type=positive, default=1.0, help="arrival-rate factor")
    parser.add_argument("--ttft-ms", type=positive, default=2000.0)
    parser.add_argument("--tpot-ms", type=positive, default=100.0)
    parser.add_argument("--num-blocks", type=blocks, default=65536)
    parser.add_argument("--limit", type=count, default=0, help="first N requests only")
    parser.add_argument("--cost-model", type=Path, help="a scheduler's --step-cost-out file")
    parser.add_argument(
        "--retention-share",
        type=share,
        default=RETENTION_SHARE,
        help="the most of the pool retained blocks hold (0: plain LRU)",
    )
    parser.add_argument("--max-retention-s", type=non_negative, default=MAX_RETENTION_S)
    for key, flag in COST_FLAGS.items():
        parser.add_argument(flag, dest=key, type=non_negative, help="overrides --cost-model")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"{args.trace}: not a workload record, Mooncake or Azure trace: {e}")
    trace = scaled(trace[: args.limit] if args.limit else trace, args.load)
    config = replay_config(args.policy, retention_share=args.retention_share,
                           max_retention_s=args.max_retention_s)  # fmt: skip
    run = Replay(trace, config, args.num_blocks, cost_model(args, parser),
                 ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms).run()  # fmt: skip
    print(json.dumps(report(run), indent=2))


if __name__ == "__main__":
    main()
