"""The three services as real processes over real gRPC on loopback ports."""

import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from flagstop.v1 import generation_pb2
from tests.helpers.streams import (
    assert_greedy_under_pressure,
    assert_matches_reference,
    run_concurrently,
)
from tests.helpers.streams import short_greedy_workload as workload
from tools.stack import ROOT, free_port, generate, spawn, start_stack, wait_serving

pytestmark = pytest.mark.processes  # every test here runs processes

SERVICES = {
    "router": "flagstop.v1.Generation",
    "scheduler": "flagstop.v1.Scheduler",
    "executor": "flagstop.v1.Executor",
}


def running_stack(model_dir, log_dir, **kwargs):
    stack = start_stack(model_dir, log_dir, **kwargs)
    yield stack
    codes = stack.stop()
    assert codes == {"router": 0, "scheduler": 0, "executor": 0}, stack.logs()


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    yield from running_stack(
        model_dir, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "512"]
    )


@pytest.fixture(scope="module")
def tight_stack(model_dir, tmp_path_factory):
    """A 384-token KV pool and a 32-token budget: preemption and chunked prefill."""
    yield from running_stack(
        model_dir, tmp_path_factory.mktemp("tight"),
        executor_args=["--num-blocks", "24"],
        scheduler_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "8"],
    )  # fmt: skip


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    for name in ("stack", "tight_stack", "queue_stack"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


def test_health_and_reflection_on_every_service(stack):
    for name, service in SERVICES.items():
        channel = stack.channel(getattr(stack, name))
        health = health_pb2_grpc.HealthStub(channel)
        for service_name in ("", service):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        listed = {s.name for r in replies for s in r.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= listed


def test_concurrent_greedy_requests_match_transformers(stack, reference):
    requests = workload(1)
    assert_matches_reference(reference, requests, run_concurrently(stack, requests))


def test_greedy_outputs_survive_preemption_chunking_and_prefix_sharing(tight_stack, reference):
    assert_greedy_under_pressure(tight_stack, reference, workload(2, shared_prefix=True))


def test_two_routers_share_one_scheduler(stack, model_dir, reference, tmp_path):
    port = free_port()
    args = ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler", stack.scheduler]
    args += ["--port", str(port), "--metrics-port", "0", "--http-port", "0"]
    second = spawn("router2", args, tmp_path)
    try:
        wait_serving(stack.channel(f"127.0.0.1:{port}"), second)
        other = dataclasses.replace(
            stack, addresses={**stack.addresses, "router": f"127.0.0.1:{port}"}
        )
        requests = workload(3, n=12)
        with ThreadPoolExecutor(2) as pool:
            halves = [
                pool.submit(run_concurrently, s, requests[i::2])
                for i, s in enumerate((stack, other))
            ]
            outputs = [halves[i % 2].result()[i // 2] for i in range(len(requests))]
        assert_matches_reference(reference, requests, outputs)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0


def test_a_new_request_joins_while_long_ones_run(stack):
    first_token_at, finished_at = {}, {}

    def stream(name: str, max_tokens: int) -> None:
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=[0, 7, 8, 9], max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        for chunk in stack.generation().Generate(request, timeout=60):
            if chunk.token_ids and name not in first_token_at:
                first_token_at[name] = time.monotonic()
        finished_at[name] = time.monotonic()

    long_ones = [threading.Thread(target=stream, args=(f"long{i}", 300)) for i in range(4)]
    for t in long_ones:
        t.start()
    while len(first_token_at) < 4:
        time.sleep(0.01)
    stream("short", 3)
    for t in long_ones:
        t.join()
    assert first_token_at["short"] < min(finished_at[f"long{i}"] for i in range(4))
    assert finished_at["short"] < min(finished_at[f"long{i}"] for i in range(4))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt_token_ids": [0, 5], "max_tokens": 5000}, "exceeds the model's max_model_len"),
        ({"prompt_token_ids": [0, 5], "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt_token_ids": [0, 5], "temperature": -0.5}, "temperature must be >= 0"),
        ({"prompt_token_ids": [0, 5], "top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"prompt_token_ids": [0, 5], "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"prompt_token_ids": [0, 5], "top_k": -1}, "top_k must be >= 0"),
        ({"prompt_token_ids": [0, 5, 512]}, "token id 512 is outside the vocabulary"),
        ({"prompt": "hi", "prompt_token_ids": [0]}, "either prompt or prompt_token_ids"),
    ],
)
def test_bad_input_is_refused_while_others_complete(stack, fields, message):
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(generate, stack, prompt_token_ids=[0, 40 + i], max_tokens=30,
                              temperature=0, ignore_eos=True) for i in range(2)]  # fmt: skip
        with pytest.raises(grpc.RpcError) as error:
            generate(stack, **fields)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(message, error.value.details()), error.value.details()
        for other in others:
            assert len(other.result()[0]) == 30


def test_a_prompt_larger_than_the_kv_pool_is_refused_while_others_complete(tight_stack):
    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(generate, tight_stack, prompt_token_ids=[0, 40 + i], max_tokens=30,
                              temperature=0, ignore_eos=True) for i in range(2)]  # fmt: skip
        with pytest.raises(grpc.RpcError) as error:
            generate(tight_stack, prompt_token_ids=[0] + [5] * 399, max_tokens=1)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the whole KV cache (384 tokens)" in error.value.details()
        assert all(len(other.result()[0]) == 30 for other in others)


