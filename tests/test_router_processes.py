"""flagstop-router --processes N: router processes sharing the gRPC and HTTP ports
(SO_REUSEPORT), each with its own scheduler stream, metrics summed over all of them,
one that dies started again, SIGTERM draining all."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tools.stack import ROOT, start_stack

pytestmark = pytest.mark.processes  # every test here runs processes


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


async def streams_over_connections(router: str, num_connections: int, per_connection: int):
    """Token counts of per_connection streams on each of num_connections connections."""
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # one TCP each
    channels = [grpc.aio.insecure_channel(router, options=options)
                for _ in range(num_connections)]  # fmt: skip

    async def one(stub, i: int) -> int:
        request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 5 + i, 9], max_tokens=4,
                                                 ignore_eos=True)  # fmt: skip
        return sum([len(c.token_ids) async for c in stub.Generate(request, timeout=60)])

    try:
        stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
        calls = [one(stub, i) for stub in stubs for i in range(per_connection)]
        return await asyncio.gather(*calls)
    finally:
        for c in channels:
            await c.close()


def generation_tokens(stack) -> float:
    text = httpx.get(f"http://{stack.http}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r'^vllm:generation_tokens_total\{[^}]*\} (\S+)$',
                                            text, re.M))  # fmt: skip


def test_router_processes_share_the_ports_restart_and_drain(model_dir, tmp_path):
    stack = start_stack(
        model_dir, tmp_path, executor_args=["--simulate", "--simulate-base-ms", "5"],
        router_args=["--processes", "2", "--min-uptime-s", "1"],
    )  # fmt: skip
    try:
        stack.wait_routers(2)
        supervisor = stack.processes["router"]
        workers = children(supervisor.pid)
        assert len(workers) == 2

        assert asyncio.run(streams_over_connections(stack.router, 8, 4)) == [4] * 32
        stack.wait_idle()
        # Whichever process answers /metrics, it counts the tokens of both.
        assert {generation_tokens(stack) for _ in range(6)} == {32 * 4}
        openai_reply = httpx.post(
            f"{stack.base_url}/completions",
            timeout=30,
            json={"model": "flagstop-tiny", "prompt": "hi", "max_tokens": 3},
        )
        assert openai_reply.status_code == 200, openai_reply.text

        # A process that dies after serving a while is started again.
        time.sleep(max(0.0, 1.5 - (time.monotonic() - started_at(workers[0]))))
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (set(children(supervisor.pid)) - set(workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        stack.wait_routers(2)
        assert asyncio.run(streams_over_connections(stack.router, 4, 2)) == [4] * 8
    finally:
        codes = stack.stop()
    assert codes["router"] == 0, stack.logs()
    assert not children(supervisor.pid)


def started_at(pid: int) -> float:
    """When the process started, on the monotonic clock."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.monotonic() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


@pytest.mark.parametrize("argv, said", [
    (["--processes", "2", "--port", "0"], "--processes needs a fixed --port"),
    (["--processes", "2", "--model", "/nonexistent", "--port", "1"], "cannot"),
])  # fmt: skip
def test_a_bad_setting_stops_the_router_processes_with_one_line(argv, said):
    done = subprocess.run([sys.executable, "-m", "flagstop.router", *argv, "--http-port", "0",
                           "--metrics-port", "0"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert said in done.stderr, done.stderr
