"""The README's charts, from the results of bench/peers.py and bench/serve_bench.py.

    python bench/plots.py [--results bench/results]

occupancy.png: batch slots over forward steps, static batching (transformers
generate()) above continuous batching (ours), from the same workload's real runs;
one colour per request, grey for an idle slot. serving.png: output throughput and
p99 TTFT against the request rate.
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench.png import BLACK, GREY, LIGHT, PALETTE, WHITE, Canvas

WIDTH, LANE, MARGIN = 1200, 12, 70


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


def draw_occupancy(canvas: Canvas, top: int, title: str, steps, num_slots, x_scale) -> None:
    canvas.text(MARGIN, top, title)
    top += 22
    for step, row in enumerate(slot_rows(steps, num_slots)):
        x = MARGIN + step * x_scale
        for slot, req in enumerate(row):
            color = LIGHT if req is None else PALETTE[int(req[1:]) % len(PALETTE)]
            y = top + slot * LANE
            canvas.rect(x, y + 1, x + x_scale, y + LANE - 1, color)
    canvas.text(MARGIN - 8, top + num_slots * LANE / 2 - 7, "SLOTS", GREY, 1, "right")


def occupancy_chart(peers: dict, out: Path, num_slots: int = 16) -> None:
    static, continuous = peers["occupancy"]["static"], peers["occupancy"]["continuous"]
    longest = max(len(static), len(continuous))
    x_scale = (WIDTH - 2 * MARGIN) / longest
    panel = num_slots * LANE + 50
    canvas = Canvas(WIDTH, 2 * panel + 70)
    idle = peers["idle"]
    titles = [
        f"static batching, transformers generate(): {len(static)} steps, "
        f"{idle['static']:.0%} of slot-steps idle",
        f"continuous batching, flagstop: {len(continuous)} steps, {idle['continuous']:.0%} idle",
    ]
    for i, (title, steps) in enumerate(zip(titles, (static, continuous), strict=True)):
        draw_occupancy(canvas, 20 + i * panel, title, steps, num_slots, x_scale)
    axis_y = 2 * panel + 20
    canvas.line(MARGIN, axis_y, WIDTH - MARGIN, axis_y, BLACK)
    for step in range(0, longest + 1, tick_step(longest)):
        x = MARGIN + step * x_scale
        canvas.line(x, axis_y, x, axis_y + 5, BLACK)
        canvas.text(x, axis_y + 9, str(step), BLACK, 1, "center")
    canvas.text(WIDTH / 2, axis_y + 25, "forward steps (one colour per request, grey: idle slot)",
                GREY, 1, "center")  # fmt: skip
    canvas.save(out)


def tick_step(span: float) -> float:
    raw = span / 8
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def line_chart(canvas: Canvas, box: tuple[int, int, int, int], title: str, labels: list[str],
               series: list[tuple[list[float], tuple]], x_label: str) -> None:  # fmt: skip
    """One line per (values, color) over the same x labels."""
    x0, y0, x1, y1 = box
    canvas.text((x0 + x1) / 2, y0 - 30, title, BLACK, 2, "center")
    canvas.line(x0, y1, x1, y1, BLACK)
    canvas.line(x0, y0, x0, y1, BLACK)
    top = max(max(values) for values, _ in series) * 1.15 or 1
    step = tick_step(top)
    tick = 0.0
    while tick <= top:
        y = y1 - (y1 - y0) * tick / top
        canvas.line(x0 + 1, y, x1, y, LIGHT)
        canvas.text(x0 - 6, y - 3, f"{tick:g}", BLACK, 1, "right")
        tick += step
    xs = [x0 + (x1 - x0) * (i + 0.5) / len(labels) for i in range(len(labels))]
    for values, color in series:
        points = [(x, y1 - (y1 - y0) * v / top) for x, v in zip(xs, values, strict=True)]
        for (ax, ay), (bx, by) in itertools.pairwise(points):
            canvas.line(ax, ay, bx, by, color, 3)
        for x, y in points:
            canvas.rect(x - 4, y - 4, x + 4, y + 4, color)
    for x, label in zip(xs, labels, strict=True):
        canvas.text(x, y1 + 8, label, BLACK, 1, "center")
    canvas.text((x0 + x1) / 2, y1 + 24, x_label, GREY, 1, "center")


def serving_chart(serve: dict, out: Path) -> None:
    results = serve["results"]
    labels = ["inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}" for r in results]
    canvas = Canvas(WIDTH, 420, WHITE)
    half = WIDTH // 2
    rate = "request rate (req/s)"
    line_chart(canvas, (MARGIN + 10, 70, half - 40, 360), "output tokens/s", labels,
               [([r["output_throughput"] for r in results], PALETTE[0])], rate)  # fmt: skip
    line_chart(canvas, (half + MARGIN, 70, WIDTH - 40, 360), "p99 time to first token (ms)",
               labels, [([r["p99_ttft_ms"] for r in results], PALETTE[3])], rate)  # fmt: skip
    canvas.save(out)


def overhead_chart(overhead: dict, out: Path, step_ms: float = 8.0) -> None:
    """Delivered tokens/s and router CPU per token vs streams, a line per variant."""
    rows = [r for r in overhead["rows"] if r["step_ms"] == step_ms]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    labels = [str(n) for n in dict.fromkeys(r["streams"] for r in rows)]

    def series(key: str) -> list:
        return [([r[key] for r in rows if r["variant"] == v], PALETTE[i % len(PALETTE)])
                for i, v in enumerate(variants)]  # fmt: skip

    canvas = Canvas(WIDTH, 460, WHITE)
    half = WIDTH // 2
    line_chart(canvas, (MARGIN + 10, 70, half - 40, 360), f"tokens/s at {step_ms:g} ms steps",
               labels, series("tok_s"), "streams")  # fmt: skip
    line_chart(canvas, (half + MARGIN, 70, WIDTH - 40, 360), "router CPU us / token",
               labels, series("router_us_per_token"), "streams")  # fmt: skip
    for i, variant in enumerate(variants):
        canvas.text(MARGIN + 10 + 220 * (i % 4), 410 + 18 * (i // 4), variant or "this checkout",
                    PALETTE[i % len(PALETTE)], 1, "left")  # fmt: skip
    canvas.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    occupancy_chart(json.loads((args.results / "peers.json").read_text()),
                    args.results / "occupancy.png")  # fmt: skip
    serving_chart(json.loads((args.results / "serve.json").read_text()),
                  args.results / "serving.png")  # fmt: skip
    for name in ("overhead", "overhead_levers"):
        if (args.results / f"{name}.json").exists():
            overhead_chart(json.loads((args.results / f"{name}.json").read_text()),
                           args.results / f"{name}.png")  # fmt: skip
    print(f"wrote the charts in {args.results}")


if __name__ == "__main__":
    main()
