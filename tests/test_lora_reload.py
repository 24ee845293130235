"""A LoRA adapter loaded again under the same name, on real processes against peft:
the prefix cache keys an adapter by the digest of its files, not its name, so nothing
the old files computed is hit again (in a replica's pool, in its host tier, through
the router's prefix index), while the same files loaded again hit their own KV; a
name loaded already, or the base model's, is refused; a request that began under
other files is refused where it would go on (a decode replica, a replica that holds
the name from other files)."""

import random
import threading

import grpc
import pytest

from flagstop.adapters import adapter_digest
from flagstop.v1 import executor_pb2_grpc, generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.helpers.adapters import http, make_adapter, merged_reference
from tests.helpers.checkpoints import reference_generate
from tests.helpers.streams import Streams
from tools.stack import generate, start_replicas, start_stack

# Three full blocks of 16 each: what the old code served from the old adapter's cache.
PROMPTS = [[0, *range(40, 87)], [0, *range(100, 147)]]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from tests.helpers.checkpoints import write_checkpoint

    return write_checkpoint("llama", tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def files(base, tmp_path_factory):
    """Two adapters' directories: the name c is loaded from one, then the other."""
    root = tmp_path_factory.mktemp("adapters")
    return {"A": make_adapter(base, root / "A", "all", 8, seed=21),
            "B": make_adapter(base, root / "B", "attention", 16, seed=22)}  # fmt: skip


@pytest.fixture(scope="module")
def want(base, files) -> dict[str, list[list[int]]]:
    """Each adapter's greedy tokens for PROMPTS: peft's merged model's."""
    out = {}
    for name, path in files.items():
        reference = merged_reference(base, path)
        out[name] = [reference_generate(reference, p, NUM_TOKENS) for p in PROMPTS]
    assert out["A"] != out["B"], "the adapters agree: the tests could not fail"
    return out


def serve(stack, lora_name: str = "c") -> tuple[list[list[int]], list[int]]:
    """PROMPTS under the adapter, one after the other: their tokens, and how many
    prompt tokens each found cached (in the pool or the host tier)."""
    outputs, cached = [], []
    for prompt in PROMPTS:
        tokens, _, last = generate(stack, prompt_token_ids=prompt, max_tokens=NUM_TOKENS,
                                   temperature=0, ignore_eos=True, lora_name=lora_name)  # fmt: skip
        outputs.append(tokens)
        cached.append(last.usage.cached_tokens)
    return outputs, cached


def load(stack, name: str, path, **extra) -> tuple[int, object]:
    return http(stack, "POST", "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": str(path), **extra})  # fmt: skip


