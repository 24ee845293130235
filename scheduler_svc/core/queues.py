"""The waiting queues a policy orders: arrival order, priority order, or the freshest
ranking decided by the policy (built-in or remote). The loop only calls the
RequestQueue methods, and a policy's admission order reaches the queue by
apply_ranking."""

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from flagstop.scheduler_svc.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove_all(self, request_ids: set[str]) -> None: ...
    def apply_ranking(self, order: Sequence[str]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


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

    def apply_ranking(self, order: Sequence[str]) -> None:
        """Ranked ids first in the given order, the rest behind in arrival order (an
        empty ranking: arrival order). New arrivals go behind everything ranked until
        the next ranking places them."""
        rank = {request_id: i for i, request_id in enumerate(order)}
        unranked = len(rank)
        self._queue = deque(
            sorted(self._queue, key=lambda r: (rank.get(r.request_id, unranked), r.arrival_time))
        )

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

    def apply_ranking(self, order: Sequence[str]) -> None:
        pass  # its order is the requests' priorities

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in sorted(self._heap))
