"""flagstop-replay: traces in each format load, a replay is deterministic, and the
report counts what happened (in-process, on a virtual clock)."""

import itertools
import json
import random

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


def test_bad_command_line_values_are_usage_errors(tmp_path, capsys):
    record = str(write_traces(tmp_path)[2])
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    for args, words in ((["--load", "0"], "--load: must be a number above 0"),
                        (["--load", "inf"], "--load: must be a number above 0"),
                        (["--policy", "nope"], "--policy: invalid choice: 'nope'"),
                        (["--limit", "-2"], "--limit: must be a whole number"),
                        (["--num-blocks", "0"], "--num-blocks: must be at least 1 block"),
                        (["--simulate-base-ms", "-1"], "--simulate-base-ms: must be a number"),
                        (["--cost-model", str(junk)], "not a step-cost file")):  # fmt: skip
        with pytest.raises(SystemExit) as usage:
            main([record, *args])
        assert usage.value.code == 2
        assert words in capsys.readouterr().err.strip().splitlines()[-1], args
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.jsonl")])
    assert "not a workload record" in capsys.readouterr().err


def test_the_cost_models_figures_come_from_the_command_line_or_a_fitted_file(tmp_path, capsys):
    record = str(write_traces(tmp_path)[2])
    fitted = tmp_path / "fitted.json"
    fitted.write_text(json.dumps({"base_ms": 40.0, "us_per_scheduled_token": 8.0,
                                  "us_per_context_token": 0.03, "num_observed": 9}))  # fmt: skip

    def tpot(*args: str) -> float:
        main([record, *args])
        return json.loads(capsys.readouterr().out)["tpot_p50_ms"]

    assert tpot() == pytest.approx(6.0, rel=0.05)  # the simulator's default base
    assert tpot("--cost-model", str(fitted)) == pytest.approx(40.0, rel=0.05)
    assert tpot("--cost-model", str(fitted), "--simulate-base-ms", "20") == pytest.approx(
        20.0, rel=0.05)  # fmt: skip


# The simulator's figures in the round trip: other than the replay's defaults (6 ms, 8 µs,
# 0.03 µs), so that only a calibrated replay predicts the stack.
FIGURES = {"base_ms": 14.0, "us_per_scheduled_token": 20.0, "us_per_context_token": 0.05}


@pytest.mark.processes
def test_a_replay_calibrated_on_a_stack_predicts_it(tmp_path, model_dir, capsys):
    """The round trip docs/policy.md describes: a stack (the executor simulator at
    FIGURES) records its workload and fits its step cost (--record-workload,
    --step-cost-out); flagstop-replay replays the record with the fitted file and
    predicts the TTFT and TPOT the clients measured within bench/replay_check.py's
    tolerance, where the uncalibrated defaults do not."""
    import asyncio

    from bench.replay_check import drive, summary, within_tolerance
    from tools.stack import start_stack

    rng, now, trace = random.Random(5), 0.0, []
    for _ in range(60):  # Poisson arrivals over about 15 s, Azure-conversation-like sizes
        now += rng.expovariate(4.0)
        trace.append(TraceRequest(now, rng.randint(100, 1500), rng.randint(20, 120)))
    fitted, record = tmp_path / "fitted.json", tmp_path / "record.jsonl"
    simulate = [f"--simulate-{k.replace('_', '-')}={v}" for k, v in FIGURES.items()]
    limits = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "256"]
    stack = start_stack(
        model_dir, tmp_path / "logs", executor_args=["--simulate", *simulate, *limits[:2]],
        scheduler_args=[*limits, "--step-cost-out", str(fitted)],
        router_args=["--record-workload", str(record)],
    )  # fmt: skip
    try:
        real = summary(asyncio.run(drive(stack.router, trace, 512)))
    finally:
        assert set(stack.stop().values()) == {0}
    figures = json.loads(fitted.read_text())
    assert figures["num_observed"] > 100
    assert abs(figures["base_ms"] - FIGURES["base_ms"]) < 5, figures

    def predicted(*args: str) -> dict:
        main([str(record), "--ttft-ms", "1000", "--tpot-ms", "50", *args])
        return json.loads(capsys.readouterr().out)

    calibrated = predicted("--cost-model", str(fitted))
    assert calibrated["requests"] == len(trace)
    assert within_tolerance(calibrated, real), (calibrated, real)
    assert not within_tolerance(predicted(), real), "the defaults predict it too: no test"


def session_trace(ttl_s: float | None) -> list[TraceRequest]:
    """Four turns of one session, closed loop 2 s apart, each resending the last
    (equal block ids), beside filler that cycles an 8k-token pool every second."""
    from flagstop.scheduler_svc.core.request import Retention

    retention = Retention(50, ttl_s) if ttl_s is not None else None
    turns = [TraceRequest(0.0, 512 * (k + 2), 4, tuple(range(1, k + 3)), session="s",
                          retention=retention, after_s=None if k == 0 else 2.0)
             for k in range(4)]  # fmt: skip
    filler = [TraceRequest(0.1 * i, 2048, 4) for i in range(120)]
    return turns + filler


def session_share(ttl_s: float | None, retention_share: float = 0.5) -> dict:
    config = replay_config("fcfs", retention_share=retention_share)
    return report(Replay(session_trace(ttl_s), config, num_blocks=512).run())


def test_a_retained_session_hits_through_filler_and_plain_lru_does_not():
    retained, lru = session_share(300.0), session_share(300.0, retention_share=0.0)
    # Turns 2-4 find the turn before cached: 1024 + 1536 + 2048 of 7168 prompt tokens.
    assert retained["session_cached_share"] >= 0.6 and retained["retention_hits"] > 0
    assert lru["session_cached_share"] < 0.1 and lru["retention_hits"] == 0
    assert retained["prefill_tokens"] < lru["prefill_tokens"]


def test_a_retention_shorter_than_the_gap_runs_out_on_the_virtual_clock():
    assert session_share(1.0)["session_cached_share"] < 0.1
    assert session_share(3.0)["session_cached_share"] >= 0.6


def test_a_sessions_later_turn_arrives_its_gap_after_the_turn_before_ended():
    run = Replay(session_trace(300.0), replay_config("fcfs"), num_blocks=512).run()
    turns = [run.served[f"r{k}"] for k in range(4)]
    for before, after in itertools.pairwise(turns):
        assert after.arrival_s == pytest.approx(before.end_s + 2.0)


def test_a_recorded_session_and_retention_load_for_the_replay(tmp_path):
    from flagstop.router.recorder import _session
    from flagstop.v1 import generation_pb2, scheduler_pb2

    retention = generation_pb2.Retention(priority=50, ttl_s=600)
    add = scheduler_pb2.AddRequest(session_id="agent-1", retention=retention)
    record = tmp_path / "record.jsonl"
    entry = {"arrival_s": 1.0, "prompt_tokens": 40, "output_tokens": 2, **_session(add)}
    record.write_text(json.dumps(entry) + "\n")
    [r] = load_trace(record)
    assert r.session == "agent-1" and (r.retention.priority, r.retention.ttl_s) == (50, 600)


def test_the_slo_policy_retains_a_sessions_turns_without_an_ask():
    config = replay_config("slo", no_shed=True)
    run = report(Replay(session_trace(None), config, num_blocks=512).run())
    assert run["session_cached_share"] >= 0.6 and run["retention_hits"] > 0
    assert session_share(None)["session_cached_share"] < 0.1  # fcfs keeps nothing unasked
