"""Reconnecting to a peer that went away (a router to its scheduler, a scheduler to its
executor): exponential backoff with jitter between attempts, and how long the peer
has been lost, so that the work waiting for it fails once it has waited too long."""

import asyncio
import random
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Reconnect:
    give_up_after_s: float  # requests waiting longer than this for the peer fail
    initial_delay_s: float = 0.1
    max_delay_s: float = 0.5  # gRPC's own backoff is capped alike (server.CHANNEL_OPTIONS)
    delay_s: float = field(init=False)
    lost_since: float | None = None  # None: connected, or never connected yet

    def __post_init__(self) -> None:
        self.delay_s = self.initial_delay_s

    def connected(self) -> None:
        self.lost_since, self.delay_s = None, self.initial_delay_s

    def lost(self) -> None:
        if self.lost_since is None:
            self.lost_since = time.monotonic()

    @property
    def lost_for_s(self) -> float:
        """How long the peer has been lost; 0 while connected."""
        return 0.0 if self.lost_since is None else time.monotonic() - self.lost_since

    @property
    def gave_up(self) -> bool:
        return self.lost_for_s > self.give_up_after_s

    async def wait(self) -> None:
        """Sleep before the next attempt: half the delay plus up to as much again at
        random, so that many routers that lost the same scheduler do not all come back
        in lockstep; the delay doubles up to its cap."""
        await asyncio.sleep(self.delay_s * (0.5 + random.random() / 2))
        self.delay_s = min(self.delay_s * 2, self.max_delay_s)
