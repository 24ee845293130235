"""Scheduling policies: the order of the waiting queue and the choice of a victim.

The scheduling loop only calls the RequestQueue methods and `select_victim`, so a
policy decided elsewhere (a remote ranking service) plugs in as another queue.
"""

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from flagstop.scheduler_svc.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove_all(self, request_ids: set[str]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class SchedulingPolicy(Protocol):
    name: str

    def new_waiting_queue(self) -> RequestQueue: ...
    def select_victim(self, running: list[Request]) -> int:
        """Index in `running` (oldest first) of the request to preempt."""
        ...


class FCFSQueue:
    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        # A preempted request goes back to the head: it was admitted before anyone
        # still waiting, and FCFS must not let later arrivals overtake it.
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_all(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival_time, request_id) first."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(), request))

    def prepend(self, request: Request) -> None:
        # Its key already places it: a preempted request keeps its priority and arrival.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_all(self, request_ids: set[str]) -> None:
        self._heap = [e for e in self._heap if e[1].request_id not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap))


class FCFSPolicy:
    name = "fcfs"

    def new_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def select_victim(self, running: list[Request]) -> int:
        # The newest running request has the least work to lose.
        return len(running) - 1


class PriorityPolicy:
    name = "priority"

    def new_waiting_queue(self) -> RequestQueue:
        return PriorityQueue()

    def select_victim(self, running: list[Request]) -> int:
        return max(range(len(running)), key=lambda i: running[i].sort_key())


class RankedQueue(FCFSQueue):
    """Ordered by the freshest ranking decided elsewhere (a remote policy): ranked ids
    first in the given order, the rest behind in arrival order. Without a ranking, or
    after the ranker failed, it is plain FCFS (new arrivals go behind everything ranked,
    until the next ranking places them)."""

    __slots__ = ()

    def apply_ranking(self, order: list[str]) -> None:
        rank = {request_id: i for i, request_id in enumerate(order)}
        unranked = len(rank)
        self._queue = deque(
            sorted(self._queue, key=lambda r: (rank.get(r.request_id, unranked), r.arrival_time))
        )

    def clear_ranking(self) -> None:
        self._queue = deque(sorted(self._queue, key=lambda r: r.arrival_time))


class RankedPolicy:
    """The `remote` policy's mechanics: the service feeds it the rankings of a
    SchedulerPolicy server, or fails it open to FCFS."""

    name = "remote"

    def __init__(self) -> None:
        self.queue = RankedQueue()
        self.preemption_order: dict[str, int] = {}

    def new_waiting_queue(self) -> RequestQueue:
        return self.queue

    def apply(self, admission_order: list[str], preemption_order: list[str]) -> None:
        self.queue.apply_ranking(admission_order)
        self.preemption_order = {request_id: i for i, request_id in enumerate(preemption_order)}

    def fail_open(self) -> None:
        self.queue.clear_ranking()
        self.preemption_order = {}

    def select_victim(self, running: list[Request]) -> int:
        ranked = [i for i, r in enumerate(running) if r.request_id in self.preemption_order]
        if ranked:
            return min(ranked, key=lambda i: self.preemption_order[running[i].request_id])
        return len(running) - 1  # FCFS: the newest


POLICIES: dict[str, type[FCFSPolicy] | type[PriorityPolicy] | type[RankedPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "remote": RankedPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
