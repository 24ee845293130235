"""A candidate policy in shadow: every step it decides on the same view as the live
policy, its decision compared with the live one and counted, never applied; so that a
policy can be tried on production traffic before it is swapped in.

Agreement: the first HEAD requests of the two admission orders are the same. Its
sheds and defers are counted as what it would have done. The null default, NoShadow,
does nothing: the loop calls it either way."""

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flagstop.scheduler_svc.core.decision import PolicyView, StepDecision
from flagstop.scheduler_svc.core.output import SchedulerOutput
from flagstop.scheduler_svc.core.request import Request

HEAD = 8


class NoShadow:
    name = ""
    num_decisions = num_agreed = num_would_shed = num_would_defer = 0

    def compare(self, view: PolicyView, live: StepDecision) -> None:
        pass

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        pass


@dataclass(slots=True)
class Disagreement:
    time: float
    live_head: list[str]
    shadow_head: list[str]
    would_shed: list[str]


@dataclass(slots=True)
class Shadow:
    policy: object  # a SchedulingPolicy
    num_decisions: int = 0
    num_agreed: int = 0
    num_would_shed: int = 0
    num_would_defer: int = 0
    # The latest disagreements, for the shell to log.
    recent: deque[Disagreement] = field(default_factory=lambda: deque(maxlen=32))

    @property
    def name(self) -> str:
        return self.policy.name  # type: ignore[attr-defined]

    def compare(self, view: PolicyView, live: StepDecision) -> None:
        if not view.waiting:
            return  # nothing to decide
        theirs = self.policy.decide(view)  # type: ignore[attr-defined]
        live_head = _head(live.admission_order, view.waiting)
        shadow_head = _head(theirs.admission_order, view.waiting)
        self.num_decisions += 1
        self.num_would_shed += len(theirs.shed)
        self.num_would_defer += len(theirs.defer)
        if live_head == shadow_head and theirs.shed.keys() == live.shed.keys():
            self.num_agreed += 1
        else:
            self.recent.append(Disagreement(view.now, live_head, shadow_head, list(theirs.shed)))

    def observe(self, plan: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        self.policy.observe(plan, requests)  # type: ignore[attr-defined]


def _head(order: Sequence[str] | None, waiting: Sequence[Request]) -> list[str]:
    """The first HEAD ids of the queue once the order is applied (unranked ids behind,
    by arrival; no order: the queue's own)."""
    if order is None:
        return [r.request_id for _, r in zip(range(HEAD), waiting, strict=False)]
    head = list(order[:HEAD])
    if len(head) < HEAD:
        ranked = set(head)
        rest = sorted((r for r in waiting if r.request_id not in ranked),
                      key=lambda r: r.arrival_time)  # fmt: skip
        head += [r.request_id for r in rest[: HEAD - len(head)]]
    return head


NO_SHADOW = NoShadow()
