"""Useful output tokens/s of our engine beside transformers' static and continuous
batching, on the same checkpoint and the same deterministic workload.

    python bench/peers.py [--size small] [--requests 64] [--variant LABEL=CHECKOUT ...]
        [--out bench/results/peers.md]

Every request is sent at t=0, greedy, EOS ignored, so each system generates exactly
the tokens asked for. 16 slots everywhere. The limits are the cost of the model
forwards alone for a perfect 16-slot schedule: every prompt prefilled in 512-token
steps, every decode step full. Each step shape is timed with our forward and with
transformers' (interleaved rounds): one limit with ours throughout, and the honest one
with the FASTER of the two for each shape, which a slow forward cannot flatter. The
tail (the steps after the last one with every slot busy) is reported from our
in-process run's step times. The per-step slot occupancy of the static and of our
continuous run goes to peers.json for bench/plots.py.

--variant LABEL=CHECKOUT also runs another checkout (with its own .venv): its engine
in one process and its 3-process stack, in the same run (a before/after table).
"""

import argparse
import asyncio
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.executor_bench import (
    hf_decode_timer,
    hf_prefill_timer,
    our_decode_step,
    our_step,
    rounds,
    timed,
)
from bench.output import write_result
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.make_model import write_model
from tools.stack import ROOT, start_stack

NUM_BLOCKS, BLOCK_SIZE, SLOTS, BUDGET = 1024, 16, 16, 512
Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def skewed(rng: random.Random, low: int, high: int, power: float) -> int:
    """Mostly short, sometimes long: low + (high - low) * u**power."""
    return low + int((high - low) * rng.random() ** power)


def workload(num_requests: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    return [
        ([0] + [rng.randrange(3, 512) for _ in range(skewed(rng, 16, 510, 2.5))],
         skewed(rng, 8, 296, 2.0))
        for _ in range(num_requests)
    ]  # fmt: skip


def new_runner(model_dir: Path) -> ModelRunner:
    config = ExecutorConfig(
        model=str(model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=SLOTS,
        max_num_batched_tokens=BUDGET,
    )  # fmt: skip
    return ModelRunner(config)


@torch.inference_mode()
def run_in_process(
    model_dir: Path, requests: Workload, steps: list | None = None
) -> tuple[float, int]:
    """The scheduler core and the model runner called directly: (wall s, tokens);
    steps, if given, gets (scheduled request ids, seconds) of every step."""
    runner = new_runner(model_dir)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=BUDGET, max_num_seqs=SLOTS, block_size=BLOCK_SIZE,
        max_model_len=runner.max_model_len,
    )  # fmt: skip
    scheduler = Scheduler(scheduler_config, NUM_BLOCKS)
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        scheduler.add_request(Request(
            f"r{i}", "bench", prompt, StopParams(max_tokens, ignore_eos=True),
            sampling_params=SamplingParams(),
        ))  # fmt: skip
    generated = 0
    while scheduler.has_unfinished_requests():
        step_start = time.perf_counter()
        plan = scheduler.schedule()
        output = runner.execute(plan)
        for out in scheduler.update_from_output(plan, output).values():
            generated += len(out.new_token_ids)
        if steps is not None:
            steps.append((list(plan.num_scheduled_tokens), time.perf_counter() - step_start))
    return time.perf_counter() - start, generated


def run_in_checkout(checkout: Path, model_dir: Path, requests: Workload) -> tuple[float, int]:
    """run_in_process of another checkout, in its own interpreter."""
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, '.'); "
        "from bench.peers import run_in_process, workload; "
        "print(json.dumps(run_in_process(Path(sys.argv[1]), workload(int(sys.argv[2])))))"
    )
    python = str(checkout / ".venv" / "bin" / "python")
    command = [python, "-c", code, str(model_dir.resolve()), str(len(requests))]
    out = subprocess.run(command, cwd=checkout, check=True, capture_output=True, text=True)
    seconds, tokens = json.loads(out.stdout.splitlines()[-1])
    return seconds, tokens


