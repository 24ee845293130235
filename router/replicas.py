"""The replicas behind this router: which there are (the --scheduler list, names
resolved again now and then), the model they serve, which one a request goes to, and
where the requests of a replica that is lost go.

Each request goes to one replica (router/routing.py) and waits in that replica's
admission queue until its scheduler grants credits. A replica that is lost hands back
the requests its scheduler held, as their remainders, to the head of its queue; when
it stays away past --replica-grace-s (or leaves the list) its queue moves to the live
replicas, and with none live the requests fail after --scheduler-timeout.

With prefill/decode disaggregation a request may run in two halves: its prefill at a
prefill replica, which ends it with REQUEST_FINISH_TRANSFER and says where its KV
waits, then its remainder (prompt + first token) at a decode replica, which reads
that KV. Either half lost goes on as any lost request does."""

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable

import grpc

from flagstop.router.discovery import Resolver, has_names, parse_targets
from flagstop.router.pending import Pending
from flagstop.router.replica import Replica, ReplicaMismatch
from flagstop.router.routing import (
    BOTH,
    PREFILL,
    PrefixIndex,
    ReplicaChooser,
    ReplicaView,
    RoutingConfig,
)
from flagstop.router.settings import RouterSettings
from flagstop.router.telemetry import ROUTED, export_model
from flagstop.router.validation import ModelLimits
from flagstop.scheduler_svc.core.kv_cache_manager import chain_hashes, prefix_root
from flagstop.scheduler_svc.core.media import media_from_proto
from flagstop.server import TLSConfig
from flagstop.settings import config_from
from flagstop.v1 import generation_pb2, scheduler_pb2

log = logging.getLogger("flagstop.router")
REBALANCE_INTERVAL_S = 0.2


def splittable(add: scheduler_pb2.AddRequest) -> bool:
    """Whether --pd-threshold may split the request between a prefill and a decode
    replica. Prompt logprobs come out of a prefill's logits, and a remainder bound for
    a decode replica has had its prefill: neither is split (again). Nor is a prompt
    with images: its prefill and decode run on one replica (docs/multimodal.md), nor a
    pooling request, which has no decode."""
    return not (add.sampling.HasField("prompt_logprobs") or add.kv_transfer.remote_endpoint
                or add.media or add.sampling.HasField("pooling"))  # fmt: skip


# Sessions remembered by the router, the least recently routed forgotten first.
MAX_SESSIONS = 100_000


