"""`fair`: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24). Each tenant has a counter of the service it got, prefill
tokens weighted prefill_weight and output tokens decode_weight; the waiting queue is
ordered by always taking the next request of the tenant with the lowest counter.
A tenant that comes back from idle is lifted to the lowest counter of the tenants
still backlogged, so that idling banks no credit. The order only: the loop admits
whatever fits, so it never idles while work waits (work-conserving), and between
two backlogged tenants the gap of counters stays within the paper's bound,
2 x (prefill_weight x longest prompt + decode_weight x longest output), plus what
one step's chunking can add (tests/test_slo_policies.py holds it every step).

The tenant: the request's objectives' tenant, else its `tenant` label."""

import heapq
from collections.abc import Mapping

from flagstop.scheduler_svc.core.decision import PolicyView, StepDecision
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.queues import FCFSQueue, RequestQueue
from flagstop.scheduler_svc.core.request import Request


def tenant_of(request: Request) -> str:
    return request.objectives.tenant or request.labels.get("tenant", "")


class FairPolicy:
    name = "fair"

    def __init__(self, prefill_weight: float = 1.0, decode_weight: float = 2.0) -> None:
        self.prefill_weight, self.decode_weight = prefill_weight, decode_weight
        self.counters: dict[str, float] = {}
        self.backlogged: set[str] = set()

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def decide(self, view: PolicyView) -> StepDecision:
        by_tenant: dict[str, list[Request]] = {}
        for request in sorted(view.waiting, key=lambda r: r.arrival_time):
            by_tenant.setdefault(tenant_of(request), []).append(request)
        self._lift(set(by_tenant))
        counters = self.counters
        heap = [(counters[t], t) for t in by_tenant]
        heapq.heapify(heap)
        order, next_index = [], dict.fromkeys(by_tenant, 0)
        while heap:
            counter, tenant = heapq.heappop(heap)
            i = next_index[tenant]
            request = by_tenant[tenant][i]
            order.append(request.request_id)
            if i + 1 < len(by_tenant[tenant]):
                next_index[tenant] = i + 1
                cost = self.prefill_weight * (request.num_tokens - request.num_computed_tokens)
                heapq.heappush(heap, (counter + cost, tenant))
        return StepDecision(admission_order=order)

    def _lift(self, backlogged: set[str]) -> None:
        """Tenants backlogged again (requests waiting, as in the paper) start from the
        lowest counter of those that stayed backlogged (VTC's counter lift)."""
        stayed = [self.counters[t] for t in backlogged & self.backlogged]
        floor = min(stayed) if stayed else max(self.counters.values(), default=0.0)
        for tenant in backlogged - self.backlogged:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.backlogged = backlogged

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        for request_id, num in plan.num_scheduled_tokens.items():
            request = requests[request_id]
            self.charge(request, request.num_computed_tokens - num, request.num_computed_tokens)

    def charge(self, request: Request, start: int, end: int) -> None:
        """The service of computing the request's positions start..end: prompt
        positions at the prefill weight, the rest at the output weight."""
        num_prefill = max(0, min(end, request.num_prompt_tokens) - start)
        tenant = tenant_of(request)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + (
            self.prefill_weight * num_prefill + self.decode_weight * (end - start - num_prefill)
        )

    def select_victim(self, running: list[Request]) -> int:
        # The most served tenant's newest request.
        counters = self.counters
        return max(range(len(running)),
                   key=lambda i: (counters.get(tenant_of(running[i]), 0.0), i))  # fmt: skip
