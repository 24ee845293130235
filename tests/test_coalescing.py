"""Coalescing: a stream that falls behind gets the tokens of several steps in one
message (the router's mailbox, --stream-interval-ms), never reordered, dropped or
doubled, with the same text, stop-string cut, finish and usage as one by one."""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from flagstop.router.detokenizer import StopStringMatcher, new_detokenizer
from flagstop.router.output import ChunkBuilder, Mailbox, StepToken
from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2
from tools.make_model import write_model
from tools.stack import start_stack

STOP, LENGTH = generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_model(tmp_path_factory.mktemp("tok"), "tiny"))


class Trace:
    def first_token(self) -> None:
        pass

    def finish(self, reason: int, num_generated: int) -> None:
        pass


def stream(tokenizer, items: list, takes: list[int], stop: list[str]) -> dict:
    """What a client sees when the mailbox holds takes[0] items, then takes[1], ..."""
    pending = SimpleNamespace(
        trace=Trace(), prompt_token_ids=[0, 5, 9], prompt_logprobs=None, num_cached_tokens=0,
        request=generation_pb2.GenerateRequest(stop=stop, stop_token_ids=[7]),
    )  # fmt: skip
    builder = ChunkBuilder(pending, new_detokenizer(tokenizer, [0, 5, 9]), StopStringMatcher(stop))
    seen = {"token_ids": [], "text": "", "logprobs": [], "finish": None, "failed": None}
    start = 0
    for take in takes:
        chunk, failure = builder.build(items[start : start + take])
        start += take
        if chunk is not None:
            seen["token_ids"] += chunk.token_ids
            seen["text"] += chunk.text
            seen["logprobs"] += [e.logprob for e in chunk.logprobs]
            if chunk.finish_reason:
                usage = chunk.usage.completion_tokens
                seen["finish"] = (chunk.finish_reason, chunk.stop_reason, usage)
        if failure is not None:
            seen["failed"] = str(failure)
        if builder.done or failure is not None:
            break
    return seen


@settings(max_examples=200, deadline=None)
@given(
    token_ids=st.lists(st.integers(3, 511), min_size=1, max_size=30),
    end=st.sampled_from(["length", "stop token", "bare finish", "error"]),
    cut=st.lists(st.integers(1, 5), min_size=1, max_size=30),
    stop_at=st.none() | st.tuples(st.integers(0, 29), st.integers(1, 3)),
)
def test_any_coalescing_gives_what_one_by_one_gives(tokenizer, token_ids, end, cut, stop_at):
    logprob = generation_pb2.TokenLogprob
    items = [StepToken(t, 0, logprob(token_id=t, logprob=-i)) for i, t in enumerate(token_ids)]
    if end == "stop token":
        items[-1] = items[-1]._replace(token_id=7, finish_reason=STOP)
    elif end == "length":
        items[-1] = items[-1]._replace(finish_reason=LENGTH)
    elif end == "bare finish":
        items.append(StepToken(None, STOP, None))
    else:
        items.append(scheduler_pb2.RequestError(code=14, message="the scheduler went away"))
    stop = []
    if stop_at is not None:  # a stop string cut from the text itself, so it can match
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        start = min(stop_at[0], max(len(text) - 1, 0))
        stop = [s for s in [text[start : start + stop_at[1]]] if s.strip()]
    takes = (cut * len(items))[: len(items)]  # cover every item
    one_by_one = stream(tokenizer, items, [1] * len(items), stop)
    assert stream(tokenizer, items, takes, stop) == one_by_one
    assert stream(tokenizer, items, [len(items)], stop) == one_by_one
    if not stop:
        assert one_by_one["token_ids"] == [i[0] for i in items if isinstance(i, tuple) and i[0]]


def test_the_mailbox_hands_over_everything_in_order():
    async def run() -> list:
        mailbox, taken = Mailbox(), []

        async def slow_reader():
            while len(taken) < 100:
                taken.extend(await mailbox.take())
                await asyncio.sleep(0.003)

        reader = asyncio.create_task(slow_reader())
        for i in range(100):
            mailbox.put(i)
            if i % 7 == 0:
                await asyncio.sleep(0.001)
        await reader
        return taken

    assert asyncio.run(run()) == list(range(100))


@pytest.mark.processes
def test_a_slow_client_gets_every_token_once_in_order(model_dir, tmp_path):
    """A client reading one message per 40 ms of a stream stepping every 5 ms, with
    --stream-interval-ms 20: the same tokens and text as a client that keeps up, and
    both in fewer messages than tokens."""
    stack = start_stack(
        model_dir, tmp_path, executor_args=["--simulate", "--simulate-base-ms", "5"],
        router_args=["--stream-interval-ms", "20"],
    )  # fmt: skip
    try:
        request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 11, 12, 13], max_tokens=120,
                                                 ignore_eos=True, stop=["zzz"])  # fmt: skip
        fast = asyncio.run(read(stack.router, request, delay=0))
        slow = asyncio.run(read(stack.router, request, delay=0.04))
        assert slow["token_ids"] == fast["token_ids"] and len(fast["token_ids"]) == 120
        assert slow["text"] == fast["text"]
        assert slow["finish"] == fast["finish"] == (LENGTH, 120)
        assert slow["messages"] < 60 and fast["messages"] < 120  # coalesced
        stack.wait_idle()
    finally:
        assert set(stack.stop().values()) == {0}


async def read(router: str, request, delay: float) -> dict:
    seen = {"token_ids": [], "text": "", "messages": 0, "finish": None}
    async with grpc.aio.insecure_channel(router, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        async for chunk in stub.Generate(request, timeout=60):
            seen["messages"] += 1
            seen["token_ids"] += chunk.token_ids
            seen["text"] += chunk.text
            if chunk.finish_reason:
                seen["finish"] = (chunk.finish_reason, chunk.usage.completion_tokens)
            time.sleep(delay)  # a client busy elsewhere: nothing read meanwhile
    return seen
