"""`fair`: tenant shares by the Virtual Token Counter (Sheng et al., "Fairness in
Serving Large Language Models", OSDI'24), weighted, with a reserve for the tenants
below their share.

Counters. Each tenant has a counter of the service it got, prefill tokens weighted
prefill_weight and output tokens decode_weight, divided by the tenant's weight
(`--tenant-weights`: the paper's weighted VTC). The waiting queue is ordered by
always taking the next request of the tenant with the lowest counter; of equal
counters, the tenant holding fewer seats. A tenant that comes back from idle is lifted
to the lowest counter of the tenants still backlogged, so that idling banks no credit.
Between two backlogged tenants the gap of counters stays within the paper's bound,
2 x (prefill_weight x longest prompt + decode_weight x longest output), plus what
one step's chunking can add (tests/test_slo_policies.py holds it every step).

The reserve. Counters order who is admitted next, but under overload the heavy tenant
holds every seat (or every KV block) by the time a light request arrives, and the
light one waits for a heavy one to finish whatever its counter: VTC alone kept the
light tenant's TTFT at 3.7x its solo run on the Azure replay at 1.5x capacity
(bench/slo_bench.py), most of it spent waiting for a seat. So while more than one
tenant is active (running or waiting), a tenant at or above its weighted share of
the engine's dominant resource (seats or KV blocks, whichever it holds more of: the
dominant share of DRF, Ghodsi et al., NSDI'11) is not admitted into the last
`reserve` of either: a request of a tenant below its share finds a seat and blocks
at once. It costs the heavy tenant at most that fraction of the engine, and only
while someone else is there; alone, a tenant has the whole engine.

The hold. A seat found at once still leaves the light request's first chunk in a
step as long as the heavy batch makes it (on the Azure replay a light prefill alone
takes 15 ms on average; beside the heavy batch, that plus its decodes and chunks).
So when the request first in line is new and its tenant below its share, the running
requests of the tenants at or above theirs sit that one step out (they keep their KV
blocks; nothing is recomputed) and their waiting ones are deferred: its first chunk
runs with the other under-share tenants' work alone. At most `hold` of the steps (a
token bucket, bursts of HOLD_BURST): 1/20 cost 0.6 % of output throughput on the
Azure replay (bench/slo_bench.py; the floor a heavy batch sets: docs/policy.md).

The order and the admissions only: the loop admits whatever fits of the rest, so
the policy never idles the engine while work it may admit waits.

Retention. A session's turn is kept for its next, at a priority in its tenant's
weight (the pool's bound demotes a lighter tenant's first); a batch request's prefix
is not (session_retention.py).

The tenant: the request's objectives' tenant, else its `tenant` label."""

import heapq
from collections import Counter
from collections.abc import Mapping

from flagstop.scheduler_svc.core.config import FAIR_HOLD, FAIR_RESERVE
from flagstop.scheduler_svc.core.decision import PolicyView, StepDecision
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.queues import FCFSQueue, RequestQueue
from flagstop.scheduler_svc.core.request import Request
from flagstop.scheduler_svc.core.session_retention import SESSION_PRIORITY, session_retention

HOLD_BURST = 2.0  # held steps the bucket saves up (two light requests in a row)


def tenant_of(request: Request) -> str:
    return request.objectives.tenant or request.labels.get("tenant", "")