async def run_stack(router: str, requests: Workload) -> tuple[float, int]:
    async with channel(router) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(prompt: list[int], max_tokens: int) -> int:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
            )
            return sum([len(c.token_ids) async for c in stub.Generate(request, timeout=3600)])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, n) for p, n in requests))
        return time.perf_counter() - start, sum(counts)


def run_through_stack(
    model_dir: Path, requests: Workload, env: dict[str, str] | None = None, checkout: Path = ROOT
):
    """(wall seconds, generated tokens) through a fresh 3-process stack (of checkout)."""
    stack = start_stack(
        model_dir.resolve(), Path(tempfile.mkdtemp(prefix="bench-")),
        executor_args=["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)],
        scheduler_args=["--max-num-seqs", str(SLOTS), "--max-num-batched-tokens", str(BUDGET)],
        env=env, checkout=checkout,
    )  # fmt: skip
    try:
        return asyncio.run(run_stack(stack.router, requests))
    finally:
        stack.stop()


def load_hf(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    return model


def run_hf_static(model_dir: Path, requests: Workload, occupancy: list) -> tuple[float, int]:
    """generate() on left-padded batches of 16 in arrival order; a batch runs until its
    longest request ends, and a slot whose request ended sits idle until then."""
    model = load_hf(model_dir)
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(requests), SLOTS):
        batch = requests[first : first + SLOTS]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, eos_token_id=None,
        )  # fmt: skip
        steps = out.shape[1] - width
        occupancy += [[f"r{first + i}" for i, (_, n) in enumerate(batch) if n > t]
                      for t in range(steps)]  # fmt: skip
        generated += sum(min(n, steps) for _, n in batch)
    return time.perf_counter() - start, generated


def run_hf_continuous(model_dir: Path, requests: Workload) -> tuple[float, int]:
    """transformers' own continuous batching manager (paged cache, FIFO scheduler),
    given per-request output lengths."""
    model = load_hf(model_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in requests))
    config.eos_token_id = -1
    cb = ContinuousBatchingConfig(
        page_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_tokens=BUDGET,
        max_requests_per_batch=SLOTS,
    )  # fmt: skip
    generated = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):
            manager.add_request(prompt, f"r{i}", max_new_tokens=max_tokens, eos_token_id=-1)
        for _ in requests:
            while (result := manager.get_result(timeout=1)) is None or not result.is_finished():
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
            generated += len(result.generated_tokens)
        return time.perf_counter() - start, generated


