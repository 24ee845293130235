"""The three services as real processes on free loopback ports, for integration tests."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagstop.server import CHANNEL_OPTIONS
from flagstop.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports handed to services come from below the kernel's ephemeral range: a port taken
# with bind(0) and released is also what the kernel gives the next outgoing connection
# of any process, and a test's service lost its port to one that way in CI ("Address
# already in use"). Below the range only another free_port() competes: this process
# never hands a port out twice, and the bind checks for other processes.
PORT_RANGE = (max(1024, _ephemeral_low() - 12000), _ephemeral_low())
_handed_out: set[int] = set()
_ports = random.Random(os.urandom(8))  # not the global random, which tests reseed


def free_port() -> int:
    for _ in range(1000):
        port = _ports.randrange(*PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the range is used up: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """One router in front of one replica (scheduler + executor), or of several:
    then their processes are named scheduler-0, executor-0, scheduler-1, ..."""

    addresses: dict[str, str]  # process name: its gRPC address
    processes: dict[str, subprocess.Popen]
    log_dir: Path
    metrics_ports: dict[str, int]
    commands: dict[str, list[str]]
    env: dict[str, str] | None = None
    channel_credentials: grpc.ChannelCredentials | None = None
    http: str = ""  # the router's OpenAI HTTP address

    @property
    def router(self) -> str:
        return self.addresses["router"]

    @property
    def scheduler(self) -> str:
        return self.addresses["scheduler"]

    @property
    def executor(self) -> str:
        return self.addresses["executor"]

    @property
    def base_url(self) -> str:
        return f"http://{self.http}/v1"

    def channel(self, address: str) -> grpc.Channel:
        if self.channel_credentials is not None:
            return grpc.secure_channel(address, self.channel_credentials, CHANNEL_OPTIONS)
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.processes[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.processes[name].wait()

    def restart(self, name: str) -> None:
        """The same command on the same port, as a supervisor would."""
        self.processes[name] = spawn(name, self.commands[name], self.log_dir, self.env, "a")
        wait_serving(self.channel(self.addresses[name]), self.processes[name])

    def set_routed(self, num_replicas: int) -> None:
        """The router's --config names the first num_replicas schedulers (start_replicas)."""
        self.route_to([self.addresses[f"scheduler-{i}"] for i in range(num_replicas)])

    def route_to(self, schedulers: list[str]) -> None:
        """The router's --config names these (then SIGHUP it)."""
        config = {"scheduler": ",".join(schedulers)}
        (self.log_dir / "router.json").write_text(json.dumps(config))

    def router_ready(self) -> bool:
        """The router's readiness entry: SERVING while some replica can take a request."""
        stub = health_pb2_grpc.HealthStub(self.channel(self.router))
        reply = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def generation(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel(self.router))

    def stats(self, scheduler: str = "scheduler") -> scheduler_pb2.GetStatsResponse:
        stub = scheduler_pb2_grpc.SchedulerStub(self.channel(self.addresses[scheduler]))
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)

    def wait_idle(
        self, timeout: float = 15.0, scheduler: str = "scheduler"
    ) -> scheduler_pb2.GetStatsResponse:
        """The idle invariant: nothing running or waiting, every block free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats(scheduler)
            if (stats.num_running, stats.num_waiting) == (0, 0) and (
                stats.num_free_blocks == stats.num_total_blocks
            ):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"scheduler not idle after {timeout}s: {stats}")
            time.sleep(0.05)

    def wait_routers(self, count: int, timeout: float = 60.0, scheduler: str = "scheduler") -> None:
        """Until count router processes hold a stream to the scheduler (--processes)."""
        deadline = time.monotonic() + timeout
        while (num_routers := self.stats(scheduler).num_routers) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{num_routers} of {count} routers after {timeout}s")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + (self.log_dir / f"{name}.log").read_text()[-3000:]
            for name in self.processes
        )

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM, router first; the exit codes (None: had to be killed)."""
        codes: dict[str, int | None] = {}
        for name, process in sorted(self.processes.items(), key=lambda kv: _stop_order(kv[0])):
            process.send_signal(signal.SIGCONT)  # a test may have stopped it
            process.send_signal(signal.SIGTERM)
            try:
                codes[name] = process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                codes[name] = None
        return codes