class FairPolicy:
    name = "fair"

    def __init__(
        self, prefill_weight: float = 1.0, decode_weight: float = 2.0,
        weights: Mapping[str, float] | None = None, reserve: float = FAIR_RESERVE,
        hold: float = FAIR_HOLD,
    ) -> None:  # fmt: skip
        self.prefill_weight, self.decode_weight = prefill_weight, decode_weight
        # Tenant -> its weight (its share is its weight over the active tenants'); 1 if
        # unnamed.
        self.weights = dict(weights or {})
        self.reserve, self.hold_rate = reserve, hold
        self.counters: dict[str, float] = {}
        self.backlogged: set[str] = set()
        # Held steps the bucket allows now.
        self.hold_credit = 0.0

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def decide(self, view: PolicyView) -> StepDecision:
        by_tenant: dict[str, list[Request]] = {}
        for request in sorted(view.waiting, key=lambda r: r.arrival_time):
            by_tenant.setdefault(tenant_of(request), []).append(request)
        self._lift(set(by_tenant))
        seats = Counter(tenant_of(r) for r in view.running)
        order = self._order(by_tenant, seats)
        admission_order = [r.request_id for r in order]
        retain = session_retention(view.waiting, self._session_priority)
        tenants = seats.keys() | by_tenant.keys()
        if len(tenants) < 2:
            return StepDecision(admission_order, retain=retain)
        blocks = self._blocks_by_tenant(view)
        under = self._under_share(view, tenants, seats, blocks)
        defer = self._held_back(view, order, seats, blocks) if self.reserve else frozenset()
        if not self._takes_a_hold(order, under):
            return StepDecision(admission_order, defer=defer, retain=retain)
        hold = frozenset(r.request_id for r in view.running if tenant_of(r) not in under)
        defer |= {r.request_id for r in order if tenant_of(r) not in under}
        return StepDecision(admission_order, defer=defer, hold=hold, retain=retain)

    def _session_priority(self, request: Request) -> int:
        """A session's retention priority in its tenant's weight: the heaviest tenant's
        at SESSION_PRIORITY, a lighter one's lower (the pool's bound demotes the lowest
        first), never below 1."""
        heaviest = max([1.0, *self.weights.values()])
        return max(1, round(SESSION_PRIORITY * self.weight(tenant_of(request)) / heaviest))

    def _order(self, by_tenant: dict[str, list[Request]], seats: Counter) -> list[Request]:
        counters = self.counters
        heap = [(counters[t], seats[t], t) for t in by_tenant]
        heapq.heapify(heap)
        order, next_index = [], dict.fromkeys(by_tenant, 0)
        while heap:
            counter, held, tenant = heapq.heappop(heap)
            i = next_index[tenant]
            request = by_tenant[tenant][i]
            order.append(request)
            if i + 1 < len(by_tenant[tenant]):
                next_index[tenant] = i + 1
                num_new = request.num_tokens - request.num_computed_tokens
                cost = self.prefill_weight * num_new / self.weight(tenant)
                heapq.heappush(heap, (counter + cost, held, tenant))
        return order

    def _takes_a_hold(self, order: list[Request], under: set[str]) -> bool:
        """Whether this step is held for the request first in line: new, of a tenant
        below its share, and the bucket allows it."""
        self.hold_credit = min(HOLD_BURST, self.hold_credit + self.hold_rate)
        head = order[0] if order else None
        if head is None or head.num_computed_tokens or tenant_of(head) not in under:
            return False
        if self.hold_credit < 1:
            return False
        self.hold_credit -= 1
        return True

    def _blocks_by_tenant(self, view: PolicyView) -> Counter:
        blocks: Counter = Counter()
        for request in view.running:
            blocks[tenant_of(request)] += -(-request.num_tokens // view.block_size)
        return blocks

    def _under_share(
        self, view: PolicyView, tenants: set[str], seats: Counter, blocks: Counter
    ) -> set[str]:
        """The tenants whose dominant share (of seats or KV blocks) is below their
        weighted share."""
        total_weight = sum(self.weight(t) for t in tenants)
        num_blocks = max(1, view.num_total_blocks)
        return {t for t in tenants
                if max(seats[t] / view.max_num_seqs, blocks[t] / num_blocks)
                < self.weight(t) / total_weight}  # fmt: skip

    def _held_back(
        self, view: PolicyView, order: list[Request], seats: Counter, blocks: Counter
    ) -> frozenset:
        """The requests that would take a tenant above its weighted dominant share (of
        seats or KV blocks, whichever it holds more of) and into the reserve, as the
        loop would admit them in this order (what the requests ahead take counts)."""
        seats, blocks = seats.copy(), blocks.copy()
        weights = {t: self.weight(t) for t in seats.keys() | {tenant_of(r) for r in order}}
        total_weight = sum(weights.values())
        seats_left = view.max_num_seqs - len(view.running) - int(self.reserve * view.max_num_seqs)
        blocks_left = view.num_free_blocks - int(self.reserve * view.num_total_blocks)
        held = []
        for request in order:
            tenant, num_blocks = tenant_of(request), -(-request.num_tokens // view.block_size)
            share = max((seats[tenant] + 1) / view.max_num_seqs,
                        (blocks[tenant] + num_blocks) / max(1, view.num_total_blocks))  # fmt: skip
            if share > weights[tenant] / total_weight and (
                seats_left < 1 or blocks_left < num_blocks
            ):
                held.append(request.request_id)
                continue
            seats_left, blocks_left = seats_left - 1, blocks_left - num_blocks
            seats[tenant] += 1
            blocks[tenant] += num_blocks
        return frozenset(held)

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
        positions at the prefill weight, the rest at the output weight, over the
        tenant's weight."""
        num_prefill = max(0, min(end, request.num_prompt_tokens) - start)
        tenant = tenant_of(request)
        service = self.prefill_weight * num_prefill + self.decode_weight * (
            end - start - num_prefill
        )
        self.counters[tenant] = self.counters.get(tenant, 0.0) + service / self.weight(tenant)

    def service_by_tenant(self) -> Mapping[str, float]:
        return self.counters

    def select_victim(self, running: list[Request]) -> int:
        # The most served tenant's newest request.
        counters = self.counters
        return max(range(len(running)),
                   key=lambda i: (counters.get(tenant_of(running[i]), 0.0), i))  # fmt: skip
