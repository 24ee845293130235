"""Prefill/decode disaggregation in-process: the two scheduler connectors (a prefill
replica's hand-off, a decode replica's loads), the prefill executor's leases, the
decode executor's reads (their confirmation after the read), Mooncake's transfer
engine between two sets of KV tensors, and the router's choice to split."""

import asyncio
import time

import pytest
import torch

from flagstop.executor.kv_transfers import leases
from flagstop.executor.kv_transfers.base import LayoutMismatch
from flagstop.executor.kv_transfers.decode import READ, DecodeSide, TransferFailed
from flagstop.executor.kv_transfers.leases import Leases
from flagstop.executor.kv_transfers.prefill import PrefillSide
from flagstop.router.routing import (
    BOTH,
    DECODE,
    PREFILL,
    PrefixIndex,
    ReplicaChooser,
    ReplicaView,
    RoutingConfig,
)
from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.disaggregation import DecodeConnector, PrefillConnector
from flagstop.scheduler_svc.core.kv_cache_manager import chain_hashes
from flagstop.scheduler_svc.core.kv_connector import (
    KVConnectorMetadata,
    KVHandoff,
    KVLoad,
    KVSend,
    KVTransferResult,
)
from flagstop.scheduler_svc.core.request import FinishReason, RequestStatus
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.v1 import executor_pb2
from tests.helpers.scheduler_invariants import check_idle, check_invariants
from tests.helpers.scheduler_steps import EOS, make_request, run_to_idle, step

BS = 4
PROMPT = list(range(10, 19))  # two full blocks and one token


def make(connector, num_blocks: int = 16, **overrides) -> Scheduler:
    config = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, block_size=BS)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config), num_blocks, connector=connector)


def prefill() -> Scheduler:
    return make(PrefillConnector("10.0.0.1:50053", "engine-a", "sched"))


def report(scheduler: Scheduler, recving=(), failed=(), sending=()) -> None:
    scheduler.transfers.update(scheduler.kv, KVTransferResult(recving, failed, sending))
    check_invariants(scheduler)


# -- the prefill replica: hand-offs -----------------------------------------------


def test_a_prefill_replica_hands_off_after_the_first_token_and_holds_the_blocks():
    scheduler = prefill()
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=8, do_remote_decode=True))
    blocks = scheduler.kv.block_ids("a")
    plan, outputs = step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 9}
    out = outputs["router-0"]
    assert out.new_token_ids == [7] and out.finished == {"a": FinishReason.TRANSFER}
    handoff = out.kv_transfers["a"]
    blocks = list(handoff.block_ids)
    assert (handoff.endpoint, handoff.engine_id, handoff.num_tokens) == (
        "10.0.0.1:50053", "engine-a", 9,
    )  # fmt: skip
    assert len(blocks) == 3 and scheduler.stats().num_kv_leases == 1
    # Held until the executor says the decode side is done with them, and told to
    # hold them under a lease with the next step.
    assert scheduler.has_unfinished_requests() and scheduler.num_free_blocks == 16 - 3
    plan, _ = step(scheduler)
    assert plan.kv_connector.sends == [KVSend(handoff.transfer_id, blocks)]
    assert plan.poll_kv_transfers and not plan.num_scheduled_tokens
    report(scheduler, sending=[handoff.transfer_id])
    check_idle(scheduler)


@pytest.mark.parametrize(
    ("first_token", "max_tokens", "reason"),
    [(EOS, 8, FinishReason.STOP), (7, 1, FinishReason.LENGTH)],
)
def test_a_first_token_that_ends_the_request_ends_it_there(first_token, max_tokens, reason):
    scheduler = prefill()
    scheduler.add_request(
        make_request("a", prompt=PROMPT, max_tokens=max_tokens, do_remote_decode=True)
    )
    _, outputs = step(scheduler, token=first_token)
    out = outputs["router-0"]
    assert out.finished == {"a": reason} and not out.kv_transfers
    check_idle(scheduler)


def test_without_a_connector_that_hands_off_the_request_runs_whole():
    scheduler = make(DecodeConnector(BS))
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=3, do_remote_decode=True))
    plans = run_to_idle(scheduler)
    assert len(plans) == 3


def test_a_handed_off_request_whose_id_comes_back_keeps_its_blocks_apart():
    """The decode replica died: the router resubmits the remainder to the prefill
    replica, under the same id, while the first lease still holds its blocks."""
    scheduler = prefill()
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=8, do_remote_decode=True))
    _, outputs = step(scheduler)
    first = outputs["router-0"].kv_transfers["a"]
    scheduler.add_request(make_request("a", prompt=[*PROMPT, 7], max_tokens=2))
    step(scheduler)
    assert set(scheduler.kv.block_ids("a")) & set(first.block_ids) == set(first.block_ids[:2])
    report(scheduler, sending=[first.transfer_id])  # the old lease ends mid-way
    run_to_idle(scheduler)


