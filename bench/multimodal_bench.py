"""Images, side by side in one run (docs/multimodal.md), on a Qwen2.5-VL-shaped
checkpoint (tools/make_vision_model.py, a larger tower than the tests') on the CPU:

    python bench/multimodal_bench.py [--part cache|budget|pixels|all] [--size tiny]

cache (results/multimodal_cache.md): prompts that ask different questions about a few
images, with the encoder cache holding them all against one holding a single image;
the encoder's work (images and embedding tokens computed) and the TTFT, the
scheduler core and the model runner in one process, one step at a time.

budget (results/multimodal_budget.md): text requests decoding while a burst of image
prompts arrives, with the encoder budget at one image a step against an unbounded
encoder (the token budget alone): the decodes' inter-token time (mean, p99, max).

pixels (results/multimodal_pixels.md): the pixel path's cost for one image, by image
size (up to 4 megapixels) with Qwen2.5-VL's own processor settings: the processor
(resize, normalise, patches), the hash, the bytes that cross, their protobuf encoding
and decoding on each of the two hops (router -> scheduler -> executor), and the
executor's tensor from them.
"""

import argparse
import io
import itertools
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.output import write_result
from tools.make_vision_model import IMAGE_PART, write_vision_model

RESULTS = Path(__file__).parent / "results"
# A tower of a real one's depth at a small width (Qwen2.5-VL-3B's: 32 blocks of 1280).
BENCH_TOWER = dict(depth=8, hidden_size=256, intermediate_size=1024, num_heads=4,
                   fullatt_block_indexes=[3, 7])  # fmt: skip


def runner_for(model_dir: Path):
    from flagstop.executor.config import ExecutorConfig
    from flagstop.executor.model_runner import ModelRunner

    return ModelRunner(ExecutorConfig(model=str(model_dir), num_blocks=2048, block_size=16,
                                      max_num_seqs=64))  # fmt: skip


def prepared(model_dir: Path, runner, text: str, images: list[bytes]):
    """(prompt tokens, media) as the router makes them; the pixels put to the runner."""
    from flagstop.scheduler_svc.core.media import media_from_proto
    from tests.helpers.images import processor

    out = processor(model_dir).process(text, images, ["x"] * len(images), False)
    for d in out.media_data:
        runner.prepare_media(d.hash, d.pixel_values, list(d.shape), d.dtype, list(d.grid))
    return out.token_ids, media_from_proto(out.media)


class Engine:
    """The scheduler core and the runner, one step at a time, each step timed."""

    def __init__(self, runner, config) -> None:
        from flagstop.scheduler_svc.core.scheduler import Scheduler

        runner.reset()
        self.runner = runner
        self.scheduler = Scheduler(config, runner.num_blocks, kv_groups=runner.kv_groups)
        self.arrived: dict[str, float] = {}
        self.token_times: dict[str, list[float]] = {}

    def add(self, request_id: str, tokens: list[int], media, max_tokens: int) -> None:
        from flagstop.scheduler_svc.core.request import Request, StopParams

        self.scheduler.add_request(Request(request_id, "bench", tokens,
                                           StopParams(max_tokens, ignore_eos=True),
                                           media=media))  # fmt: skip
        self.arrived[request_id] = time.perf_counter()
        self.token_times[request_id] = []

    def step(self) -> bool:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self.scheduler.has_unfinished_requests()
        outputs = self.scheduler.update_from_output(plan, self.runner.execute(plan))
        now = time.perf_counter()
        for out in outputs.values():
            for request_id in out.req_ids:
                self.token_times[request_id].append(now)
        return self.scheduler.has_unfinished_requests()

    def ttft_ms(self, request_id: str) -> float:
        return (self.token_times[request_id][0] - self.arrived[request_id]) * 1e3


def drawn_images(count: int, size: int) -> list[bytes]:
    from tests.helpers.images import drawn

    return [drawn(100 + i, size, size) for i in range(count)]


# -- cache -------------------------------------------------------------------------


