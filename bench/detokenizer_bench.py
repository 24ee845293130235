"""CPU cost of the router's incremental detokenizer per streamed token: byte-level
tokens' own texts with DecodeStream between (what a byte-level fast tokenizer
streams through), tokenizers' DecodeStream alone (other fast tokenizers) and the
windowed decode kept as the fallback for slow ones.

    python bench/detokenizer_bench.py [--streams 64] [--tokens 256] [--repeats 5]

Each stream replays tokens of real text (this repository's README through the
embedded model's byte-level BPE, so multi-byte characters split across tokens occur)
one token per add(), as the router does for one step's token. CPU time of this
process (time.process_time), median of --repeats rounds, both in the same run.
"""

import argparse
import statistics
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
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "detokenizer.md"))
    args = p.parse_args()
    model = write_model(Path(tempfile.mkdtemp()) / "flagstop-tiny", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    work = streams(tokenizer, args.streams, args.tokens)
    rows = [(name, cpu_us_per_token(make, tokenizer, work, args.repeats))
            for name, make in (("windowed decode (before; slow tokenizers)",
                                IncrementalDetokenizer),
                               ("DecodeStream alone (fast tokenizers)", StreamDetokenizer),
                               ("own texts, DecodeStream between (byte-level fast "
                                "tokenizers)", new_detokenizer))]  # fmt: skip
    lines = [
        "# Detokenizer: CPU per streamed token",
        "",
        f"`python bench/detokenizer_bench.py --streams {args.streams} --tokens {args.tokens} "
        f"--repeats {args.repeats}` on {date.today()}: {args.streams} streams of "
        f"{args.tokens} tokens, one add() per token, median CPU time of {args.repeats} rounds.",
        "",
        "| detokenizer | CPU µs / token |",
        "|---|---:|",
        *(f"| {name} | {us:.2f} |" for name, us in rows),
        "",
        f"DecodeStream costs {rows[1][1] / rows[0][1]:.2f}x the windowed decode, own texts "
        f"{rows[2][1] / rows[1][1]:.2f}x DecodeStream.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