def test_a_lost_prefill_executor_takes_its_leases_with_it():
    scheduler = prefill()
    scheduler.add_request(make_request("a", prompt=PROMPT, max_tokens=8, do_remote_decode=True))
    step(scheduler)
    scheduler.reset_executor()
    check_idle(scheduler)
    assert not scheduler.transfers.connector.build_connector_meta().sends


# -- the decode replica: loads ------------------------------------------------------


def remote(num_tokens: int, blocks=(40, 41, 42)) -> KVHandoff:
    return KVHandoff("kv-p-1", "10.0.0.1:50053", "engine-a", tuple(blocks), num_tokens)


def decode_request(rid: str = "a", prompt=PROMPT, max_tokens: int = 4):
    """A remainder: the prompt the prefill replica computed (all but the last token,
    the first token it sampled)."""
    return make_request(rid, prompt=prompt, max_tokens=max_tokens,
                        remote_prefill=remote(len(prompt) - 1))  # fmt: skip


def test_a_decode_replica_loads_the_prompt_and_computes_only_the_first_token():
    scheduler = make(DecodeConnector(BS), max_num_seqs=1)
    scheduler.add_request(decode_request())
    scheduler.add_request(make_request("other", num_prompt=5, max_tokens=2))
    plan, _ = step(scheduler)
    [load] = plan.kv_connector.loads
    # Tokens 0..7 of the prompt: two blocks, the second partly filled on the prefill
    # side; no seat (--max-num-seqs 1: "other" runs), no budget.
    assert load == KVLoad("a", scheduler.kv.block_ids("a")[:2], [40, 41], "10.0.0.1:50053",
                          "engine-a", "kv-p-1")  # fmt: skip
    assert list(plan.num_scheduled_tokens) == ["other"]
    assert scheduler.transfers.loading["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    report(scheduler, recving=["a"])
    run_to_idle(scheduler)
    assert scheduler.transfers.external_stats.num_hits == 8


def test_the_loaded_request_runs_its_first_token_only():
    scheduler = make(DecodeConnector(BS))
    scheduler.add_request(decode_request())
    step(scheduler)
    report(scheduler, recving=["a"])
    plan, _ = step(scheduler)
    [data] = plan.scheduled_new_reqs
    assert data.num_computed_tokens == 8 and plan.num_scheduled_tokens == {"a": 1}
    run_to_idle(scheduler)


@pytest.mark.parametrize("num_cached", [1, 2])
def test_a_prefix_cached_here_is_not_read_again(num_cached):
    """A partial hit loads the rest; a full one (every block the prefill side holds
    past them cached, the last one here too) reads nothing and only releases the
    lease."""
    scheduler = make(DecodeConnector(BS))
    cached_prompt = PROMPT[: num_cached * BS] + ([1] if num_cached == 2 else [99])
    scheduler.add_request(make_request("warm", prompt=cached_prompt, max_tokens=1))
    run_to_idle(scheduler)
    prompt = [*PROMPT[:8], 7] if num_cached == 2 else PROMPT
    scheduler.add_request(decode_request(prompt=prompt))
    plan, _ = step(scheduler)
    [load] = plan.kv_connector.loads
    if num_cached == 2:
        assert load.block_ids == [] and load.source_ids == [], "nothing left to read"
        assert plan.num_scheduled_tokens == {"a": 1}
    else:
        assert load.source_ids == [41] and "a" in scheduler.transfers.loading
        report(scheduler, recving=["a"])
    run_to_idle(scheduler)


def test_a_failed_load_recomputes_the_prompt_here():
    scheduler = make(DecodeConnector(BS))
    scheduler.add_request(decode_request())
    step(scheduler)
    report(scheduler, failed=["a"])
    plan, _ = step(scheduler)
    assert plan.num_scheduled_tokens == {"a": 9}
    assert not plan.kv_connector.loads, "one read of a hand-off, never a second"
    run_to_idle(scheduler)


def test_a_request_ended_before_its_load_releases_the_lease():
    scheduler = make(DecodeConnector(BS), num_blocks=4)
    scheduler.add_request(make_request("big", num_prompt=8, max_tokens=4))
    step(scheduler)
    scheduler.add_request(decode_request())  # waits: 3 blocks needed, 2 free
    plan, _ = step(scheduler)
    assert "a" not in scheduler.transfers.loading and not plan.kv_connector.loads
    scheduler.abort(["a", "big"])
    plan, _ = step(scheduler)
    [load] = plan.kv_connector.loads
    assert (load.block_ids, load.transfer_id) == ([], "kv-p-1")
    check_idle(scheduler)


def test_an_abort_mid_load_holds_the_blocks_until_the_read_ends():
    scheduler = make(DecodeConnector(BS))
    scheduler.add_request(decode_request())
    step(scheduler)
    scheduler.abort(["a"])
    assert scheduler.has_unfinished_requests()
    report(scheduler, recving=["a"])
    check_idle(scheduler)


# -- the prefill executor's leases ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_lease_is_renewed_released_once_and_reported():
    clock = Clock()
    leases = Leases(10.0, clock)
    leases.hold(["t1", "t2"])
    clock.now = 9.0
    assert run(leases.renew("t1"))
    clock.now = 15.0  # t2 expired at 10; t1 renewed until 19
    assert run(leases.release("t1"))
    assert not run(leases.release("t1")), "released twice"
    assert not run(leases.release("t2")), "read after its lease ended"
    assert sorted(leases.take_ended()) == ["t1", "t2"] and leases.take_ended() == []


def test_a_lease_asked_for_before_it_is_held_waits_for_it(monkeypatch):
    monkeypatch.setattr(leases, "REGISTRATION_WAIT_S", 0.2)

    async def scenario():
        leases = Leases(10.0)
        release = asyncio.ensure_future(leases.release("t1"))
        await asyncio.sleep(0.01)
        leases.hold(["t1"])
        unknown = await leases.renew("never")
        return await release, unknown

    assert run(scenario()) == (True, False)


def test_a_new_scheduler_voids_every_lease_without_reporting_it():
    leases = Leases(10.0)
    leases.hold(["t1"])
    leases.clear()
    assert not run(leases.release("t1")) and leases.take_ended() == []


def test_the_handshake_refuses_another_layout_in_one_line():
    side = PrefillSide("tiny block_size=16", "engine-a", 100, 30.0, lambda: [])
    assert side.handshake("tiny block_size=16").engine_id == "engine-a"
    with pytest.raises(LayoutMismatch) as refused:
        side.handshake("tiny block_size=32")
    assert "\n" not in str(refused.value) and "block_size=32" in str(refused.value)


# -- the decode executor's reads -------------------------------------------------------


class FakePrefill:
    """The lease calls and the reads a decode executor makes, against a prefill side
    held in memory."""

    def __init__(self, held=("t1",), ends_during_read: bool = False) -> None:
        self.held, self.ends_during_read = set(held), ends_during_read
        self.released: list[str] = []
        self.read_blocks: list[list[int]] = []

    def handshake(self, endpoint, layout):
        return executor_pb2.KVHandshakeResponse(engine_id="engine-a", num_blocks=64,
                                                ranks=[executor_pb2.KVRank()])  # fmt: skip

    def renew(self, load):
        return load.transfer_id in self.held

    def release(self, load):
        self.released.append(load.transfer_id)
        held = load.transfer_id in self.held
        self.held.discard(load.transfer_id)
        return held

    def read(self, remote, num_remote_blocks, source_ids, block_ids):
        if source_ids == [13]:
            raise TransferFailed("connection reset")
        self.read_blocks.append(source_ids)
        if self.ends_during_read:
            self.held.clear()


def load(req_id: str, sources=(1, 2), transfer_id: str = "t1") -> KVLoad:
    return KVLoad(req_id, [5, 6][: len(sources)], list(sources), "p:1", "engine-a", transfer_id)


def pulled(side: DecodeSide, *loads: KVLoad) -> KVTransferResult:
    side.start(KVConnectorMetadata(loads=list(loads)))
    deadline = time.monotonic() + 5
    received, failed = [], []
    while len(received) + len(failed) < sum(1 for x in loads if x.block_ids):
        assert time.monotonic() < deadline
        result = side.finished()
        received += result.finished_recving
        failed += result.failed_recving
    side.control.submit(lambda: None).result()  # its releases are sent
    return KVTransferResult(received, failed)


def decode_side(prefill: FakePrefill, agree=lambda values: values) -> DecodeSide:
    side = DecodeSide(0, "layout", prefill, agree)
    side.leases = prefill
    return side


def test_a_read_counts_only_once_the_lease_is_confirmed_after_it():
    prefill = FakePrefill(held=("t1", "t2"))
    side = decode_side(prefill)
    result = pulled(side, load("a"), load("b", transfer_id="t2"))
    assert result == KVTransferResult(["a", "b"], [])
    assert prefill.read_blocks == [[1, 2], [1, 2]] and prefill.released == ["t1", "t2"]


def test_a_lease_that_ended_during_the_read_discards_it():
    prefill = FakePrefill(ends_during_read=True)
    assert pulled(decode_side(prefill), load("a")) == KVTransferResult([], ["a"])


@pytest.mark.parametrize("why", ["lease over", "read fails"])
def test_a_load_that_cannot_read_fails_and_lets_the_lease_go(why):
    prefill = FakePrefill(held=() if why == "lease over" else ("t1",))
    result = pulled(decode_side(prefill), load("a", sources=(13,)))
    assert result == KVTransferResult([], ["a"])
    assert prefill.read_blocks == [] and prefill.released == ["t1"]


def test_a_load_with_nothing_to_read_only_releases_and_is_not_reported():
    prefill = FakePrefill()
    side = decode_side(prefill)
    assert pulled(side, load("a", sources=())) == KVTransferResult([], [])
    assert prefill.released == ["t1"]


def test_the_ranks_agree_a_load_failed_when_any_rank_failed():
    prefill = FakePrefill()
    agreed = []

    def another_rank_failed(values):
        agreed.append(values)
        return [min(v, 1) for v in values]  # rank 1 read nothing

    result = pulled(decode_side(prefill, another_rank_failed), load("a"))
    assert result == KVTransferResult([], ["a"]) and agreed[-1] == [READ]


# -- Mooncake's transfer engine, between two sets of KV tensors ----------------------


def test_mooncake_reads_a_prefill_sides_blocks_in_runs():
    pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine does not load "
                        "here (Debian: apt-get install libibverbs1; .ci/run does)")  # fmt: skip
    from flagstop.executor.kv_transfers.mooncake import MooncakeTransport, _runs

    assert _runs([5, 6, 9, 10], [1, 2, 3, 4]) == [(5, 1, 2), (9, 3, 2)]
    theirs = [torch.arange(8 * 6, dtype=torch.float32).view(8, 2, 3) + 1000 * i for i in (1, 2)]
    ours = [torch.zeros(8, 2, 3) for _ in theirs]
    prefill = MooncakeTransport(theirs, "127.0.0.1", 5.0)
    decode = MooncakeTransport(ours, "127.0.0.1", 5.0)
    decode.read(prefill.rank, 8, [1, 2, 6], [5, 6, 0])
    for mine, source in zip(ours, theirs, strict=True):
        assert torch.equal(mine[[5, 6, 0]], source[[1, 2, 6]])
        assert not mine[[1, 2, 3, 4, 7]].any(), "a block nobody asked for was written"
    with pytest.raises(TransferFailed):
        decode.read(prefill.rank, 8, [8], [1])  # past the prefill side's blocks


