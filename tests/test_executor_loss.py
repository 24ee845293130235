"""A replica whose executor is gone, and nothing restarts it (a GPU failed, a node
drains), on real processes: its scheduler says so at once, the router places new
requests elsewhere and, past --replica-grace-s, moves what the replica held (the
remainders, token-exact against transformers); an executor back within the grace
moves nothing; with no executor anywhere a request is refused, saying so, until one
is back. Every block free afterwards."""

import time

import grpc
import pytest

from tests.helpers.checkpoints import reference_generate
from tests.helpers.metrics import scrape
from tests.helpers.streams import Streams, assert_token_exact, long_greedy_workload
from tools.stack import generate, start_disaggregated, start_replicas, start_stack

pytestmark = pytest.mark.processes

GRACE_S = 1.0
ARGS = {"executor_args": ["--num-blocks", "256"],
        "router_args": ["--replica-grace-s", str(GRACE_S)]}  # fmt: skip


def moved(stack) -> float:
    """Requests the router moved between replicas (flagstop:routed_requests, moved)."""
    samples = scrape(stack.metrics_ports["router"])
    return sum(v for k, v in samples.items()
               if k.startswith("flagstop:routed_requests_total") and "'moved'" in k)  # fmt: skip


def greedy(stack, prompt: list[int], max_tokens: int) -> list[int]:
    tokens, _, last = generate(stack, prompt_token_ids=prompt, max_tokens=max_tokens,
                               temperature=0, ignore_eos=True)  # fmt: skip
    assert last.usage.completion_tokens == max_tokens
    return tokens


def test_a_dead_executors_streams_move_and_new_requests_avoid_its_replica(
    model_dir, tmp_path, reference
):
    stack = start_replicas(model_dir, tmp_path, 2, **ARGS)
    try:
        streams = Streams(stack, long_greedy_workload())
        streams.wait_for_tokens(10)
        busy = [stack.stats(f"scheduler-{i}").num_running for i in range(2)]
        assert min(busy) > 0, busy  # both replicas serve some of the streams
        stack.kill("executor-0")
        # New requests are served, none placed on the replica without an executor.
        prompts = [[0, 7, i + 3, 11] for i in range(6)]
        for prompt in prompts:
            assert greedy(stack, prompt, 8) == reference_generate(reference, prompt, 8)
        assert_token_exact(reference, streams)  # those it ran, moved and finished
        assert moved(stack) >= busy[0]
        stack.wait_idle(scheduler="scheduler-1")
        stats = stack.wait_idle(scheduler="scheduler-0")  # it holds nothing more
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        stack.stop(10)


def test_an_executor_back_within_the_grace_moves_nothing(model_dir, tmp_path, reference):
    args = {**ARGS, "router_args": ["--replica-grace-s", "60"]}
    stack = start_replicas(model_dir, tmp_path, 2, **args)
    try:
        streams = Streams(stack, long_greedy_workload(4, seed=3))
        streams.wait_for_tokens(5)
        stack.kill("executor-0")
        stack.restart("executor-0")
        assert_token_exact(reference, streams)
        assert moved(stack) == 0
        for i in range(2):
            stack.wait_idle(scheduler=f"scheduler-{i}")
    finally:
        stack.stop(10)


def test_with_no_executor_left_a_request_is_refused_until_one_is_back(
    model_dir, tmp_path, reference
):
    """The router stops counting on the replica at once (its readiness drops within
    a second of the executor's death), refuses once the grace has passed, and serves
    again when the executor is back."""
    stack = start_stack(model_dir, tmp_path, **ARGS)
    try:
        killed = time.monotonic()
        stack.kill("executor")
        while stack.router_ready():
            assert time.monotonic() - killed < 5, "the router did not hear of it"
            time.sleep(0.01)
        time.sleep(GRACE_S + 0.2)
        with pytest.raises(grpc.RpcError) as refused:
            greedy(stack, [0, 5, 6], 4)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no replica can serve" in refused.value.details()
        stack.restart("executor")
        while not stack.router_ready():
            time.sleep(0.05)
        assert greedy(stack, [0, 5, 6], 4) == reference_generate(reference, [0, 5, 6], 4)
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        stack.stop(10)


def test_a_dead_prefill_executors_work_goes_whole_to_the_decode_replica(
    model_dir, tmp_path, reference
):
    """Disaggregated (every prompt's prefill split off): the streams handed off finish
    on the decode replica; those whose prefill was under way, and every new request,
    are served whole there."""
    stack = start_disaggregated(model_dir, tmp_path, prefill_args=["--num-blocks", "256"],
                                decode_args=["--num-blocks", "256"],
                                router_args=["--pd-threshold", "0", "--replica-grace-s",
                                             str(GRACE_S)])  # fmt: skip
    try:
        streams = Streams(stack, long_greedy_workload(6, seed=4))
        streams.wait_for_tokens(3)
        late = Streams(stack, [([0, *range(20, 400)], 20) for _ in range(2)])  # long prefills
        stack.kill("executor-0")
        prompts = [[0, 9, i + 4, 13] for i in range(4)]
        for prompt in prompts:
            assert greedy(stack, prompt, 8) == reference_generate(reference, prompt, 8)
        assert_token_exact(reference, streams)
        assert_token_exact(reference, late)
        stack.wait_idle(scheduler="scheduler-1")
        stack.wait_idle(scheduler="scheduler-0")
    finally:
        stack.stop(10)
