"""KV beyond the pool, in the core: what the scheduler does around its KV connector
(kv_connector.py; a host tier, or a side of prefill/decode disaggregation). The core
loop calls one of these at named seams; NoKVTransfers, the engine without a
connector, answers each as if nothing ever lived beyond the pool.

- A waiting request may have tokens to load past its local prefix hits: it reserves
  blocks for its whole remaining prefill, waits WAITING_FOR_REMOTE_KVS in `loading`
  (no token budget, no seat), and once its load is reported moves to `loaded`, where
  it holds its blocks and is seated before anyone waiting (vLLM #57841).
- Blocks a transfer still reads outlive their request: held under a key of their own
  (`freeing`: the transfer id the executor will report -> the keys, oldest first), so
  that the request's id may come back meanwhile (a remainder resubmitted).
- A prefill replica's request ends after its first token and hands its blocks off
  under a lease (`leased`).
- Each plan carries the connector's transfers, and asks after those under way."""

from collections import deque

from flagstop.scheduler_svc.core.kv_cache_manager import (
    ComputedBlocks,
    KVCacheManager,
    PrefixCacheStats,
)
from flagstop.scheduler_svc.core.kv_connector import KVConnector, KVTransferResult
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.request import (
    FINISHED_TRANSFERRED,
    WAITING_FOR_REMOTE_KVS,
    Request,
)
from flagstop.utils import cdiv


