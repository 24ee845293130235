"""Conversions between the scheduler core's objects and the flagstop.v1 messages."""

import itertools

from flagstop.scheduler_svc.core.kv_connector import (
    NO_TRANSFERS,
    KVConnectorMetadata,
    KVHandoff,
    KVTransferResult,
)
from flagstop.scheduler_svc.core.kv_groups import KVLayer
from flagstop.scheduler_svc.core.media import media_from_proto, media_to_proto
from flagstop.scheduler_svc.core.objectives import NO_OBJECTIVES, Objectives, seconds_of
from flagstop.scheduler_svc.core.output import SchedulerOutput, StepOutcome
from flagstop.scheduler_svc.core.request import Request, Retention, StopParams
from flagstop.v1 import executor_pb2, generation_pb2, scheduler_pb2


def kv_layers_from_proto(model: generation_pb2.ModelInfo) -> list[KVLayer]:
    """The executor's layers as the core's groups are built from (ValueError names a
    bad one)."""
    return [KVLayer(x.attention, x.sliding_window, x.sinks, x.kv_bytes_per_token)
            for x in model.kv_layers]  # fmt: skip


def layers_to_proto(layers: list[KVLayer]) -> list[generation_pb2.KVCacheLayer]:
    return [generation_pb2.KVCacheLayer(attention=x.attention, sliding_window=x.sliding_window,
                                        sinks=x.sinks, kv_bytes_per_token=x.kv_bytes_per_token)
            for x in layers]  # fmt: skip


def request_from_proto(
    add: scheduler_pb2.AddRequest,
    owner: str,
    eos_token_ids: frozenset[int],
    lora_id: str = "",
    fallback: Objectives = NO_OBJECTIVES,
) -> Request:
    """lora_id: the identity of the adapter the replica holds under add.lora_name;
    fallback: the targets of a request that states none."""
    return Request(
        request_id=add.request_id,
        owner=owner,
        prompt_token_ids=list(add.prompt_token_ids),
        stop=StopParams(
            max_tokens=add.max_tokens if add.HasField("max_tokens") else None,
            min_tokens=add.min_tokens,
            ignore_eos=add.ignore_eos,
            stop_token_ids=frozenset(add.stop_token_ids),
        ),
        eos_token_ids=eos_token_ids,
        priority=add.priority,
        arrival_time=add.arrival_time,
        sampling_params=add.sampling,
        labels=dict(add.labels),
        skip_prefix_cache=add.sampling.HasField("prompt_logprobs"),
        num_speculative_tokens=add.num_speculative_tokens
        if add.HasField("num_speculative_tokens") else None,
        lora_name=add.lora_name,
        lora_id=lora_id,
        objectives=objectives_from_proto(add, fallback),
        do_remote_decode=add.kv_transfer.do_remote_decode,
        remote_prefill=handoff_from_proto(add.kv_transfer)
        if add.kv_transfer.remote_endpoint else None,
        media=media_from_proto(add.media),
        media_data=add.media_data,
        retention=retention_from_proto(add),
        cache_salt=add.cache_salt,
        session_id=add.session_id,
        pools=add.sampling.HasField("pooling"),
    )  # fmt: skip


def retention_from_proto(add: scheduler_pb2.AddRequest) -> Retention | None:
    """Its prompt's retention (num_tokens 0: the whole prompt), or None."""
    if not add.HasField("retention") or add.retention.priority <= 0:
        return None
    r = add.retention
    num_tokens = r.num_tokens or len(add.prompt_token_ids)
    return Retention(min(r.priority, 100), max(0.0, r.ttl_s), num_tokens)


def objectives_from_proto(add: scheduler_pb2.AddRequest, fallback: Objectives) -> Objectives:
    """fallback: the targets of a request that states none (the router resolved them
    already; --default-ttft-ms/--default-tpot-ms serve clients that bypass it)."""
    if not (add.slo_ttft_ms or add.slo_tpot_ms or add.tenant or add.request_class):
        return fallback
    objectives = Objectives(seconds_of(add.slo_ttft_ms), seconds_of(add.slo_tpot_ms),
                            add.tenant, add.request_class)  # fmt: skip
    return objectives.with_defaults(fallback)


