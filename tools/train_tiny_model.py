"""The embedded model's architecture trained on flagstop's own docs: a target with
something to learn, for measuring drafts (docs/speculative.md).

    python -m tools.train_tiny_model --out models/flagstop-tiny-trained   (make trained-model)

The embedded checkpoint (`make model`) has random weights: its greedy text is as
good as uniform noise over the vocabulary (a bigram table of 12k of its tokens
predicts 0.4 % of the next, chance), so no draft method can be measured on it. This
one starts from the same checkpoint (its config, tokenizer and seeded weights) and
learns next-token prediction on docs/*.md (about 195k tokens of the embedded
tokenizer) for a few minutes: a small language model whose text has the regularities
drafts exist for. Its last DOCS_HELD_OUT docs are left out, for held-out prompts.
The docs change with the code, so the weights are those of the checkout's docs.

Written with torch and transformers' own model (its loss): the loop is ~30 lines."""

import argparse
import math
import random
import shutil
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS_HELD_OUT = 3  # docs/*.md by name, the last ones: the held-out prompts' text
SEQUENCE = 128
BATCH = 16


def docs(held_out: bool) -> list[Path]:
    """The training docs, or the held-out ones."""
    files = sorted((ROOT / "docs").glob("*.md"))
    return files[-DOCS_HELD_OUT:] if held_out else files[:-DOCS_HELD_OUT]


def token_ids(tokenizer, files: list[Path]) -> torch.Tensor:
    return torch.tensor(tokenizer("\n".join(f.read_text() for f in files)).input_ids)


def train(base: Path, out: Path, steps: int, seed: int, lr: float = 3e-3) -> dict:
    """`base` (the embedded checkpoint) trained for `steps` batches, written to `out`
    in the same layout; its losses."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    ids, rng = token_ids(tokenizer, docs(held_out=False)), random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _cosine(s, steps))
    losses, started = [], time.monotonic()
    model.train()
    for _ in range(steps):
        starts = [rng.randrange(len(ids) - SEQUENCE) for _ in range(BATCH)]
        batch = torch.stack([ids[s : s + SEQUENCE] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    _save(model.eval(), base, out)
    return {"steps": steps, "tokens": steps * BATCH * SEQUENCE, "first_loss": losses[0],
            "last_loss": sum(losses[-20:]) / len(losses[-20:]),
            "held_out_loss": held_out_loss(model, tokenizer),
            "seconds": round(time.monotonic() - started)}  # fmt: skip


def _cosine(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def held_out_loss(model, tokenizer) -> float:
    ids = token_ids(tokenizer, docs(held_out=True))
    windows = ids[: len(ids) // SEQUENCE * SEQUENCE].view(-1, SEQUENCE)[:64]
    return model(input_ids=windows, labels=windows).loss.item()


def _save(model, base: Path, out: Path) -> None:
    """The weights, beside the base checkpoint's other files (its tokenizer, and its
    config.json as make model wrote it: the same architecture)."""
    model.save_pretrained(out)
    shutil.copytree(base, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.train_tiny_model", description=__doc__)
    parser.add_argument("--base", type=Path, default=Path("models/flagstop-tiny"))
    parser.add_argument("--out", type=Path, default=Path("models/flagstop-tiny-trained"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(train(args.base, args.out, args.steps, args.seed))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