def cache_part(model_dir: Path, args) -> None:
    from flagstop.scheduler_svc.core.config import SchedulerConfig

    runner = runner_for(model_dir)
    images = drawn_images(args.distinct_images, args.image_size)
    rows, data = [], {}
    for label, capacity in (("cache of every image", 1 << 16), ("cache of one image", 0)):
        engine = None
        ttfts = []
        for i in range(args.cache_requests):
            # A new question first: no prefix hit reaches the image (its KV differs).
            text = f"<s><|user|>\nQuestion {i}: what is in {IMAGE_PART}?\n<|assistant|>\n"
            tokens, media = prepared(model_dir, runner, text, [images[i % len(images)]])
            one_image = media[0].length
            if engine is None:
                config = SchedulerConfig(max_num_batched_tokens=2048, block_size=16,
                                         max_num_encoder_input_tokens=2048,
                                         encoder_cache_size=capacity or one_image)  # fmt: skip
                engine = Engine(runner, config)
            engine.add(f"r{i}", tokens, media, 1)
            while engine.step():  # one at a time: each request's own TTFT
                pass
            ttfts.append(engine.ttft_ms(f"r{i}"))
        stats = engine.scheduler.encoder.stats
        rows.append(f"| {label} | {stats.num_encoded_items} | {stats.num_encoded_tokens} | "
                    f"{stats.num_cache_hits} | {statistics.mean(ttfts):.1f} |")  # fmt: skip
        data[label] = {"encoded_images": stats.num_encoded_items,
                       "encoded_tokens": stats.num_encoded_tokens,
                       "cache_hits": stats.num_cache_hits,
                       "mean_ttft_ms": statistics.mean(ttfts)}  # fmt: skip
    table = "\n".join(["| encoder cache | images encoded | embedding tokens | cache hits | "
                       "mean TTFT (ms) |", "|---|---:|---:|---:|---:|", *rows])  # fmt: skip
    setup = (
        f"{args.cache_requests} prompts, each a new question before one of "
        f"{args.distinct_images} images of {args.image_size}x{args.image_size} "
        f"({one_image} embedding tokens each), one at a time; the tower: {BENCH_TOWER}."
    )
    print(table)
    write_result(RESULTS / "multimodal_cache.md", "Images: the encoder cache", setup, table,
                 data)  # fmt: skip


# -- budget ------------------------------------------------------------------------


def budget_part(model_dir: Path, args) -> None:
    from flagstop.scheduler_svc.core.config import SchedulerConfig

    runner = runner_for(model_dir)
    images = drawn_images(args.burst, args.image_size)
    tokenizer = runner_tokenizer(model_dir)
    text_prompt = tokenizer("A continuous batching server keeps the accelerator busy.").input_ids
    rows, data = [], {}
    for label, encoder_budget in (("one image a step", 0), ("unbounded", 1 << 20)):
        burst = [
            prepared(
                model_dir,
                runner,
                f"<s><|user|>\nPicture {i}: {IMAGE_PART}\n<|assistant|>\n",
                [image],
            )
            for i, image in enumerate(images)
        ]
        one_image = max(m[0].length for _, m in burst)
        config = SchedulerConfig(max_num_batched_tokens=args.token_budget, block_size=16,
                                 max_num_encoder_input_tokens=encoder_budget or one_image,
                                 encoder_cache_size=1 << 20)  # fmt: skip
        engine = Engine(runner, config)
        for j in range(args.decodes):
            engine.add(f"text{j}", text_prompt, (), args.decode_tokens)
        steps = 0
        while engine.step():
            steps += 1
            if steps == 5:  # the decodes are under way: the burst arrives
                for i, (tokens, media) in enumerate(burst):
                    engine.add(f"image{i}", tokens, media, 4)
        gaps = sorted((b - a) * 1e3 for j in range(args.decodes)
                      for a, b in pairwise(engine.token_times[f"text{j}"]))  # fmt: skip
        ttft = statistics.mean(engine.ttft_ms(f"image{i}") for i in range(args.burst))
        p99 = gaps[int(0.99 * (len(gaps) - 1))]
        rows.append(f"| {label} | {statistics.mean(gaps):.1f} | {p99:.1f} | {gaps[-1]:.1f} | "
                    f"{ttft:.0f} |")  # fmt: skip
        data[label] = {"mean_itl_ms": statistics.mean(gaps), "p99_itl_ms": p99,
                       "max_itl_ms": gaps[-1], "image_mean_ttft_ms": ttft}  # fmt: skip
    table = "\n".join(["| encoder budget | decode ITL mean (ms) | p99 | max | image prompts' "
                       "mean TTFT (ms) |", "|---|---:|---:|---:|---:|", *rows])  # fmt: skip
    setup = (
        f"{args.decodes} text requests decoding {args.decode_tokens} tokens; at their "
        f"5th step {args.burst} image prompts arrive ({args.image_size}x"
        f"{args.image_size}, {one_image} embedding tokens each); a token budget of "
        f"{args.token_budget}; the tower: {BENCH_TOWER}."
    )
    print(table)
    write_result(RESULTS / "multimodal_budget.md", "Images: the encoder budget", setup, table,
                 data)  # fmt: skip