def reload(stack, path) -> None:
    """c unloaded, then loaded from other files, as a user does."""
    assert http(stack, "POST", "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    status, text = load(stack, "c", path)
    assert status == 200, text


@pytest.mark.processes
def test_a_name_loaded_again_from_other_files_serves_the_new_ones_token_exact(
    base, files, want, tmp_path
):
    """c from A's files, its prompts cached; a second load of c and one named like the
    base model are refused (naming the adapter, no internal address); c unloaded and
    loaded from B's files serves B's tokens and hits nothing A computed; A's files
    again in place of B (load_inplace) end c's running request and hit A's KV."""
    args = ["--num-blocks", "256", "--max-loras", "2", "--lora-modules", f"c={files['A']}"]
    stack = start_stack(base, tmp_path, executor_args=args)
    try:
        assert serve(stack) == (want["A"], [0, 0])
        assert serve(stack) == (want["A"], [32, 32])  # the cache the old code hit

        status, error = load(stack, "c", files["B"])
        assert status == 400 and "'c' is already loaded" in error["error"]["message"], error
        with pytest.raises(grpc.RpcError) as refused:
            stack.generation().LoadLoRAAdapter(generation_pb2.LoadLoRAAdapterRequest(
                lora_name="c", lora_path=str(files["B"])), timeout=60)  # fmt: skip
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        status, error = load(stack, base.name, files["B"])
        assert status == 400 and "is the base model's" in error["error"]["message"], error
        status, error = load(stack, "bad", tmp_path)
        message = error["error"]["message"]
        assert status == 400 and message.startswith("LoRA adapter 'bad': "), message
        assert "127.0.0.1" not in message and "no adapter_config.json" in message, message
        assert serve(stack)[0] == want["A"]  # nothing changed

        reload(stack, files["B"])
        assert serve(stack) == (want["B"], [0, 0])

        running = Streams(stack, [(PROMPTS[0], 1500)], lora_name="c")
        running.wait_for_tokens(3)
        status, text = load(stack, "c", files["A"], load_inplace=True)
        assert status == 200, text
        assert running.errors() == [grpc.StatusCode.UNAVAILABLE]
        assert serve(stack) == (want["A"], [32, 32])  # A's own KV: the same identity
        _, listed = http(stack, "GET", "/v1/models")
        assert [m["root"] for m in listed["data"] if m["id"] == "c"] == [str(files["A"])]
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.mark.processes
def test_a_name_loaded_again_never_hits_the_old_files_kv_in_the_host_tier(
    base, files, want, tmp_path
):
    """A small pool with a host tier: c's prompts under A's files are flushed out of
    the pool into the tier; c loaded from B's files finds nothing of them there, and
    A's files loaded back in place find them all there."""
    args = ["--num-blocks", "24", "--kv-offload-bytes", str(64 << 20), "--max-loras", "2",
            "--lora-modules", f"c={files['A']}"]  # fmt: skip
    stack = start_stack(base, tmp_path, executor_args=args)
    rng = random.Random(5)
    try:
        assert serve(stack) == (want["A"], [0, 0])
        for _ in range(3):  # 3 x 10 blocks through a 24-block pool: the tier keeps c's
            generate(stack, prompt_token_ids=[0] + [rng.randrange(3, 512) for _ in range(150)],
                     max_tokens=2, ignore_eos=True)  # fmt: skip
        before = stack.stats()
        reload(stack, files["B"])
        assert serve(stack) == (want["B"], [0, 0])
        assert stack.stats().external_prefix_cache_hits == before.external_prefix_cache_hits

        assert load(stack, "c", files["A"], load_inplace=True)[0] == 200
        assert serve(stack) == (want["A"], [32, 32])
        assert stack.stats().external_prefix_cache_hits - before.external_prefix_cache_hits >= 32
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        assert stack.stop() == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.mark.processes
def test_two_replicas_route_and_serve_a_name_loaded_again_by_its_new_files(
    base, files, want, tmp_path
):
    """Two replicas behind prefix routing: c loaded again from B's files on both serves
    B's tokens (the router's prefix index and the replica that cached A's KV hold
    nothing under B's identity); both report B's identity; a remainder that began
    under A's files (a decode replica's hand-off, a moved request) is refused where
    the name now holds B's."""
    args = ["--num-blocks", "256", "--max-loras", "2", "--lora-modules", f"c={files['A']}"]
    stack = start_replicas(base, tmp_path, 2, executor_args=args)
    try:
        assert serve(stack) == (want["A"], [0, 0])
        assert serve(stack) == (want["A"], [32, 32])  # the index sent them back there
        reload(stack, files["B"])
        assert serve(stack) == (want["B"], [0, 0])
        info = stack.generation().GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        assert [(a.name, a.id) for a in info.model.lora_adapters] == [
            ("c", adapter_digest(files["B"]))
        ]
        # Each layer refuses a second load of c itself (another router, a direct call).
        again = generation_pb2.LoadLoRAAdapterRequest(lora_name="c", lora_path=str(files["A"]))
        for stub in (scheduler_pb2_grpc.SchedulerStub, executor_pb2_grpc.ExecutorStub):
            name = "scheduler-0" if stub is scheduler_pb2_grpc.SchedulerStub else "executor-0"
            with pytest.raises(grpc.RpcError) as refused:
                stub(stack.channel(stack.addresses[name])).LoadLoRAAdapter(again, timeout=30)
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS, name
        for i in range(2):
            error = refusal(stack.addresses[f"scheduler-{i}"], lora_id=adapter_digest(files["A"]))
            assert error.code == grpc.StatusCode.ABORTED.value[0], error
            assert "'c' was loaded again from other files" in error.message, error
            stats = stack.wait_idle(scheduler=f"scheduler-{i}")
            assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        codes = stack.stop()
        assert set(codes.values()) == {0}, stack.logs()


def refusal(address: str, lora_id: str) -> scheduler_pb2.RequestError:
    """The error a scheduler answers for a remainder of c admitted under lora_id, sent
    straight to it as a router would."""
    add = scheduler_pb2.AddRequest(request_id="remainder", prompt_token_ids=PROMPTS[0],
                                   max_tokens=4, lora_name="c", lora_id=lora_id)  # fmt: skip
    answered = threading.Event()

    def messages():
        yield scheduler_pb2.RouterMessage(router_id="test-router", adds=[add])
        answered.wait(30)

    with grpc.insecure_channel(address) as channel:
        replies = scheduler_pb2_grpc.SchedulerStub(channel).Connect(messages(), timeout=30)
        try:
            return next(msg for msg in replies if msg.errors).errors[0]
        finally:
            answered.set()
            replies.cancel()
