"""Images in the prompt, in process (docs/multimodal.md): Qwen2.5-VL on a tiny random
checkpoint made with transformers' classes, token-exact against transformers'
generate() with the same processor through prefill, chunks that cut an image, prefix
hits with the same image and misses with another, preemption and joins; the
scheduler's encoder budget and cache; image identity in the block hashes."""

import math

import pytest
import torch

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.models.config import ModelConfig
from flagstop.executor.models.vision import mrope_positions
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.encoder_cache import EncoderCache
from flagstop.scheduler_svc.core.kv_cache_manager import chain_hashes
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.scheduler_svc.core.media import MediaPlaceholder, media_from_proto
from flagstop.scheduler_svc.core.request import Request, StopParams
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.core.step import Step
from flagstop.scheduler_svc.core.step_cost import StepCostModel
from tests.helpers.images import VisionReference, drawn, processor
from tools.inprocess import Job, run_engine
from tools.make_vision_model import FAMILIES, write_vision_model

pytestmark = pytest.mark.numeric  # no clock in its in-process tests (Makefile: test)

ASK = "<s><|user|>\nWhat is in {} this picture, and why?\n<|assistant|>\n"
TWO = "<s><|user|>\nCompare {} with {} please.\n<|assistant|>\n"
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vl_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / f"flagstop-tiny-{request.param}"
    return write_vision_model(out, arch=request.param)


def image_part(model_dir) -> str:
    """The family's placeholder of one image in a prompt."""
    return FAMILIES[model_dir.name.removeprefix("flagstop-tiny-")].image_part


def whole_images(model_dir) -> bool:
    """Gemma 3: a chunk never cuts an image (its tokens attend both ways)."""
    return ModelConfig.from_pretrained(model_dir).vision.layout.bidirectional


@pytest.fixture(scope="module")
def vl_reference(vl_model):
    return VisionReference(vl_model)


@pytest.fixture(scope="module")
def runner(vl_model):
    config = ExecutorConfig(model=str(vl_model), num_blocks=256, block_size=4, max_num_seqs=8)
    return ModelRunner(config)


def job(model_dir, runner, text: str, images: list[bytes]) -> Job:
    """The prompt as the router makes it; its pixels put to the runner."""
    if not images:
        tokenizer = processor(model_dir).processor.tokenizer
        return Job(tokenizer(text, add_special_tokens=False).input_ids, MAX_TOKENS)
    processed = processor(model_dir).process(text, images, ["x"] * len(images), False)
    for d in processed.media_data:
        runner.prepare_media(d.hash, d.pixel_values, list(d.shape), d.dtype, list(d.grid))
    return Job(processed.token_ids, MAX_TOKENS, media=media_from_proto(processed.media))


def config(model_dir, budget: int = 2048, **fields) -> SchedulerConfig:
    return SchedulerConfig(**{"max_num_batched_tokens": budget, "block_size": 4,
                              "max_num_encoder_input_tokens": 2048, "encoder_cache_size": 4096,
                              "whole_images": whole_images(model_dir), **fields})  # fmt: skip


def prompts(model_dir) -> list[tuple[str, list[bytes]]]:
    image = image_part(model_dir)
    return [
        (ASK.format(image), [drawn(1)]),
        (TWO.format(image, image), [drawn(2, 60, 90), drawn(3, 140, 56)]),
        ("<s><|user|>\nNo picture here, only words.\n<|assistant|>\n", []),
        (ASK.format(image), [drawn(4, 200, 120, "JPEG")]),
    ]


@pytest.mark.parametrize("chunked", [False, True])
def test_image_prompts_equal_generate_whole_and_in_chunks_cutting_images(
    vl_model, vl_reference, runner, chunked
):
    """Four requests in one batch (two images in one, none in another); chunked, at a
    token budget of 7 every image is cut by chunk boundaries and its embeddings
    sliced (Gemma 3's, never cut, at 20: the chunks end before its images)."""
    budget = (20 if whole_images(vl_model) else 7) if chunked else 2048
    cases = prompts(vl_model)
    jobs = [job(vl_model, runner, text, images) for text, images in cases]
    run = run_engine(runner, jobs, config(vl_model, budget))
    for (text, images), out in zip(cases, run.outputs, strict=True):
        assert out == vl_reference.greedy(text, images, MAX_TOKENS)


