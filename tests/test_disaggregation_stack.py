"""Prefill/decode disaggregation on real processes: a router in front of a prefill
replica and a decode replica (their executors exchanging KV over Mooncake's transfer
engine), greedy outputs token-exact against transformers, and every fault of a
transfer mid-stream (the prefill side killed, silent, or past its lease; the decode
side killed) token-exact too, with every block free on both replicas afterwards.

The faults share one stack (each puts back what it stopped or killed): its prefill
executor has a small pool, so that blocks freed at a lease's end are soon another
request's, leases of 3 s and transfers that time out after 2 s."""

import random
import signal
import time

import grpc
import pytest

from flagstop.v1 import executor_pb2, executor_pb2_grpc, generation_pb2
from tests.helpers.checkpoints import reference_generate
from tests.helpers.metrics import scrape
from tests.helpers.streams import Streams, assert_token_exact
from tools.stack import generate, start_disaggregated

pytestmark = pytest.mark.processes

PREFILL, DECODE = "scheduler-0", "scheduler-1"
EOS = 1  # the embedded model's
LEASE_S, TIMEOUT_S = 3.0, 2.0


def needs_mooncake() -> None:
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine does not load "
                        "here (Debian: apt-get install libibverbs1; .ci/run does)")  # fmt: skip


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    needs_mooncake()
    stack = start_disaggregated(
        model_dir, tmp_path_factory.mktemp("disaggregated"),
        executor_args=["--kv-lease-s", str(LEASE_S), "--kv-transfer-timeout-s", str(TIMEOUT_S)],
        prefill_args=["--num-blocks", "64"],
        # Every prompt is split, and a lost replica's requests move on after 1 s.
        router_args=["--pd-threshold", "0", "--replica-grace-s", "1"],
    )  # fmt: skip
    yield stack
    stack.stop(10)


def prompt(rng: random.Random, length: int) -> list[int]:
    return [0] + [rng.randrange(3, 512) for _ in range(length - 1)]


def greedy(stack, token_ids: list[int], max_tokens: int, **fields) -> tuple[list[int], object]:
    tokens, _, last = generate(stack, prompt_token_ids=token_ids, max_tokens=max_tokens,
                               temperature=0, **fields)  # fmt: skip
    return tokens, last


def loaded_tokens(stack) -> int:
    return stack.stats(DECODE).external_prefix_cache_hits


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_all_blocks_free(stack) -> None:
    """Both replicas idle, every block free (the prefill side's once its leases end)."""
    for scheduler in (PREFILL, DECODE):
        stats = stack.wait_idle(LEASE_S + 15, scheduler)
        assert stats.num_kv_leases == 0 and stats.num_loading == 0, scheduler


def test_disaggregated_greedy_outputs_are_token_exact(stack, reference):
    rng = random.Random(1)
    cases = {
        "shorter than a block": prompt(rng, 5),
        "a partial last block": prompt(rng, 70),
        "block-aligned": prompt(rng, 64),
    }
    for name, token_ids in cases.items():
        before = loaded_tokens(stack)
        tokens, last = greedy(stack, token_ids, 12, ignore_eos=True)
        assert tokens == reference_generate(reference, token_ids, 12), name
        assert last.usage.completion_tokens == 12
        # The decode replica read the whole prompt (all but its first token's KV).
        assert loaded_tokens(stack) - before == len(token_ids), name
    # The decode replica holds these prompts now: a full hit reads nothing more, a
    # partial one (the first 32 tokens shared) reads the rest.
    aligned, partial = cases["block-aligned"], [*cases["a partial last block"][:32], 7, 8, 9]
    for name, token_ids, read in (("full hit", aligned, 0), ("partial hit", partial, 3)):
        before = loaded_tokens(stack)
        tokens, _ = greedy(stack, token_ids, 8, ignore_eos=True)
        assert tokens == reference_generate(reference, token_ids, 8), name
        assert loaded_tokens(stack) - before == read, name
    # An EOS as the first token ends the request at the prefill replica: one token.
    tokens, last = greedy(stack, cases["a partial last block"], 8, logit_bias={EOS: 100})
    assert tokens == [EOS] and last.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert last.usage.completion_tokens == 1
    assert_all_blocks_free(stack)
    assert decode_metric(stack, "vllm:external_prefix_cache_hits_total") == loaded_tokens(stack)


