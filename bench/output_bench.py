"""What reading a chat choice's output costs the router per streamed chunk: the chat
builder's fold of a chunk into its delta (router/openai/bodies.py) through each
output reader, and the chunk's SSE bytes, on one token a chunk as streams arrive:

    plain       no tool parser, no reasoning parser (the default path)
    hermes      --tool-call-parser hermes over text with no call
    hermes+call ... over a reply that is one call (held, given out whole at its end)
    qwen3       --reasoning-parser qwen3 then hermes: reasoning, then an answer
    harmony     gpt-oss' harmony, read token by token by openai-harmony's parser

    python bench/output_bench.py [--chunks 20000] [--repeats 5] [--out bench/results/output.md]

CPU microseconds per chunk (time.process_time, the best of --repeats runs). Needs the
o200k vocabulary for the harmony row (python -m tools.harmony_vocab), else skips it."""

import argparse
import time
from pathlib import Path

from flagstop.router.openai.bodies import Choice, ResponseBuilder
from flagstop.router.openai.outputs import PlainOutput, TextOutput
from flagstop.router.openai.reasoning import FORMATS, NoReasoning, ThinkParser
from flagstop.router.openai.sse import sse
from flagstop.router.openai.tool_parsers import Hermes
from flagstop.v1 import generation_pb2

RESULTS = Path(__file__).parent / "results"
WORDS = "The scheduler keeps the accelerator busy by letting requests join the batch. "
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


def pieces(text: str, n: int) -> list[str]:
    """n chunks of a few characters each, as a byte-level tokenizer's tokens come."""
    out, i = [], 0
    while len(out) < n:
        step = 1 + (i * 7) % 5
        out.append(text[i % len(text) : i % len(text) + step] or " ")
        i += step
    return out


def text_cases(n: int) -> dict[str, tuple]:
    plain = pieces(WORDS, n)
    call = pieces(CALL, len(CALL))
    thought = pieces("<think>" + WORDS * (n // len(WORDS) + 1), n // 2)
    return {
        "plain": (PlainOutput, plain),
        "hermes": (lambda: TextOutput(NoReasoning(), Hermes(), True), plain),
        "hermes+call": (lambda: TextOutput(NoReasoning(), Hermes(), True),
                        (call * (n // len(call) + 1))[:n]),
        "qwen3": (lambda: TextOutput(ThinkParser(FORMATS["qwen3"], False), Hermes(), True),
                  [*thought, "</think>", *plain[: n - len(thought) - 1]]),
    }  # fmt: skip


def harmony_case(n: int):
    try:
        from flagstop.router.openai.harmony import HarmonyOutput, load_encoding

        encoding = load_encoding()
    except Exception as e:  # no vocabulary here: the row is skipped
        print(f"harmony skipped: {e}")
        return None
    analysis = encoding.encode("<|channel|>analysis<|message|>", allowed_special="all")
    body = encoding.encode(WORDS * (n // 10))[: n - len(analysis)]
    return lambda: HarmonyOutput(encoding, True), [[t] for t in [*analysis, *body]]


def run(make, chunks: list, repeats: int) -> float:
    """CPU microseconds per chunk, the best of repeats."""
    best = float("inf")
    for _ in range(repeats):
        builder = ResponseBuilder("chat", "m", str, with_logprobs=False)
        choice = Choice(0, output=make())
        messages = [generation_pb2.GenerateResponse(token_ids=[7], text=c)
                    if isinstance(c, str) else generation_pb2.GenerateResponse(token_ids=c)
                    for c in chunks]  # fmt: skip
        started = time.process_time()
        for message in messages:
            piece = builder.apply(choice, message)
            if piece is not None:
                sse(builder.chunk([piece]))
        best = min(best, (time.process_time() - started) / len(chunks) * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "output.md"))
    args = parser.parse_args()
    cases = text_cases(args.chunks)
    if (harmony := harmony_case(args.chunks)) is not None:
        cases["harmony"] = harmony
    rows = [(name, run(make, chunks, args.repeats)) for name, (make, chunks) in cases.items()]
    lines = ["| output reader | CPU µs per chunk (fold + SSE bytes) |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    table = "\n".join(lines)
    print(table)
    Path(args.out).write_text(
        "# Reading a chat choice's output, per streamed chunk\n\n"
        f"`python bench/output_bench.py --chunks {args.chunks}`\n\n{table}\n"
    )


if __name__ == "__main__":
    main()
