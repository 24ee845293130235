"""CPU cost of the router's incremental detokenizer per streamed token: the
byte-level one (tokens' own texts, their bytes through a UTF-8 decoder where a
character spans tokens: what a byte-level fast tokenizer streams through),
tokenizers' DecodeStream alone (other fast tokenizers) and the windowed decode kept
as the fallback for slow ones.

    python bench/detokenizer_bench.py [--streams 64] [--tokens 256] [--repeats 5]
        [--before CHECKOUT]

Each stream replays, one token per add() as the router does for one step's token,
tokens of real text (this repository's README through the embedded model's
byte-level BPE, so multi-byte characters split across tokens occur) and, in a
second column, ids drawn uniformly from the vocabulary as the executor simulator
draws them (a quarter of the embedded vocabulary's tokens are parts of a
character). --before adds the rows of another checkout's router/detokenizer.py.
CPU time of this process (time.process_time), median of --repeats rounds, all in
the same run.
"""

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer

from flagstop.router.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    new_detokenizer,
)
from tools.make_model import write_model

ROOT = Path(__file__).resolve().parents[1]


def streams(tokenizer, num_streams: int, num_tokens: int) -> list[tuple[list[int], list[int]]]:
    ids = tokenizer((ROOT / "README.md").read_text(), add_special_tokens=False).input_ids
    step = max(1, (len(ids) - num_tokens - 8) // num_streams)
    return [(ids[i * step : i * step + 8], ids[i * step + 8 : i * step + 8 + num_tokens])
            for i in range(num_streams)]  # fmt: skip


def random_streams(tokenizer, num_streams: int, num_tokens: int) -> list:
    """The same prompts, then ids drawn as the executor simulator draws them."""
    rng = random.Random(0)
    return [(prompt, [rng.randrange(len(tokenizer)) for _ in range(num_tokens)])
            for prompt, _ in streams(tokenizer, num_streams, num_tokens)]  # fmt: skip


def before_rows(checkout: str) -> list[tuple[str, object]]:
    """Another checkout's detokenizers, loaded from its file beside ours."""
    path = Path(checkout) / "router" / "detokenizer.py"
    spec = importlib.util.spec_from_file_location("detokenizer_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rev = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or checkout  # fmt: skip
    return [(f"before ({rev}): its new_detokenizer", module.new_detokenizer)]


def cpu_us_per_token(make, tokenizer, work, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        started = time.process_time()
        for prompt, generated in work:
            detokenizer = make(tokenizer, prompt)
            for i, token_id in enumerate(generated):
                detokenizer.add([token_id], final=i == len(generated) - 1)
        rounds.append(time.process_time() - started)
    return statistics.median(rounds) * 1e6 / sum(len(g) for _, g in work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--before", help="another checkout's rows beside")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "detokenizer.md"))
    args = p.parse_args()
    model = write_model(Path(tempfile.mkdtemp()) / "flagstop-tiny", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    works = (streams(tokenizer, args.streams, args.tokens),
             random_streams(tokenizer, args.streams, args.tokens))  # fmt: skip
    makers = [("windowed decode (slow tokenizers)", IncrementalDetokenizer),
              ("DecodeStream alone (other fast tokenizers)", StreamDetokenizer),
              ("byte-level: own texts, bytes between (byte-level fast tokenizers)",
               new_detokenizer), *(before_rows(args.before) if args.before else [])]  # fmt: skip
    rows = [(name, *(cpu_us_per_token(make, tokenizer, work, args.repeats) for work in works))
            for name, make in makers]  # fmt: skip
    before = f" --before {args.before}" if args.before else ""
    lines = [
        "# Detokenizer: CPU per streamed token",
        "",
        f"`python bench/detokenizer_bench.py --streams {args.streams} --tokens {args.tokens} "
        f"--repeats {args.repeats}{before}` on {date.today()}: {args.streams} streams of "
        f"{args.tokens} tokens, one add() per token, median CPU time of {args.repeats} rounds.",
        "",
        "| detokenizer | CPU µs / token, README text | uniform random ids |",
        "|---|---:|---:|",
        *(f"| {name} | {text:.2f} | {drawn:.2f} |" for name, text, drawn in rows),
        "",
        f"On text, DecodeStream costs {rows[1][1] / rows[0][1]:.2f}x the windowed decode, "
        f"the byte-level one {rows[2][1] / rows[1][1]:.2f}x DecodeStream.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