def _stop_order(name: str) -> int:
    return ("router", "scheduler", "executor").index(name.split("-")[0])


def scheduler_refusal(model_dir: Path, executor_args: list[str]) -> tuple[int, str]:
    """A scheduler started against an executor of model_dir (executor_args beside its
    model and ports) that stops start-up: its exit code and its last line on stderr."""
    executor_port, scheduler_port = free_port(), free_port()
    executor = subprocess.Popen(
        [sys.executable, "-m", "flagstop.executor", "--model", str(model_dir), "--port",
         str(executor_port), "--metrics-port", str(free_port()), *executor_args],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "flagstop.scheduler_svc", "--port", str(scheduler_port),
             "--metrics-port", str(free_port()), "--executor", f"127.0.0.1:{executor_port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        executor.kill()
        executor.wait()
    return done.returncode, done.stderr.strip().splitlines()[-1]


def start_stack(
    model_dir: Path,
    log_dir: Path,
    *,
    executor_args=(),
    scheduler_args=(),
    router_args=(),
    env: dict[str, str] | None = None,
    channel_credentials: grpc.ChannelCredentials | None = None,
    checkout: Path = ROOT,
) -> Stack:
    """channel_credentials: how the test talks to the three (with TLS on); checkout:
    run another checkout of flagstop, with its own .venv (two versions side by side)."""
    return _once_more_if_a_port_was_taken(lambda: _start_stack(
        model_dir, log_dir, executor_args, scheduler_args, router_args, env,
        channel_credentials, checkout,
    ))  # fmt: skip


def _once_more_if_a_port_was_taken(start: Callable[[], "Stack"]) -> "Stack":
    """Another process can still bind a port between free_port() and the service (one
    outside this process's test run): a stack that did not come up for that starts
    once more, on new ports."""
    try:
        return start()
    except RuntimeError as e:
        if "Address already in use" not in str(e):
            raise
    return start()


def _start_stack(
    model_dir, log_dir, executor_args, scheduler_args, router_args, env, channel_credentials,
    checkout,
) -> Stack:  # fmt: skip
    ports = {name: free_port() for name in ("router", "scheduler", "executor")}
    metrics_ports = {name: free_port() for name in ports}
    address = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    commands = {
        "executor": ["-m", "flagstop.executor", "--model", str(model_dir), *executor_args],
        "scheduler": ["-m", "flagstop.scheduler_svc", "--executor", address["executor"],
                      *scheduler_args],
        "router": ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler",
                   address["scheduler"], *router_args],
    }  # fmt: skip
    for name, args in commands.items():
        args += ["--port", str(ports[name]), "--metrics-port", str(metrics_ports[name])]
    http = f"127.0.0.1:{free_port()}"
    if "--http-port" not in router_args:
        commands["router"] += ["--http-port", http.rsplit(":", 1)[1]]
    processes = {name: spawn(name, args, log_dir, env, checkout=checkout)
                 for name, args in commands.items()}  # fmt: skip
    stack = Stack(address, processes, log_dir, metrics_ports, commands, env,
                  channel_credentials, http)  # fmt: skip
    return _wait_up(stack)


def _wait_up(stack: Stack) -> Stack:
    try:
        for name in sorted(stack.processes, key=_stop_order, reverse=True):
            wait_serving(stack.channel(stack.addresses[name]), stack.processes[name])
    except Exception:
        stack.stop(5)
        raise RuntimeError(f"the stack did not come up:\n{stack.logs()}") from None
    return stack


