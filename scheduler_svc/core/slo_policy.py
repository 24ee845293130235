"""`slo`: each step against each request's deadlines.

- Order: least slack first, slack = TTFT deadline - now - the request's own predicted
  prefill time (EDF that knows a long prompt needs longer).
- Prefill budget: the most prefill tokens a step may take and still end within the
  tightest TPOT target of the running requests, by the fitted step-cost model (the
  knob that bounds the decodes' TPOT while long prompts prefill); never below one
  block, so prompts always progress.
- Shedding (on by default): a waiting request the model predicts will miss its TTFT
  even if admitted now, behind the requests ahead of it in the order, is refused with
  the prediction (the client retries elsewhere or later) instead of being served late
  at the others' expense. A request that already streamed tokens is never shed.
- Victims: the running request with the least work to recompute.
- Retention: a session's turn is kept for its next, a batch request's prefix is not
  (session_retention.py).

A request without a target (after the router's --slo-defaults and the scheduler's
--default-ttft-ms fallback, core/objectives.py) has no deadline: ordered behind those
with one, by arrival."""

import math
from collections.abc import Callable, Mapping

from flagstop.scheduler_svc.core.decision import UNLIMITED, PolicyView, StepDecision
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.queues import FCFSQueue, RequestQueue
from flagstop.scheduler_svc.core.request import Request
from flagstop.scheduler_svc.core.session_retention import session_retention


class SLOPolicy:
    name = "slo"

    def __init__(self, shed: bool = True) -> None:
        self.shed = shed
        # The last decision's predicted first-token time of each request it kept.
        self.predicted: dict[str, float] = {}
        self.hits: dict[str, int | None] = {}

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def decide(self, view: PolicyView) -> StepDecision:
        prefill_budget = self._prefill_budget(view)
        prefill_s = self._prefill_time(view, prefill_budget)
        remaining = self._remaining(view)
        now, deadline = view.now, self._deadline
        shed, order, self.predicted = {}, [], {}
        # Prefill still under way among the running goes before any newcomer.
        ahead = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in view.running)
        by_slack = sorted(
            view.waiting,
            key=lambda r: (
                deadline(r) - now - prefill_s(remaining[r.request_id]),
                r.arrival_time,
                r.request_id,
            ),
        )
        for request in by_slack:
            request_id = request.request_id
            predicted = now + prefill_s(ahead + remaining[request_id])
            if self.shed and predicted > deadline(request) and not request.first_token_time:
                shed[request_id] = _miss(request, predicted, deadline(request))
                continue
            ahead += remaining[request_id]
            order.append(request_id)
            self.predicted[request_id] = predicted
        return StepDecision(admission_order=order, shed=shed, prefill_budget=prefill_budget,
                            retain=session_retention(view.waiting))  # fmt: skip

    @staticmethod
    def _prefill_time(view: PolicyView, prefill_budget: int) -> Callable[[int], float]:
        """Seconds to prefill n tokens in steps of the budget beside the decodes."""
        tokens_a_step = max(1, min(prefill_budget, view.token_budget))
        step_s = view.cost.seconds(tokens_a_step + len(view.running),
                                   _context(view) + tokens_a_step)  # fmt: skip
        return lambda n: math.ceil(n / tokens_a_step) * step_s

    def _remaining(self, view: PolicyView) -> dict[str, int]:
        """Each waiting request's tokens to prefill past its prefix hits, the hits
        looked up once (a long prompt's blocks are many; the cache changes slowly
        against a deadline)."""
        hits = {r.request_id: self.hits.get(r.request_id) for r in view.waiting}
        remaining = {}
        for r in view.waiting:
            if (num_hit := hits[r.request_id]) is None:
                num_hit = hits[r.request_id] = view.prefix_hit_tokens(r)
            remaining[r.request_id] = max(1, r.num_tokens - max(r.num_computed_tokens, num_hit))
        self.hits = hits
        return remaining

    def _deadline(self, request: Request) -> float:
        ttft = request.objectives.ttft_s
        return math.inf if ttft is None else request.arrival_time + ttft

    def _prefill_budget(self, view: PolicyView) -> int:
        targets = [t for r in view.running if (t := r.objectives.tpot_s) is not None]
        if not targets:
            return UNLIMITED
        # The decodes, and one request more: the prefill's own.
        num_decodes = len(view.running)
        within = view.cost.tokens_within(min(targets), _context(view)) - num_decodes
        return max(view.block_size, within)

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        pass

    def service_by_tenant(self) -> Mapping[str, float]:
        return {}

    def select_victim(self, running: list[Request]) -> int:
        # Least recompute; of equals, the newest (the FCFS victim).
        return min(range(len(running)), key=lambda i: (running[i].num_computed_tokens, -i))


def _context(view: PolicyView) -> int:
    """The running requests' context, a step's floor."""
    return sum(r.num_computed_tokens for r in view.running)


def _miss(request: Request, predicted: float, deadline: float) -> str:
    ttft_ms = (deadline - request.arrival_time) * 1e3
    return (f"the scheduler predicts a time to first token of "
            f"{(predicted - request.arrival_time) * 1e3:.0f} ms against its target of "
            f"{ttft_ms:.0f} ms under the current load: retry later or elsewhere")  # fmt: skip
