"""A separately deployed scheduling policy: its rankings order admission, and a dead,
slow or silly one fails open to FCFS without errors or slower steps."""

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagstop.v1 import generation_pb2
from tests.helpers.metrics import scrape
from tools.make_model import write_model
from tools.stack import free_port, spawn, start_stack, wait_serving

pytestmark = pytest.mark.processes  # every test here runs processes


class PolicyProcess:
    def __init__(self, log_dir) -> None:
        self.port, self.log_dir, self.process = free_port(), log_dir, None

    def start(self, strategy: str, sleep_ms: int = 0) -> None:
        args = ["-m", "examples.policy_server", "--strategy", strategy,
                "--port", str(self.port), "--sleep-ms", str(sleep_ms)]  # fmt: skip
        self.process = spawn(f"policy-{strategy}-{sleep_ms}", args, self.log_dir)
        wait_serving(grpc.insecure_channel(f"127.0.0.1:{self.port}"), self.process)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart(self, strategy: str, sleep_ms: int = 0) -> None:
        """The policy a test needs, whatever an earlier test (in any order) left."""
        if self.process.poll() is None:
            self.kill()
        self.start(strategy, sleep_ms)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    policy = PolicyProcess(logs)
    policy.start("shortest-prompt-first")
    model_dir = write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny", "tiny")
    stack = start_stack(
        model_dir, logs, executor_args=["--num-blocks", "256"],
        # One seat: admission order is completion order.
        scheduler_args=["--max-num-seqs", "1", "--policy", "remote", "--policy-addr",
                        f"127.0.0.1:{policy.port}", "--policy-deadline-ms", "200"],
    )  # fmt: skip
    yield stack, policy
    policy.kill()
    assert set(stack.stop().values()) == {0}


def run_behind_a_blocker(stack, requests: list[tuple[int, dict]]) -> list[int]:
    """Occupy the only seat, queue `requests` (prompt length, labels) in this order,
    and return the indexes in the order they finished (= were admitted)."""
    finished: list[int] = []
    lock = threading.Lock()

    def one(index: int, length: int, labels: dict, max_tokens: int) -> None:
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=[0] + [7] * (length - 1), max_tokens=max_tokens, ignore_eos=True,
            labels=labels,
        )  # fmt: skip
        for _ in stack.generation().Generate(request, timeout=120):
            pass
        with lock:
            finished.append(index)

    blocker = threading.Thread(target=one, args=(-1, 4, {"tenant": "blocker"}, 150))
    blocker.start()
    while stack.stats().num_running == 0:
        time.sleep(0.01)
    threads = []
    for i, (length, labels) in enumerate(requests):
        threads.append(threading.Thread(target=one, args=(i, length, labels, 3)))
        threads[-1].start()
        while stack.stats().num_waiting < i + 1:
            time.sleep(0.01)
    for t in [blocker, *threads]:
        t.join()
    return [i for i in finished if i >= 0]


def test_shortest_prompt_first_reorders_admission(setup):
    stack, policy = setup
    policy.restart("shortest-prompt-first")
    lengths = [40, 10, 30, 20, 5]
    order = run_behind_a_blocker(stack, [(n, {}) for n in lengths])
    assert [lengths[i] for i in order] == sorted(lengths)  # FCFS would be [40, 10, 30, 20, 5]
    assert stack.stats().remote_policy_active


def policy_health(stack) -> int:
    stub = health_pb2_grpc.HealthStub(stack.channel(stack.scheduler))
    return stub.Check(health_pb2.HealthCheckRequest(service="flagstop.v1.SchedulerPolicy")).status


def test_a_killed_policy_fails_open_and_a_restarted_one_takes_over(setup):
    stack, policy = setup
    before = stack.stats().remote_policy_failures
    policy.kill()
    lengths = [40, 10, 30, 20]
    # No errors, and FCFS order while the policy is gone.
    assert run_behind_a_blocker(stack, [(n, {}) for n in lengths]) == [0, 1, 2, 3]
    stats = stack.stats()
    assert not stats.remote_policy_active and stats.remote_policy_failures > before
    assert policy_health(stack) == health_pb2.HealthCheckResponse.NOT_SERVING
    policy.start("fair-share")
    # Two tenants at unequal load: the small one is interleaved, not served last.
    tenants = ["a"] * 5 + ["b"] * 2
    order = run_behind_a_blocker(stack, [(8, {"tenant": t}) for t in tenants])
    assert [tenants[i] for i in order][:4] == ["a", "b", "a", "b"]
    assert stack.stats().remote_policy_active
    assert policy_health(stack) == health_pb2.HealthCheckResponse.SERVING


def steps_while_asking(stack) -> float:
    return scrape(stack.metrics_ports["scheduler"])["flagstop:policy_steps_while_asking_total[]"]


def test_a_policy_slower_than_its_deadline_does_not_slow_the_steps(setup):
    """The loop plans steps while a query is out (it never waits for the answer): a
    count of the steps planned meanwhile, not a rate against the machine's load."""
    stack, policy = setup
    policy.restart("shortest-prompt-first", sleep_ms=1000)  # answers after the deadline
    failures, steps = stack.stats().remote_policy_failures, steps_while_asking(stack)
    run_behind_a_blocker(stack, [(n, {}) for n in [12, 9, 6, 3] * 3])
    assert stack.stats().remote_policy_failures > failures, "the deadline was meant to pass"
    # Each query is out for the 200 ms deadline: a loop that waited for it would plan
    # nothing meanwhile; this one plans the blocker's decode steps.
    assert steps_while_asking(stack) > steps


def test_a_built_in_policy_served_remotely_sheds_and_orders(setup):
    """The example server runs the core's slo policy on the view the query carries:
    a request it predicts will miss its target is shed (RESOURCE_EXHAUSTED, the
    reason), the others are served by slack."""
    stack, policy = setup
    policy.restart("slo")
    finished: list[int] = []

    def blocker() -> None:
        request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 4], max_tokens=120,
                                                 ignore_eos=True)  # fmt: skip
        finished.append(sum(len(c.token_ids) for c in stack.generation().Generate(request)))

    thread = threading.Thread(target=blocker)
    thread.start()
    while stack.stats().num_running == 0:
        time.sleep(0.01)
    hopeless = generation_pb2.GenerateRequest(prompt_token_ids=[0, 9], max_tokens=3,
                                              slo_ttft_ms=0.001)  # fmt: skip
    with pytest.raises(grpc.RpcError) as shed:
        list(stack.generation().Generate(hopeless, timeout=60))
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "time to first token" in shed.value.details()
    thread.join()
    assert finished == [120] and stack.stats().remote_policy_active
