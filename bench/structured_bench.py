"""Structured outputs: what constraining costs, and why the grammar engine is llguidance.

    python bench/structured_bench.py [--size tiny] [--rounds 3] [--engines]

1. Throughput: the same workload (--requests concurrent requests of --max-tokens
   tokens each) through a real stack (router -> scheduler -> executor), with none,
   half and all of the requests constrained. A constrained request follows a JSON
   schema (an array of at least 100 objects with enums, integers and bounded strings)
   or a regex (100 `key=digits;` items), alternately, neither of which can end before
   max_tokens: every run makes the same number of tokens. Unconstrained requests
   ignore EOS. Rounds interleave the three mixes; the table gives medians of output
   tokens/s (wall) and of the executor's CPU time per token (its own /proc counters,
   steadier than wall time on a shared machine).
2. Compile time: a fresh GrammarBook compiling each test case cold (a new process's
   first request of that grammar), then cached (what every later request pays: a
   lookup and a copy of the compiled matcher); the router's check beside it.
3. --engines (needs `pip install -e '.[bench]'` for xgrammar): xgrammar and
   llguidance side by side on this machine: compile time, mask time per token, and
   how many of --walks random walks through the schema (a uniformly random allowed
   token each step: the random-weight model's behaviour, without the model) end in
   output that Python's json module or UTF-8 decoding refuses.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from bench.serve_bench import cpu_seconds
from flagstop.executor.grammar_book import GrammarBook
from flagstop.structured import check, constraint_from_proto
from flagstop.v1 import generation_pb2
from tools.make_model import write_model
from tools.stack import generate, start_stack

RESULTS = Path(__file__).parent / "results"
ITEM = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["router", "scheduler", "executor"]},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "name": {"type": "string", "maxLength": 12},
    },
    "required": ["kind", "port", "name"],
    "additionalProperties": False,
}
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 100}},
    "required": ["items"],
    "additionalProperties": False,
}
LONG_REGEX = r"([a-z]{2,8}=[0-9]{1,3}; ){100}"
CASES = {  # the test suite's cases (tests/test_structured.py), compiled cold and cached
    "json schema (nested, enums)": generation_pb2.StructuredOutputs(
        json_schema=json.dumps(LONG_SCHEMA), strict=True
    ),
    "any JSON object": generation_pb2.StructuredOutputs(json_object=True),
    "regex (a date)": generation_pb2.StructuredOutputs(
        regex=r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    ),
    "choice (3)": generation_pb2.StructuredOutputs(
        choice=generation_pb2.Choices(choices=["positive", "negative", "neutral"])
    ),
    "grammar (EBNF arithmetic)": generation_pb2.StructuredOutputs(
        grammar='root ::= expr\nexpr ::= term (("+" | "-") term){0,3}\n'
        'term ::= num (("*" | "/") num){0,2}\nnum ::= [1-9] [0-9]{0,2}\n'
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--engines", action="store_true")
    p.add_argument("--walks", type=int, default=200)
    p.add_argument("--out", default=str(RESULTS / "structured.md"))
    return p.parse_args()


def constraint_message(i: int) -> generation_pb2.StructuredOutputs:
    if i % 2 == 0:
        return generation_pb2.StructuredOutputs(json_schema=json.dumps(LONG_SCHEMA), strict=True)
    return generation_pb2.StructuredOutputs(regex=LONG_REGEX)


def run_mix(stack, args, percent: int) -> tuple[float, float]:
    """(output tokens/s, executor CPU ms per token) of one run."""
    num_constrained = args.requests * percent // 100

    def one(i: int) -> int:
        fields: dict = {"prompt": f"Request {i}: the scheduler", "max_tokens": args.max_tokens,
                        "temperature": 1.0, "seed": i}  # fmt: skip
        if i < num_constrained:
            fields["structured_outputs"] = constraint_message(i)
        else:
            fields["ignore_eos"] = True
        tokens, _, _ = generate(stack, timeout=600, **fields)
        return len(tokens)

    pid = stack.processes["executor"].pid
    cpu, started = cpu_seconds(pid), time.perf_counter()
    with ThreadPoolExecutor(args.requests) as pool:
        num_tokens = sum(pool.map(one, range(args.requests)))
    wall, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    assert num_tokens == args.requests * args.max_tokens, num_tokens
    return num_tokens / wall, cpu / num_tokens * 1e3


def throughput(args, model_dir: Path) -> tuple[str, dict]:
    mixes = (0, 50, 100)
    runs: dict[int, list[tuple[float, float]]] = {m: [] for m in mixes}
    with tempfile.TemporaryDirectory() as logs:
        stack = start_stack(model_dir, Path(logs), executor_args=["--num-blocks", "1024"])
        try:
            for m in mixes:  # warm-up: compiles the two grammars, fills the caches
                run_mix(stack, args, m)
            for r in range(args.rounds):
                for m in mixes if r % 2 == 0 else reversed(mixes):
                    runs[m].append(run_mix(stack, args, m))
                    print(f"round {r}, {m}% constrained: {runs[m][-1][0]:.0f} tokens/s")
        finally:
            stack.stop()
    rows = ["| constrained | output tokens/s (median) | vs none | executor CPU ms/token "
            "(median) | vs none |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    base_tps = statistics.median(t for t, _ in runs[0])
    base_cpu = statistics.median(c for _, c in runs[0])
    data = {}
    for m in mixes:
        tps, cpu = (
            statistics.median(t for t, _ in runs[m]),
            statistics.median(c for _, c in runs[m]),
        )
        data[m] = {"tokens_per_s": tps, "cpu_ms_per_token": cpu, "runs": runs[m]}
        rows.append(f"| {m}% | {tps:.0f} | {tps / base_tps:.2f}x | {cpu:.2f} | "
                    f"{cpu / base_cpu:.2f}x |")  # fmt: skip
    return "\n".join(rows), data


def compile_times(model_dir: Path, vocab_size: int) -> tuple[str, dict]:
    book = GrammarBook(str(model_dir), vocab_size, [1], 16)
    rows = ["| constraint | router check (ms) | executor compile, cold (ms) | cached: "
            "lookup + matcher copy (us) |", "|---|---:|---:|---:|"]  # fmt: skip
    data = {}
    for name, message in CASES.items():
        constraint = constraint_from_proto(message)
        started = time.perf_counter()
        check.__wrapped__(constraint)  # uncached, as for a schema the router has not seen
        checked = time.perf_counter() - started
        cold = book.compile(constraint)
        started = time.perf_counter()
        for row in range(8):
            book.add(row, constraint, [])
        cached = (time.perf_counter() - started) / 8
        data[name] = {"check_ms": checked * 1e3, "cold_ms": cold * 1e3, "cached_us": cached * 1e6}
        rows.append(f"| {name} | {checked * 1e3:.2f} | {cold * 1e3:.1f} | {cached * 1e6:.0f} |")
    data["mask_ms_per_step"] = mask_ms = step_mask_ms(book, vocab_size)
    rows.append(f"\nMasking a step of 16 rows of the long schema (GrammarBook.mask + accept, "
                f"in process): {mask_ms:.3f} ms.")  # fmt: skip
    return "\n".join(rows), data


def step_mask_ms(book: GrammarBook, vocab_size: int, num_rows: int = 16, steps: int = 200):
    constraint = constraint_from_proto(constraint_message(0))
    book.compile(constraint)
    for row in range(num_rows):
        book.add(row, constraint, [])
    rows, rng, elapsed = np.arange(num_rows), np.random.default_rng(0), 0.0
    for _ in range(steps):
        logits = torch.randn(num_rows, vocab_size)
        started = time.perf_counter()
        constrained = book.mask(logits, rows)
        elapsed += time.perf_counter() - started
        tokens = [int(rng.choice(torch.isfinite(row).nonzero().flatten())) for row in logits]
        started = time.perf_counter()
        book.accept(constrained, tokens)
        elapsed += time.perf_counter() - started
    return elapsed / steps * 1e3


def engines(args, model_dir: Path, vocab_size: int) -> tuple[str, dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    schema = json.dumps(TEST_SCHEMA)
    results = {"llguidance": _walk_llguidance(tokenizer, vocab_size, schema, args.walks)}
    try:
        results["xgrammar"] = _walk_xgrammar(tokenizer, vocab_size, schema, args.walks)
    except ImportError:
        print("xgrammar is not installed (pip install -e '.[bench]'): llguidance alone")
    rows = ["| engine | compile (ms) | mask per token (us, mean) | walks refused by "
            "json.loads or UTF-8 |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, r in results.items():
        rows.append(f"| {name} | {r['compile_ms']:.2f} | {r['mask_us']:.1f} | "
                    f"{r['invalid']} of {r['walks']} |")  # fmt: skip
    return "\n".join(rows), results


# A nested schema of the kind tests/test_structured.py holds the engine to: bounded
# strings (where xgrammar admits control characters), enums, a required sub-object.
TEST_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "role": {"enum": ["router", "scheduler", "executor"]},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 64},
        "owner": {"type": "object", "properties": {"team": {"type": "string", "maxLength": 8}},
                  "required": ["team"], "additionalProperties": False},
    },
    "required": ["name", "role", "replicas", "owner"],
    "additionalProperties": False,
}  # fmt: skip


def _valid(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except ValueError:
        return False
    return True


def _walk(new_matcher, fill, accept, done, vocab_size: int, walks: int, to_bytes):
    rng = np.random.default_rng(0)
    mask_s, num_masks, invalid = 0.0, 0, 0
    for _ in range(walks):
        matcher, tokens = new_matcher(), []
        while not done(matcher) and len(tokens) < 400:
            started = time.perf_counter()
            allowed = fill(matcher)
            mask_s, num_masks = mask_s + time.perf_counter() - started, num_masks + 1
            token = int(rng.choice(allowed))
            if token == 1:  # EOS
                break
            accept(matcher, token)
            tokens.append(token)
        invalid += not _valid(to_bytes(tokens))
    return mask_s / num_masks * 1e6, invalid


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return np.flatnonzero(bits.flatten()[:vocab_size].numpy())


def _token_bytes(tokenizer):
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = [bytes(byte_decoder[c] for c in piece) if i > 2 else b"" for i, piece in
             enumerate(pieces)]  # fmt: skip
    return lambda tokens: b"".join(table[t] for t in tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the embedded tokenizer's), byte -> character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


def _walk_llguidance(tokenizer, vocab_size: int, schema: str, walks: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=[1])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False}
    )
    started = time.perf_counter()
    template = llguidance.LLMatcher(info, grammar, log_level=0)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    llguidance.torch.fill_next_token_bitmask(template, bitmask, 0)
    compile_ms = (time.perf_counter() - started) * 1e3

    def fill(m):
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        return _allowed(bitmask, vocab_size)

    mask_us, invalid = _walk(template.deep_copy, fill, lambda m, t: m.consume_token(t),
                             lambda m: m.is_stopped(), vocab_size, walks,
                             _token_bytes(tokenizer))  # fmt: skip
    return {"compile_ms": compile_ms, "mask_us": mask_us, "invalid": invalid, "walks": walks}


def _walk_xgrammar(tokenizer, vocab_size: int, schema: str, walks: int) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[1])  # fmt: skip
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    compile_ms = (time.perf_counter() - started) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def fill(m):
        m.fill_next_token_bitmask(bitmask)
        return _allowed(bitmask, vocab_size)

    mask_us, invalid = _walk(lambda: xgr.GrammarMatcher(compiled), fill,
                             lambda m, t: m.accept_token(t), lambda m: m.is_terminated(),
                             vocab_size, walks, _token_bytes(tokenizer))  # fmt: skip
    return {"compile_ms": compile_ms, "mask_us": mask_us, "invalid": invalid, "walks": walks}


def main() -> None:
    args = parse_args()
    model_dir = Path(__file__).resolve().parents[1] / "models" / f"flagstop-{args.size}"
    if not (model_dir / "config.json").exists():
        write_model(model_dir, args.size)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    sections, data = [], {}
    if args.engines:
        table, data["engines"] = engines(args, model_dir, vocab_size)
        sections.append(f"Grammar engines on the test schema, {args.walks} random walks "
                        f"each ({vocab_size}-token vocabulary):\n\n{table}")  # fmt: skip
    table, data["compile"] = compile_times(model_dir, vocab_size)
    sections.append(f"Compile time, cold and cached ({vocab_size}-token vocabulary):\n\n{table}")
    table, data["throughput"] = throughput(args, model_dir)
    sections.insert(0, f"{args.requests} concurrent requests x {args.max_tokens} tokens, "
                       f"temperature 1, {args.rounds} rounds interleaved:\n\n{table}")  # fmt: skip
    print("\n\n".join(sections))
    write_result(args.out, "Structured outputs", f"the {args.size} model, a 3-process stack.",
                 "\n\n".join(sections), data)  # fmt: skip


if __name__ == "__main__":
    main()
