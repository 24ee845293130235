"""Liveness apart from readiness: a process that is up but waiting for its peer stays
live (an orchestrator must not restart it and lose its queue) and is not ready; with
its peer it is both. The same entries answer the CLI and Kubernetes' gRPC probes."""

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagstop.health import LIVENESS, READINESS
from tools.stack import ROOT, free_port, spawn

pytestmark = pytest.mark.processes  # every test here runs processes

SERVING = health_pb2.HealthCheckResponse.SERVING


def status(address: str, entry: str):
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=entry), timeout=2
            )
        except grpc.RpcError:
            return None
    return reply.status


def probe(address: str, kind: str) -> int:
    command = [sys.executable, "-m", "flagstop.health", address, "--probe", kind]
    return subprocess.run(command, cwd=ROOT, capture_output=True, timeout=30).returncode


def wait_live(address: str, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while status(address, LIVENESS) != SERVING:
        assert process.poll() is None, f"exited with {process.returncode}"
        assert time.monotonic() < deadline, "never live"
        time.sleep(0.1)


@pytest.mark.parametrize("name", ["scheduler", "router"])
def test_waiting_for_its_peer_is_live_and_not_ready(name, model_dir, tmp_path):
    port, peer = free_port(), f"127.0.0.1:{free_port()}"  # nothing listens at peer
    args = {
        "scheduler": ["-m", "flagstop.scheduler_svc", "--executor", peer],
        "router": [
            "-m",
            "flagstop.router",
            "--model",
            str(model_dir),
            "--scheduler",
            peer,
            "--http-port",
            "0",
        ],
    }[name]
    process = spawn(name, [*args, "--port", str(port), "--metrics-port", "0"], tmp_path)
    address = f"127.0.0.1:{port}"
    try:
        wait_live(address, process)
        time.sleep(0.5)  # a few reconnect attempts
        assert status(address, LIVENESS) == SERVING
        assert status(address, READINESS) != SERVING and status(address, "") != SERVING
        assert (probe(address, "live"), probe(address, "ready")) == (0, 1)
    finally:
        process.terminate()
        assert process.wait(30) == 0


def test_a_serving_stack_is_live_and_ready(model_dir, tmp_path):
    from tools.stack import start_stack

    stack = start_stack(model_dir, tmp_path, executor_args=["--num-blocks", "64"])
    try:
        for address in (stack.router, stack.scheduler, stack.executor):
            assert status(address, LIVENESS) == status(address, READINESS) == SERVING
            assert (probe(address, "live"), probe(address, "ready")) == (0, 0)
    finally:
        assert set(stack.stop().values()) == {0}