class SessionReplicas:
    """Each session's replica (docs/sessions.md): where its last turn went."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.replica_of: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        return self.replica_of.get(session)

    def remember(self, session: str, replica: str) -> None:
        self.replica_of[session] = replica
        self.replica_of.move_to_end(session)
        if len(self.replica_of) > self.capacity:
            self.replica_of.popitem(last=False)


class ReplicaSet:
    def __init__(
        self,
        settings: RouterSettings,
        requests: dict[str, Pending],
        fan_out: Callable[[scheduler_pb2.SchedulerMessage], None],
        changed: Callable[[], None],
    ) -> None:
        """requests: the router's table of client streams (whose replica a move
        changes); fan_out: where each scheduler message goes; changed: called when
        a replica connects or is lost (readiness)."""
        self.settings, self.requests = settings, requests
        self.fan_out, self.changed = fan_out, changed
        self.tls = TLSConfig.from_settings(settings)
        self.model_info = generation_pb2.ModelInfo()
        self.limits: ModelLimits | None = None
        self.kv_layout = ""  # the disaggregated replicas' (prefill and decode roles)
        self.by_address: dict[str, Replica] = {}
        self.leaving: list[Replica] = []  # left the scheduler list, requests not moved yet
        self.sessions = SessionReplicas(MAX_SESSIONS)
        self.chooser = ReplicaChooser(
            config_from(settings, RoutingConfig), PrefixIndex(settings.prefix_index_blocks)
        )
        self.targets = parse_targets(settings.scheduler)
        self.resolver = Resolver()
        self.rediscover = asyncio.Event()

    def __iter__(self):
        return iter(self.by_address.values())

    @property
    def any_serving(self) -> bool:
        """Some replica can take a request now (connected, with an executor)."""
        return any(r.serving for r in self.by_address.values())

    # -- which replicas --------------------------------------------------------

    async def run(self) -> None:
        try:
            await asyncio.gather(self._discover_forever(), self._rebalance_forever())
        finally:
            for replica in self.by_address.values():
                await replica.stop()

    def reload(self, scheduler: str) -> None:
        """A new scheduler list (SIGHUP): replicas not in it leave, new ones join."""
        self.targets = parse_targets(scheduler)
        log.info("scheduler list: %s", ", ".join(self.targets))
        self.rediscover.set()

    async def _discover_forever(self) -> None:
        while True:
            await self._discover()
            interval = self.settings.resolve_interval_s if has_names(self.targets) else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rediscover.wait(), interval)
            self.rediscover.clear()

    async def _discover(self) -> None:
        addresses = await self.resolver.addresses(self.targets)
        for address in addresses - self.by_address.keys():
            log.info("replica %s joins", address)
            replica = Replica(address, self.settings, self.tls, self)
            self.by_address[address] = replica
            replica.start()
        for address in self.by_address.keys() - addresses:
            log.info("replica %s leaves", address)
            replica = self.by_address.pop(address)
            self.leaving.append(replica)  # until its requests have moved on
            await replica.stop()

    # -- what a replica tells ----------------------------------------------------

    def described(self, info: generation_pb2.ModelInfo) -> None:
        """The replica's model must be the one the router already serves."""
        served = self.model_info.model_name
        if served and info.model_name != served:
            raise ReplicaMismatch(f"serves {info.model_name!r}, the other replicas {served!r}")
        if info.kv_role != BOTH:  # its blocks must mean the same at every other one
            if self.kv_layout and info.kv_layout != self.kv_layout:
                raise ReplicaMismatch(f"its KV layout ({info.kv_layout}) is not the other "
                                      f"disaggregated replicas' ({self.kv_layout}): they "
                                      "could not read each other's blocks")  # fmt: skip
            self.kv_layout = info.kv_layout
        # The index counts a prefix as held for as long as it remembers it, so it must
        # remember at least what one replica's pool and host tier keep.
        if (held := info.num_blocks + info.num_host_blocks) > self.chooser.index.max_blocks:
            log.warning("a replica keeps %d blocks (pool and host tier) but the prefix index "
                        "remembers %d: raise --prefix-index-blocks", held,
                        self.chooser.index.max_blocks)  # fmt: skip
        if served and self.limits.kv_capacity_tokens <= ModelLimits.of(info).kv_capacity_tokens:
            return  # the smallest replica bounds what a request may ask
        self.model_info = generation_pb2.ModelInfo()
        self.model_info.CopyFrom(info)
        self.limits = ModelLimits.of(info)
        export_model(info.model_name)

    def connected(self) -> None:
        self.changed()

    def sent(self, adds) -> None:
        """These requests reached their replica's scheduler."""
        for add in adds:
            self.requests[add.request_id].sent = True

    def lost(self, replica: Replica) -> None:
        """The replica and all it held are gone. Every request it was serving goes back
        to the head of its admission queue as its remainder: its client sees a pause,
        then the rest of its tokens, from this replica when it is back within
        --replica-grace-s, from another otherwise (see rebalance)."""
        self.chooser.index.forget(replica.address)  # its prefix cache is gone
        self.changed()  # still live: the queue waits for a replica
        resubmit = []
        for pending in self.requests.values():
            if pending.replica is replica and pending.sent and not pending.finished:
                pending.sent = False
                resubmit.append(pending.remainder())
        replica.admission.push_front(resubmit)

    # -- where requests go -------------------------------------------------------

    def routable(self) -> list[Replica]:
        """The replicas serving (connected, with an executor); with none, those that
        may still come back within --replica-grace-s: a scheduler lost, or one whose
        executor is away (requests queue for them, as for a restart). None: no replica
        can serve."""
        replicas, grace = self.by_address.values(), self.settings.replica_grace_s
        return [r for r in replicas if r.serving] or [
            r for r in replicas
            if (r.connected and r.executor_lost_for_s <= grace)
            or (not r.connected and r.may_come_back)
        ]  # fmt: skip

    def adapters(self) -> dict[str, generation_pb2.LoRAAdapter]:
        """Every adapter some replica holds, by name (one replica's, when they differ)."""
        return {name: a for r in self.by_address.values() for name, a in r.adapters.items()}

    def adapter_id(self, lora_name: str) -> str | None:
        """The identity a new request of this adapter runs under: the one most replicas
        hold under the name (they differ only while it is loaded again across them);
        None when none holds it."""
        ids = Counter(r.adapters[lora_name].id for r in self.by_address.values()
                      if lora_name in r.adapters)  # fmt: skip
        return max(ids, key=lambda i: (ids[i], i)) if ids else None

    def place(
        self, pending: Pending, add: scheduler_pb2.AddRequest, replicas: list[Replica],
        moved: bool = False,
    ) -> tuple[Replica, scheduler_pb2.AddRequest]:  # fmt: skip
        """Where the request (add: what it asks now, pending.add or its remainder) is to
        be queued, and what to queue: itself, or its prefill, marked to be handed off,
        when the routing splits it."""
        lora_name = add.lora_name
        if lora_name:  # only a replica holding the adapter (these very files) can run it
            replicas = [r for r in replicas if r.holds(lora_name, add.lora_id)] or replicas
        by_name = {r.address: r for r in replicas}
        token_ids, hashes = add.prompt_token_ids, []
        if self.settings.routing == "prefix":
            hashes = chain_hashes(list(token_ids), self.model_info.block_size,
                                  parent_hash=prefix_root(add.lora_id, add.cache_salt),
                                  media=media_from_proto(add.media))  # fmt: skip
        views = self._views(replicas)
        name, decode, why = self.chooser.place(
            hashes, len(token_ids), self.model_info.block_size, views, lora_name, splittable(add)
        )
        session = pending.request.session_id
        if session and decode is None and (held := self.sessions.get(session)) in by_name:
            name, why = held, "session"  # its blocks are there (prefix routing's fallback)
        if session:
            self.sessions.remember(session, name)
        if decode is not None or add.kv_transfer.do_remote_decode:
            add = self._marked(add, decode is not None)
        replica = by_name[name]
        pending.replica, pending.decode_replica = replica, by_name.get(decode)
        replica.routed_since_report += 1
        ROUTED.labels(name, "moved" if moved else why).inc()
        return replica, add

    @staticmethod
    def _marked(add: scheduler_pb2.AddRequest, remote_decode: bool) -> scheduler_pb2.AddRequest:
        """A copy that asks the replica to hand the decode off, or not (never pending.add
        itself: its remainders are whole requests)."""
        marked = scheduler_pb2.AddRequest()
        marked.CopyFrom(add)
        marked.kv_transfer.do_remote_decode = remote_decode
        return marked

    def hand_off(self, pending: Pending, params: scheduler_pb2.KVTransferParams | None) -> None:
        """A prefill replica computed the prompt and the first token: the remainder goes
        to the decode replica (another decode or colocated one if that is gone), which
        reads the prompt's KV from where params say it waits."""
        pending.sent = False
        add = pending.remainder()
        if params is not None:
            add.kv_transfer.CopyFrom(params)
        target = pending.decode_replica
        live = [r for r in self.by_address.values() if r.serving and r.kv_role != PREFILL
                and r.holds(add.lora_name, add.lora_id)]  # fmt: skip
        if target is None or not target.serving:
            target = self._best_of(add, live) or pending.replica  # no decode replica: whole
        pending.replica, pending.decode_replica = target, None
        target.routed_since_report += 1
        ROUTED.labels(target.address, "pd-decode").inc()
        pending.trace.handed_off(target.address)
        target.admission.push_front([add])
        target.flush.set()

    def _best_of(self, add: scheduler_pb2.AddRequest, replicas: list[Replica]) -> Replica | None:
        if not replicas:
            return None
        name, _ = self.chooser.choose([], self._views(replicas), add.lora_name)
        return next(r for r in replicas if r.address == name)

    @staticmethod
    def _views(replicas: list[Replica]) -> list[ReplicaView]:
        return [ReplicaView(r.address, r.load, r.reported.kv_cache_usage,
                            frozenset(r.reported.running_loras), r.max_loras, r.kv_role)
                for r in replicas]  # fmt: skip

    async def _rebalance_forever(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            self.rebalance()

    def rebalance(self) -> None:
        """Requests queued at a replica that is gone move to the serving ones; with
        none serving, they wait up to --scheduler-timeout and then fail. A replica
        whose executor stays away past the grace gives up what it holds too."""
        live = [r for r in self.by_address.values() if r.serving]
        grace = self.settings.replica_grace_s
        for replica in [*self.by_address.values(), *self.leaving]:
            replica.forget_evacuated()
            if replica.connected:
                if live and replica.executor_lost_for_s > grace:
                    self._evacuate(replica, live)
                continue
            if not replica.admission:
                continue
            if live and (replica.removed or replica.reconnect.lost_for_s > grace):
                self._move(replica, live)
            elif replica.reconnect.gave_up:
                self._fail(replica, f"no scheduler for {self.settings.scheduler_timeout:g}s")
        self.leaving = [r for r in self.leaving if r.admission]

    def _evacuate(self, replica: Replica, live: list[Replica]) -> None:
        """Its executor is away past the grace: what is queued for it moves, and what
        its scheduler holds is aborted there and goes on elsewhere as its remainder
        (prompt + the tokens streamed: the same greedy tokens)."""
        if replica.admission:
            self._move(replica, live)
        held = [p for p in self.requests.values()
                if p.replica is replica and p.sent and not p.finished]  # fmt: skip
        if not held:
            return
        moved: dict[Replica, list[scheduler_pb2.AddRequest]] = {}
        for pending in held:
            replica.evacuate(pending.request_id)
            pending.sent = False
            target, add = self.place(pending, pending.remainder(), live, moved=True)
            moved.setdefault(target, []).append(add)
        for target, adds in moved.items():
            target.admission.push_front(adds)
            target.flush.set()
        log.warning("%d requests move from %s (no executor for %.1fs)", len(held),
                    replica.address, replica.executor_lost_for_s)  # fmt: skip

    def _move(self, replica: Replica, live: list[Replica]) -> None:
        moved: dict[Replica, list[scheduler_pb2.AddRequest]] = {}
        for add in replica.admission.take_all():
            if (pending := self.requests.get(add.request_id)) is not None:
                target, add = self.place(pending, add, live, moved=True)
                moved.setdefault(target, []).append(add)
        for target, adds in moved.items():
            target.admission.push_front(adds)  # they came before what is queued there
            target.flush.set()
            log.warning("%d requests move from %s to %s", len(adds), replica.address,
                        target.address)  # fmt: skip

    def _fail(self, replica: Replica, why: str) -> None:
        for add in replica.admission.take_all():
            if (pending := self.requests.get(add.request_id)) is not None:
                pending.fail(grpc.StatusCode.UNAVAILABLE, f"{why}; retry the request")
