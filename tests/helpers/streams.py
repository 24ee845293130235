"""Client streams against a running stack (tools/stack.py) and what the tests check of
them: token-exact against transformers, every stream finished, memory back."""

import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from flagstop.v1 import generation_pb2
from tests.helpers.checkpoints import reference_generate
from tools.stack import generate


def long_greedy_workload(n: int = 8, seed: int = 1) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([0] + [rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))],
         rng.randrange(100, 160))
        for _ in range(n)
    ]  # fmt: skip


class Streams:
    """Greedy streams on threads, their tokens visible as they arrive."""

    def __init__(self, stack, requests, lora_name: str = "") -> None:
        self.requests, self.lora_name = requests, lora_name
        self.tokens: list[list[int]] = [[] for _ in requests]
        self.pool = ThreadPoolExecutor(len(requests))
        self.futures = [
            self.pool.submit(self._one, stack.generation(), i) for i in range(len(requests))
        ]

    def _one(self, stub, i: int):
        prompt, max_tokens = self.requests[i]
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            lora_name=self.lora_name,
        )
        last = None
        for chunk in stub.Generate(request, timeout=120):
            self.tokens[i] += chunk.token_ids
            last = chunk
        return last

    def wait_for_tokens(self, each: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while min(map(len, self.tokens)) < each:
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.005)

    def results(self) -> list:
        try:
            return [f.result(timeout=120) for f in self.futures]
        finally:
            self.pool.shutdown()

    def errors(self) -> list[grpc.StatusCode]:
        codes = []
        for future in self.futures:
            with pytest.raises(grpc.RpcError) as error:
                future.result(timeout=60)
            codes.append(error.value.code())
        self.pool.shutdown()
        return codes


def assert_token_exact(reference, streams: Streams) -> None:
    lasts = streams.results()
    for i, ((prompt, max_tokens), last) in enumerate(zip(streams.requests, lasts, strict=True)):
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == max_tokens
        assert streams.tokens[i] == reference_generate(reference, prompt, max_tokens), i


def short_greedy_workload(seed: int, n: int = 16, shared_prefix: bool = False):
    rng = random.Random(seed)
    prefix = [0] + [rng.randrange(3, 512) for _ in range(20)]
    requests = []
    for _ in range(n):
        own = [rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))]
        prompt = prefix[: rng.randrange(8, 21)] + own if shared_prefix else [0, *own]
        requests.append((prompt, rng.randrange(6, 40)))
    return requests


def run_concurrently(stack, requests):
    def one(item):
        prompt, max_tokens = item
        tokens, _, last = generate(
            stack, prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == max_tokens == len(tokens)
        return tokens

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def assert_greedy_under_pressure(stack, reference, requests) -> None:
    """The requests, run concurrently, equal transformers, and the run preempted and hit
    the prefix cache (what the small pool and the shared prefixes were meant to force).
    A block is cached only once computed, so a burst admitted in one step (one loaded
    CI run's arrival order) shared nothing: the two requests that share the longest
    prefix run first, one after the other, and the second hits the first's blocks;
    then the burst, whose pool forces preemption."""
    before = stack.stats()
    pair = max(itertools.combinations(range(len(requests)), 2),
               key=lambda ij: _common(requests[ij[0]][0], requests[ij[1]][0]))  # fmt: skip
    alone = [run_concurrently(stack, [requests[i]])[0] for i in pair]
    outputs = run_concurrently(stack, requests)
    assert [outputs[i] for i in pair] == alone
    assert_matches_reference(reference, requests, outputs)
    after = stack.wait_idle()
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to force preemption"
    assert after.prefix_cache_hits > before.prefix_cache_hits, "prefixes were meant to be shared"


def _common(a: list[int], b: list[int]) -> int:
    """The length of a and b's common prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))  # fmt: skip


def assert_matches_reference(reference, requests, outputs):
    expected = [reference_generate(reference, p, n) for p, n in requests]
    every = [t for tokens in expected for t in tokens]
    assert len(set(every)) > 0.5 * len(every), "degenerate reference: the test could not fail"
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got == want, f"request {i}"


def greedy(stack, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy request of exactly max_tokens tokens, streamed."""
    tokens, _, _ = generate(stack, prompt_token_ids=prompt, max_tokens=max_tokens,
                            temperature=0, ignore_eos=True)  # fmt: skip
    return tokens


def assert_evicted_prefix_loads_back(
    stack, reference, prompt_len: int, flush_len: int, min_hits: int, seed: int,
    answer_len: int = 8,
) -> None:  # fmt: skip
    """A first turn of prompt_len tokens (answer_len out), evicted from the pool by three
    of flush_len, then its follow-up: token-exact, with at least min_hits tokens of it
    loaded from the host tier (the stack's executor has one) and every block free after."""
    rng = random.Random(seed)
    first = [1, *(rng.randrange(3, 500) for _ in range(prompt_len - 1))]
    answer = greedy(stack, first, answer_len)
    assert answer == reference_generate(reference, first, answer_len)
    for _ in range(3):  # the tier keeps every group's blocks
        greedy(stack, [1, *(rng.randrange(3, 500) for _ in range(flush_len - 1))], 2)
    before = stack.stats()
    follow_up = [*first, *answer, 5, 6, 7]
    assert greedy(stack, follow_up, 10) == reference_generate(reference, follow_up, 10)
    stats = stack.wait_idle()
    assert stats.external_prefix_cache_hits - before.external_prefix_cache_hits >= min_hits
    assert stats.num_free_blocks == stats.num_total_blocks
