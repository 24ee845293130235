"""Service objectives through the real processes: targets and tenants from fields and
headers reach the scheduler and the metrics; the admin call swaps the policy under
load losing nothing; a shadow policy's comparisons show; a request the slo policy
cannot serve in time is refused with RESOURCE_EXHAUSTED / 429 and a time to retry."""

import json
import re
import threading
import time

import grpc
import httpx
import pytest

from flagstop.replay import main
from flagstop.v1 import generation_pb2, scheduler_pb2, scheduler_pb2_grpc
from tools.make_model import write_model
from tools.stack import start_stack

pytestmark = pytest.mark.processes
ADMIN = (("authorization", "Bearer sesame"),)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return tmp_path_factory.mktemp("record") / "workload.jsonl"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, record):
    model_dir = write_model(tmp_path_factory.mktemp("model") / "flagstop-tiny", "tiny")
    stack = start_stack(
        model_dir, tmp_path_factory.mktemp("logs"), executor_args=["--num-blocks", "256"],
        scheduler_args=["--max-num-seqs", "2", "--admin-key", "sesame",
                        "--shadow-policy", "slo"],
        router_args=["--slo-defaults", '{"class:batch": {"ttft_ms": 60000}}',
                     "--record-workload", str(record)],
    )  # fmt: skip
    yield stack
    assert set(stack.stop().values()) == {0}


def admin(stack) -> scheduler_pb2_grpc.SchedulerStub:
    return scheduler_pb2_grpc.SchedulerStub(stack.channel(stack.scheduler))


def set_policy(stack, **fields) -> scheduler_pb2.SetPolicyResponse:
    return admin(stack).SetPolicy(scheduler_pb2.SetPolicyRequest(**fields), metadata=ADMIN)


def stream(stack, results: list, max_tokens: int = 40, **fields) -> None:
    fields.setdefault("prompt_token_ids", [0, 5, 6, 7])
    request = generation_pb2.GenerateRequest(ignore_eos=True, max_tokens=max_tokens,
                                             **fields)  # fmt: skip
    tokens = []
    for chunk in stack.generation().Generate(request, timeout=120):
        tokens += chunk.token_ids
    results.append(len(tokens))


def metrics(stack, name: str) -> str:
    return httpx.get(f"http://127.0.0.1:{stack.metrics_ports[name]}/metrics").text


def test_tenants_classes_and_attainment_show_in_the_metrics(stack):
    set_policy(stack, policy="fcfs")
    results = []
    stream(stack, results, 3, tenant="acme", request_class="batch")
    stream(stack, results, 3, slo_ttft_ms=60000, slo_tpot_ms=60000, tenant="globex")
    http = httpx.post(
        f"{stack.base_url}/completions",
        json={"model": "flagstop-tiny", "prompt": [0, 5], "max_tokens": 2, "request_class": "chat"},
        headers={"x-flagstop-tenant": "initech", "x-llm-d-slo-ttft-ms": "60000"},
        timeout=60,
    )
    assert http.status_code == 200, http.text
    text = metrics(stack, "router")
    for tenant, request_class in (("acme", "batch"), ("globex", ""), ("initech", "chat")):
        assert (
            f'flagstop:time_to_first_token_seconds_count{{class="{request_class}",'
            f'model_name="flagstop-tiny",tenant="{tenant}"}} 1.0'
        ) in text
    # acme's target comes from --slo-defaults for its class; all three met theirs.
    assert len(re.findall(r'slo_requests_total{[^}]*result="met"[^}]*} 1.0', text)) == 3, text
    # Under fair, the service each tenant got (its virtual token counter) is exported.
    set_policy(stack, policy="fair")
    stream(stack, results, 3, tenant="acme")
    service = re.search(r'flagstop:tenant_service{policy="fair",tenant="acme"} (\S+)',
                        metrics(stack, "scheduler"))  # fmt: skip
    assert service and float(service[1]) > 0
    bad = httpx.post(
        f"{stack.base_url}/completions",
        json={"model": "flagstop-tiny", "prompt": [0, 5], "max_tokens": 2},
        headers={"x-llm-d-slo-ttft-ms": "soon"},
        timeout=60,
    )
    assert bad.status_code == 400 and "x-llm-d-slo-ttft-ms" in bad.json()["error"]["message"]