def handoff_from_proto(p: scheduler_pb2.KVTransferParams) -> KVHandoff:
    return KVHandoff(p.transfer_id, p.remote_endpoint, p.remote_engine_id,
                     tuple(p.remote_block_ids), p.num_remote_tokens)  # fmt: skip


def handoff_to_proto(handoff: KVHandoff) -> scheduler_pb2.KVTransferParams:
    return scheduler_pb2.KVTransferParams(
        remote_endpoint=handoff.endpoint, remote_engine_id=handoff.engine_id,
        transfer_id=handoff.transfer_id, remote_block_ids=handoff.block_ids,
        num_remote_tokens=handoff.num_tokens,
    )  # fmt: skip


def step_to_proto(plan: SchedulerOutput) -> executor_pb2.StepRequest:
    step = executor_pb2.StepRequest(step_id=plan.step_id)
    out = step.plan
    out.finished_req_ids.extend(plan.finished_req_ids)
    out.preempted_req_ids.extend(plan.preempted_req_ids)
    c, cached = plan.scheduled_cached_reqs, out.scheduled_cached_reqs
    cached.req_ids.extend(c.req_ids)
    cached.num_computed_tokens.extend(c.num_computed_tokens)
    num_scheduled = plan.num_scheduled_tokens
    cached.num_scheduled_tokens.extend([num_scheduled[r] for r in c.req_ids])
    if plan.num_draft_slots:
        drafts = plan.num_draft_slots
        cached.num_draft_slots.extend([drafts.get(r, 0) for r in c.req_ids])
    if plan.trimmed_blocks:
        out.trimmed_req_ids.extend(plan.trimmed_blocks)
        out.trimmed_num_blocks.extend(plan.trimmed_blocks.values())
    if any(c.new_block_ids):
        cached.num_new_blocks.extend([len(b) for b in c.new_block_ids])
        cached.new_block_ids.extend(itertools.chain.from_iterable(c.new_block_ids))
    if plan.kv_connector:
        transfers_to_proto(plan.kv_connector, out.kv_connector)
    out.poll_kv_transfers = plan.poll_kv_transfers
    out.encoder_inputs.extend(plan.encoder_inputs)
    out.encoder_frees.extend(plan.encoder_frees)
    admitted = {d.req_id: d for d in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs)}
    # Batch order: running first, then admitted in admission order, as the core
    # scheduled them (the order in which sampled tokens come back).
    for req_id in itertools.islice(num_scheduled, len(c.req_ids), None):
        d = admitted[req_id]
        new = out.scheduled_new_reqs.add(
            req_id=d.req_id, token_ids=d.token_ids, num_prompt_tokens=d.num_prompt_tokens,
            sampling_params=d.sampling_params, block_ids=d.block_ids,
            num_computed_tokens=d.num_computed_tokens, num_scheduled_tokens=num_scheduled[req_id],
            lora_name=d.lora_name,
        )  # fmt: skip
        media_to_proto(d.media, new.media)
    return step


def transfers_to_proto(meta: KVConnectorMetadata, out: executor_pb2.KVConnectorMetadata) -> None:
    for load in meta.loads:
        out.loads.add(
            req_id=load.req_id, block_ids=load.block_ids, source_ids=load.source_ids,
            endpoint=load.endpoint, engine_id=load.engine_id, transfer_id=load.transfer_id,
        )  # fmt: skip
    out.save_block_ids.extend(meta.save_block_ids)
    out.save_slots.extend(meta.save_slots)
    for send in meta.sends:
        out.sends.add(transfer_id=send.transfer_id, block_ids=send.block_ids)


def outcome_from_result(result: executor_pb2.StepResult) -> StepOutcome:
    transfers = NO_TRANSFERS
    if result.finished_recving or result.failed_recving or result.finished_sending:
        transfers = KVTransferResult(result.finished_recving, result.failed_recving,
                                     result.finished_sending)  # fmt: skip
    return StepOutcome(result.sampled_token_ids, result.num_sampled_tokens,
                       result.num_draft_tokens, transfers, result.pooled)  # fmt: skip
