"""Killing or hanging any part of the stack loses no request: real processes, real
signals, and every stream checked token for token against transformers."""

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest

from tests.helpers.streams import Streams, assert_token_exact
from tests.helpers.streams import long_greedy_workload as workload
from tools.load import many_streams, rss_kib
from tools.stack import ROOT, start_stack

pytestmark = pytest.mark.processes  # every test here runs processes


@pytest.fixture
def stack(model_dir, tmp_path, request):
    """A fresh stack per test (each breaks its own); extra flags by indirect param."""
    flags = getattr(request, "param", {})
    stack = start_stack(
        model_dir, tmp_path,
        executor_args=["--num-blocks", "512", *flags.get("executor", [])],
        scheduler_args=flags.get("scheduler", []), router_args=flags.get("router", []),
        env=flags.get("env"),
    )  # fmt: skip
    yield stack
    stack.stop(10)


def wait_until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_killed_executor_is_replaced_and_every_stream_completes_token_exact(stack, reference):
    streams = Streams(stack, workload())
    streams.wait_for_tokens(10)
    stack.kill("executor")
    wait_until(lambda: not stack.stats().executor_connected)
    progress = list(map(len, streams.tokens))
    assert all(n < max_tokens for n, (_, max_tokens) in zip(progress, workload(), strict=True))
    stack.restart("executor")
    assert_token_exact(reference, streams)
    stats = stack.wait_idle()
    assert stats.executor_connected and stats.num_preemptions >= len(streams.requests)


LOST = {"scheduler": ["--executor-heartbeat-timeout", "1", "--executor-timeout", "2"]}


@pytest.mark.parametrize("stack", [LOST], indirect=True)
def test_without_an_executor_requests_end_unavailable_and_free_every_block(stack):
    streams = Streams(stack, workload(4))
    streams.wait_for_tokens(5)
    stack.kill("executor")
    start = time.monotonic()
    assert streams.errors() == [grpc.StatusCode.UNAVAILABLE] * 4
    assert time.monotonic() - start < 10
    stats = stack.wait_idle(timeout=5)
    assert not stats.executor_connected
    stack.restart("executor")
    wait_until(lambda: stack.stats().executor_connected)
    assert len(Streams(stack, workload(2)).results()) == 2  # serving again


@pytest.mark.parametrize("stack", [LOST], indirect=True)
def test_a_hung_executor_is_detected_by_its_heartbeat_and_treated_as_dead(stack):
    streams = Streams(stack, workload(4))
    streams.wait_for_tokens(5)
    stack.kill("executor", signal.SIGSTOP)  # alive, holding its connections, silent
    wait_until(lambda: not stack.stats().executor_connected, timeout=5)
    assert streams.errors() == [grpc.StatusCode.UNAVAILABLE] * 4
    stack.wait_idle(timeout=5)
    stack.kill("executor", signal.SIGCONT)
    wait_until(lambda: stack.stats().executor_connected)
    assert len(Streams(stack, workload(2)).results()) == 2


def test_a_killed_scheduler_is_replaced_and_clients_see_only_a_pause(stack, reference):
    streams = Streams(stack, workload())
    streams.wait_for_tokens(10)
    stack.kill("scheduler")
    stack.restart("scheduler")
    assert_token_exact(reference, streams)
    stack.wait_idle()


def test_a_killed_client_frees_its_blocks_within_a_step(stack):
    script = (
        "import sys, grpc\n"
        "from flagstop.v1 import generation_pb2 as g, generation_pb2_grpc as s\n"
        f"stub = s.GenerationStub(grpc.insecure_channel('{stack.router}'))\n"
        "request = g.GenerateRequest(prompt_token_ids=[0, 3], max_tokens=1900, ignore_eos=True)\n"
        "for chunk in stub.Generate(request):\n"
        "    print(len(chunk.token_ids), flush=True)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              env={"PYTHONPATH": f"{ROOT}:{ROOT / 'protos'}"})  # fmt: skip
    for _ in range(3):
        client.stdout.readline()
    assert stack.stats().num_running == 1
    client.kill()
    client.wait()
    step_at_kill = stack.stats().step_id
    idle = stack.wait_idle(timeout=5)
    assert idle.step_id - step_at_kill <= 5


# The executor's two oneDNN primitive caches (ideep's and oneDNN's own) fill over many
# loads, one primitive per weight shape and padded row count: +70 MiB over ten loads at
# the default --onednn-cache-capacity (bounded; bench/soak.py, docs/memory.md). Pinned
# small here, so that the test watches our own objects. Only one of the two caches was
# pinned before, and the other's filling failed this test in CI (+16.4 MiB a load).
SMALL_CACHES = {"executor": ["--onednn-cache-capacity", "16"]}
NUM_LOADS, FILLED_AFTER = 6, 2


@pytest.mark.parametrize("stack", [SMALL_CACHES], indirect=True)
def test_a_thousand_concurrent_streams_complete_and_memory_plateaus(stack):
    """Loads of 1000 concurrent streams: all complete, every block comes back, and each
    process's memory stays flat once the first loads have filled what they fill."""
    asyncio.run(many_streams(stack.router, 100))  # warm-up: the baseline is a used stack
    stack.wait_idle()
    rss: dict[str, list[int]] = {name: [] for name in stack.processes}
    for _ in range(NUM_LOADS):
        assert asyncio.run(many_streams(stack.router, 1000)) == [4] * 1000
        stats = stack.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
        for name, process in stack.processes.items():
            rss[name].append(rss_kib(process.pid) // 1024)
    for name, series in rss.items():
        flat = series[FILLED_AFTER:]
        # Seen over ten loads: the router swings 440-460 MiB (its allocators' arenas),
        # the scheduler and the executor stay within 5 MiB. A leak of 16 KiB a request
        # adds 16 MiB a load: 48 MiB between the ends of the window.
        trend = (flat[-1] + flat[-2]) / 2 - (flat[0] + flat[1]) / 2
        assert trend < 16 and max(flat) - min(flat) < 32, (name, rss)