def test_requests_join_and_leave_a_running_batch_token_exact(vl_model, vl_reference, runner):
    """Two seats for six requests of different lengths: each leaves at its own
    max_tokens and the next joins the batch mid-decode of the others, images and all."""
    image = image_part(vl_model)
    cases = [*prompts(vl_model), (ASK.format(image), [drawn(7, 120, 120)]),
             (TWO.format(image, image), [drawn(8), drawn(1)])]  # fmt: skip
    lengths = [3, 11, 6, 14, 2, 9]
    jobs = [job(vl_model, runner, text, images) for text, images in cases]
    for j, n in zip(jobs, lengths, strict=True):
        j.max_tokens = n
    run = run_engine(runner, jobs, config(vl_model, 64, max_num_seqs=2))
    for (text, images), n, out in zip(cases, lengths, run.outputs, strict=True):
        assert out == vl_reference.greedy(text, images, n)


def test_same_image_hits_the_prefix_cache_and_another_misses(vl_model, vl_reference, runner):
    text = ASK.format(image_part(vl_model))
    first = job(vl_model, runner, text, [drawn(5)])
    run = run_engine(runner, [first], config(vl_model))
    scheduler = run.scheduler
    stats = scheduler.kv.prefix_stats
    hits_before = stats.num_hits
    again = run_engine(runner, [job(vl_model, runner, text, [drawn(5)])], config(vl_model),
                       scheduler=scheduler)  # fmt: skip
    image = first.media[0]
    assert stats.num_hits - hits_before >= image.end // 4 * 4 > image.offset  # past the image
    assert again.outputs[0] == run.outputs[0]
    hits_before = stats.num_hits
    other = run_engine(runner, [job(vl_model, runner, text, [drawn(6)])], config(vl_model),
                       scheduler=scheduler)  # fmt: skip
    assert stats.num_hits - hits_before <= image.offset  # the text before it only
    assert other.outputs[0] == vl_reference.greedy(text, [drawn(6)], MAX_TOKENS)
    assert other.outputs[0] != run.outputs[0]


def test_preempted_image_requests_recompute_token_exact(vl_model, vl_reference, runner):
    """A pool too small for all of them: requests are preempted and recompute their
    prompts, images included (their embeddings cached or encoded again)."""
    cases = [(ASK.format(image_part(vl_model)), [drawn(10 + i)]) for i in range(4)]
    jobs = [job(vl_model, runner, text, images) for text, images in cases]
    cfg = config(vl_model, 20 if whole_images(vl_model) else 16, reserve_full_isl=False,
                 max_num_encoder_input_tokens=64, encoder_cache_size=64)  # fmt: skip
    run = run_engine(runner, jobs, cfg, num_blocks=30 * len(runner.kv_groups))
    assert run.scheduler.num_preemptions > 0
    for (text, images), out in zip(cases, run.outputs, strict=True):
        assert out == vl_reference.greedy(text, images, MAX_TOKENS)


def test_mrope_positions_match_transformers(vl_model, vl_reference):
    if not ModelConfig.from_pretrained(vl_model).vision.layout.mrope:
        pytest.skip("plain RoPE positions")
    text = TWO.format(image_part(vl_model), image_part(vl_model))
    images = [drawn(2, 60, 90), drawn(3, 140, 56)]
    processed = processor(vl_model).process(text, images, ["x", "y"], False)
    model = vl_reference.model
    ids = torch.tensor([processed.token_ids])
    grids = torch.tensor([list(m.grid) for m in processed.media])
    types = (ids == model.config.image_token_id).int()
    expected, delta = model.model.get_rope_index(ids, types, image_grid_thw=grids)
    media = media_from_proto(processed.media)
    positions, ours = mrope_positions(len(processed.token_ids), media, 2)
    assert torch.equal(positions, expected[:, 0]) and ours == int(delta)


# -- the scheduler's encoder budget and cache, and image identity ------------------


def image(key: bytes, offset: int, length: int) -> MediaPlaceholder:
    return MediaPlaceholder(key, offset, length, (1, 2, 2 * length))


def request(request_id: str, num_tokens: int, *media: MediaPlaceholder) -> Request:
    return Request(request_id, "t", list(range(num_tokens)), StopParams(max_tokens=4),
                   media=media)  # fmt: skip


def test_a_chunk_stops_short_of_an_image_the_encoder_budget_cannot_take():
    cache = EncoderCache(capacity=100, budget=30)
    step = Step(token_budget=100, encoder_budget=30)
    a = request("a", 60, image(b"a", 10, 20))
    b = request("b", 60, image(b"b", 5, 20))
    assert cache.chunk(a, 0, 60, step) == 60  # its image computed this step
    assert cache.chunk(b, 0, 60, step) == 5  # 10 of the budget left: up to its image
    assert [m.hash for m in step.encoder_inputs] == [b"a"]
    assert cache.chunk(b, 0, 5, Step(token_budget=100, encoder_budget=30)) == 5


