"""Conversions between the flagstop.v1 executor messages and the executor's objects:
the step plan (the scheduler core's SchedulerOutput) in, sampled tokens out. The plan's
one encoder is the scheduler's (scheduler_svc/convert.py: step_to_proto)."""

from flagstop.executor.sampling_params import Pooling, SampleOutput, SamplingParams, TokenLogprobs
from flagstop.pooling_tasks import task_name, task_value
from flagstop.scheduler_svc.core.kv_connector import KVConnectorMetadata, KVLoad, KVSend
from flagstop.scheduler_svc.core.media import media_from_proto
from flagstop.scheduler_svc.core.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from flagstop.structured import constraint_from_proto, constraint_to_proto
from flagstop.v1 import executor_pb2, generation_pb2


def sampling_from_proto(p: executor_pb2.SamplingParams) -> SamplingParams:
    """Raises GrammarError for a constraint the router would have refused."""
    structured = p.structured_outputs if p.HasField("structured_outputs") else None
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        min_tokens=p.min_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        grammar=None if structured is None else constraint_from_proto(structured),
        num_prompt_tokens_constrained=0 if structured is None
        else structured.num_prompt_tokens_constrained,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        min_p=p.min_p, logit_bias=tuple(sorted(p.logit_bias.items())),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        pooling=pooling_from_proto(p.pooling) if p.HasField("pooling") else None,
    )  # fmt: skip


def pooling_from_proto(p: generation_pb2.PoolingParams) -> Pooling:
    if not (task := task_name(p.task)):
        raise ValueError(f"pooling task {p.task} is not one this executor runs")
    normalize = p.normalize if p.HasField("normalize") else None
    activation = p.activation if p.HasField("activation") else True
    return Pooling(task, p.dimensions, normalize, activation)


def sampling_to_proto(p: SamplingParams) -> executor_pb2.SamplingParams:
    """The inverse of sampling_from_proto (tests and benchmarks that write plans by
    hand; the scheduler passes the router's message through)."""
    out = executor_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids, seed=p.seed, logprobs=p.logprobs,
        repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, min_p=p.min_p, logit_bias=dict(p.logit_bias),
        prompt_logprobs=p.prompt_logprobs,
    )  # fmt: skip
    if p.grammar is not None:
        out.structured_outputs.CopyFrom(constraint_to_proto(p.grammar))
        out.structured_outputs.num_prompt_tokens_constrained = p.num_prompt_tokens_constrained
    if p.pooling is not None:
        out.pooling.CopyFrom(generation_pb2.PoolingParams(
            task=task_value(p.pooling.task), dimensions=p.pooling.dimensions,
            normalize=p.pooling.normalize, activation=p.pooling.activation))  # fmt: skip
    return out


def plan_from_proto(step: executor_pb2.StepRequest) -> SchedulerOutput:
    p, c = step.plan, step.plan.scheduled_cached_reqs
    req_ids = list(c.req_ids)
    new_block_ids: list[list[int]] = [[] for _ in req_ids]
    if c.new_block_ids:
        flat, start = list(c.new_block_ids), 0
        for i, n in enumerate(c.num_new_blocks):
            new_block_ids[i], start = flat[start : start + n], start + n
    plan = SchedulerOutput(
        step_id=step.step_id,
        scheduled_cached_reqs=CachedRequestData(
            req_ids, list(c.num_computed_tokens), new_block_ids
        ),
        num_scheduled_tokens=dict(zip(req_ids, c.num_scheduled_tokens, strict=True)),
        finished_req_ids=set(p.finished_req_ids),
        preempted_req_ids=set(p.preempted_req_ids),
    )
    if c.num_draft_slots:
        plan.num_draft_slots = {r: n for r, n in zip(req_ids, c.num_draft_slots, strict=True) if n}
    if p.trimmed_req_ids:
        plan.trimmed_blocks = dict(zip(p.trimmed_req_ids, p.trimmed_num_blocks, strict=True))
    for r in p.scheduled_new_reqs:
        plan.scheduled_new_reqs.append(NewRequestData(
            r.req_id, list(r.token_ids), r.num_prompt_tokens,
            sampling_from_proto(r.sampling_params), list(r.block_ids), r.num_computed_tokens,
            r.lora_name, media_from_proto(r.media), r.sampling_params.HasField("pooling"),
        ))  # fmt: skip
        plan.num_scheduled_tokens[r.req_id] = r.num_scheduled_tokens
    plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
    if p.HasField("kv_connector"):
        plan.kv_connector = transfers_from_proto(p.kv_connector)
    plan.poll_kv_transfers = p.poll_kv_transfers
    plan.encoder_inputs, plan.encoder_frees = list(p.encoder_inputs), list(p.encoder_frees)
    return plan


def transfers_from_proto(m: executor_pb2.KVConnectorMetadata) -> KVConnectorMetadata:
    return KVConnectorMetadata(
        loads=[KVLoad(x.req_id, list(x.block_ids), list(x.source_ids), x.endpoint, x.engine_id,
                      x.transfer_id) for x in m.loads],
        save_block_ids=list(m.save_block_ids), save_slots=list(m.save_slots),
        sends=[KVSend(x.transfer_id, list(x.block_ids)) for x in m.sends],
    )  # fmt: skip


def result_to_proto(step_id: int, output: SampleOutput) -> executor_pb2.StepResult:
    transfers = output.transfers
    result = executor_pb2.StepResult(
        step_id=step_id, sampled_token_ids=output.token_ids,
        num_sampled_tokens=output.num_sampled_tokens, num_draft_tokens=output.num_draft_tokens,
        finished_recving=transfers.finished_recving, failed_recving=transfers.failed_recving,
        finished_sending=transfers.finished_sending, pooled=output.pooled,
    )  # fmt: skip
    for token_id, row in zip(output.token_ids, output.logprobs or (), strict=False):
        _fill(result.logprobs.add(token_id=token_id), row)
    for chunk in output.prompt_logprobs or ():
        out = result.prompt_logprobs.add(req_id=chunk.req_id, first_token=chunk.first_token)
        for token_id, row in zip(chunk.token_ids, chunk.entries, strict=True):
            _fill(out.logprobs.add(token_id=token_id), row)
    return result


def _fill(entry: generation_pb2.TokenLogprob, row: TokenLogprobs | None) -> None:
    if row is not None:
        entry.logprob = row[0]
        entry.top.extend(
            generation_pb2.TopLogprob(token_id=t, logprob=lp)
            for t, lp in zip(row[1], row[2], strict=True)
        )