def requests(seed: int, n: int = 4, max_tokens: int = 24) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(prompt(rng, rng.randrange(20, 90)), max_tokens) for _ in range(n)]


def handed_off(stack, workload) -> Streams:
    """Start the streams with the decode executor stopped, once their prefills are
    done and their blocks leased: no read has started."""
    greedy(stack, prompt(random.Random(0), 40), 2)  # the handshake is done before
    wait_until(lambda: stack.stats(PREFILL).num_kv_leases == 0, "its lease was not released")
    stack.kill("executor-1", signal.SIGSTOP)
    streams = Streams(stack, workload)
    wait_until(lambda: stack.stats(PREFILL).num_kv_leases == len(workload),
               "the prefills were not handed off")  # fmt: skip
    return streams


def restore(stack, name: str) -> None:
    stack.restart(name)
    scheduler = name.replace("executor", "scheduler")
    wait_until(lambda: stack.stats(scheduler).executor_connected, f"{name} not back")


def test_the_prefill_executor_killed_mid_transfer(stack, reference):
    streams = handed_off(stack, requests(2))
    stack.kill("executor-0", signal.SIGSTOP)  # its lease calls hang ...
    stack.kill("executor-1", signal.SIGCONT)
    time.sleep(0.3)
    stack.kill("executor-0")  # ... then fail: it is gone, its blocks with it
    assert_token_exact(reference, streams)  # recomputed at the decode replica
    restore(stack, "executor-0")
    assert_all_blocks_free(stack)


def test_a_transfer_that_times_out(stack, reference):
    streams = handed_off(stack, requests(3))
    stack.kill("executor-0", signal.SIGSTOP)
    stack.kill("executor-1", signal.SIGCONT)
    try:
        assert_token_exact(reference, streams)  # after --kv-transfer-timeout-s, recomputed
    finally:
        stack.kill("executor-0", signal.SIGCONT)
    assert_all_blocks_free(stack)  # the prefill side's leases expire


def test_a_read_after_the_lease_ended_fails_loudly_and_never_decodes_freed_blocks(stack, reference):
    workload = requests(4)
    streams = handed_off(stack, workload)
    failures = _load_failures(stack)
    wait_until(lambda: stack.stats(PREFILL).num_kv_leases == 0, "the leases did not end", 15)
    # The freed blocks are other prompts' now: these take 60 of the prefill pool's 64,
    # beyond the 44 or so nobody had used.
    others = Streams(stack, [(prompt(random.Random(i), 240), 2) for i in range(4)])
    wait_until(lambda: stack.stats(PREFILL).num_kv_leases >= 4, "the others were not prefilled")
    stack.kill("executor-1", signal.SIGCONT)
    assert_token_exact(reference, streams)
    assert_token_exact(reference, others)
    assert _load_failures(stack) - failures == len(workload)
    assert (stack.log_dir / "executor-1.log").read_text().count("had ended") >= len(workload)
    assert_all_blocks_free(stack)


def _load_failures(stack) -> float:
    return decode_metric(stack, "flagstop:kv_load_failures_total")


def decode_metric(stack, name: str) -> float:
    """A series of the decode scheduler's /metrics (0 before its first sample)."""
    metrics = scrape(stack.metrics_ports[DECODE])
    return sum(v for k, v in metrics.items() if k.startswith(name + "["))


def test_the_decode_replica_killed_mid_stream(stack, reference):
    streams = Streams(stack, requests(5, max_tokens=60))
    streams.wait_for_tokens(4)
    stack.kill("scheduler-1")
    stack.kill("executor-1")
    assert_token_exact(reference, streams)  # moved on: whole, at the prefill replica
    stack.restart("executor-1")
    stack.restart("scheduler-1")
    stack.wait_routers(1, scheduler=DECODE)
    assert_all_blocks_free(stack)