def test_the_encoder_cache_keeps_what_running_requests_need_and_evicts_the_oldest_other():
    cache = EncoderCache(capacity=40, budget=100)
    a, b = request("a", 60, image(b"a", 0, 20)), request("b", 60, image(b"b", 0, 20))
    cache.chunk(a, 0, 60, Step(100, encoder_budget=100))
    cache.chunk(b, 0, 60, Step(100, encoder_budget=100))
    c = request("c", 60, image(b"c", 0, 20))
    assert cache.chunk(c, 0, 60, Step(100, encoder_budget=100)) == 0  # a and b in use
    cache.free(a)
    cache.free(b)
    same = request("d", 60, image(b"b", 0, 20))
    step = Step(100, encoder_budget=100)
    assert cache.chunk(same, 0, 60, step) == 60 and not step.encoder_inputs  # a hit
    assert cache.chunk(c, 0, 60, step) == 60  # a, unused longest, made room
    assert cache.take_frees() == [b"a"] and cache.stats.num_cache_hits == 1


def test_an_image_larger_than_the_encoder_budget_is_refused_at_admission():
    scheduler = Scheduler(SchedulerConfig(max_num_encoder_input_tokens=16,
                                          encoder_cache_size=64), 64)  # fmt: skip
    with pytest.raises(RequestRejected, match="encoder"):
        scheduler.add_request(request("a", 40, image(b"a", 0, 20)))
    text_only = Scheduler(SchedulerConfig(), 64)
    with pytest.raises(RequestRejected, match="reads no images"):
        text_only.add_request(request("b", 40, image(b"b", 0, 8)))


def test_an_images_hash_keys_every_block_over_it_and_after_it():
    tokens = list(range(32))
    one = chain_hashes(tokens, 4, media=[image(b"one", 9, 6)])
    other = chain_hashes(tokens, 4, media=[image(b"two", 9, 6)])
    assert one[:2] == other[:2] == chain_hashes(tokens, 4)[:2]  # before the image
    assert all(x != y for x, y in zip(one[2:], other[2:], strict=True))


def test_the_step_cost_model_learns_what_the_encoder_costs():
    """Steps with images teach the encoder term; a text step's prediction is the same
    as without it."""
    model = StepCostModel()
    truth = StepCostModel(base_s=0.01, s_per_token=2e-5, s_per_context_token=1e-7,
                          s_per_encoder_token=6e-5)  # fmt: skip
    for i in range(600):
        tokens, context = (i * 37) % 2048 + 1, (i * 7919) % 300_000 + 1
        encoder = (i * 131) % 1024 if i % 3 == 0 else 0
        model.observe(tokens, context, truth.seconds(tokens, context, encoder), encoder)
    for tokens, context, encoder in ((512, 64_000, 0), (512, 64_000, 1000), (2048, 1, 256)):
        assert math.isclose(model.seconds(tokens, context, encoder),
                            truth.seconds(tokens, context, encoder), rel_tol=0.02)  # fmt: skip
    assert model.figures()["us_per_encoder_token"] == pytest.approx(60, rel=0.05)


def test_a_step_with_images_carries_their_embedding_tokens_to_the_cost_model():
    scheduler = Scheduler(SchedulerConfig(max_num_encoder_input_tokens=64,
                                          encoder_cache_size=64), 64)  # fmt: skip
    scheduler.add_request(request("a", 40, image(b"a", 4, 20), image(b"b", 30, 6)))
    plan = scheduler.schedule()
    assert plan.encoder_inputs == [b"a", b"b"] and plan.num_encoder_tokens == 26


def test_a_prompt_with_images_is_never_split_between_prefill_and_decode_replicas():
    from flagstop.router.replicas import splittable
    from flagstop.v1 import generation_pb2, scheduler_pb2

    text = scheduler_pb2.AddRequest(request_id="a", prompt_token_ids=range(40))
    assert splittable(text)
    with_image = scheduler_pb2.AddRequest(
        request_id="b",
        prompt_token_ids=range(40),
        media=[generation_pb2.MediaPlaceholder(hash=b"x", offset=3, length=8, grid=[1, 4, 8])],
    )
    assert not splittable(with_image)


def test_an_image_gone_from_the_pixel_store_fails_its_request_alone(vl_model, vl_reference):
    """A store that keeps one image: the first request's pixels are gone when its
    encoder step comes; it ends with an error, the other request is token-exact."""
    config_ = ExecutorConfig(model=str(vl_model), num_blocks=256, block_size=4,
                             max_num_seqs=8, media_store_bytes=1)  # fmt: skip
    small = ModelRunner(config_)
    text = ASK.format(image_part(vl_model))
    lost, kept = job(vl_model, small, text, [drawn(20)]), job(vl_model, small, text, [drawn(21)])
    run = run_engine(small, [lost, kept], config(vl_model))
    assert run.outputs[0] in ([], [-1])
    assert run.outputs[1] == vl_reference.greedy(text, [drawn(21)], MAX_TOKENS)
