"""The policy's part of each step, one component beside the loop: the live policy
and its shadow, the step-cost model they read, and the requests the policy shed.

The loop calls it at three seams: `decide` before it schedules anything (the
waiting queue's order, sheds applied, nonsense left out), `observe` once the plan
is made, and the shell's `measured` once the executor timed the step. Its null is
the policy's: fcfs and priority decide nothing (NO_DECISION) and NO_SHADOW compares
nothing, so the loop calls the same seams whichever policy runs.

Its collaborators are given, not its host: `view` builds what the policy sees (a
live getter: the queues change identity between steps), `refuse` finishes a shed
request in the scheduler's books, `retain` sets a request's retention within the
operator's bounds."""

from collections.abc import Callable, Mapping

from flagstop.scheduler_svc.core.decision import (
    NO_DECISION,
    UNLIMITED,
    PolicyView,
    StepDecision,
)
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.policy import SchedulingPolicy
from flagstop.scheduler_svc.core.queues import RequestQueue
from flagstop.scheduler_svc.core.request import Request, Retention
from flagstop.scheduler_svc.core.shadow import NO_SHADOW, NoShadow, Shadow
from flagstop.scheduler_svc.core.step_cost import StepCostModel


class PolicyStep:
    def __init__(
        self, policy: SchedulingPolicy, view: Callable[[], PolicyView],
        refuse: Callable[[Request], None],
        retain: Callable[[Request, Retention | None], None],
    ) -> None:  # fmt: skip
        self.policy = policy
        self.shadow: NoShadow | Shadow = NO_SHADOW
        # The executor's step time, fitted from the steps it measured (`measured`).
        self.cost = StepCostModel()
        self._view, self._refuse, self._retain = view, refuse, retain
        # Shed since the shell last took them: (request, why).
        self.shed: list[tuple[Request, str]] = []
        self.num_shed = 0
        # Parts of decisions ignored as nonsense (unknown ids, negative caps).
        self.num_ignored_decisions = 0
        # Steps in which the policy held running requests out (fair's hold).
        self.num_held_steps = 0

    def decide(self) -> StepDecision:
        """The policy's decision for this step, its sheds applied, its nonsense left
        out (and counted): it fails open to what the loop would do without it."""
        view = self._view()
        decision = self.policy.decide(view)
        self.shadow.compare(view, decision)
        if decision is NO_DECISION:
            return decision
        if decision.admission_order is not None:
            view.waiting.apply_ranking(decision.admission_order)
        if decision.shed:
            self._shed(decision.shed, view.waiting)
        if decision.retain:
            self._set_retention(decision.retain, view)
        caps = {k: v for k, v in decision.chunk_caps.items() if v >= 0}
        self.num_ignored_decisions += (len(decision.chunk_caps) - len(caps)
                                       + (decision.prefill_budget < 0))  # fmt: skip
        budget = decision.prefill_budget if decision.prefill_budget >= 0 else UNLIMITED
        self.num_held_steps += bool(decision.hold)
        return StepDecision(
            defer=decision.defer, prefill_budget=budget, chunk_caps=caps, hold=decision.hold
        )

    def _shed(self, shed: Mapping[str, str], waiting: RequestQueue) -> None:
        """Waiting requests that streamed nothing yet are shed (refused: the shell tells
        their clients); other ids are ignored, and counted."""
        by_id = {r.request_id: r for r in waiting}
        shed_ids = set()
        for request_id, reason in shed.items():
            request = by_id.get(request_id)
            if request is not None and not request.first_token_time:
                self._refuse(request)
                self.shed.append((request, reason))
                shed_ids.add(request_id)
            else:
                self.num_ignored_decisions += 1
        if shed_ids:
            waiting.remove_all(shed_ids)
            self.num_shed += len(shed_ids)

    def _set_retention(self, retain: Mapping[str, Retention | None], view: PolicyView) -> None:
        """Each named request's retention from now on; unknown ids are ignored, and
        counted."""
        by_id = {r.request_id: r for queue in (view.waiting, view.running) for r in queue}
        for request_id, retention in retain.items():
            if (request := by_id.get(request_id)) is not None:
                self._retain(request, retention)
            else:
                self.num_ignored_decisions += 1

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The step just planned (a fair policy charges the service it gave)."""
        self.policy.observe(plan, requests)
        self.shadow.observe(plan, requests)

    def measured(self, plan: SchedulerOutput, seconds: float) -> None:
        """A step the executor timed: the step-cost model learns from it."""
        self.cost.observe(plan.total_num_scheduled_tokens, plan.num_context_tokens, seconds,
                          plan.num_encoder_tokens)  # fmt: skip

    def take_shed(self) -> list[tuple[Request, str]]:
        """The requests shed since the last call, and why (the shell tells their
        clients to retry: RESOURCE_EXHAUSTED, HTTP 429)."""
        shed, self.shed = self.shed, []
        return shed

    def swap(self, policy: SchedulingPolicy, waiting: RequestQueue) -> RequestQueue:
        """The live policy swapped between steps: the waiting requests move to its
        queue in their current order, none is lost; returns that queue."""
        self.policy, queue = policy, policy.new_waiting_queue()
        for request in waiting:
            queue.add(request)
        return queue

    def set_shadow(self, policy: SchedulingPolicy | None) -> None:
        """Run a candidate policy in shadow (None: none)."""
        self.shadow = NO_SHADOW if policy is None else Shadow(policy)