# -- the router's choice ------------------------------------------------------------------


def views(**roles_and_loads):
    return [ReplicaView(name, load, kv_role=role) for name, (role, load) in roles_and_loads.items()]


def chooser(threshold: int = 8) -> ReplicaChooser:
    return ReplicaChooser(RoutingConfig(pd_threshold=threshold), PrefixIndex(1000))


def test_a_long_uncached_prompt_is_prefilled_at_a_prefill_replica():
    c, prompt = chooser(), list(range(40))
    hashes = chain_hashes(prompt, BS)
    replicas = views(p=(PREFILL, 0), d=(DECODE, 0))
    assert c.place(hashes, len(prompt), BS, replicas) == ("p", "d", "pd-prefill")
    # Now cached at the decode replica (as the index knows): it stays there whole.
    assert c.place(hashes, len(prompt), BS, replicas)[:2] == ("d", None)


def test_short_prompts_and_prompt_logprobs_stay_whole():
    c, replicas = chooser(), views(p=(PREFILL, 0), d=(DECODE, 0))
    assert c.place(chain_hashes([1, 2, 3], BS), 3, BS, replicas)[:2] == ("d", None)
    hashes = chain_hashes(list(range(40)), BS)
    assert c.place(hashes, 40, BS, replicas, splittable=False)[:2] == ("d", None)


def test_without_both_roles_every_request_runs_whole():
    prompt = list(range(40))
    hashes = chain_hashes(prompt, BS)
    assert chooser().place(hashes, 40, BS, views(p=(PREFILL, 3)))[:2] == ("p", None)
    assert chooser().place(hashes, 40, BS, views(a=(BOTH, 0), p=(PREFILL, 0)))[:2] == ("a", None)
    assert chooser(0).place(hashes, 40, BS, views(d=(DECODE, 0)))[:2] == ("d", None)
