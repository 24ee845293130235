"""Consults a separately deployed SchedulerPolicy off the critical path: the engine
loop only ever starts a query; the freshest answer that arrives in time orders the
waiting queue, and a slow, absent or nonsensical policy fails open to FCFS."""

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from prometheus_client import Counter

from flagstop.scheduler_svc.core.policy import RankedPolicy
from flagstop.scheduler_svc.core.scheduler import Scheduler
from flagstop.scheduler_svc.policy_wire import check, decision_from_proto, describe, describe_cost
from flagstop.server import TLSConfig, channel
from flagstop.v1 import policy_pb2, policy_pb2_grpc

log = logging.getLogger("flagstop.scheduler.policy")
POLICY_SERVICE = policy_pb2.DESCRIPTOR.services_by_name["SchedulerPolicy"].full_name
FAILURES = Counter("flagstop:policy_fallbacks", "Remote policy failures (FCFS used)", ["reason"])
# Steps planned while a query was out: the loop goes on without the answer (a loop that
# waited for it would plan none meanwhile).
STEPS_WHILE_ASKING = Counter("flagstop:policy_steps_while_asking",
                             "Steps planned while a remote policy query was in flight")  # fmt: skip
# After a failure, wait this long before asking again: a dead policy is not hammered.
RETRY_AFTER_S = 0.5


class NoRemotePolicy:
    """A built-in policy runs: nothing to ask, nothing to close."""

    active = False
    num_failures = 0

    def maybe_query(self, scheduler: Scheduler) -> None:
        pass

    def close(self) -> None:
        pass


NO_REMOTE_POLICY = NoRemotePolicy()


class RemotePolicyClient:
    def __init__(
        self, address: str, policy: RankedPolicy, deadline_s: float,
        on_change: Callable[[bool, str], None], tls: TLSConfig | None = None,
    ) -> None:  # fmt: skip
        """on_change(active, failure reason or ""): after every failure and on recovery."""
        self.channel = channel(address, tls)
        self.stub = policy_pb2_grpc.SchedulerPolicyStub(self.channel)
        self.policy, self.deadline_s, self.on_change = policy, deadline_s, on_change
        self.active = False  # its rankings are in use
        self.num_failures = 0
        self.query_id = 0
        self.applied_id = 0
        self.in_flight: asyncio.Task | None = None
        self.asked_for: frozenset[str] = frozenset()
        self.retry_at = 0.0
        self._closing: asyncio.Future | None = None  # the channel's close, once swapped out

    def close(self) -> None:
        """Another policy took over (an admin swap): no answer is awaited any more."""
        if self.in_flight is not None:
            self.in_flight.cancel()
        self._closing = asyncio.ensure_future(self.channel.close())

    def maybe_query(self, scheduler: Scheduler) -> None:
        """Start a query when the waiting queue changed and none is in flight."""
        if self.in_flight is not None:
            STEPS_WHILE_ASKING.inc()
            return
        if time.monotonic() < self.retry_at:
            return
        waiting = frozenset(r.request_id for r in scheduler.waiting)
        if not waiting or waiting == self.asked_for:
            return
        self.asked_for = waiting
        self.query_id += 1
        self.in_flight = asyncio.create_task(self._query(self._snapshot(scheduler)))

    def _snapshot(self, scheduler: Scheduler) -> policy_pb2.PolicyQuery:
        query = policy_pb2.PolicyQuery(
            query_id=self.query_id, num_free_blocks=scheduler.num_free_blocks,
            num_total_blocks=scheduler.num_total_blocks, now=scheduler.clock(),
            token_budget=scheduler.config.max_num_batched_tokens,
            block_size=scheduler.block_size, max_num_seqs=scheduler.config.max_num_seqs,
        )  # fmt: skip
        describe_cost(scheduler.policy_step.cost, query.step_cost)
        for request in scheduler.waiting:
            entry = describe(request, query.waiting.add())
            entry.prefix_hit_blocks = scheduler.num_prefix_hit_blocks(request)
        for request in scheduler.running:
            describe(request, query.running.add())
        return query

    async def _query(self, query: policy_pb2.PolicyQuery) -> None:
        try:
            decision = await self.stub.Rank(query, timeout=self.deadline_s)
            problem = check(decision, query)
        except grpc.aio.AioRpcError as e:
            problem = "deadline" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "unavailable"
        finally:
            self.in_flight = None
        if problem:
            self._fail(problem)
        elif query.query_id > self.applied_id:  # the freshest answer wins
            self.applied_id = query.query_id
            self.policy.apply(decision_from_proto(decision), list(decision.preemption_order))
            if not self.active:
                log.info("remote policy in use")
                self.active = True
                self.on_change(True, "")

    def _fail(self, reason: str) -> None:
        if self.active:
            log.warning("remote policy failed (%s): FCFS until it answers again", reason)
        self.active = False
        self.num_failures += 1
        self.retry_at = time.monotonic() + RETRY_AFTER_S
        self.asked_for = frozenset()
        self.policy.fail_open()
        FAILURES.labels(reason).inc()
        self.on_change(False, reason)