class KVTransfers:
    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector
        self.loading: dict[str, Request] = {}
        self.loaded: deque[Request] = deque()  # arrived, holding blocks: seated first
        self.freeing: dict[str, list[str]] = {}
        self.num_held = 0  # keys handed out to held blocks
        self.leased: set[str] = set()  # of the held, hand-offs' (a prefill replica's)
        self.external_stats = PrefixCacheStats()  # tokens asked of / loaded by it

    # -- what the core asks ------------------------------------------------------------

    @property
    def num_host_cached_blocks(self) -> int:
        """Blocks resident beyond the pool (the load report's)."""
        return self.connector.num_cached_blocks

    def has_pending(self) -> bool:
        """Held blocks wait for a transfer's end (the engine is not idle)."""
        return bool(self.freeing)

    def watch(self, kv: KVCacheManager) -> None:
        """A new pool: the connector hears of the blocks it caches (write-through), and
        tells the pool's KV events what its tier holds."""
        kv.newly_cached = []
        self.connector.announce(kv.events)

    # -- requests ------------------------------------------------------------------------

    def on_add(self, request: Request) -> None:
        """A prefill replica's request ends with its first token, handed off (unless that
        token ends it anyway); without a connector that hands off, it runs whole."""
        if not request.do_remote_decode:
            return
        first_token_end = request.num_prompt_tokens + 1
        if not self.connector.hands_off or request.max_num_tokens <= first_token_end:
            request.do_remote_decode = False
            return
        request.max_num_tokens = first_token_end

    def num_loadable(self, request: Request, num_cached: int) -> int | None:
        """Tokens past the local hits the connector can load; None: ask next step."""
        return self.connector.get_num_new_matched_tokens(request, num_cached)

    def start_load(
        self,
        kv: KVCacheManager,
        request: Request,
        hits: ComputedBlocks | None,
        num_cached: int,
        num_external: int,
    ) -> bool:
        """Reserve blocks for the request's whole remaining prefill, uncached (a load
        fills them), and park it until the connector reports the load; False when the
        pool cannot hold it yet."""
        num_new = request.num_tokens - num_cached
        block_ids = kv.allocate_slots(request, num_new, hits, delay_cache_blocks=True)
        if block_ids is None:
            return False
        request.num_computed_tokens = num_cached
        request.num_external_tokens = num_external
        request.status = WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        # A fresh block table: the hits, then the new blocks, the loaded ones first (a
        # prefill replica's last one may be partly filled).
        first, num_groups = len(hits) if hits else 0, kv.num_groups  # ids position-major
        loaded_ids = block_ids[first * num_groups : (first + cdiv(num_external, kv.block_size))
                               * num_groups]  # fmt: skip
        self.connector.update_state_after_alloc(request, loaded_ids, num_external)
        return True

    def nothing_to_load(self, request: Request) -> None:
        """Admitted from the waiting queue with its blocks allocated, nothing to load."""
        self.connector.update_state_after_alloc(request, [], 0)

    def on_admit(self, request: Request) -> None:
        """Seated: what it loaded counts as the connector's hits."""
        self.external_stats.record(request.num_tokens, request.num_loaded_tokens)
        request.num_loaded_tokens = 0

    def finish(self, kv: KVCacheManager, request: Request, was_loading: bool) -> bool:
        """An ended request (its status says how): whether a transfer still uses its
        blocks, now held apart (else the caller frees them)."""
        request_id = request.request_id
        if was_loading:  # a load is writing its blocks: freed when it is reported done
            del self.loading[request_id]
            self._hold(kv, request_id, request_id)
            return True
        handoff = self.connector.request_finished(request, kv.block_ids(request_id))
        if handoff is None:
            return False
        request.kv_handoff = handoff  # a transfer still reads the blocks
        self._hold(kv, handoff.transfer_id, request_id)
        if request.status == FINISHED_TRANSFERRED:
            self.leased.add(handoff.transfer_id)
        return True

    def drop_queued(self, request_ids: set[str]) -> None:
        if self.loaded:
            self.loaded = deque(r for r in self.loaded if r.request_id not in request_ids)

    # -- each step ------------------------------------------------------------------------

    def attach(self, plan: SchedulerOutput, kv: KVCacheManager) -> None:
        """The plan's transfers. Told once the plan is final: a preemption victim's
        blocks are not saved. An empty step still asks after the transfers under way:
        it is the only way their end reaches us when nothing else runs."""
        self.connector.blocks_cached(kv.take_newly_cached())
        plan.kv_connector = self.connector.build_connector_meta()
        plan.poll_kv_transfers = bool(self.loading or self.freeing)

    def update(self, kv: KVCacheManager, result: KVTransferResult) -> None:
        """The executor's connector finished or failed these transfers. A loaded
        request's blocks enter the prefix cache now (never before: vLLM's
        no-spurious-prefix-caching rule) and it waits for a seat, its last token still
        to compute; a failed load keeps its blocks and recomputes what did not arrive;
        an ended request's blocks are freed."""
        if not result:
            return
        self.connector.update_connector_output(result)
        failed = set(result.failed_recving)
        for req_id in (*result.finished_recving, *failed):
            # Loads end in the order they started: one of a request that ended while
            # its KV arrived comes before one of a request its id came back as.
            if not self._release(kv, req_id) and (request := self.loading.pop(req_id, None)):
                self._loaded(kv, request, req_id not in failed)
        for transfer_id in result.finished_sending:
            self._release(kv, transfer_id)
            self.leased.discard(transfer_id)

    def reset(self, num_host_blocks: int) -> list[Request]:
        """The executor was lost, and everything it held with it: the requests that
        were loading or loaded, to recompute."""
        requests = [*self.loaded, *self.loading.values()]
        self.loading, self.loaded, self.freeing, self.leased = {}, deque(), {}, set()
        self.connector.reset(num_host_blocks)
        return requests

    # -- held blocks ------------------------------------------------------------------------

    def _hold(self, kv: KVCacheManager, reported_id: str, request_id: str) -> None:
        """Keep an ended request's blocks until the executor reports reported_id."""
        key = f"held:{self.num_held}"
        self.num_held += 1
        kv.hold(request_id, key)
        self.freeing.setdefault(reported_id, []).append(key)

    def _release(self, kv: KVCacheManager, reported_id: str) -> bool:
        """Free the oldest blocks held until reported_id, if any."""
        keys = self.freeing.get(reported_id)
        if not keys:
            return False
        kv.free(keys.pop(0))
        if not keys:
            del self.freeing[reported_id]
        return True

    def _loaded(self, kv: KVCacheManager, request: Request, ok: bool) -> None:
        if ok:
            request.num_computed_tokens += request.num_external_tokens
            request.num_loaded_tokens = request.num_external_tokens
            kv.cache_blocks(request, request.num_computed_tokens)
        request.num_external_tokens = 0
        request.status = request.resume_status()
        self.loaded.append(request)


class NoKVTransfers(KVTransfers):
    """No connector: nothing to load, hold or hand off; every queue stays empty."""

    def __init__(self) -> None:
        super().__init__(connector=None)  # type: ignore[arg-type]  # never called

    @property
    def num_host_cached_blocks(self) -> int:
        return 0

    def watch(self, kv: KVCacheManager) -> None:
        return None

    def on_add(self, request: Request) -> None:
        request.do_remote_decode = False  # nothing here hands off: it runs whole

    def num_loadable(self, request: Request, num_cached: int) -> int:
        return 0

    def nothing_to_load(self, request: Request) -> None:
        return None

    def on_admit(self, request: Request) -> None:
        return None

    def finish(self, kv: KVCacheManager, request: Request, was_loading: bool) -> bool:
        return False

    def attach(self, plan: SchedulerOutput, kv: KVCacheManager) -> None:
        return None

    def update(self, kv: KVCacheManager, result: KVTransferResult) -> None:
        return None

    def reset(self, num_host_blocks: int) -> list[Request]:
        return []


def kv_transfers(connector: KVConnector | None) -> KVTransfers:
    return NoKVTransfers() if connector is None else KVTransfers(connector)
