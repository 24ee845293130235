"""The router on --grpc-server native (pygrpc-native: HTTP/2 in Rust, the same
servicers): what a client relies on, through real processes. One stack on the
simulator for the module; each test leaves it serving. (A slow client's stream on
either server: tests/test_coalescing.py.)"""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.load import many_streams
from tools.stack import start_stack

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("native"),
        executor_args=["--simulate", "--simulate-base-ms", "5", "--max-num-seqs", "2048",
                       "--max-num-batched-tokens", "16384"],
        scheduler_args=["--max-num-seqs", "2048", "--max-waiting-requests", "2048",
                        "--max-num-batched-tokens", "16384"],
        router_args=["--grpc-server", "native", "--max-queued-requests", "4096"],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


def request(max_tokens: int, **fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=[0, 11, 12, 13], max_tokens=max_tokens, ignore_eos=True, **fields
    )


def test_two_thousand_streams_complete_and_free_every_block(stack):
    """As tests/test_simulator.py's load on grpcio (which also watches memory)."""
    started = time.monotonic()
    assert asyncio.run(many_streams(stack.router, 2000)) == [4] * 2000
    assert time.monotonic() - started < 60
    assert stack.wait_idle().num_free_blocks == stack.stats().num_total_blocks


def test_a_cancelled_stream_is_aborted_within_a_few_steps(stack):
    async def cancel_after_tokens() -> None:
        async with grpc.aio.insecure_channel(stack.router, options=CHANNEL_OPTIONS) as ch:
            call = generation_pb2_grpc.GenerationStub(ch).Generate(request(2000), timeout=60)
            async for _ in call:
                break
            call.cancel()

    asyncio.run(cancel_after_tokens())
    step = stack.stats().step_id
    idle = stack.wait_idle(timeout=5)
    assert idle.step_id - step <= 10


def test_a_deadline_ends_the_stream_and_frees_its_blocks(stack):
    stub = stack.generation()
    with pytest.raises(grpc.RpcError) as failed:
        for _ in stub.Generate(request(2000), timeout=0.5):
            pass
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_idle(timeout=5)


def test_a_call_with_metadata_is_served_and_refusals_keep_their_status(stack):
    """A call carrying metadata (a W3C traceparent) streams as any other; a refusal
    is a status with its message, as on grpcio."""
    stub, traceparent = stack.generation(), f"00-{'ab' * 16}-{'cd' * 8}-01"
    metadata = (("traceparent", traceparent),)
    chunks = list(stub.Generate(request(3), metadata=metadata, timeout=30))
    assert sum(len(c.token_ids) for c in chunks) == 3
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request(3, temperature=-1), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in refused.value.details()


def test_health_and_reflection_are_served(stack):
    ch = stack.channel(stack.router)
    health = health_pb2_grpc.HealthStub(ch)
    ready = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert ready.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([ask]), timeout=5)
    names = {s.name for s in answer.list_services_response.service}
    assert "flagstop.v1.Generation" in names


def test_a_killed_scheduler_is_replaced_and_streams_go_on(stack):
    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(stack.router, options=CHANNEL_OPTIONS) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)

            async def one(i: int) -> int:
                req = request(300, seed=i, temperature=1.0)
                return sum([len(c.token_ids) async for c in stub.Generate(req, timeout=120)])

            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await asyncio.sleep(0.5)
            stack.kill("scheduler")
            stack.restart("scheduler")
            return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == [300] * 8
    stack.wait_idle(timeout=30)
