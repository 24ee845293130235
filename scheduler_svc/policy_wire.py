"""The policy contract (protos/flagstop/v1/policy.proto) <-> the core's view and
decision, written once for both ends: the scheduler's remote-policy client describes
its requests and reads answers; a policy server (examples/policy_server.py) rebuilds
the view, runs a core policy, and answers."""

from flagstop.scheduler_svc.core.decision import UNLIMITED, PolicyView, StepDecision
from flagstop.scheduler_svc.core.objectives import Objectives, ms_of, seconds_of
from flagstop.scheduler_svc.core.request import ALL_TOKENS, Request, Retention, StopParams
from flagstop.scheduler_svc.core.step_cost import StepCostModel
from flagstop.v1 import policy_pb2


def describe(request: Request, out: policy_pb2.PolicyRequest) -> policy_pb2.PolicyRequest:
    out.request_id, out.prompt_tokens = request.request_id, request.num_prompt_tokens
    out.priority, out.arrival_time = request.priority, request.arrival_time
    out.labels.update(request.labels)
    out.computed_tokens = request.num_computed_tokens
    out.output_tokens = request.num_tokens - request.num_prompt_tokens
    out.max_tokens = request.stop.max_tokens or 0
    out.first_token_time = request.first_token_time
    objectives = request.objectives
    out.slo_ttft_ms, out.slo_tpot_ms = ms_of(objectives.ttft_s), ms_of(objectives.tpot_s)
    out.tenant, out.request_class = objectives.tenant, objectives.request_class
    out.session_id = request.session_id
    if (retention := request.retention) is not None:
        retention_to_proto(retention, out.retention)
    return out


def retention_to_proto(retention: Retention | None, out: policy_pb2.PolicyRetention) -> None:
    """None: priority 0; every block it cached: num_tokens 0."""
    if retention is not None:
        out.priority, out.ttl_s = retention.priority, retention.ttl_s
        out.num_tokens = 0 if retention.num_tokens >= ALL_TOKENS else retention.num_tokens


def retention_from_proto(entry: policy_pb2.PolicyRetention) -> Retention | None:
    if entry.priority <= 0:
        return None
    return Retention(entry.priority, entry.ttl_s, entry.num_tokens or ALL_TOKENS)


def describe_cost(cost: StepCostModel, out: policy_pb2.StepCost) -> None:
    out.base_s, out.s_per_token = cost.base_s, cost.s_per_token
    out.s_per_context_token = cost.s_per_context_token


def decision_from_proto(decision: policy_pb2.PolicyDecision) -> StepDecision:
    budget = decision.prefill_budget if decision.HasField("prefill_budget") else UNLIMITED
    retain = {k: retention_from_proto(v) for k, v in decision.retain.items()}
    return StepDecision(list(decision.admission_order), dict(decision.shed),
                        frozenset(decision.defer), budget, dict(decision.chunk_caps),
                        frozenset(decision.hold), retain)  # fmt: skip


def check(decision: policy_pb2.PolicyDecision, query: policy_pb2.PolicyQuery) -> str:
    """Nonsense is refused whole: unknown or repeated ids, negative budgets or caps."""
    waiting = {r.request_id for r in query.waiting}
    running = {r.request_id for r in query.running}
    order, victims = list(decision.admission_order), list(decision.preemption_order)
    if len(set(order)) != len(order) or not set(order) <= waiting:
        return "nonsense"
    if len(set(victims)) != len(victims) or not set(victims) <= running:
        return "nonsense"
    if not (decision.shed.keys() | set(decision.defer)) <= waiting:
        return "nonsense"
    if not set(decision.hold) <= running:
        return "nonsense"
    caps = decision.chunk_caps
    if not caps.keys() <= waiting | running or any(v < 0 for v in caps.values()):
        return "nonsense"
    retain = decision.retain
    if not retain.keys() <= waiting | running or any(
        not 0 <= r.priority <= 100 or not r.ttl_s >= 0 or r.num_tokens < 0 for r in retain.values()
    ):
        return "nonsense"
    return "nonsense" if decision.prefill_budget < 0 else ""


# -- a policy server's side ----------------------------------------------------------


def request_from_proto(entry: policy_pb2.PolicyRequest) -> Request:
    """A stand-in request with the described counts (its tokens are placeholders: a
    policy reads counts, never tokens)."""
    request = Request(
        entry.request_id, "", [0] * entry.prompt_tokens, StopParams(entry.max_tokens or None),
        priority=entry.priority, arrival_time=entry.arrival_time, labels=dict(entry.labels),
        objectives=Objectives(seconds_of(entry.slo_ttft_ms), seconds_of(entry.slo_tpot_ms),
                              entry.tenant, entry.request_class),
    )  # fmt: skip
    request.all_token_ids += [0] * entry.output_tokens
    request.num_computed_tokens = entry.computed_tokens
    request.first_token_time = entry.first_token_time
    request.session_id = entry.session_id
    request.retention = retention_from_proto(entry.retention)
    return request


def view_from_proto(query: policy_pb2.PolicyQuery) -> PolicyView:
    cost = StepCostModel(query.step_cost.base_s, query.step_cost.s_per_token,
                         query.step_cost.s_per_context_token)  # fmt: skip
    hits = {r.request_id: r.prefix_hit_blocks * query.block_size for r in query.waiting}
    return PolicyView(
        query.now, [request_from_proto(r) for r in query.waiting],
        [request_from_proto(r) for r in query.running], query.num_free_blocks,
        query.num_total_blocks, query.block_size, query.token_budget, cost,
        lambda r: hits.get(r.request_id, 0), query.max_num_seqs,
    )  # fmt: skip


def decision_to_proto(
    decision: StepDecision, preemption_order: list[str]
) -> policy_pb2.PolicyDecision:
    out = policy_pb2.PolicyDecision(admission_order=decision.admission_order or (),
                                    preemption_order=preemption_order, shed=decision.shed,
                                    defer=sorted(decision.defer),
                                    chunk_caps=decision.chunk_caps,
                                    hold=sorted(decision.hold))  # fmt: skip
    if decision.prefill_budget != UNLIMITED:
        out.prefill_budget = decision.prefill_budget
    for request_id, retention in decision.retain.items():
        retention_to_proto(retention, out.retain[request_id])
    return out
