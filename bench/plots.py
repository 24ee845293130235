"""The README's charts, from the results of bench/peers.py, bench/serve_bench.py and
bench/overhead_bench.py, drawn with matplotlib (the bench extra).

    python bench/plots.py [--results bench/results]

occupancy.png: batch slots over forward steps, static batching (transformers
generate()) above continuous batching (ours), from the same workload's real runs;
one colour per request, grey for an idle slot. serving.png: output throughput and
p99 TTFT against the request rate. overhead.png (and overhead_router.png,
overhead_levers.png, overhead_spec.png): delivered tokens/s and the router's CPU per
token against the number of streams, a line per variant. spec.png: speculative
decoding's tok/s against speculation off and its tokens per forward, a line per
proposer.
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

IDLE = "#eeeeee"
# tab20 without its two greys, which would read as idle slots.
REQUEST_COLOURS = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15)]


def slot_rows(steps: list[list[str]], num_slots: int) -> list[list[str | None]]:
    """Per step, which request holds each slot: a request keeps the slot it was given
    on its first step until it leaves; a newcomer takes the lowest free slot."""
    holder: dict[str, int] = {}
    rows = []
    for running in steps:
        present = set(running)
        holder = {req: slot for req, slot in holder.items() if req in present}
        free = iter(sorted(set(range(num_slots)) - set(holder.values())))
        for req in running:
            if req not in holder:
                holder[req] = next(free)
        row: list[str | None] = [None] * num_slots
        for req, slot in holder.items():
            row[slot] = req
        rows.append(row)
    return rows


def slot_image(steps: list[list[str]], num_slots: int, width: int) -> np.ndarray:
    """[slot, step] colour indices: 0 idle, else 1 + the request's number mod the
    number of request colours."""
    image = np.zeros((num_slots, width), np.int64)
    for step, row in enumerate(slot_rows(steps, num_slots)):
        for slot, req in enumerate(row):
            if req is not None:
                image[slot, step] = 1 + int(req[1:]) % len(REQUEST_COLOURS)
    return image


def occupancy_chart(peers: dict, out: Path, num_slots: int = 16) -> None:
    static, continuous = peers["occupancy"]["static"], peers["occupancy"]["continuous"]
    longest = max(len(static), len(continuous))
    idle = peers["idle"]
    colours = ListedColormap([IDLE, *REQUEST_COLOURS])
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.2), sharex=True, constrained_layout=True)
    panels = [
        (f"static batching, transformers generate(): {len(static)} steps, "
         f"{idle['static']:.0%} of slot-steps idle", static),
        (f"continuous batching, flagstop: {len(continuous)} steps, "
         f"{idle['continuous']:.0%} of slot-steps idle", continuous),
    ]  # fmt: skip
    for ax, (title, steps) in zip(axes, panels, strict=True):
        image = slot_image(steps, num_slots, longest)
        ax.imshow(image, aspect="auto", interpolation="nearest", cmap=colours,
                  vmin=0, vmax=len(REQUEST_COLOURS), extent=(0, longest, num_slots, 0))  # fmt: skip
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel("batch slot")
        ax.set_yticks(range(0, num_slots + 1, 4))
    axes[-1].set_xlabel("forward step (one colour per request, light grey: idle slot)")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def spans_decades(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) / min(positive) >= 10


def serving_chart(serve: dict, out: Path) -> None:
    """Throughput and p99 TTFT against the request rate (inf: all at once, drawn at
    the right end)."""
    results = serve["results"]
    labels = ["inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}" for r in results]
    x = np.arange(len(results))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    for ax, key, title, colour in (
        (left, "output_throughput", "output tokens/s", "tab:blue"),
        (right, "p99_ttft_ms", "p99 time to first token (ms)", "tab:red"),
    ):
        values = [r[key] for r in results]
        ax.plot(x, values, marker="o", color=colour, label=title)
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(title)
        if spans_decades(values):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def overhead_chart(overhead: dict, out: Path, step_ms: float = 8.0) -> None:
    """Delivered tokens/s and router CPU per token against streams, a line per variant
    (streams on a log axis: 64 to 1024)."""
    rows = [r for r in overhead["rows"] if r["step_ms"] == step_ms]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
    for ax, key, title in (
        (left, "tok_s", f"delivered tokens/s at {step_ms:g} ms steps"),
        (right, "router_us_per_token", "router CPU µs per delivered token"),
    ):
        for variant in variants:
            mine = [r for r in rows if r["variant"] == variant]
            ax.plot([r["streams"] for r in mine], [r[key] for r in mine], marker="o",
                    label=variant or "this checkout")  # fmt: skip
        ax.set_xscale("log", base=2)
        streams = sorted({r["streams"] for r in rows})
        ax.set_xticks(streams, [str(n) for n in streams])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(title)
        if spans_decades([r[key] for r in rows]):
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def spec_chart(spec: dict, out: Path) -> None:
    """Speculative decoding (bench/spec_bench.py): output tok/s relative to speculation
    off, and tokens per target forward, against streams, a line per method."""
    rows = spec["rows"]
    off = {r["streams"]: r["tok_s"] for r in rows if r["method"] == "off"}
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "off"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        streams = [r["streams"] for r in mine]
        left.plot(streams, [r["tok_s"] / off[r["streams"]] for r in mine], marker="o",
                  label=method)  # fmt: skip
        right.plot(streams, [r["tokens_per_forward"] for r in mine], marker="o", label=method)
    for ax, label in ((left, "output tok/s / speculation off"),
                      (right, "tokens per target forward")):  # fmt: skip
        ax.set_xscale("log", base=2)
        streams = sorted({r["streams"] for r in rows})
        ax.set_xticks(streams, [str(n) for n in streams])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="best", fontsize=8)
    left.axhline(1.0, color="grey", linewidth=0.8)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def slo_chart(slo: dict, out: Path) -> None:
    """Goodput (requests meeting both targets per second) against the load, a panel
    per trace, a line per policy (bench/slo_bench.py)."""
    fig, axes = plt.subplots(1, len(slo), figsize=(6 * len(slo), 4.2), constrained_layout=True)
    for ax, (trace, by_load) in zip(np.atleast_1d(axes), slo.items(), strict=True):
        loads = list(by_load)
        for policy in next(iter(by_load.values())):
            ax.plot(loads, [by_load[x][policy]["goodput_rps"] for x in loads], marker="o",
                    label=policy)  # fmt: skip
        ax.set_title(trace)
        ax.set_xlabel("load (x the simulated executor's capacity)")
        ax.set_ylabel("goodput (requests/s meeting TTFT and TPOT)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def fairness_chart(fairness: dict, out: Path) -> None:
    """The light tenant's TTFT beside the heavy one over its TTFT alone (mean and p99),
    a group per trace, a bar per policy, each with the floor its run set (a black mark;
    bench/slo_bench.py)."""
    fig, ax = plt.subplots(figsize=(9, 4.2), constrained_layout=True)
    traces = list(fairness)
    policies = [p for p in fairness[traces[0]] if p not in ("light alone", "fcfs")]
    width = 0.8 / (2 * len(policies))
    for j, (policy, stat) in enumerate((p, s) for p in policies for s in ("mean", "p99")):
        alone = [fairness[t]["light alone"][f"ttft_{stat}_ms_by_tenant"]["light"] for t in traces]
        runs = [fairness[t][policy] for t in traces]
        ratios = [
            r[f"ttft_{stat}_ms_by_tenant"]["light"] / a for r, a in zip(runs, alone, strict=True)
        ]
        x = np.arange(len(traces)) + j * width
        ax.bar(x, ratios, width, label=f"{policy}: {stat}")
        floors = [r[f"light_floor_{stat}_ms"] / a for r, a in zip(runs, alone, strict=True)]
        ax.hlines(floors, x - width / 2, x + width / 2, colors="black", lw=2,
                  label="the floor beside the heavy one" if j == 0 else None)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(np.arange(len(traces)) + width * (2 * len(policies) - 1) / 2, traces)
    ax.set_ylabel("light tenant's TTFT beside the heavy one / alone")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="best")
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    occupancy_chart(json.loads((args.results / "peers.json").read_text()),
                    args.results / "occupancy.png")  # fmt: skip
    serving_chart(json.loads((args.results / "serve.json").read_text()),
                  args.results / "serving.png")  # fmt: skip
    if (args.results / "spec.json").exists():
        spec_chart(json.loads((args.results / "spec.json").read_text()), args.results / "spec.png")
    if (args.results / "slo.json").exists():
        slo_chart(json.loads((args.results / "slo.json").read_text()), args.results / "slo.png")
    for name in ("overhead", "overhead_router", "overhead_levers", "overhead_spec"):
        if (args.results / f"{name}.json").exists():
            overhead_chart(json.loads((args.results / f"{name}.json").read_text()),
                           args.results / f"{name}.png")  # fmt: skip
    print(f"wrote the charts in {args.results}")


if __name__ == "__main__":
    main()
