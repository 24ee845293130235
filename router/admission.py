"""The router's admission queues: requests waiting for a replica's credits, one queue
per replica in arrival order, bounded together in requests and in prompt tokens."""

from collections.abc import Iterable

from flagstop.v1 import scheduler_pb2


class AdmissionQueue:
    def __init__(self) -> None:
        # A dict in arrival order: a cancelled request leaves in O(1).
        self.adds: dict[str, scheduler_pb2.AddRequest] = {}
        self.num_tokens = 0  # prompt tokens queued

    def __len__(self) -> int:
        return len(self.adds)

    def push(self, add: scheduler_pb2.AddRequest) -> None:
        self.adds[add.request_id] = add
        self.num_tokens += len(add.prompt_token_ids)

    def push_front(self, adds: list[scheduler_pb2.AddRequest]) -> None:
        """Ahead of everything queued, in the given order (resubmitted requests)."""
        self.adds = {add.request_id: add for add in adds} | self.adds
        self.num_tokens += sum(len(add.prompt_token_ids) for add in adds)

    def pop(self) -> scheduler_pb2.AddRequest:
        add = self.adds.pop(next(iter(self.adds)))
        self.num_tokens -= len(add.prompt_token_ids)
        return add

    def cancel(self, request_id: str) -> bool:
        """Whether it was still queued (then the scheduler never saw it)."""
        add = self.adds.pop(request_id, None)
        if add is None:
            return False
        self.num_tokens -= len(add.prompt_token_ids)
        return True

    def take_all(self) -> list[scheduler_pb2.AddRequest]:
        adds, self.adds, self.num_tokens = list(self.adds.values()), {}, 0
        return adds


class AdmissionBudget:
    """How much all of a router's queues hold at most: past it RESOURCE_EXHAUSTED."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens

    def refusal(self, queues: Iterable[AdmissionQueue], num_prompt_tokens: int) -> str:
        """Why one more request of this size does not fit; "" when it does."""
        queues = list(queues)
        num_requests = sum(len(q) for q in queues)
        num_tokens = sum(q.num_tokens for q in queues)
        if num_requests >= self.max_requests:
            return f"the admission queue is full ({num_requests} requests): retry later"
        if num_tokens + num_prompt_tokens > self.max_tokens:
            return (
                f"the admission queue holds {num_tokens} prompt tokens and takes "
                f"{self.max_tokens} at most: retry later"
            )
        return ""
