"""Which replica takes a request. Pure: the engine hands in the prompt's block hashes
(the scheduler's own prefix-cache keys, kv_cache_manager.chain_hashes) and each
replica's load, and gets a replica's name back.

- prefix (default): the replica that most recently received the longest run of the
  prompt's leading blocks, when that run covers at least --prefix-match-threshold of
  them and the replica is not far busier than the least loaded one (else the least
  loaded); a new prefix goes where the fewest blocks were sent. In the manner of
  SGLang's cache-aware router, on the scheduler's own chained block hashes rather
  than an approximate radix tree of characters.
- least-loaded: the replica with the fewest requests running and waiting.
- round-robin: in turn.

A LoRA request (prefix and least-loaded routing) goes, as the Gateway API Inference
Extension's LoRA affinity does, first to the replicas where its adapter runs already
(warm: in a slot) unless they are far busier than the least loaded, then to those
with a slot free for one more adapter, then anywhere; among them by the rule above.
Its block hashes start from its adapter's root (kv_cache_manager.prefix_root), so the
prefix index never mixes two adapters' blocks either.

With prefill/decode disaggregation (replicas of --kv-role prefill and decode), a
request is placed among the decode (and colocated) replicas by the rules above; when
that is a decode replica and at least --pd-threshold of the prompt's tokens are not
cached there (llm-d's pdThreshold), its prefill goes to a prefill replica, chosen by
the same rules among those, and the decode replica reads the KV from it. Short or
cached prompts stay whole on one replica (Dynamo: "if the prefill is short or the
decode engine has a high prefix cache hit, often it is more efficient to prefill
locally"). Without a replica of either role every request runs whole.
"""

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Routing = Literal["prefix", "least-loaded", "round-robin"]
# ModelInfo.kv_role's values (generation.proto's KVRole).
BOTH, PREFILL, DECODE = 0, 1, 2


@dataclass(slots=True)
class ReplicaView:
    """What the routing sees of one replica."""

    name: str
    load: int  # requests running and waiting there, and queued here for it
    kv_cache_usage: float = 0.0
    running_loras: frozenset[str] = frozenset()  # adapters of its running requests
    max_loras: int = 0
    kv_role: int = BOTH


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The router's settings of the same names (flagstop.settings.config_from). A
    replica is far busier than the least loaded one when it has more than both least +
    balance_abs_threshold and least x balance_rel_threshold requests, or its KV cache
    is kv_high full while another's is not."""

    routing: Routing = "prefix"
    prefix_match_threshold: float = 0.5  # of the prompt's full blocks
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    kv_high: float = 0.95
    pd_threshold: int = 512  # uncached prompt tokens from which a prefill is split off


class PrefixIndex:
    """Which replicas were recently sent each block hash: a bounded LRU, so memory stays
    flat however many distinct prompts pass (~400 bytes an entry, measured). A block keeps
    every replica it went to, most recent last (SGLang's tree keeps a tenant set per
    node the same way)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.holders: OrderedDict[bytes, dict[str, None]] = OrderedDict()
        self.num_held: Counter[str] = Counter()  # blocks per replica

    def matched(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Per replica, how many of the leading blocks it holds. Hashes are chained, so
        block i can only match where blocks 0..i-1 did."""
        found: dict[str, int] = {}
        for i, h in enumerate(hashes):
            extended = False
            for replica in self.holders.get(h, ()):
                if found.get(replica, 0) == i:
                    found[replica], extended = i + 1, True
            if not extended:
                break
        return found

    def latest(self, block_hash: bytes, replicas: Iterable[str]) -> str:
        """Of these holders of the block, the one it was sent to last."""
        order = list(self.holders[block_hash])
        return max(replicas, key=order.index)

    def record(self, hashes: Iterable[bytes], replica: str) -> None:
        holders = self.holders
        for h in hashes:
            held = holders.setdefault(h, {})
            if held.pop(replica, False) is False:
                self.num_held[replica] += 1
            held[replica] = None  # the most recent last
            holders.move_to_end(h)
        while len(holders) > self.max_blocks:
            self.num_held.subtract(holders.popitem(last=False)[1].keys())

    def forget(self, replica: str) -> None:
        """The replica's cache is gone (it was lost)."""
        for h, replicas in list(self.holders.items()):
            replicas.pop(replica, None)
            if not replicas:
                del self.holders[h]
        del self.num_held[replica]


