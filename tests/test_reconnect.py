"""Reconnecting: exponential backoff with jitter (routers that lost the same scheduler
must not come back in lockstep) and the give-up clock of the work waiting."""

import asyncio

from flagstop import reconnect
from flagstop.reconnect import Reconnect


def test_backoff_doubles_to_its_cap_with_jitter(monkeypatch):
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(reconnect.asyncio, "sleep", fake_sleep)
    r = Reconnect(give_up_after_s=60, initial_delay_s=0.1, max_delay_s=2.0)

    async def attempts(n: int) -> None:
        for _ in range(n):
            await r.wait()

    asyncio.run(attempts(200))
    caps = [min(0.1 * 2**i, 2.0) for i in range(200)]
    assert all(cap / 2 <= s <= cap for s, cap in zip(slept, caps, strict=True))
    assert len({round(s, 6) for s in slept[10:]}) > 150, "no jitter: routers would sync"
    r.connected()
    asyncio.run(attempts(1))
    assert slept[-1] <= 0.1


def test_give_up_counts_from_the_loss(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(reconnect.time, "monotonic", lambda: now[0])
    r = Reconnect(give_up_after_s=5)
    assert not r.gave_up  # never lost
    r.lost()
    now[0] = 104
    r.lost()  # a second failure does not restart the clock
    assert not r.gave_up
    now[0] = 105.5
    assert r.gave_up
    r.connected()
    assert not r.gave_up
