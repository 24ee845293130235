"""One Mixture-of-Experts layer's experts on the CPU, three ways, in interleaved rounds:

    python bench/moe_bench.py [--rounds 5] [--repeats 5] [--out bench/results/moe.md]

- grouped (ours): tokens sorted by expert, one GEMM pair per expert that has tokens on
  oneDNN's prepacked weights, a weighted scatter-add back (torch_moe.grouped_experts,
  as the executor runs it);
- per-expert loop (transformers 5's Qwen3MoeExperts.forward, the naive way): a one-hot
  mask of the choices, then for each expert hit a torch.where over the mask, F.linear
  on the stacked weights, and an index_add_;
- dense: every expert on every token, the non-chosen weighted by zero (what a kernel
  that does not group would do).

Shapes: the small embedded MoE's (hidden 768, 8 experts of 768, top-2) and a layer in
Qwen3-30B-A3B's proportions at a quarter of its width (hidden 512, 128 experts of 192,
top-8). Rows are tokens in the step (1, 16, 64 decodes, a 512-token prefill). CPU
seconds of this process per call, median of --repeats, median over the rounds."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.output import write_result  # noqa: E402 (needs the path above)
from flagstop.executor.models import onednn  # noqa: E402
from flagstop.kernels import torch_moe  # noqa: E402

LAYERS = {  # name -> (hidden, experts, expert size, top-k)
    "small-qwen3_moe (768, 8 x 768, top-2)": (768, 8, 768, 2),
    "Qwen3-30B-A3B-like / 4 (512, 128 x 192, top-8)": (512, 128, 192, 8),
}
TOKENS = (1, 16, 64, 512)


def layer(hidden: int, num_experts: int, inner: int, top_k: int, tokens: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inner, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inner, generator=g) / inner**0.5
    probs = torch.randn(tokens, num_experts, generator=g).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def grouped(x, w13, w2, weights, ids):
    packed = [(onednn.reorder(w13[e]), onednn.reorder(w2[e])) for e in range(len(w13))]

    def expert_mlp(e, rows):
        gate, up = onednn.matmul(rows, packed[e][0]).chunk(2, dim=-1)
        return onednn.matmul(F.silu(gate) * up, packed[e][1])

    return lambda: torch_moe.grouped_experts(x, weights, ids, 0, len(w13), expert_mlp)


def per_expert_loop(x, w13, w2, weights, ids):
    """transformers 5.x Qwen3MoeExperts.forward, verbatim in its steps."""

    def run():
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=len(w13) + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == len(w13):
                continue
            pos, token = torch.where(mask[e])
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, pos, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return run


def dense(x, w13, w2, weights, ids):
    chosen = torch.zeros(x.shape[0], len(w13)).scatter_(1, ids, weights)

    def run():
        gate, up = torch.einsum("th,eih->eti", x, w13).chunk(2, dim=-1)
        y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, w2)
        return torch.einsum("eth,te->th", y, chosen)

    return run


WAYS = {"grouped (ours)": grouped, "per-expert loop (transformers)": per_expert_loop,
        "dense (all experts)": dense}  # fmt: skip


def cpu_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure(args) -> dict:
    results = {}
    for name, shape in LAYERS.items():
        for tokens in TOKENS:
            inputs = layer(*shape, tokens)
            fns = {way: make(*inputs) for way, make in WAYS.items()}
            expected = fns["dense (all experts)"]()
            for fn in fns.values():  # the three compute the same layer
                torch.testing.assert_close(fn(), expected, rtol=1e-3, atol=1e-3)
            times = {way: [] for way in fns}
            for r in range(args.rounds):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                for way in order:
                    times[way].append(cpu_seconds(fns[way], args.repeats))
            results[f"{name}|{tokens}"] = {w: statistics.median(t) * 1e3 for w, t in times.items()}
            print(name, tokens, results[f"{name}|{tokens}"], flush=True)
    return results


def table(results: dict) -> str:
    lines = ["| layer | tokens | " + " | ".join(f"{w} (ms)" for w in WAYS) + " | loop / grouped |",
             "|---|---:|" + "---:|" * (len(WAYS) + 1)]  # fmt: skip
    for key, row in results.items():
        name, tokens = key.split("|")
        ratio = row["per-expert loop (transformers)"] / row["grouped (ours)"]
        cells = " | ".join(f"{row[w]:.2f}" for w in WAYS)
        lines.append(f"| {name} | {tokens} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe.md"))
    args = parser.parse_args()
    results = measure(args)
    text = table(results)
    print(text)
    setup = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; CPU ms "
             f"of one layer's experts, median of {args.repeats} calls, median of "
             f"{args.rounds} interleaved rounds")  # fmt: skip
    write_result(args.out, "MoE experts on the CPU", setup, text, results)


if __name__ == "__main__":
    main()
