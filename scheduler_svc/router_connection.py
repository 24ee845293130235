"""One router's stream as the scheduler's shell holds it: its outbox, its credits, and
whether it is still open (intake.py answers a request whose grammar compiled only if
its router is still there)."""

import asyncio
from dataclasses import dataclass, field

from flagstop.v1 import scheduler_pb2


@dataclass(slots=True, eq=False)
class RouterConnection:
    router_id: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    credits: int = 0  # granted, not yet sent
    held: int = 0  # sent, not yet used by an add (standing credits, or on their way)
    num_queued: int = 0  # requests waiting at the router, as it last said
    load_sent_at: float = 0.0  # monotonic time of the last load report to it
    closed: bool = False  # the router left (or was refused)

    def send_errors(self, errors: list[scheduler_pb2.RequestError]) -> None:
        self.outbox.put_nowait(scheduler_pb2.SchedulerMessage(errors=errors))
