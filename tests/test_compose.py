"""The compose deployment, proven without a Docker engine: the files validate, every
command, flag and variable is one our code takes, and the same topology runs as local
processes (loopback instead of service names) and serves a request."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from pydantic import BaseModel

from flagstop.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.compose import PARSERS
from tools.otlp_collector import start_collector
from tools.stack import ROOT, free_port, spawn

pytestmark = pytest.mark.processes  # every test here runs processes

COMPOSE = ROOT / "compose" / "compose.yaml"
GPU = ROOT / "compose" / "compose.gpu.yaml"
# Read by the OpenTelemetry SDK in flagstop.telemetry.
OTEL_VARIABLES = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_SERVICE_NAME"}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def compose_tool() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        plugin = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if plugin.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, GPU]], ids=["cpu", "gpu"])
def test_the_compose_files_validate(files):
    tool = compose_tool()
    if tool is None:
        pytest.skip(
            "no docker-compose here (.ci/run installs Debian's): compose files not validated"
        )
    flags = [arg for f in files for arg in ("-f", str(f))]
    done = subprocess.run([*tool, *flags, "config", "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", [COMPOSE, GPU], ids=["cpu", "gpu"])
def test_every_command_flag_and_variable_is_one_our_code_takes(path, monkeypatch):
    base = load(COMPOSE)
    for name, service in load(path).items():
        command = service.get("command") or base.get(name, {}).get("command")
        if name == "jaeger":
            continue
        assert command[:2] == ["python", "-m"], name
        parse_args, prefix = PARSERS[command[2]]
        environment = {k: interpolate(v) for k, v in (service.get("environment") or {}).items()}
        with monkeypatch.context() as env:
            for variable, value in environment.items():
                env.setenv(variable, value)
            parsed = parse_args(command[3:])
        for variable, value in environment.items():
            if variable in OTEL_VARIABLES:
                continue
            assert prefix and variable.startswith(prefix), f"{name}: {variable} is not read"
            dest = variable.removeprefix(prefix).lower()
            assert hasattr(parsed, dest), f"{name}: {variable} matches no flag"
            assert applied(getattr(parsed, dest), value), f"{name}: {variable} not applied"
        if "healthcheck" in service:
            assert service["healthcheck"]["test"][1:4] == ["python", "-m", "flagstop.health"]


def interpolate(value) -> str:
    """${NAME:-default} as compose resolves it with NAME unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def localize(value: str, ports: dict[str, int], models: Path, otlp: str) -> str:
    """Service names and container ports -> loopback and free ports."""
    value = value.replace("http://jaeger:4317", otlp).replace("/models", str(models))
    value = value.replace("0.0.0.0", "127.0.0.1")
    value = re.sub(r"^[a-z0-9_.-]+:(\d+)$", lambda m: f"127.0.0.1:{ports[m.group(1)]}", value)
    return str(ports.get(value, value))


def applied(parsed, value: str) -> bool:
    """A setting as parsed is the variable's value: a JSON one (a nested config such
    as --speculative-config) compared as the config it makes, a boolean one as the
    flag it sets, an empty one unset."""
    if isinstance(parsed, BaseModel):
        return parsed == type(parsed).model_validate_json(value)
    if isinstance(parsed, bool):  # a flag: EP=1 on, its default 0 off
        return parsed == (value.lower() in {"1", "true", "yes", "on"})
    return str(parsed) == value or (parsed is None and value == "")


def test_the_compose_topology_runs_as_local_processes(tmp_path):
    services = load(COMPOSE)
    server, collector, otlp_port = start_collector()
    container_ports = {"50051", "50052", "50053", "50060", "8000", "8001", "8002", "8003"}
    ports = {p: free_port() for p in container_ports}
    loc = lambda v: localize(str(v), ports, tmp_path / "models", f"http://127.0.0.1:{otlp_port}")  # noqa: E731
    processes = {}
    try:
        for name in ("model-init", "executor", "scheduler", "router"):
            service = services[name]
            env = {k: loc(interpolate(v)) for k, v in (service.get("environment") or {}).items()}
            args = [loc(a) for a in service["command"][1:]]
            processes[name] = spawn(name, args, tmp_path / "logs", env)
            if name == "model-init":
                assert processes.pop(name).wait(120) == 0
                continue
            health = [loc(a) for a in service["healthcheck"]["test"][2:]]
            wait_healthy([sys.executable, *health], processes[name])
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['50051']}")
        request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=6, temperature=0)
        chunks = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
        assert sum(len(c.token_ids) for c in chunks) == 6
        deadline = time.monotonic() + 20
        while len(collector.services()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert collector.services() == {
            "flagstop-router",
            "flagstop-scheduler",
            "flagstop-executor",
        }
    finally:
        codes = {}
        for name, process in reversed(processes.items()):
            process.terminate()
            codes[name] = process.wait(30)
        server.stop(0)
    assert set(codes.values()) == {0}


def wait_healthy(command: list[str], process: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(command, cwd=ROOT, capture_output=True).returncode != 0:
        assert process.poll() is None, f"exited with {process.returncode}"
        assert time.monotonic() < deadline, "not healthy in time"
        time.sleep(0.2)


def test_make_up_replicas_2_routes_to_both_replicas():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # under make test
    done = subprocess.run(["make", "-n", "up", "REPLICAS=2"], cwd=ROOT, capture_output=True,
                          text=True, check=True, env=env)  # fmt: skip
    command = next(line for line in done.stdout.splitlines() if " up -d" in line)
    assert "COMPOSE_PROFILES=replicas" in command
    schedulers = re.search(r"ROUTER_SCHEDULERS=(\S+)", command).group(1).split(",")
    services = load(COMPOSE)
    for address in schedulers:
        name, port = address.split(":")
        assert services[name]["environment"]["FLAGSTOP_SCHEDULER_PORT"] == port, name
    executor = services["scheduler-2"]["environment"]["FLAGSTOP_SCHEDULER_EXECUTOR"]
    assert services[executor.split(":")[0]]["profiles"] == ["replicas"]


def test_make_up_pd_1_puts_a_prefill_replica_beside_the_decode_one():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # under make test
    done = subprocess.run(["make", "-n", "up", "PD=1"], cwd=ROOT, capture_output=True,
                          text=True, check=True, env=env)  # fmt: skip
    command = next(line for line in done.stdout.splitlines() if " up -d" in line)
    assert "COMPOSE_PROFILES=pd" in command and "KV_ROLE=decode" in command
    schedulers = re.search(r"ROUTER_SCHEDULERS=(\S+)", command).group(1).split(",")
    assert schedulers == ["scheduler:50052", "scheduler-prefill:50052"]
    services = load(COMPOSE)
    executor = services["scheduler-prefill"]["environment"]["FLAGSTOP_SCHEDULER_EXECUTOR"]
    prefill = services[executor.split(":")[0]]
    assert prefill["profiles"] == ["pd"]
    assert prefill["environment"]["FLAGSTOP_EXECUTOR_KV_ROLE"] == "prefill"
    assert interpolate(services["executor"]["environment"]["FLAGSTOP_EXECUTOR_KV_ROLE"]) == "both"
