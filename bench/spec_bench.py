"""Speculative decoding on the CPU: each proposer against speculation off, side by
side in one run, at several numbers of concurrent streams. The scheduler core and
the model runner in one process (tools/inprocess.py, two steps in flight as the
service keeps them), greedy requests on the embedded model.

    python bench/spec_bench.py [--streams 1 4 16 64] [--prompt-tokens 64]
        [--output-tokens 64] [--target random|trained] [--out bench/results/spec.md]

Methods: off; ngram (k 3, lookup 1..3); suffix (k 4); draft_model with the model
itself as its draft (the mechanics' ceiling: every draft accepted, at the cost of a
second full model); draft_model with the model's first layer as the draft (a
realistic middle: cheaper, accepted less); eagle3 with the head `make eagle-head`
trains on the model's own greedy text (its prompts here, random tokens, are none it
saw). Each row: tokens per target forward (per
running request), acceptance (accepted / drafted tokens) and per position, output
tok/s and mean ITL (per request, (last token - first token) / (tokens - 1)). The
batch rule (--speculative-disable-batch-size, 32 by default) is off in every row but
"batch rule on", so that the table shows where drafting stops paying; the
per-request acceptance rule is always on.

Random weights rarely repeat themselves: the n-gram and suffix rows show their cost
more than their gain; a real model on real text accepts far more. `--target trained`
(bench/results/spec_trained.md) runs the same methods on a target with something to
learn: the embedded architecture trained on docs/*.md (`make trained-model`), its
eagle3 head trained on its text (`make eagle-head-trained`), prompts cut from the docs
both left out (tools/train_tiny_model.py's held-out docs).
"""

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import load_file, save_file

from bench.output import write_result
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.sampling_params import SamplingParams
from flagstop.scheduler_svc.core.config import SchedulerConfig
from tools.inprocess import Job, run_engine
from tools.make_model import write_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BLOCK_SIZE = 16