def test_tensor_parallel_on_both_sides(model_dir, tmp_path, reference):
    """Each decode rank reads its shard from the same rank of the prefill executor."""
    needs_mooncake()
    stack = start_disaggregated(model_dir, tmp_path, executor_args=["--tensor-parallel-size", "2"],
                                router_args=["--pd-threshold", "0"])  # fmt: skip
    try:
        assert_prompts_load_token_exact(stack, reference, random.Random(6), (5, 70), 10)
    finally:
        stack.stop(10)


def assert_prompts_load_token_exact(stack, reference, rng, lengths, max_tokens: int) -> None:
    """Prompts of these lengths, each prefilled on one side and loaded on the other,
    decode transformers' tokens; both replicas then idle."""
    for length in lengths:
        token_ids = prompt(rng, length)
        tokens, _ = greedy(stack, token_ids, max_tokens, ignore_eos=True)
        assert tokens == reference_generate(reference, token_ids, max_tokens), length
    assert loaded_tokens(stack) == sum(lengths)
    for scheduler in (PREFILL, DECODE):
        stack.wait_idle(10, scheduler)


def test_latent_blocks_move_between_replicas(tmp_path):
    """DeepSeek-V3's latent cache (one latent and one rotated key a token): the decode
    executor reads the prefill executor's latent blocks. (On two ranks every rank holds
    the whole latent, so the rank-to-rank mapping is tested by the sharded K/V above.)"""
    from tests.helpers.checkpoints import load_reference
    from tools.make_model import write_model

    needs_mooncake()
    model = write_model(tmp_path / "flagstop-tiny-deepseek_v3", "tiny", arch="deepseek_v3")
    stack = start_disaggregated(model, tmp_path, router_args=["--pd-threshold", "0"])
    try:
        assert_prompts_load_token_exact(stack, load_reference(model), random.Random(8), (6, 45), 8)
    finally:
        stack.stop(10)


def test_a_replica_whose_kv_layout_differs_is_refused_in_one_line(model_dir, tmp_path):
    """Block sizes 16 and 32 (simulated executors: only their descriptions matter)."""
    stack = start_disaggregated(
        model_dir, tmp_path, executor_args=["--simulate"], prefill_args=["--block-size", "16"],
        decode_args=["--block-size", "32"], router_args=["--pd-threshold", "0"],
        wait_routed=False,
    )  # fmt: skip
    router_log = tmp_path / "router.log"
    try:
        wait_until(lambda: "KV layout" in router_log.read_text(), "not refused")
        wait_until(lambda: stack.stats(PREFILL).num_routers + stack.stats(DECODE).num_routers,
                   "neither replica was taken")  # fmt: skip
        _, last = greedy(stack, prompt(random.Random(7), 70), 4, ignore_eos=True)
        assert last.usage.completion_tokens == 4  # whole, at the replica that was taken
        [line] = [x for x in router_log.read_text().splitlines() if "KV layout" in x]
        assert "block_size=16" in line and "block_size=32" in line
        # The prefill executor's own handshake refuses a decode side the router let by.
        executor = executor_pb2_grpc.ExecutorStub(stack.channel(stack.addresses["executor-0"]))
        with pytest.raises(grpc.RpcError) as refused:
            executor.KVHandshake(executor_pb2.KVHandshakeRequest(kv_layout="x block_size=32"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size=32" in refused.value.details() and "\n" not in refused.value.details()
        decode = executor_pb2_grpc.ExecutorStub(stack.channel(stack.addresses["executor-1"]))
        with pytest.raises(grpc.RpcError) as refused:
            decode.KVHandshake(executor_pb2.KVHandshakeRequest(kv_layout="x"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        lease = executor_pb2.ReleaseKVLeaseRequest(transfer_id="t", engine_id="e")
        assert not decode.ReleaseKVLease(lease).held
    finally:
        stack.stop(10)
