"""Scheduling policies: the order of the waiting queue and the choice of a victim.

The scheduling loop only calls the RequestQueue methods and `select_victim`, so a
policy decided elsewhere (a remote ranking service) plugs in as another queue.
"""

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from scheduler_svc.request import Request


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


POLICIES: dict[str, type[FCFSPolicy] | type[PriorityPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
