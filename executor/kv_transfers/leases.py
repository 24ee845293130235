"""Prefill/decode disaggregation, the prefill executor's leases: a handed-off request's
blocks stay held (its scheduler keeps them out of the pool) until a decode executor
has read them and released the lease, or the lease expires; either way the
transfer id goes back to the scheduler in finished_sending and the blocks are freed.

A decode executor reads the blocks one-sidedly (Mooncake's transfer engine): nothing
here sees the read. So it renews the lease before reading and releases it after, and
keeps what it read only when the release answers that the lease held until then.
Expiry is final and is the only way blocks go back without a release, so a lease
that held at the release held through the read: no decode side ever keeps bytes of
blocks that were freed (vLLM's aws-do-eks#84: 8 of 42 requests decoded freed memory).

Everything here runs on the executor's event loop (the gRPC handlers and the steps
alike): no lock. torch-free: the simulator holds leases too.
"""

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable

# A decode executor may ask for a lease before the prefill executor holds it: the
# scheduler sends the lease with its next step after the hand-off, while the router
# may already have passed the hand-off on. The call waits that long for it.
REGISTRATION_WAIT_S = 5.0
# Transfer ids that ended, remembered to answer "not held" at once (LRU).
NUM_ENDED_KEPT = 4096


class Leases:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.clock = lease_s, clock
        self.expiry: dict[str, float] = {}  # transfer id -> when its lease ends
        self.ended: OrderedDict[str, None] = OrderedDict()  # released, expired or void
        self.to_report: list[str] = []  # ended since the last step result
        self.waiters: dict[str, list[asyncio.Future]] = {}  # asked for before held
        self.news = asyncio.Event()  # a release: the poll step need not wait longer

    def __len__(self) -> int:
        return len(self.expiry)

    def hold(self, transfer_ids: list[str]) -> None:
        """The scheduler's step says: these hand-offs' blocks are held from now on."""
        deadline = self.clock() + self.lease_s
        for transfer_id in transfer_ids:
            self.expiry[transfer_id] = deadline
            for waiter in self.waiters.pop(transfer_id, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def renew(self, transfer_id: str) -> bool:
        """Extend the lease by lease_s; False when it is not held (ended, or never
        held within REGISTRATION_WAIT_S)."""
        if transfer_id not in self.expiry and transfer_id not in self.ended:
            await self._registered(transfer_id)
        self._expire()
        if transfer_id not in self.expiry:
            return False
        self.expiry[transfer_id] = self.clock() + self.lease_s
        return True

    async def release(self, transfer_id: str) -> bool:
        """End the lease (the blocks go back); whether it held until now."""
        if transfer_id not in self.expiry and transfer_id not in self.ended:
            await self._registered(transfer_id)
        self._expire()
        if self.expiry.pop(transfer_id, None) is None:
            return False
        self._end(transfer_id)
        self.news.set()
        return True

    async def _registered(self, transfer_id: str) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(transfer_id, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, REGISTRATION_WAIT_S)
        except TimeoutError:
            pass  # never held here: the caller answers so
        finally:
            waiters = self.waiters.get(transfer_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self.waiters.pop(transfer_id, None)

    def _expire(self) -> None:
        now = self.clock()
        for transfer_id in [t for t, deadline in self.expiry.items() if deadline <= now]:
            del self.expiry[transfer_id]
            self._end(transfer_id)

    def _end(self, transfer_id: str) -> None:
        self.to_report.append(transfer_id)
        self.ended[transfer_id] = None
        while len(self.ended) > NUM_ENDED_KEPT:
            self.ended.popitem(last=False)

    def take_ended(self) -> list[str]:
        """Leases released or expired since the last call: their blocks may go back."""
        self._expire()
        ended, self.to_report = self.to_report, []
        return ended

    async def wait(self, timeout_s: float) -> None:
        """A step with nothing to compute: until a release arrives, the next lease
        expires, or timeout_s (the loop serves the releases meanwhile)."""
        if self.to_report:
            return
        if self.expiry:
            timeout_s = min(timeout_s, max(0.0, min(self.expiry.values()) - self.clock()))
        self.news.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.news.wait(), timeout_s)

    def clear(self) -> None:
        """A new scheduler stream: its pool is new, so every lease is void (a decode
        side's release of one answers that it did not hold), and none is reported."""
        for transfer_id in self.expiry:
            self.ended[transfer_id] = None
        self.expiry.clear()
        self.to_report.clear()