def truncated_draft(model_dir: Path, out: Path, num_layers: int = 1) -> Path:
    """The checkpoint's first num_layers layers as a draft of it (same embedding,
    norm and LM head): a cheaper model of the same tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = {}
    for f in model_dir.glob("*.safetensors"):
        for name, tensor in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            weights[name] = tensor
    save_file(weights, out / "model.safetensors")
    index = out / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    return out


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
NO_RULE = 1 << 20  # --speculative-disable-batch-size past any batch: the rule off


def methods(model_dir: Path, draft_dir: Path, eagle_dir: Path) -> dict[str, dict | None]:
    return {
        "off": None,
        "ngram k3": NGRAM,
        "ngram k3, batch rule on": NGRAM,
        "suffix k4": {"method": "suffix", "num_speculative_tokens": 4},
        "self-draft k3": {"method": "draft_model", "num_speculative_tokens": 3,
                          "model": str(model_dir)},
        "1-layer draft k3": {"method": "draft_model", "num_speculative_tokens": 3,
                             "model": str(draft_dir)},
        "eagle3 k3 (trained)": {"method": "eagle3", "num_speculative_tokens": 3,
                                "model": str(eagle_dir)},
    }  # fmt: skip


def jobs(streams: int, prompt_tokens: int, output_tokens: int, vocab: int,
         text: list[int] | None) -> list[Job]:  # fmt: skip
    """Random token prompts, or windows of `text` (token ids)."""
    rng = random.Random(streams)

    def prompt() -> list[int]:
        if text is None:
            return [0] + [rng.randrange(3, vocab) for _ in range(prompt_tokens - 1)]
        start = rng.randrange(len(text) - prompt_tokens)
        return text[start : start + prompt_tokens]

    return [Job(prompt(), output_tokens, SamplingParams()) for _ in range(streams)]


def measure(runner: ModelRunner, streams: int, args, disable_batch_size: int = NO_RULE) -> dict:
    workload = jobs(streams, args.prompt_tokens, args.output_tokens,
                    runner.model_config.vocab_size, args.text)  # fmt: skip
    config = SchedulerConfig(
        max_num_batched_tokens=4096, max_num_seqs=max(args.streams), max_model_len=2048,
        block_size=BLOCK_SIZE, num_speculative_tokens=runner.num_speculative_tokens,
        speculative_disable_batch_size=disable_batch_size,
    )  # fmt: skip
    run_engine(runner, workload[:1], config)  # warm-up: oneDNN primitives of these shapes
    run = run_engine(runner, workload, config, timestamps=True)
    stats = run.scheduler.drafts.stats
    tokens = sum(map(len, run.outputs))
    itls = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in run.token_times if len(ts) > 1]
    return {
        "streams": streams, "tok_s": tokens / run.seconds,
        "tokens_per_forward": sum(run.tokens_per_request_step) / len(run.tokens_per_request_step),
        "acceptance": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens
        else None,
        "acceptance_per_pos": [n / stats.num_drafts for n in stats.accepted_per_pos]
        if stats.num_drafts else [],
        "itl_ms": 1e3 * sum(itls) / len(itls), "steps": run.num_steps,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| method | streams | tokens / forward | acceptance | per position | tok/s | "
             "vs off | ITL (ms) |", "|---|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    off = {r["streams"]: r["tok_s"] for r in rows if r["method"] == "off"}
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        per_pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_pos"])
        ratio = r["tok_s"] / off[r["streams"]] if r["streams"] in off else float("nan")
        lines.append(
            f"| {r['method']} | {r['streams']} | {r['tokens_per_forward']:.2f} | {acc} | "
            f"{per_pos} | {r['tok_s']:.0f} | {ratio:.2f}x | {r['itl_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", help="a subset of the method names")
    parser.add_argument("--target", choices=("random", "trained"), default="random")
    parser.add_argument("--out", help="default bench/results/spec.md (spec_trained.md)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir, eagle_dir, args.text = target(args.target)
    draft_dir = truncated_draft(model_dir, Path(f"{model_dir}-1layer"))
    rows = []
    for name, spec in methods(model_dir, draft_dir, eagle_dir).items():
        if args.methods and name not in args.methods:
            continue
        runner = ModelRunner(ExecutorConfig(
            model=str(model_dir), block_size=BLOCK_SIZE, max_num_seqs=max(args.streams),
            max_num_batched_tokens=4096, num_blocks=4096, speculative_config=spec,
        ))  # fmt: skip
        rule = SchedulerConfig().speculative_disable_batch_size if "rule on" in name else NO_RULE
        for streams in args.streams:
            rows.append({"method": name, **measure(runner, streams, args, rule)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        del runner
    text = table(rows)
    print(text)
    trained = args.target == "trained"
    prompts = "prompt tokens cut from held-out docs" if trained else "random prompt tokens"
    weights = "trained on docs/*.md" if trained else "random weights"
    out = args.out or str(RESULTS / ("spec_trained.md" if trained else "spec.md"))
    write_result(
        out, "Speculative decoding (CPU, in process)" + (", a trained target" if trained else ""),
        f"greedy requests of {args.prompt_tokens} {prompts} and {args.output_tokens} output "
        f"tokens on {model_dir.relative_to(ROOT)} ({weights}), scheduler core + model runner "
        "with two steps in flight; the batch rule off.",
        text, {"args": {k: v for k, v in vars(args).items() if k != "text"}, "rows": rows},
    )  # fmt: skip


def target(kind: str) -> tuple[Path, Path, list[int] | None]:
    """The target, its trained eagle3 head (each made first where missing) and the
    token ids prompts are cut from (None: random tokens)."""
    from tools.train_eagle_head import train

    model_dir = ROOT / "models" / "flagstop-tiny"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "tiny")
    if kind == "random":
        eagle_dir = ROOT / "models" / "flagstop-tiny-eagle3"
        if not (eagle_dir / "config.json").exists():
            print(train(model_dir, eagle_dir, 256, 3, 0), flush=True)
        return model_dir, eagle_dir, None
    from tokenizers import Tokenizer

    from tools import train_tiny_model

    trained = ROOT / "models" / "flagstop-tiny-trained"
    eagle_dir = Path(f"{trained}-eagle3")
    if not (trained / "config.json").exists():
        print(train_tiny_model.train(model_dir, trained, 600, 0), flush=True)
    if not (eagle_dir / "config.json").exists():
        print(train(trained, eagle_dir, 256, 3, 0, prompts="docs"), flush=True)
    tokenizer = Tokenizer.from_file(str(trained / "tokenizer.json"))
    held_out = "\n".join(f.read_text() for f in train_tiny_model.docs(held_out=True))
    return trained, eagle_dir, tokenizer.encode(held_out).ids


if __name__ == "__main__":
    main()
