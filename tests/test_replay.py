"""flagstop-replay: traces in each format load, a replay is deterministic, and the
report counts what happened (in-process, on a virtual clock)."""

import json

import pytest

from flagstop.replay import Replay, TraceRequest, load_trace, main, replay_config, report, scaled


def write_traces(tmp_path):
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i // 10:02d}.{i % 10}000000,{50 + 37 * i % 400},{5 + i % 20}\n"
        for i in range(60)))  # fmt: skip
    mooncake = tmp_path / "mooncake.jsonl"
    mooncake.write_text("".join(json.dumps({
        "timestamp": 100 * i, "input_length": 1200 + i, "output_length": 8,
        "hash_ids": [0, 1, i + 2]}) + "\n" for i in range(40)))  # fmt: skip
    record = tmp_path / "record.jsonl"
    record.write_text("".join(json.dumps({
        "arrival_s": 0.05 * i, "prompt_tokens": 80, "output_tokens": 6,
        "tenant": "a" if i % 3 else "b", "class": "chat", "ttft_ms": 500, "tpot_ms": 50})
        + "\n" for i in range(30)))  # fmt: skip
    return azure, mooncake, record


def test_each_format_loads(tmp_path):
    azure, mooncake, record = (load_trace(p) for p in write_traces(tmp_path))
    assert (
        len(azure) == 60 and azure[0].arrival_s == 0 and azure[11].arrival_s == pytest.approx(1.1)
    )
    assert mooncake[3] == TraceRequest(0.3, 1203, 8, (0, 1, 5))
    assert record[1].tenant == "a" and record[0].tenant == "b" and record[0].ttft_ms == 500


@pytest.mark.parametrize("policy", ["fcfs", "slo", "fair", "hrrn"])
def test_a_replay_is_deterministic_and_counts_every_request(tmp_path, policy):
    trace = scaled(load_trace(write_traces(tmp_path)[0]), 20.0)  # 20x the rate
    reports = [report(Replay(trace, replay_config(policy, max_num_batched_tokens=512),
                             num_blocks=512, ttft_ms=300, tpot_ms=40).run())
               for _ in range(2)]  # fmt: skip
    assert reports[0] == reports[1]
    r = reports[0]
    assert r["served"] + r["shed"] == r["requests"] == 60 and r["steps"] > 0
    assert policy == "slo" or r["shed"] == 0


def test_shared_prefixes_are_cache_hits(tmp_path):
    trace = load_trace(write_traces(tmp_path)[1])
    run = Replay(trace, replay_config("fcfs"), num_blocks=4096).run()
    # Each prompt after the first shares two 512-token blocks: computed once.
    assert run.num_prefix_hit_tokens >= 39 * 1024
    assert report(run)["served"] == 40


def test_the_command_prints_the_report(tmp_path, capsys):
    main([str(write_traces(tmp_path)[2]), "--policy", "fair", "--load", "2"])
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 30 and set(out["ttft_p99_ms_by_tenant"]) == {"a", "b"}
