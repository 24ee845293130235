"""Executor step time against transformers on the same batch, in interleaved rounds.

    python bench/executor_bench.py [--sizes tiny small] [--rounds 5] [--repeats 3]
        [--variant LABEL=CHECKOUT ...] [--out bench/results/executor.md]
    python bench/executor_bench.py --quantized [--sizes tiny] [--rounds 5]
        [--out bench/results/executor_quant.md]

--quantized: each quantized format of a size (tools/quantize_model.py) against the
same model in float32, ours both: the weights each holds, a decode step at B=1/16/64
(the same interleaved rounds), and the KV cache an FP8 cache fits in the same bytes.

Rows. decode B x C: B requests with C tokens of context compute one token each: one
step of ours (plan diff, inputs, forward, greedy sampling) beside one transformers
forward on a contiguous C-token DynamicCache and its greedy pick. prefill: one
512-token prompt. mixed: 15 decodes at 128 tokens and a 497-token prompt chunk in one
step of ours; transformers needs two forwards for the same work (a 497-token prefill
and a 15-row decode), timed together. Our caches hold random values: a step's cost
does not depend on them, and real prefills would take longer than the measurement.

Noise (these 2-core machines swing +-15 % between minutes): a row is --rounds rounds;
a round times ours and transformers back to back (median of --repeats steps each),
alternating which goes first. The speed-up is the median of the rounds' ratios, shown
with their range. A row is "slower" only if ours lost every round: were the two equal,
that would happen with probability 1/2^rounds (3 % at 5 rounds, a one-sided sign
test); "faster" likewise; anything else is "even", within the noise.

Each model size runs in a worker process per variant, one variant after the other:
--variant LABEL=CHECKOUT measures another checkout of flagstop (with its own .venv and
this file in its bench/) beside this one, for a before/after table from one run.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import write_result  # noqa: E402 (needs the path above)

BLOCK_SIZE = 16
CASES = {  # model (size, or size-ARCH: tools/make_model.py) -> (contexts, batch sizes)
    "tiny": ((128, 512, 1536), (1, 4, 16, 64, 256)),
    "small": ((128, 512), (1, 4, 16, 64, 256)),
    # Mixture of experts: 8 experts, 2 a token (make model ARCH=...).
    "tiny-qwen3_moe": ((512,), (1, 16, 64)),
    "small-qwen3_moe": ((512,), (1, 16, 64)),
    "tiny-mixtral": ((512,), (1, 16, 64)),
}
# --quantized: the formats the CPU runs, against float32, decoding at this context.
QUANT_SCHEMES = ("w8a8", "w4a16", "fp8-block", "fp8-hf", "gptq", "awq")
QUANT_BATCHES, QUANT_CONTEXT = (1, 16, 64), 512
MIXED = (15, 128, 497)  # decodes, their context, prompt chunk: a full 512-token step
Timer = Callable[[], float]  # runs once, returns the seconds that count


def timed(fn: Callable[[], object]) -> Timer:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def median_of(timer: Timer, repeats: int) -> float:
    timer()  # warm-up
    return statistics.median(timer() for _ in range(repeats))


# -- ours ---------------------------------------------------------------------------


def new_runner(model_dir: Path, max_seqs: int, max_tokens: int, **kw):
    from flagstop.executor.config import ExecutorConfig
    from flagstop.executor.model_runner import ModelRunner
    from flagstop.utils import cdiv

    config = ExecutorConfig(
        model=str(model_dir), num_blocks=max_seqs * cdiv(max_tokens, BLOCK_SIZE) + 64,
        block_size=BLOCK_SIZE, max_num_seqs=max_seqs, max_num_batched_tokens=4096, **kw,
    )  # fmt: skip
    return ModelRunner(config)


def new_request(req_id: str, num_tokens: int, num_computed: int, first_block: int):
    from flagstop.executor.sampling_params import SamplingParams
    from flagstop.scheduler_svc.core.output import NewRequestData
    from flagstop.utils import cdiv

    blocks = list(range(first_block, first_block + cdiv(num_tokens + 64, BLOCK_SIZE)))
    return NewRequestData(req_id, [1] * num_tokens, num_tokens, SamplingParams(), blocks,
                          num_computed)  # fmt: skip


def our_decode_step(runner, batch: int, context: int) -> Callable[[], None]:
    """B requests whose first context-1 tokens count as cached; a call decodes one more
    token for each (the contexts grow by one a call)."""
    from flagstop.scheduler_svc.core.output import SchedulerOutput
    from flagstop.utils import cdiv

    runner.reset()
    stride = cdiv(context + 64, BLOCK_SIZE)
    plan = SchedulerOutput()
    for i in range(batch):
        plan.scheduled_new_reqs.append(new_request(f"r{i}", context, context - 1, i * stride))
        plan.num_scheduled_tokens[f"r{i}"] = 1
    runner.execute(plan)
    ids = list(plan.num_scheduled_tokens)

    def step() -> None:
        cached = SchedulerOutput(num_scheduled_tokens=dict.fromkeys(ids, 1))
        cached.scheduled_cached_reqs.req_ids = ids
        cached.scheduled_cached_reqs.num_computed_tokens = [
            int(runner.batch.num_computed_tokens[runner.batch.req_rows[r]]) for r in ids
        ]
        cached.scheduled_cached_reqs.new_block_ids = [[] for _ in ids]
        runner.execute(cached)

    return step


def our_step(runner, decodes: int, context: int, chunk: int) -> Timer:
    """One step of a fresh batch: `decodes` requests at `context` plus one `chunk`-token
    prompt (the batch's making is not timed)."""
    from flagstop.scheduler_svc.core.output import SchedulerOutput
    from flagstop.utils import cdiv

    stride = cdiv(context + 64, BLOCK_SIZE)

    def run() -> float:
        runner.reset()
        plan = SchedulerOutput()
        for i in range(decodes):
            plan.scheduled_new_reqs.append(new_request(f"d{i}", context, context - 1, i * stride))
            plan.num_scheduled_tokens[f"d{i}"] = 1
        plan.scheduled_new_reqs.append(new_request("p", chunk, 0, decodes * stride))
        plan.num_scheduled_tokens["p"] = chunk
        start = time.perf_counter()
        runner.execute(plan)
        return time.perf_counter() - start

    return run


# -- transformers -------------------------------------------------------------------


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    return model.eval()


def hf_decode_timer(model, batch: int, context: int) -> Timer:
    """One forward of B rows on a fresh contiguous cache of context-1 tokens and the
    greedy pick; the cache's making is not timed. The cache's first update keeps the
    tensors it is given and the forward appends by torch.cat into new ones, so one set
    of random tensors serves every call."""
    from transformers import DynamicCache

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (batch, c.num_key_value_heads, context - 1, head_dim)
    tokens = torch.ones(batch, 1, dtype=torch.long)
    layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(c.num_hidden_layers)]

    def run() -> float:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(layers):
            cache.update(k, v, layer)
        start = time.perf_counter()
        model(tokens, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - start

    return run


def hf_prefill_timer(model, num_tokens: int) -> Timer:
    tokens = torch.ones(1, num_tokens, dtype=torch.long)
    # logits_to_keep=1: generate()'s prefill computes the last position's logits only.
    return timed(lambda: model(tokens, logits_to_keep=1).logits[:, -1].argmax(-1).tolist())


def hf_mixed_timer(model, decodes: int, context: int, chunk: int) -> Timer:
    """The work of one mixed step: a chunk-token prefill and a decode of `decodes` rows."""
    prefill, decode = hf_prefill_timer(model, chunk), hf_decode_timer(model, decodes, context)
    return lambda: prefill() + decode()


# -- the worker: one model size, one checkout ----------------------------------------


def rounds(ours: Timer, theirs: Timer, num_rounds: int, repeats: int) -> dict:
    """Per-round medians of ours and theirs, alternating which goes first."""
    our_times, their_times = [], []
    for i in range(num_rounds):
        pair = [(ours, our_times), (theirs, their_times)]
        for timer, times in pair if i % 2 == 0 else pair[::-1]:
            times.append(median_of(timer, repeats))
    return {"ours": our_times, "theirs": their_times}


def cases(size: str) -> list[tuple[str, Callable, Callable]]:
    """(row name, ours(runner) -> Timer, theirs(hf) -> Timer) of a model size."""
    contexts, batches = CASES[size]
    rows = [
        (f"decode B={b} ctx={c}",
         lambda r, b=b, c=c: timed(our_decode_step(r, b, c)),
         lambda m, b=b, c=c: hf_decode_timer(m, b, c))
        for c in contexts for b in batches
    ]  # fmt: skip
    decodes, context, chunk = MIXED
    rows += [
        ("prefill 512 tokens", lambda r: our_step(r, 0, 0, 512),
         lambda m: hf_prefill_timer(m, 512)),
        (f"mixed: {decodes} decodes at {context} + {chunk}-token chunk",
         lambda r: our_step(r, decodes, context, chunk),
         lambda m: hf_mixed_timer(m, decodes, context, chunk)),
    ]  # fmt: skip
    return rows


@torch.inference_mode()
def worker(size: str, num_rounds: int, repeats: int) -> None:
    """Prints one JSON line per row."""
    from tools.make_model import write_model

    model_dir = ROOT / "models" / f"flagstop-{size}"
    if not (model_dir / "config.json").exists():
        dims, _, arch = size.partition("-")
        write_model(model_dir, dims, arch=arch or "llama")
    contexts, batches = CASES[size]
    runner = new_runner(model_dir, max(batches), max(contexts) + 64)
    hf = load_hf(model_dir)
    for name, ours, theirs in cases(size):
        row = rounds(ours(runner), theirs(hf), num_rounds, repeats)
        print(json.dumps({"size": size, "step": name, **row}), flush=True)


# -- quantized formats ----------------------------------------------------------------


def weight_bytes(runner) -> tuple[int, int]:
    """(bytes the linear layers hold, what they would in float32)."""
    from flagstop.executor.models.linear import QuantLinear

    layers = [m for m in runner.model.layers.modules()
              if isinstance(m, QuantLinear) or hasattr(m, "packed")]  # fmt: skip
    dense = sum(m.in_features * m.out_features * 4 for m in layers)
    held = sum(m.resident_bytes() if isinstance(m, QuantLinear) else
               m.in_features * m.out_features * 4 for m in layers)  # fmt: skip
    return held, dense


@torch.inference_mode()
def quant_worker(size: str, num_rounds: int, repeats: int) -> None:
    """Prints one JSON line per (scheme, batch), then the KV cache's line."""
    from tools.make_model import write_model
    from tools.quantize_model import default_out, quantize

    source = ROOT / "models" / f"flagstop-{size}"
    if not (source / "config.json").exists():
        write_model(source, size)
    plain = new_runner(source, max(QUANT_BATCHES), QUANT_CONTEXT + 64)
    for scheme in QUANT_SCHEMES:
        path = default_out(source, scheme)
        if not (path / "config.json").exists():
            quantize(source, scheme, path)
        runner = new_runner(path, max(QUANT_BATCHES), QUANT_CONTEXT + 64)
        held, dense = weight_bytes(runner)
        for batch in QUANT_BATCHES:
            ours = timed(our_decode_step(runner, batch, QUANT_CONTEXT))
            theirs = timed(our_decode_step(plain, batch, QUANT_CONTEXT))
            row = rounds(ours, theirs, num_rounds, repeats)
            print(json.dumps({"size": size, "scheme": scheme, "batch": batch, "held": held,
                              "dense": dense, **row}), flush=True)  # fmt: skip
    print(json.dumps({"size": size, "kv": kv_capacity(source)}), flush=True)


def kv_capacity(model_dir: Path) -> dict:
    """Blocks and the longest context (one request alone) in the default KV bytes."""
    from flagstop.executor.config import ExecutorConfig
    from flagstop.executor.model_runner import ModelRunner

    out = {}
    for dtype in ("auto", "fp8"):
        runner = ModelRunner(ExecutorConfig(model=str(model_dir), block_size=BLOCK_SIZE,
                                            kv_cache_dtype=dtype))  # fmt: skip
        out[dtype] = {"blocks": runner.num_blocks, "tokens": runner.num_blocks * BLOCK_SIZE,
                      "bytes": runner.num_blocks * runner.block_bytes,
                      "max_model_len": runner.max_model_len}  # fmt: skip
    return out


def quant_table(lines: list[dict]) -> str:
    rows = ["| model | scheme | weights held (of float32's) | B | ours (ms) | float32 (ms) "
            "| speed-up (range) | verdict |", "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for line in (x for x in lines if "scheme" in x):
        s = summarize(line)
        rows.append(
            f"| {line['size']} | {line['scheme']} | {line['held'] / 1e6:.2f} MB "
            f"({line['held'] / line['dense']:.0%} of {line['dense'] / 1e6:.2f}) | {line['batch']} "
            f"| {s['ours_ms']:.1f} | {s['theirs_ms']:.1f} | {s['speedup']:.2f}x "
            f"({s['low']:.2f}-{s['high']:.2f}) | {s['verdict']} |"
        )
    rows += ["", "| model | KV cache dtype | bytes | blocks | tokens they hold (the "
             "longest context, the model's limit aside) |", "|---|---|---:|---:|---:|"]  # fmt: skip
    for line in (x for x in lines if "kv" in x):
        for dtype, kv in line["kv"].items():
            name = "model's (float32)" if dtype == "auto" else "fp8 (e4m3)"
            limit = kv["max_model_len"]
            rows.append(f"| {line['size']} | {name} | {kv['bytes'] / 2**20:.0f} MiB | "
                        f"{kv['blocks']} | {kv['tokens']} (limit {limit}) |")  # fmt: skip
    return "\n".join(rows)


def run_quantized(args) -> None:
    lines = []
    for size in args.sizes:
        command = [sys.executable, str(Path(__file__)), "--quant-worker", size,
                   "--rounds", str(args.rounds), "--repeats", str(args.repeats)]  # fmt: skip
        out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
        lines += [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    text = quant_table(lines)
    print(text)
    setup = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; each quantized "
        f"checkpoint of tools/quantize_model.py against the same model in float32, ours "
        f"both, a decode step at {QUANT_CONTEXT} tokens of context (median ms, "
        f"{args.rounds} interleaved rounds of {args.repeats} steps; verdict as in "
        f"executor.md); the KV cache in the default --kv-cache-bytes."
    )
    write_result(args.out, "Quantized weights and the FP8 KV cache", setup, text, lines)


# -- the driver ----------------------------------------------------------------------


def run_variant(checkout: Path, size: str, args) -> list[dict]:
    python = sys.executable if checkout == ROOT else str(checkout / ".venv" / "bin" / "python")
    command = [python, str(checkout / "bench" / "executor_bench.py"), "--worker", size,
               "--rounds", str(args.rounds), "--repeats", str(args.repeats)]  # fmt: skip
    out = subprocess.run(command, cwd=checkout, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def summarize(row: dict) -> dict:
    ratios = [t / o for o, t in zip(row["ours"], row["theirs"], strict=True)]
    verdict = "slower" if max(ratios) < 1 else "faster" if min(ratios) > 1 else "even"
    return {
        "ours_ms": statistics.median(row["ours"]) * 1e3,
        "theirs_ms": statistics.median(row["theirs"]) * 1e3,
        "speedup": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
        "verdict": verdict,
    }  # fmt: skip


def table(results: dict[str, list[dict]]) -> str:
    labels = list(results)
    head = "| model | step |" + "".join(
        f" {v}: ours (ms) | transformers (ms) | speed-up (range) | verdict |" for v in labels
    )
    lines = [head, "|---|---|" + "---:|---:|---:|---|" * len(labels)]
    for i, first in enumerate(results[labels[0]]):
        cells = ""
        for label in labels:
            s = summarize(results[label][i])
            cells += (f" {s['ours_ms']:.1f} | {s['theirs_ms']:.1f} | {s['speedup']:.2f}x "
                      f"({s['low']:.2f}-{s['high']:.2f}) | {s['verdict']} |")  # fmt: skip
        lines.append(f"| {first['size']} | {first['step']} |{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="flagstop", help="this checkout's column label")
    parser.add_argument("--variant", action="append", default=[], help="LABEL=CHECKOUT")
    parser.add_argument("--worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--quantized", action="store_true", help="the quantized formats' rows")
    parser.add_argument("--quant-worker", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.rounds, args.repeats)
    if args.quant_worker:
        return quant_worker(args.quant_worker, args.rounds, args.repeats)
    results_dir = Path(__file__).parent / "results"
    if args.quantized:
        args.out = args.out or str(results_dir / "executor_quant.md")
        return run_quantized(args)
    args.out = args.out or str(results_dir / "executor.md")
    variants = [(label, Path(path).resolve()) for label, path in
                (v.split("=", 1) for v in args.variant)] + [(args.label, ROOT)]  # fmt: skip
    results: dict[str, list[dict]] = {label: [] for label, _ in variants}
    for size in args.sizes:
        for label, checkout in variants:
            results[label] += run_variant(checkout, size, args)
            print(f"{size}: {label} done", flush=True)
    text = table(results)
    print(text)
    setup = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, the torch "
        f"reference attention; median ms of a step, {args.rounds} interleaved rounds of "
        f"{args.repeats} steps; verdict by a sign test over the rounds (see the bench's doc)."
    )
    write_result(args.out, "Executor step time", setup, text, results)


if __name__ == "__main__":
    main()
