"""What the scheduler reports of itself: one snapshot, its fields named as GetStats
answers them (the shell copies them by name), for GetStats, the metrics and the load
each router hears."""

from dataclasses import asdict, dataclass
from typing import Protocol

from flagstop.scheduler_svc.core.encoder_cache import EncoderCache, NoEncoder
from flagstop.scheduler_svc.core.kv_cache_manager import KVCacheManager
from flagstop.scheduler_svc.core.kv_transfers import KVTransfers
from flagstop.scheduler_svc.core.policy_step import PolicyStep
from flagstop.scheduler_svc.core.queues import RequestQueue
from flagstop.scheduler_svc.core.request import Request


class Core(Protocol):
    """What the figures read of the scheduler (scheduler.py), below it."""

    step_id: int
    num_preemptions: int
    running: list[Request]
    waiting: RequestQueue
    kv: KVCacheManager
    transfers: KVTransfers
    policy_step: PolicyStep
    encoder: EncoderCache | NoEncoder


@dataclass(slots=True)
class SchedulerStats:
    step_id: int
    num_running: int
    num_waiting: int  # in this scheduler's queues (the routers' queued are the shell's)
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_loading: int
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    num_host_cached_blocks: int
    num_kv_leases: int
    policy: str
    num_shed: int
    num_ignored_decisions: int
    shadow_policy: str
    shadow_decisions: int
    shadow_agreed: int
    shadow_would_shed: int
    num_held_steps: int
    encoder_cache_used_tokens: int
    encoder_cache_size: int
    num_encoded_images: int
    num_encoded_tokens: int
    encoder_cache_hits: int
    num_retained_blocks: int
    num_retentions: int
    retention_hits: int
    retained_evictions: int
    retention_expiries: int
    num_cached_blocks: int

    def as_fields(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class LoadFigures:
    """What a replica's load report says of its core, each step (cheaper than the
    stats: no counters)."""

    num_running: int
    kv_cache_usage: float
    num_host_cached_blocks: int
    external_prefix_cache_hits: int
    running_loras: list[str]  # the adapters of the running requests, sorted
    waiting_loras: list[str]  # of the waiting ones
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of those, found


def make_load(scheduler: Core) -> LoadFigures:
    transfers = scheduler.transfers
    waiting = (*scheduler.waiting, *transfers.loaded)
    return LoadFigures(
        num_running=len(scheduler.running), kv_cache_usage=scheduler.kv.pool.usage(),
        num_host_cached_blocks=transfers.num_host_cached_blocks,
        external_prefix_cache_hits=transfers.external_stats.num_hits,
        running_loras=sorted({r.lora_name for r in scheduler.running if r.lora_name}),
        waiting_loras=sorted({r.lora_name for r in waiting if r.lora_name}),
        prefix_cache_queries=scheduler.kv.prefix_stats.num_queries,
        prefix_cache_hits=scheduler.kv.prefix_stats.num_hits,
    )  # fmt: skip


def make_stats(scheduler: Core) -> SchedulerStats:
    pool, transfers, decisions = scheduler.kv.pool, scheduler.transfers, scheduler.policy_step
    shadow = decisions.shadow
    prefix, external = scheduler.kv.prefix_stats, transfers.external_stats
    encoder = scheduler.encoder
    retention = pool.retention_stats
    return SchedulerStats(
        step_id=scheduler.step_id, num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(transfers.loaded),
        num_free_blocks=pool.num_free_blocks, num_total_blocks=pool.num_usable_blocks,
        kv_cache_usage=pool.usage(), prefix_cache_queries=prefix.num_queries,
        prefix_cache_hits=prefix.num_hits, num_preemptions=scheduler.num_preemptions,
        num_loading=len(transfers.loading),
        external_prefix_cache_queries=external.num_queries,
        external_prefix_cache_hits=external.num_hits,
        num_host_cached_blocks=transfers.num_host_cached_blocks,
        num_kv_leases=len(transfers.leased), policy=decisions.policy.name,
        num_shed=decisions.num_shed, num_ignored_decisions=decisions.num_ignored_decisions,
        shadow_policy=shadow.name, shadow_decisions=shadow.num_decisions,
        shadow_agreed=shadow.num_agreed, shadow_would_shed=shadow.num_would_shed,
        num_held_steps=decisions.num_held_steps,
        encoder_cache_used_tokens=encoder.num_used_tokens, encoder_cache_size=encoder.capacity,
        num_encoded_images=encoder.stats.num_encoded_items,
        num_encoded_tokens=encoder.stats.num_encoded_tokens,
        encoder_cache_hits=encoder.stats.num_cache_hits,
        num_retained_blocks=pool.retained.num_free_blocks,
        num_retentions=retention.num_retained, retention_hits=retention.num_hits,
        retained_evictions=retention.num_evicted, retention_expiries=retention.num_expired,
        num_cached_blocks=len(pool.cached_blocks),
    )  # fmt: skip
