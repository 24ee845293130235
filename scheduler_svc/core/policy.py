"""Scheduling policies: the order of the waiting queue, the choice of a preemption
victim, and once a step a decision (decision.py): what to shed, defer, and how many
prefill tokens the step and each request may take.

The loop only calls `new_waiting_queue`, `decide`, `observe` and `select_victim`,
so a policy decided elsewhere (a remote ranking service) plugs in as another one.
Built in: fcfs, priority, hrrn (here), slo (slo_policy.py), fair (fair_policy.py),
and remote (fed by policy_client.py)."""

from collections.abc import Mapping
from typing import Protocol

from flagstop.scheduler_svc.core.config import SchedulerConfig
from flagstop.scheduler_svc.core.decision import NO_DECISION, PolicyView, StepDecision
from flagstop.scheduler_svc.core.fair_policy import FairPolicy
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.queues import FCFSQueue, PriorityQueue, RequestQueue
from flagstop.scheduler_svc.core.request import Request
from flagstop.scheduler_svc.core.slo_policy import SLOPolicy


class SchedulingPolicy(Protocol):
    name: str

    def new_waiting_queue(self) -> RequestQueue: ...
    def decide(self, view: PolicyView) -> StepDecision:
        """Once a step, before anything is scheduled: the waiting queue's order and
        the rest of the step's decision (it reads the view, changes none of it)."""
        ...

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The step just planned, its requests by id (a fair policy charges the service
        it gave)."""
        ...

    def select_victim(self, running: list[Request]) -> int:
        """Index in `running` (oldest first) of the request to preempt."""
        ...

    def service_by_tenant(self) -> Mapping[str, float]:
        """Tenant -> the service it got, as the policy counts it (fair: its virtual
        token counter); empty for a policy that counts none."""
        ...


class NoDecisions:
    """The null part of a policy that only orders: no step decision, nothing observed."""

    def decide(self, view: PolicyView) -> StepDecision:
        return NO_DECISION

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        pass

    def service_by_tenant(self) -> Mapping[str, float]:
        return {}


class FCFSPolicy(NoDecisions):
    name = "fcfs"

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def select_victim(self, running: list[Request]) -> int:
        # The newest running request has the least work to lose.
        return len(running) - 1


class PriorityPolicy(NoDecisions):
    name = "priority"

    def new_waiting_queue(self) -> RequestQueue:
        return PriorityQueue()

    def select_victim(self, running: list[Request]) -> int:
        return max(range(len(running)), key=lambda i: running[i].sort_key())


class RankedPolicy(NoDecisions):
    """The `remote` policy's mechanics: the service feeds it the answers of a
    SchedulerPolicy server, or fails it open to FCFS. An answer's order and sheds
    apply once, at the next step; its defers, prefill budget and chunk caps until the
    next answer."""

    name = "remote"

    def __init__(self) -> None:
        self.fresh: StepDecision | None = None
        self.standing = NO_DECISION
        self.preemption_order: dict[str, int] = {}

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def apply(self, decision: StepDecision, preemption_order: list[str]) -> None:
        self.fresh = decision
        self.standing = StepDecision(defer=decision.defer, prefill_budget=decision.prefill_budget,
                                     chunk_caps=decision.chunk_caps)  # fmt: skip
        self.preemption_order = {request_id: i for i, request_id in enumerate(preemption_order)}

    def fail_open(self) -> None:
        self.fresh, self.standing = StepDecision(admission_order=()), NO_DECISION
        self.preemption_order = {}

    def decide(self, view: PolicyView) -> StepDecision:
        fresh, self.fresh = self.fresh, None
        return fresh or self.standing

    def select_victim(self, running: list[Request]) -> int:
        ranked = [i for i, r in enumerate(running) if r.request_id in self.preemption_order]
        if ranked:
            return min(ranked, key=lambda i: self.preemption_order[running[i].request_id])
        return len(running) - 1  # FCFS: the newest


class HRRNPolicy(NoDecisions):
    """Highest response ratio next: (time waited + expected service) / expected
    service, the service its prefill's predicted time. Short prompts go first, and a
    long one's ratio grows as it waits, so none starves (SGLang's HRRN: mean TTFT
    -69 % against FCFS on production traffic)."""

    name = "hrrn"

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def decide(self, view: PolicyView) -> StepDecision:
        cost, now = view.cost, view.now

        def rank(r: Request) -> tuple[float, float, float]:
            num = r.num_tokens - r.num_computed_tokens
            service = max(1e-6, cost.seconds(num, num))
            # Highest ratio first; of equal ratios (nobody waited yet) the shortest.
            return -(now - r.arrival_time + service) / service, service, r.arrival_time

        return StepDecision(admission_order=[r.request_id for r in sorted(view.waiting, key=rank)])

    def select_victim(self, running: list[Request]) -> int:
        return len(running) - 1


POLICIES: dict[str, type] = {
    "fcfs": FCFSPolicy, "priority": PriorityPolicy, "hrrn": HRRNPolicy, "slo": SLOPolicy,
    "fair": FairPolicy, "remote": RankedPolicy,
}  # fmt: skip


def policy_for(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy the config names, with its options."""
    if config.policy == "slo":
        return make_policy("slo", shed=not config.no_shed)
    if config.policy == "fair":
        return make_policy(
            "fair",
            weights=config.tenant_weights,
            reserve=config.fair_reserve,
            hold=config.fair_hold,
        )
    return make_policy(config.policy)


def make_policy(name: str, **options) -> SchedulingPolicy:
    """options: the policy's own (slo: shedding; fair: weights)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name](**options)