def start_replicas(
    model_dir: Path,
    log_dir: Path,
    num_replicas: int,
    *,
    executor_args=(),
    scheduler_args=(),
    router_args=(),
    env: dict[str, str] | None = None,
    num_routed: int | None = None,
    replica_executor_args=(),
    wait_routed: bool = True,
) -> Stack:
    """A router in front of num_replicas replicas (scheduler-i + executor-i each); it
    knows the first num_routed of them (default all) from its --config file, which
    set_routed() rewrites (then SIGHUP the router). replica_executor_args[i]: more
    flags for executor-i (a prefill and a decode replica: --kv-role). wait_routed:
    return once the router holds a stream to each (else once all serve)."""
    return _once_more_if_a_port_was_taken(lambda: _start_replicas(
        model_dir, log_dir, num_replicas, executor_args, scheduler_args, router_args, env,
        num_routed, replica_executor_args, wait_routed,
    ))  # fmt: skip


def start_disaggregated(
    model_dir: Path, log_dir: Path, prefill_args=(), decode_args=(), **kwargs
) -> Stack:
    """A router in front of a prefill replica (scheduler-0 + executor-0) and a decode
    replica (scheduler-1 + executor-1); prefill_args, decode_args: more flags for
    either executor."""
    roles = [["--kv-role", "prefill", *prefill_args], ["--kv-role", "decode", *decode_args]]
    return start_replicas(model_dir, log_dir, 2, replica_executor_args=roles, **kwargs)


def _start_replicas(
    model_dir, log_dir, num_replicas, executor_args, scheduler_args, router_args, env,
    num_routed, replica_executor_args, wait_routed,
) -> Stack:  # fmt: skip
    names = ["router"] + [f"{kind}-{i}" for i in range(num_replicas)
                          for kind in ("scheduler", "executor")]  # fmt: skip
    address = {name: f"127.0.0.1:{free_port()}" for name in names}
    commands = {"router": ["-m", "flagstop.router", "--model", str(model_dir),
                           "--config", str(log_dir / "router.json"), *router_args]}  # fmt: skip
    for i in range(num_replicas):
        own = replica_executor_args[i] if i < len(replica_executor_args) else []
        commands[f"executor-{i}"] = ["-m", "flagstop.executor", "--model", str(model_dir),
                                     *executor_args, *own]  # fmt: skip
        commands[f"scheduler-{i}"] = ["-m", "flagstop.scheduler_svc", "--executor",
                                      address[f"executor-{i}"], *scheduler_args]  # fmt: skip
    metrics_ports = {name: free_port() for name in names}
    for name, args in commands.items():
        args += ["--port", address[name].rsplit(":", 1)[1],
                 "--metrics-port", str(metrics_ports[name])]  # fmt: skip
    http = f"127.0.0.1:{free_port()}"
    commands["router"] += ["--http-port", http.rsplit(":", 1)[1]]
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(address, {}, log_dir, metrics_ports, commands, env, http=http)
    stack.set_routed(num_replicas if num_routed is None else num_routed)
    stack.processes = {name: spawn(name, args, log_dir, env) for name, args in commands.items()}
    _wait_up(stack)
    try:
        for i in range(num_replicas if num_routed is None else num_routed):
            if wait_routed:
                stack.wait_routers(1, scheduler=f"scheduler-{i}")  # routable, not only up
    except Exception:
        stack.stop(5)  # no process outlives a stack that did not come up
        raise
    return stack


def spawn(
    name: str,
    args: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    mode: str = "w",
    checkout: Path = ROOT,
) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / f"{name}.log").open(mode)
    return subprocess.Popen(
        [python(checkout), *args], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT
    )


def python(checkout: Path) -> str:
    return sys.executable if checkout == ROOT else str(checkout / ".venv" / "bin" / "python")


def wait_serving(channel: grpc.Channel, process: subprocess.Popen, timeout: float = 90.0) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}")
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise TimeoutError("not SERVING in time")


def generate(stack: Stack, timeout: float = 60.0, **fields) -> tuple[list[int], str, object]:
    """Token ids, text and the last chunk of one streamed request."""
    tokens, text, last = [], "", None
    for chunk in stack.generation().Generate(
        generation_pb2.GenerateRequest(**fields), timeout=timeout
    ):
        tokens += chunk.token_ids
        text += chunk.text
        last = chunk
    return tokens, text, last
