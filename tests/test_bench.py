"""The benchmark tools' own arithmetic: arrivals, percentiles, slot charts, the charts."""

import itertools
import math
import statistics
from types import SimpleNamespace

import pytest

from bench.peers import idle_fraction, workload
from bench.plots import occupancy_chart, overhead_chart, serving_chart, slot_image, slot_rows
from bench.serve_bench import RequestRecord, arrival_gaps, summarize


def test_the_peers_workload_is_seeded_and_skewed_within_its_ranges():
    requests = workload(64)
    assert requests == workload(64) and requests != workload(64, seed=1)
    prompts, outputs = [len(p) for p, _ in requests], [n for _, n in requests]
    assert min(prompts) >= 17 and max(prompts) <= 511
    assert min(outputs) >= 8 and max(outputs) <= 296
    # Skewed short: the median well below the middle of the range.
    assert statistics.median(outputs) < (8 + 296) / 2 and max(outputs) > 200


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_burstiness():
    assert arrival_gaps(5, math.inf, 1.0) == [0.0] * 5
    poisson = arrival_gaps(4000, 4.0, 1.0)
    bursty = arrival_gaps(4000, 4.0, 0.25)
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.08)
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.15)
    cv2 = lambda gaps: statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2  # noqa: E731
    assert cv2(poisson) == pytest.approx(1.0, rel=0.15)
    assert cv2(bursty) == pytest.approx(4.0, rel=0.2)  # 1 / shape


def test_summary_percentiles_goodput_and_failures():
    records = [
        RequestRecord(ttft=0.1 * (i + 1), latency=0.1 * (i + 1) + 0.9, output_tokens=10,
                      itls=[0.1] * 9)
        for i in range(10)
    ]  # fmt: skip
    records.append(RequestRecord(error="UNAVAILABLE: gone"))
    args = SimpleNamespace(burstiness=1.0, max_concurrency=0, slo_ttft_ms=500, slo_tpot_ms=150)
    result = summarize(records, 2.0, 4.0, args)
    assert (result["completed"], result["failed"]) == (10, 1)
    assert result["errors"] == ["UNAVAILABLE: gone"]
    assert result["output_throughput"] == 50.0 and result["request_throughput"] == 5.0
    assert result["mean_ttft_ms"] == pytest.approx(550) and result["p99_ttft_ms"] == 1000
    assert result["median_tpot_ms"] == pytest.approx(100)
    assert result["goodput"] == 2.5  # TTFT <= 500 ms: 5 requests in 2 s


def test_slots_are_kept_by_their_request_and_refilled_lowest_first():
    steps = [["a", "b", "c"], ["a", "c"], ["a", "c", "d"], ["d"]]
    assert slot_rows(steps, 3) == [
        ["a", "b", "c"], ["a", None, "c"], ["a", "d", "c"], [None, "d", None],
    ]  # fmt: skip
    assert idle_fraction(steps) == pytest.approx(1 - 9 / (16 * 4))


def test_the_charts_are_drawn_from_results(tmp_path):
    steps = [["r0", "r1"], ["r1"], ["r2", "r1"]]
    peers = {"occupancy": {"static": steps, "continuous": steps[:2]},
             "idle": {"static": 0.5, "continuous": 0.25}}  # fmt: skip
    serve = {
        "results": [
            {"request_rate": r, "output_throughput": 10.0 * i + 1, "p99_ttft_ms": 5.0 * 10**i}
            for i, r in enumerate([4, math.inf])
        ]
    }
    rows = [{"step_ms": 8.0, "variant": v, "streams": n, "tok_s": n * 2.0,
             "router_us_per_token": 30.0} for v in ("", "b") for n in (64, 256)]  # fmt: skip
    occupancy_chart(peers, tmp_path / "o.png", num_slots=2)
    serving_chart(serve, tmp_path / "s.png")
    overhead_chart({"rows": rows}, tmp_path / "h.png")
    for name in ("o", "s", "h"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert slot_image(steps, 2, 4).tolist() == [[1, 0, 3, 0], [2, 2, 2, 0]]


def test_the_tail_starts_after_the_last_full_step_and_is_costed_in_full_steps():
    from bench.peers import SLOTS, tail

    full = [f"r{i}" for i in range(SLOTS)]
    steps = [(full[:3], 1.0), (full, 2.0), (full, 2.0), (full[:4], 1.5), (full[:2], 1.0)]
    found = tail(steps, full_decode_s=2.0)
    assert (found["steps"], found["tokens"]) == (2, 6)
    assert (found["seconds"], found["total_seconds"]) == (2.5, 7.5)
    assert found["at_full_occupancy"] == pytest.approx(6 / SLOTS * 2.0)


def test_a_row_is_slower_or_faster_only_when_every_round_agrees():
    from bench.executor_bench import summarize

    row = lambda ours, theirs: {"ours": ours, "theirs": theirs}  # noqa: E731
    assert summarize(row([2.0, 2.0, 2.0], [1.9, 1.8, 1.99]))["verdict"] == "slower"
    assert summarize(row([2.0, 2.0, 2.0], [1.9, 2.2, 1.99]))["verdict"] == "even"
    fast = summarize(row([1.0, 1.0, 2.0], [2.0, 3.0, 2.2]))
    assert fast["verdict"] == "faster" and fast["speedup"] == 2.0 and fast["low"] == 1.1


def test_the_agent_workload_grows_each_session_within_its_ranges():
    from bench.session_bench import GAP_MEDIAN_S, SHAPES, agent_sessions

    shape = SHAPES["replay"]
    turns = agent_sessions(shape)
    assert turns == agent_sessions(shape) and turns != agent_sessions(shape, seed=1)
    sessions: dict[str, list] = {}
    for r in turns:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == shape.sessions
    for session in sessions.values():
        assert 10 <= len(session) <= 50 and session[0].after_s is None
        for before, after in itertools.pairwise(session):
            # The turn before, its answer and a new tool result: a longer prefix.
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
            assert after.block_hashes[: len(before.block_hashes)] == before.block_hashes
    gaps = sorted(r.after_s for r in turns if r.after_s is not None)
    assert statistics.median(gaps) == pytest.approx(GAP_MEDIAN_S, rel=0.2)
    assert gaps[-1] > 10 * GAP_MEDIAN_S  # a heavy tail: some tool calls take minutes