class ReplicaChooser:
    def __init__(self, config: RoutingConfig, index: PrefixIndex) -> None:
        self.config, self.index = config, index
        self.turn = itertools.count()

    def choose(
        self, hashes: Sequence[bytes], replicas: Sequence[ReplicaView], lora_name: str = ""
    ) -> tuple[str, str]:
        """(replica name, why: prefix, least-cached, least-loaded or round-robin;
        lora-warm or lora-room for a LoRA request)."""
        if self.config.routing == "round-robin":
            return replicas[next(self.turn) % len(replicas)].name, "round-robin"
        why = ""
        if lora_name:
            replicas, why = self._by_adapter(lora_name, replicas)
        if self.config.routing == "least-loaded":
            return self._least_loaded(replicas), why or "least-loaded"
        name, by_prefix = self._by_prefix(hashes, replicas)
        self.index.record(hashes, name)
        return name, why or by_prefix

    def place(
        self, hashes: Sequence[bytes], num_tokens: int, block_size: int,
        replicas: Sequence[ReplicaView], lora_name: str = "", splittable: bool = True,
    ) -> tuple[str, str | None, str]:  # fmt: skip
        """(where the request runs, or its prefill; its decode replica when it is split
        off; why). Whole requests go to decode and colocated replicas, or to prefill
        replicas while no other is up."""
        prefill = [r for r in replicas if r.kv_role == PREFILL]
        serving = [r for r in replicas if r.kv_role != PREFILL] or prefill
        cached = self.index.matched(hashes) if splittable and prefill else {}
        name, why = self.choose(hashes, serving, lora_name)
        decode = next(r for r in serving if r.name == name)
        if not (splittable and prefill and decode.kv_role == DECODE):
            return name, None, why
        if num_tokens - cached.get(name, 0) * block_size < self.config.pd_threshold:
            return name, None, why
        prefill_name, _ = self.choose(hashes, prefill, lora_name)
        return prefill_name, name, "pd-prefill"

    def _by_adapter(
        self, lora_name: str, replicas: Sequence[ReplicaView]
    ) -> tuple[Sequence[ReplicaView], str]:
        """The replicas a LoRA request may go to: where its adapter is warm, else
        where a slot is free, else all (and why)."""
        fit = [r for r in replicas if not self._far_busier(r, replicas)]
        if warm := [r for r in fit if lora_name in r.running_loras]:
            return warm, "lora-warm"
        if room := [r for r in fit if len(r.running_loras) < r.max_loras]:
            return room, "lora-room"
        return replicas, ""

    def _by_prefix(
        self, hashes: Sequence[bytes], replicas: Sequence[ReplicaView]
    ) -> tuple[str, str]:
        matched = self.index.matched(hashes)
        longest = max((matched.get(r.name, 0) for r in replicas), default=0)
        if not longest or longest < self.config.prefix_match_threshold * len(hashes):
            return self._least_cached(hashes, replicas)
        # Of the replicas holding that much, the one the prefix went to last: after load
        # moved a group elsewhere, it follows there rather than alternating between two
        # copies (which would halve what the caches hold).
        holders = [r.name for r in replicas if matched.get(r.name) == longest]
        latest = self.index.latest(hashes[longest - 1], holders)
        best = next(r for r in replicas if r.name == latest)
        if self._far_busier(best, replicas):
            return self._least_loaded(replicas), "least-loaded"
        return best.name, "prefix"

    def _least_cached(
        self, hashes: Sequence[bytes], replicas: Sequence[ReplicaView]
    ) -> tuple[str, str]:
        """A new prefix: where the fewest blocks were sent (the caches fill evenly, as
        SGLang's smallest-tree rule), among the replicas not far busier than the rest;
        a prompt without a full block goes where the load is least."""
        if not hashes:
            return self._least_loaded(replicas), "least-loaded"
        held = self.index.num_held
        fit = [r for r in replicas if not self._far_busier(r, replicas)] or list(replicas)
        return min(fit, key=lambda r: (held[r.name], r.load)).name, "least-cached"

    def _far_busier(self, replica: ReplicaView, replicas: Sequence[ReplicaView]) -> bool:
        least = min(r.load for r in replicas)
        c = self.config
        if (
            replica.load > least + c.balance_abs_threshold
            and replica.load > least * c.balance_rel_threshold
        ):
            return True
        return replica.kv_cache_usage >= c.kv_high and any(
            r.kv_cache_usage < c.kv_high for r in replicas
        )

    def _least_loaded(self, replicas: Sequence[ReplicaView]) -> str:
        """Fewest requests, a replica with a nearly full KV cache last; ties in turn."""
        kv_high = self.config.kv_high

        def key(r: ReplicaView) -> tuple:
            return (r.kv_cache_usage >= kv_high, r.load, round(r.kv_cache_usage, 2))

        least = min(key(r) for r in replicas)
        tied = [r for r in replicas if key(r) == least]
        return tied[next(self.turn) % len(tied)].name