class Limits:
    """Forward time of a perfect schedule: prompt tokens in full 512-token prefill steps,
    then decode steps with all 16 slots busy at the workload's mean decode context, each
    shape timed with ours and transformers' forward in interleaved rounds. Measured
    again beside each of our runs: these machines drift by 15-30 % over minutes, so a
    run is held to the mean of the limits timed just before and just after it."""

    def __init__(self, model_dir: Path, requests: Workload) -> None:
        prompt_tokens = sum(len(p) for p, _ in requests)
        decode_tokens = sum(n for _, n in requests) - len(requests)  # 1st: with prefill
        context = round(
            sum(len(p) * (n - 1) + n * (n - 1) // 2 for p, n in requests) / decode_tokens
        )
        hf, runner = load_hf(model_dir), new_runner(model_dir)
        # Our timers are made afresh per measurement: a decode step grows its contexts.
        self.shapes = [
            (f"prefill {BUDGET}", prompt_tokens / BUDGET,
             lambda: our_step(runner, 0, 0, BUDGET), hf_prefill_timer(hf, BUDGET)),
            (f"decode {SLOTS} x {context}", decode_tokens / SLOTS,
             lambda: timed(our_decode_step(runner, SLOTS, context)),
             hf_decode_timer(hf, SLOTS, context)),
        ]  # fmt: skip

    @torch.inference_mode()
    def measure(self) -> dict:
        found = {"ours": 0.0, "faster": 0.0, "shapes": []}
        for name, count, make_ours, theirs in self.shapes:
            times = rounds(make_ours(), theirs, num_rounds=2, repeats=2)
            our_s, their_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
            found["ours"] += count * our_s
            found["faster"] += count * min(our_s, their_s)
            found["shapes"].append({"shape": name, "steps": count, "ours": our_s,
                                    "theirs": their_s})  # fmt: skip
        return found


def tail(steps: list[tuple[list[str], float]], full_decode_s: float) -> dict:
    """The steps after the last one with every slot busy: their share of the wall time,
    and what their tokens would cost in full decode steps."""
    last_full = max((i for i, (ids, _) in enumerate(steps) if len(ids) == SLOTS), default=-1)
    tail_steps = steps[last_full + 1 :]
    tokens = sum(len(ids) for ids, _ in tail_steps)
    return {
        "steps": len(tail_steps), "tokens": tokens,
        "seconds": sum(s for _, s in tail_steps), "total_seconds": sum(s for _, s in steps),
        "at_full_occupancy": tokens / SLOTS * full_decode_s,
    }  # fmt: skip


def idle_fraction(occupancy: list[list[str]]) -> float:
    return 1 - sum(map(len, occupancy)) / (SLOTS * len(occupancy))


def parse_args(out_name: str, requests: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--variant", action="append", default=[], help="LABEL=CHECKOUT")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / out_name))
    args = parser.parse_args()
    args.model_dir = Path("models") / f"flagstop-{args.size}"
    if not (args.model_dir / "config.json").exists():
        write_model(args.model_dir, args.size)
    return args


def run_all(model_dir: Path, requests: Workload, variants: list[tuple[str, Path]]) -> dict:
    """Every system's (name, wall s, tokens), the limits, the occupancies and the tail."""
    static_steps: list[list[str]] = []
    our_steps: list[tuple[list[str], float]] = []
    systems = [
        ("flagstop, one process", lambda m, r: run_in_process(m, r, our_steps)),
        ("flagstop, router -> scheduler -> executor", run_through_stack),
        ("transformers generate(), static batches",
         lambda m, r: run_hf_static(m, r, static_steps)),
        ("transformers generate_batch(), continuous", run_hf_continuous),
    ]  # fmt: skip
    for label, checkout in variants:
        systems[:0] = [
            (f"{label}: one process", lambda m, r, c=checkout: run_in_checkout(c, m, r)),
            (f"{label}: router -> scheduler -> executor",
             lambda m, r, c=checkout: run_through_stack(m, r, checkout=c)),
        ]  # fmt: skip
    limits = Limits(model_dir, requests)
    measured, beside = [limits.measure()], {}
    rows = []
    for name, run in systems:
        seconds, tokens = run(model_dir, requests)
        print(f"{name:>46}: {tokens} tokens in {seconds:6.1f} s = {tokens / seconds:6.1f} tok/s",
              flush=True)  # fmt: skip
        rows.append((name, seconds, tokens))
        if not name.startswith("transformers"):
            measured.append(limits.measure())
            beside[name] = (measured[-2]["faster"] + measured[-1]["faster"]) / 2
    output_tokens = sum(n for _, n in requests)
    mean = {kind: statistics.fmean(m[kind] for m in measured) for kind in ("ours", "faster")}
    rows += [("limit: our forwards of a perfect schedule", mean["ours"], output_tokens),
             ("limit: the faster forward (ours or transformers') per step shape",
              mean["faster"], output_tokens)]  # fmt: skip
    decode_s = statistics.fmean(m["shapes"][-1]["ours"] for m in measured)
    return {
        "rows": rows, "limits": measured, "beside": beside, "tail": tail(our_steps, decode_s),
        "occupancy": {"static": static_steps, "continuous": [ids for ids, _ in our_steps]},
    }  # fmt: skip


def describe(result: dict) -> tuple[str, str]:
    """The table and the summary under it."""
    rows = {name: (s, n) for name, s, n in result["rows"]}
    limit = rows["limit: the faster forward (ours or transformers') per step shape"][0]
    beside = result["beside"]  # our runs: the limit timed just before and after each
    table = "\n".join([
        "| system | wall (s) | output tokens | useful tokens/s | of the honest limit |",
        "|---|---:|---:|---:|---:|",
        *(f"| {name} | {s:.1f} | {n} | {n / s:.1f} | {beside.get(name, limit) / s:.2f} |"
          for name, s, n in result["rows"]),
    ])  # fmt: skip
    shapes = "; ".join(
        f"{x['shape']} ({x['steps']:.0f} steps): ours "
        f"{statistics.fmean(m['shapes'][i]['ours'] for m in result['limits']) * 1e3:.0f} ms, "
        f"transformers "
        f"{statistics.fmean(m['shapes'][i]['theirs'] for m in result['limits']) * 1e3:.0f} ms"
        for i, x in enumerate(result["limits"][0]["shapes"])
    )
    honest = [m["faster"] for m in result["limits"]]
    idle = {kind: idle_fraction(steps) for kind, steps in result["occupancy"].items()}
    t = result["tail"]
    stack = "flagstop, router -> scheduler -> executor"
    alone = rows["flagstop, one process"]
    static = rows["transformers generate(), static batches"]
    continuous = rows["transformers generate_batch(), continuous"]
    summary = (
        f"Step shapes of the limits (means): {shapes}. The honest limit, timed "
        f"{len(honest)} times through the run (before and after each of our runs, which "
        f"are held to the mean of the two): {min(honest):.1f}-{max(honest):.1f} s. Idle "
        f"slot-steps: static batching {idle['static']:.0%}, ours {idle['continuous']:.0%}. "
        f"The 3-process stack reaches **{beside[stack] / rows[stack][0]:.2f}** of the honest "
        f"limit and the engine in one process "
        f"**{beside['flagstop, one process'] / alone[0]:.2f}**; the stack is "
        f"**{static[0] / rows[stack][0]:.1f}x** transformers' static batching and "
        f"**{continuous[0] / rows[stack][0]:.1f}x** its continuous batching.\n\nThe tail: "
        f"after the last step with all {SLOTS} slots busy, {t['steps']} steps filled "
        f"{t['tokens']} slot-steps (a token each) in {t['seconds']:.1f} s, "
        f"**{t['seconds'] / t['total_seconds']:.0%}** of the one-process run's step time; in "
        f"full decode steps they would take {t['at_full_occupancy']:.1f} s. The tail "
        f"alone keeps the one-process run "
        f"{(t['seconds'] - t['at_full_occupancy']) / alone[0]:.0%} of its wall time from the "
        f"limit, which counts every decode step full."
    )
    return table, summary


def main() -> None:
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    transformers.utils.logging.disable_progress_bar()
    args = parse_args("peers.md", 64)
    requests = workload(args.requests)
    variants = [(label, Path(path).resolve()) for label, path in
                (v.split("=", 1) for v in args.variant)]  # fmt: skip
    result = run_all(args.model_dir, requests, variants)
    expected = sum(n for _, n in requests)
    assert all(tokens == expected for _, _, tokens in result["rows"]), result["rows"]
    table, summary = describe(result)
    print(f"\n{table}\n\n{summary}")
    prompt_lens, output_lens = [len(p) for p, _ in requests], [n for _, n in requests]
    setup = (
        f"{args.size} model, fp32, torch {torch.__version__}; {args.requests} requests at t=0, "
        f"prompts of {min(prompt_lens)}-{max(prompt_lens)} tokens, outputs of "
        f"{min(output_lens)}-{max(output_lens)} tokens (skewed short, seeded), greedy, EOS "
        f"ignored; {SLOTS} slots, {BUDGET}-token step budget."
    )
    idle = {kind: idle_fraction(steps) for kind, steps in result["occupancy"].items()}
    data = {**result, "idle": idle}
    write_result(args.out, "Beside the peers", setup, f"{table}\n\n{summary}", data)


if __name__ == "__main__":
    main()