def test_stop_strings_end_the_text_before_the_match(stack):
    _, text, _ = generate(stack, prompt="Once upon a time", max_tokens=40, temperature=0)
    assert len(text) > 12
    stop = text[8:11]
    _, stopped_text, last = generate(
        stack, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop]
    )
    assert stopped_text == text[: text.index(stop)]
    assert last.finish_reason == generation_pb2.FINISH_REASON_STOP and last.stop_reason == stop


def test_a_cancelled_stream_frees_its_blocks_within_a_step(stack):
    call = stack.generation().Generate(
        generation_pb2.GenerateRequest(prompt_token_ids=[0, 3, 4], max_tokens=500, ignore_eos=True),
        timeout=60,
    )
    for _ in range(3):
        next(call)
    assert stack.stats().num_running == 1
    call.cancel()
    step_at_cancel = stack.stats().step_id
    idle = stack.wait_idle(timeout=5)
    # The scheduler frees the blocks as the abort arrives, before its next plan; until
    # then the cancel crosses the router while steps of a few ms go on, and the steps
    # already in flight finish.
    assert idle.step_id - step_at_cancel <= 5


def test_a_passed_deadline_is_deadline_exceeded_and_frees_the_blocks(stack):
    with pytest.raises(grpc.RpcError) as error:
        generate(stack, timeout=0.5, prompt_token_ids=[0, 3], max_tokens=1900, ignore_eos=True)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.fixture(scope="module")
def queue_stack(model_dir, tmp_path_factory):
    """One seat, one waiting place at the scheduler; at the router, three requests or 40
    prompt tokens in the queue."""
    yield from running_stack(
        model_dir, tmp_path_factory.mktemp("queue"),
        executor_args=["--num-blocks", "128"],
        scheduler_args=["--max-num-seqs", "1", "--max-waiting-requests", "1"],
        router_args=["--max-queued-requests", "3", "--max-queued-tokens", "40"],
    )  # fmt: skip


def test_a_full_admission_queue_is_resource_exhausted_at_once(queue_stack):
    def long_request():
        return generate(queue_stack, prompt_token_ids=[0, 9], max_tokens=300, ignore_eos=True)

    def submit_until(pool, running: int, waiting: int):
        future = pool.submit(long_request)
        while (queue_stack.stats().num_running, queue_stack.stats().num_waiting) != (
            running,
            waiting,
        ):
            time.sleep(0.01)
        return future

    def refused(prompt_token_ids: list[int]) -> str:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            generate(queue_stack, prompt_token_ids=prompt_token_ids, max_tokens=5)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - start < 1.0
        # gRPC's retry pushback tells the client when to try again.
        assert ("grpc-retry-pushback-ms", "1000") in error.value.trailing_metadata()
        return error.value.details()

    with ThreadPoolExecutor(5) as pool:
        # 1 running + 1 waiting at the scheduler, then 2 queued at the router (4 tokens).
        admitted = [submit_until(pool, 1, 0), submit_until(pool, 1, 1)]
        admitted += [pool.submit(long_request) for _ in range(2)]
        time.sleep(0.3)
        assert "holds 4 prompt tokens" in refused([0] + [9] * 37)  # 4 + 38 > 40
        admitted.append(pool.submit(long_request))  # the third place
        time.sleep(0.3)
        assert "admission queue is full" in refused([0, 9])
        assert all(len(f.result()[0]) == 300 for f in admitted)


