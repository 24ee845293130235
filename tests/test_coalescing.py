"""Coalescing: a stream that falls behind gets the tokens of several steps in one
message (all the fan-out left since the stream last woke; --stream-interval-ms),
never reordered, dropped or doubled, with the same text, stop-string cut, finish
and usage as one by one."""

import asyncio
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from flagstop.router.detokenizer import StopStringMatcher, new_detokenizer
from flagstop.router.pending import ChunkBuilder, Pending
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

    def next_tokens(self) -> None:
        pass

    def finish(self, reason: int, num_generated: int) -> None:
        pass


# What the fan-out can leave a stream: a token (with its logprob entry), the end, or
# the scheduler's failure.
Token = tuple[int, generation_pb2.TokenLogprob]


def stream(tokenizer, events: list, takes: list[int], stop: list[str]) -> dict:
    """What a client sees when the fan-out left takes[0] events before the stream woke,
    then takes[1], ..."""
    pending = Pending(
        "r", generation_pb2.GenerateRequest(stop=stop, stop_token_ids=[7]), [0, 5, 9],
        Trace(), scheduler_pb2.AddRequest(), None, logprobs=[],
    )  # fmt: skip
    builder = ChunkBuilder(pending, new_detokenizer(tokenizer, [0, 5, 9]), StopStringMatcher(stop))
    seen = {"token_ids": [], "text": "", "logprobs": [], "finish": None, "failed": None}
    start = 0
    for take in takes:
        for event in events[start : start + take]:
            leave(pending, event)
        start += take
        chunk, failure = builder.build()
        if chunk is not None:
            seen["token_ids"] += chunk.token_ids
            seen["text"] += chunk.text
            seen["logprobs"] += [e.logprob for e in chunk.logprobs]
            if chunk.finish_reason:
                usage = chunk.usage.completion_tokens
                seen["finish"] = (chunk.finish_reason, chunk.stop_reason, usage)
        if failure is not None:
            seen["failed"] = str(failure)
        if builder.done:
            break
    return seen


def leave(pending: Pending, event) -> None:
    if isinstance(event, scheduler_pb2.RequestError):
        pending.failed(event)
    elif isinstance(event, int):
        pending.end(event)
    else:
        pending.generated.append(event[0])
        pending.logprobs.append(event[1])


@settings(max_examples=200, deadline=None)
@given(
    token_ids=st.lists(st.integers(3, 511), min_size=1, max_size=30),
    end=st.sampled_from(["length", "stop token", "bare finish", "error"]),
    cut=st.lists(st.integers(1, 5), min_size=1, max_size=30),
    stop_at=st.none() | st.tuples(st.integers(0, 29), st.integers(1, 3)),
)
def test_any_coalescing_gives_what_one_by_one_gives(tokenizer, token_ids, end, cut, stop_at):
    logprob = generation_pb2.TokenLogprob
    events: list = [(t, logprob(token_id=t, logprob=-i)) for i, t in enumerate(token_ids)]
    if end == "stop token":
        events[-1] = (7, events[-1][1])
        events.append(STOP)  # the end comes with the step's last token, or after
    elif end in ("length", "bare finish"):
        events.append(LENGTH if end == "length" else STOP)
    else:
        events.append(scheduler_pb2.RequestError(code=14, message="the scheduler went away"))
    stop = []
    if stop_at is not None:  # a stop string cut from the text itself, so it can match
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        start = min(stop_at[0], max(len(text) - 1, 0))
        stop = [s for s in [text[start : start + stop_at[1]]] if s.strip()]
    takes = (cut * len(events))[: len(events)]  # cover every event
    one_by_one = stream(tokenizer, events, [1] * len(events), stop)
    assert stream(tokenizer, events, takes, stop) == one_by_one
    assert stream(tokenizer, events, [len(events)], stop) == one_by_one
    if not stop:
        assert one_by_one["token_ids"] == [t for t, _ in events[:-1]]
        assert (one_by_one["failed"] is not None) == (end == "error")
        if end == "stop token":
            assert one_by_one["finish"] == (STOP, "7", len(token_ids))


def test_a_stream_wakes_for_every_token_and_takes_them_in_order():
    """The fan-out appends while the stream is busy elsewhere; each wake-up takes
    everything new: 100 tokens, in order, none twice, in fewer takes than tokens."""

    async def run() -> tuple[list, int]:
        pending = Pending("r", generation_pb2.GenerateRequest(), [0], Trace(),
                          scheduler_pb2.AddRequest(), None)  # fmt: skip
        builder = ChunkBuilder(pending, Echo(), StopStringMatcher([]))
        taken, takes = [], 0

        async def slow_reader():
            nonlocal takes
            while not builder.done:
                if not builder.has_news:
                    pending.waiter = asyncio.get_running_loop().create_future()
                    await pending.waiter
                chunk, _ = builder.build()
                taken.extend(chunk.token_ids)
                takes += 1
                await asyncio.sleep(0.003)

        reader = asyncio.create_task(slow_reader())
        for i in range(100):
            pending.generated.append(i)
            pending.wake()
            if i % 7 == 0:
                await asyncio.sleep(0.001)
        pending.end(LENGTH)
        await reader
        return taken, takes

    taken, takes = asyncio.run(run())
    assert taken == list(range(100)) and takes < 100


class Echo:
    def add(self, token_ids: list[int], final: bool = False) -> str:
        return "".join(f"<{t}>" for t in token_ids)


@pytest.mark.processes
@pytest.mark.parametrize("server", ["grpcio", "native"])
def test_a_slow_client_gets_every_token_once_in_order(model_dir, tmp_path, server):
    """A client reading one message per 40 ms of a stream stepping every 5 ms, with
    --stream-interval-ms 20, on either client-facing server: the same tokens and text
    as a client that keeps up, and both in fewer messages than tokens. (Without an
    interval a slow client gets one message per token all the same: on loopback both
    servers buffer megabytes before a write waits, so what coalesces is what the
    router itself fell behind on.)"""
    stack = start_stack(
        model_dir, tmp_path, executor_args=["--simulate", "--simulate-base-ms", "5"],
        router_args=["--stream-interval-ms", "20", "--grpc-server", server],
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