def test_the_policy_swaps_under_load_and_loses_no_request(stack):
    with pytest.raises(grpc.RpcError) as refused:
        admin(stack).SetPolicy(scheduler_pb2.SetPolicyRequest(policy="slo"),
                               metadata=(("authorization", "Bearer guess"),))  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for bad in (dict(policy="lottery"), dict(shadow="remote")):
        with pytest.raises(grpc.RpcError) as refused:
            set_policy(stack, **bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    num_shed = stack.stats().num_shed
    results: list[int] = []
    threads = [threading.Thread(target=stream, args=(stack, results)) for _ in range(8)]
    for t in threads:
        t.start()
    while stack.stats().num_running < 2:
        time.sleep(0.01)
    for policy in ("hrrn", "fair", "slo", "fcfs"):
        assert set_policy(stack, policy=policy, shadow="slo").policy == policy
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert results == [40] * 8
    stats = stack.stats()
    assert stats.policy == "fcfs" and stats.shadow_policy == "slo"
    assert stats.shadow_decisions > 0 and stats.num_shed == num_shed
    assert "flagstop:shadow_decisions_total" in metrics(stack, "scheduler")


def test_a_request_slo_cannot_serve_in_time_is_refused_with_a_time_to_retry(stack):
    set_policy(stack, policy="slo")
    results: list[int] = []
    blockers = [threading.Thread(target=stream, args=(stack, results, 200)) for _ in range(2)]
    for t in blockers:
        t.start()
    while stack.stats().num_running < 2:
        time.sleep(0.01)
    request = generation_pb2.GenerateRequest(prompt_token_ids=[0, 9], max_tokens=3,
                                             slo_ttft_ms=0.001)  # fmt: skip
    with pytest.raises(grpc.RpcError) as shed:
        list(stack.generation().Generate(request, timeout=60))
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry later" in shed.value.details()
    assert ("grpc-retry-pushback-ms", "1000") in shed.value.trailing_metadata()
    http = httpx.post(f"{stack.base_url}/completions", json={
        "model": "flagstop-tiny", "prompt": [0, 9], "max_tokens": 3, "slo_ttft_ms": 0.001},
        timeout=60)  # fmt: skip
    assert http.status_code == 429 and http.headers["retry-after"] == "1", http.text
    # Streamed, the headers wait for the first token: a shed request is a 429 too, on
    # every streamed route, never a 200 with an error event.
    for route, body in (
        ("completions", {"prompt": [0, 9], "max_tokens": 3}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("responses", {"input": "hi", "max_output_tokens": 3}),
        ("messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ):  # fmt: skip
        streamed = httpx.post(
            f"{stack.base_url}/{route}",
            json={"model": "flagstop-tiny", "stream": True, "slo_ttft_ms": 0.001, **body},
            timeout=60,
        )
        assert streamed.status_code == 429, (route, streamed.text)
        assert streamed.headers["retry-after"] == "1" and "retry later" in streamed.text
    for t in blockers:
        t.join()
    assert results == [200, 200]  # the others are untouched
    assert stack.stats().num_shed >= 2
    set_policy(stack, policy="fcfs")


def test_the_recorded_workload_replays(stack, record, capsys):
    """Every request so far is a line of the record (no tokens), and flagstop-replay
    takes the file as it is."""
    set_policy(stack, policy="fcfs")
    for _ in range(3):
        stream(stack, [], 2)
    stream(stack, [], 3, prompt_token_ids=[0] + [5] * 1100, tenant="acme")
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 4 and "length" in {x["finish"] for x in lines}
    long = next(x for x in lines if x["prompt_tokens"] == 1101)
    assert long["tenant"] == "acme" and long["output_tokens"] == 3
    assert len(long["block_hashes"]) == 2 and "prompt_token_ids" not in long
    main([str(record), "--policy", "fair"])
    assert json.loads(capsys.readouterr().out)["requests"] == len(lines)


def test_the_record_holds_the_requests_the_router_refused(stack, record):
    """Refused before they were queued (here: prompts past the model's length), they
    are lines of the record with their arrival, prompt and reason: a record taken in an
    overload holds all of the load."""
    too_long = [0] + [5] * 5000
    before = len(record.read_text().splitlines())
    with pytest.raises(grpc.RpcError) as refused:
        list(stack.generation().Generate(generation_pb2.GenerateRequest(
            prompt_token_ids=too_long, max_tokens=4, tenant="acme"), timeout=60))  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    http = httpx.post(f"{stack.base_url}/completions", json={
        "model": "flagstop-tiny", "prompt": too_long, "max_tokens": 4}, timeout=60)  # fmt: skip
    assert http.status_code == 400
    lines = [json.loads(x) for x in record.read_text().splitlines()[before:]]
    assert [x["finish"] for x in lines] == ["refused", "refused"]
    assert all(x["prompt_tokens"] == 5001 and x["output_tokens"] == 4 for x in lines)
    assert lines[0]["tenant"] == "acme" and lines[0]["reason"].startswith("INVALID_ARGUMENT: ")
    assert len(lines[0]["block_hashes"]) == 9 and lines[0]["arrival_s"] > 0