def runner_tokenizer(model_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


# -- pixels ------------------------------------------------------------------------


def pixels_part(args) -> None:
    """Qwen2.5-VL's own processor settings (min 56x56, max 12.8 megapixels)."""
    from PIL import Image

    from flagstop.executor.media import pixels_from_bytes
    from flagstop.router.media.processor import MediaProcessor
    from flagstop.v1 import scheduler_pb2
    from tests.helpers.images import drawn

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_vision_model(Path(tmp) / "vl")
        processor = MediaProcessor(str(model_dir), runner_tokenizer(model_dir), 1 << 26)
        processor.image_processor.size = {"shortest_edge": 56 * 56,
                                          "longest_edge": 28 * 28 * 16384}  # fmt: skip
        text = f"<s><|user|>\n{IMAGE_PART}\n<|assistant|>\n"
        rows, data = [], {}
        for side, dtype in itertools.product((448, 1024, 2048), ("float32", "bfloat16")):
            jpeg = drawn(1, side, side, "JPEG")
            ms = {k: [] for k in ("process", "hash", "hops", "tensor")}
            for _ in range(args.rounds):
                out, ms["process"] = timed(processor.process, text, [jpeg], ["x"], False, dtype)
                image = Image.open(io.BytesIO(jpeg))
                image.load()
                ms["hash"] += timed(processor._hash, image)[1]
                add = scheduler_pb2.AddRequest(request_id="x", media_data=out.media_data)
                wire, encode = timed(add.SerializeToString)
                parsed, decode = timed(scheduler_pb2.AddRequest.FromString, wire)
                ms["hops"] += [2 * (encode[0] + decode[0])]  # router -> scheduler -> executor
                m = parsed.media_data[0]
                ms["tensor"] += timed(pixels_from_bytes, m.pixel_values, list(m.shape),
                                      m.dtype, list(m.grid))[1]  # fmt: skip
            median = {k: statistics.median(v) * 1e3 for k, v in ms.items()}
            total = sum(median.values())
            mib = len(out.media_data[0].pixel_values) / 2**20
            rows.append(f"| {side}x{side} ({side * side / 1e6:.1f} MP) | {dtype} | {mib:.1f} | "
                        f"{out.media[0].length} | {median['process']:.0f} | "
                        f"{median['hash']:.1f} | {median['hops']:.1f} | "
                        f"{median['tensor']:.2f} | {total:.0f} |")  # fmt: skip
            data[f"{side}/{dtype}"] = {**median, "pixel_mib": mib, "total_ms": total,
                                       "tokens": out.media[0].length}  # fmt: skip
    table = "\n".join(
        [
            "| image | pixels sent as | MiB crossing | embedding tokens | processor "
            "(ms) | hash (ms) | two hops' protobuf (ms) | executor tensor (ms) | "
            "total (ms) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    setup = (
        f"a JPEG of each size through Qwen2.5-VL's processor settings (up to 12.8 "
        f"megapixels: a 4-megapixel image keeps its size), its pixels in the executor's "
        f"dtype (float32 on the CPU, bfloat16 on a GPU); median of {args.rounds}; each "
        "hop encodes and decodes the AddRequest (then the PrepareMedia call) once."
    )
    print(table)
    write_result(RESULTS / "multimodal_pixels.md", "Images: the pixel path", setup, table, data)


def timed(call, *args):
    """(call's result, [its seconds])."""
    started = time.perf_counter()
    result = call(*args)
    return result, [time.perf_counter() - started]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["cache", "budget", "pixels", "all"], default="all")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--distinct-images", type=int, default=4)
    parser.add_argument("--cache-requests", type=int, default=16)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("pixels", "all"):
        pixels_part(args)
    if args.part in ("cache", "budget", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = write_vision_model(Path(tmp) / "vl", args.size, vision=BENCH_TOWER)
            if args.part in ("cache", "all"):
                cache_part(model_dir, args)
            if args.part in ("budget", "all"):
                budget_part(model_dir, args)


if __name__ == "__main__":
    main()
