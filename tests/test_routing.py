"""The router's replica choice, its prefix index, admission budget and discovery,
driven in-process (the multi-replica stacks are in test_replicas.py)."""

import asyncio

import pytest

from flagstop.router import discovery
from flagstop.router.admission import AdmissionBudget, AdmissionQueue
from flagstop.router.discovery import Resolver, parse_targets
from flagstop.router.routing import PrefixIndex, ReplicaChooser, ReplicaView, RoutingConfig
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager, chain_hashes
from flagstop.v1 import scheduler_pb2

from .test_scheduler import make_request


def chooser(routing="prefix", max_blocks=1000, **config) -> ReplicaChooser:
    return ReplicaChooser(RoutingConfig(routing, **config), PrefixIndex(max_blocks))


def views(**loads) -> list[ReplicaView]:
    return [ReplicaView(name, load) for name, load in loads.items()]


def test_router_hashes_are_the_prefix_cache_keys():
    request = make_request("r", num_prompt=37)
    manager = KVCacheManager(num_blocks=16, block_size=4)
    manager.update_block_hashes(request)
    assert chain_hashes(request.all_token_ids, 4) == request.block_hashes
    assert len(request.block_hashes) == 9  # full blocks only


def test_a_prefix_follows_the_replica_that_got_it():
    c, prefix = chooser(), list(range(64))
    first, why = c.choose(chain_hashes([*prefix, 1, 2, 3, 4], 4), views(a=0, b=0))
    assert why == "least-cached"
    for suffix in range(5):  # the other replica is idler, the prefix wins
        hashes = chain_hashes(prefix + [100 + suffix] * 4, 4)
        assert c.choose(hashes, views(**{first: 3, ("b" if first == "a" else "a"): 0})) == (
            first, "prefix",
        )  # fmt: skip


def test_a_far_busier_replica_sheds_work_even_with_the_prefix():
    c, hashes = (
        chooser(balance_abs_threshold=8, balance_rel_threshold=1.5),
        chain_hashes(list(range(64)), 4),
    )
    c.index.record(hashes, "a")
    assert c.choose(hashes, views(a=8, b=0)) == ("a", "prefix")  # not more than least + 8
    assert c.choose(hashes, views(a=20, b=14)) == ("a", "prefix")  # not 1.5x
    assert c.choose(hashes, views(a=30, b=14)) == ("b", "least-loaded")


def test_a_full_kv_cache_sheds_work_while_another_has_room():
    c, hashes = chooser(), chain_hashes(list(range(64)), 4)
    c.index.record(hashes, "a")
    full = [ReplicaView("a", 1, 0.97), ReplicaView("b", 1, 0.2)]
    assert c.choose(hashes, full)[0] == "b"


def test_a_short_match_is_no_affinity():
    c = chooser(prefix_match_threshold=0.5)
    c.index.record(chain_hashes(list(range(16)), 4), "a")  # 4 blocks of the 16 below
    assert c.choose(chain_hashes(list(range(64)), 4), views(a=0, b=1)) == ("b", "least-cached")


def test_new_prefixes_fill_the_caches_evenly_unless_that_one_is_far_busier():
    c = chooser(balance_abs_threshold=8)
    groups = [chain_hashes([g] * 64, 4) for g in range(6)]
    chosen = [c.choose(hashes, views(a=5, b=0))[0] for hashes in groups]
    assert chosen.count("a") == chosen.count("b") == 3  # the load is no reason to skew
    assert c.choose(chain_hashes([99] * 64, 4), views(a=0, b=20)) == ("a", "least-cached")
    assert c.index.num_held == {"a": 64, "b": 48}
    assert c.choose([], views(a=0, b=1)) == ("a", "least-loaded")  # no full block


def test_round_robin_and_least_loaded():
    rr = chooser("round-robin")
    assert [rr.choose([], views(a=9, b=0, c=0))[0] for _ in range(4)] == ["a", "b", "c", "a"]
    ll = chooser("least-loaded")
    assert ll.choose([], views(a=3, b=1, c=2)) == ("b", "least-loaded")


def test_the_index_is_a_bounded_lru():
    index = PrefixIndex(max_blocks=8)
    old, new = chain_hashes(list(range(32)), 4), chain_hashes(list(range(100, 132)), 4)
    index.record(old, "a")
    index.record(new, "b")
    assert len(index.holders) == 8
    assert index.matched(old) == {} and index.matched(new) == {"b": 8}
    assert index.num_held == {"a": 0, "b": 8}
    index.forget("b")
    assert index.matched(new) == {}


def test_the_match_stops_at_the_first_unknown_block():
    index, hashes = PrefixIndex(100), chain_hashes(list(range(40)), 4)
    index.record(hashes[:3], "a")
    index.record(hashes[5:], "b")  # chained: unreachable without blocks 3 and 4
    assert index.matched(hashes) == {"a": 3}


def test_the_admission_budget_counts_every_queue():
    budget = AdmissionBudget(max_requests=3, max_tokens=10)
    queues = [AdmissionQueue(), AdmissionQueue()]
    queues[0].push(scheduler_pb2.AddRequest(request_id="x", prompt_token_ids=[1] * 4))
    queues[1].push(scheduler_pb2.AddRequest(request_id="y", prompt_token_ids=[1] * 4))
    assert budget.refusal(queues, 2) == ""
    assert "prompt tokens" in budget.refusal(queues, 3)
    queues[1].push(scheduler_pb2.AddRequest(request_id="z", prompt_token_ids=[1]))
    assert "full (3 requests)" in budget.refusal(queues, 1)


@pytest.mark.parametrize(
    "bad", ["", "host", "host:port", "dns:name", "a:1,b:99999", f"dns:{'a' * 70}.svc:5"]
)
def test_bad_scheduler_lists_are_named(bad):
    with pytest.raises(ValueError, match=r"not HOST:PORT|no address|not a valid host"):
        parse_targets(bad)


def test_a_name_that_stops_resolving_keeps_its_addresses(monkeypatch):
    answers = [{"10.0.0.1:50052", "10.0.0.2:50052"}, OSError("no such host")]

    async def resolve(target):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(discovery, "resolve", resolve)
    resolver, targets = Resolver(), ["dns:replicas:50052", "127.0.0.1:7"]
    first = asyncio.run(resolver.addresses(targets))
    assert first == {"10.0.0.1:50052", "10.0.0.2:50052", "127.0.0.1:7"}
    assert asyncio.run(resolver.addresses(targets)) == first


def test_localhost_resolves():
    addresses = asyncio.run(discovery.resolve("dns:localhost:50052"))
    assert "127.0.0.1:50052" in addresses


def test_a_prefix_sent_to_two_replicas_matches_on_both():
    c, hashes = chooser(), chain_hashes(list(range(64)), 4)
    c.index.record(hashes, "a")
    c.index.record(hashes, "b")  # load sent the group's next request to b
    assert c.index.matched(hashes) == {"a": 16, "b": 16}
    assert c.choose(hashes, views(a=1, b=3)) == ("b", "prefix")  # where it went last
    c.index.forget("b")
    assert c.index.matched(hashes) == {"a": 16}