@pytest.fixture(scope="module")
def token_capped_stack(model_dir, tmp_path_factory):
    """One seat; the scheduler takes waiting requests up to 10 prompt tokens (plus the
    routers' standing credits), the router queues two more."""
    yield from running_stack(
        model_dir, tmp_path_factory.mktemp("tokens"),
        executor_args=["--num-blocks", "128"],
        scheduler_args=["--max-num-seqs", "1", "--max-waiting-tokens", "10"],
        router_args=["--max-queued-requests", "2"],
    )  # fmt: skip


def test_waiting_prompt_tokens_are_capped_and_the_rest_refused(token_capped_stack):
    stack = token_capped_stack

    def one(max_tokens: int, prompt_len: int = 20):
        try:
            return len(generate(stack, prompt_token_ids=[0] + [9] * (prompt_len - 1),
                                max_tokens=max_tokens, ignore_eos=True)[0])  # fmt: skip
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(16) as pool:
        blocker = pool.submit(one, 300, 2)
        while stack.stats().num_running < 1:
            time.sleep(0.01)
        others = [pool.submit(one, 2) for _ in range(15)]
        time.sleep(0.5)
        # Without the cap all 15 would wait at the scheduler (--max-waiting-requests 256).
        assert stack.stats().num_waiting <= 1 + 8  # one past the cap, the standing credits
        results = [f.result() for f in others]
    assert blocker.result() == 300
    refused = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert refused and all(r == 2 for r in results if r not in refused)


def test_the_router_never_loads_torch(stack):
    """The embedded checkpoint's tokenizer loads without transformers' configuration
    code, which imports torch (router/tokenizer.py): 5 s less of every start-up."""
    generate(stack, prompt="hello", max_tokens=3)
    maps = Path(f"/proc/{stack.processes['router'].pid}/maps").read_text()
    assert "libtorch" not in maps


def test_model_info(stack):
    reply = stack.generation().GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
    info = reply.model
    assert (info.model_name, info.vocab_size, info.block_size, info.num_blocks) == (
        "flagstop-tiny",
        512,
        16,
        512,
    )
    assert list(info.eos_token_ids) == [1] and info.max_model_len == 2048


def run_client(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flagstop.router.client", "--addr", stack.router, *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_the_client_cli_streams_and_reports(stack):
    done = run_client(stack, "--prompt-ids", "0,5,6", "--max-tokens", "7", "--temperature", "0",
                      "--ignore-eos", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {
        "text",
        "token_ids",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "ttft_s",
        "e2e_s",
    }
    assert (result["finish_reason"], result["prompt_tokens"], result["completion_tokens"]) == (
        "length",
        3,
        7,
    )
    assert len(result["token_ids"]) == 7 and 0 < result["ttft_s"] <= result["e2e_s"]
    failed = run_client(stack, "hello", "--max-tokens", "0")
    assert failed.returncode == 1 and "INVALID_ARGUMENT: max_tokens must be >= 1" in failed.stderr


def test_the_client_waits_for_a_router_that_is_not_up_yet(stack, model_dir, tmp_path):
    """Clients started together with (or just before) the router, or while it restarts,
    are served once it answers, within their --timeout, instead of failing their
    first connection attempt with UNAVAILABLE."""
    port = free_port()
    client = [sys.executable, "-m", "flagstop.router.client", "--addr", f"127.0.0.1:{port}",
              "--prompt-ids", "0,5,6", "--max-tokens", "3", "--ignore-eos", "--json"]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": ROOT}
    waiting = [subprocess.Popen([*client, "--timeout", "90"], **pipes) for _ in range(4)]
    time.sleep(2)  # the clients are trying; nothing listens on the port yet
    args = ["-m", "flagstop.router", "--model", str(model_dir), "--scheduler", stack.scheduler,
            "--port", str(port), "--metrics-port", "0", "--http-port", "0"]  # fmt: skip
    router = spawn("late-router", args, tmp_path)
    try:
        for process in waiting:
            out, err = process.communicate(timeout=90)
            assert process.returncode == 0, err
            assert json.loads(out)["completion_tokens"] == 3
        served = subprocess.run([*client, "--connect-timeout", "1"], capture_output=True,
                                text=True, timeout=30, cwd=ROOT)  # fmt: skip
        assert served.returncode == 0, served.stderr  # the router is up by now
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
    gone = subprocess.run([*client, "--connect-timeout", "1"], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)  # fmt: skip
    assert gone.returncode == 1 and "no router answered" in gone.stderr
