"""python -m examples.policy_server: an example SchedulerPolicy service, and the
template for your own (in any language: protos/flagstop/v1/policy.proto is the
contract).

Strategies: the scheduler's built-in policies served remotely (fcfs, priority, hrrn,
slo, fair: the core's own code, on the view rebuilt from each query), and two
ordering-only examples of the contract's first version: shortest-prompt-first, and
fair-share (per tenant, by the `tenant` label: the tenant with the fewest requests
running, or already ranked ahead, goes next)."""

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Literal

from pydantic import NonNegativeFloat
from pydantic_settings import SettingsConfigDict

from flagstop.health import Health
from flagstop.scheduler_svc.core.fair_policy import FairPolicy
from flagstop.scheduler_svc.core.policy import make_policy
from flagstop.scheduler_svc.policy_wire import decision_to_proto, view_from_proto
from flagstop.server import TLSConfig, new_server, run_service, run_until_signalled
from flagstop.settings import Port, ServiceSettings
from flagstop.v1 import policy_pb2, policy_pb2_grpc

SERVICE_NAME = policy_pb2.DESCRIPTOR.services_by_name["SchedulerPolicy"].full_name


def shortest_prompt_first(query: policy_pb2.PolicyQuery) -> list[str]:
    ranked = sorted(query.waiting, key=lambda r: (r.prompt_tokens, r.arrival_time))
    return [r.request_id for r in ranked]


def fair_share(query: policy_pb2.PolicyQuery) -> list[str]:
    load: dict[str, int] = defaultdict(int)
    for request in query.running:
        load[request.labels.get("tenant", "")] += 1
    queues: dict[str, deque] = defaultdict(deque)
    for request in sorted(query.waiting, key=lambda r: r.arrival_time):
        queues[request.labels.get("tenant", "")].append(request)
    order = []
    while queues:
        # Least loaded first; ties to the tenant whose oldest request came first.
        tenant = min(queues, key=lambda t: (load[t], queues[t][0].arrival_time))
        order.append(queues[tenant].popleft().request_id)
        load[tenant] += 1
        if not queues[tenant]:
            del queues[tenant]
    return order


def ranking(rank: Callable[[policy_pb2.PolicyQuery], list[str]]):
    return lambda query: policy_pb2.PolicyDecision(admission_order=rank(query))


class BuiltIn:
    """A core policy behind the contract. A fair policy's counters are charged with
    what each running request computed since the last query."""

    def __init__(self, name: str) -> None:
        self.policy = make_policy(name)
        self.computed: dict[str, int] = {}

    def __call__(self, query: policy_pb2.PolicyQuery) -> policy_pb2.PolicyDecision:
        view = view_from_proto(query)
        if isinstance(self.policy, FairPolicy):
            self._charge(view.running)
        decision = self.policy.decide(view)
        return decision_to_proto(decision, self._victims(list(view.running)))

    def _charge(self, running) -> None:
        computed = {r.request_id: r.num_computed_tokens for r in running}
        for request in running:
            start = self.computed.get(request.request_id, 0)
            if request.num_computed_tokens > start:
                self.policy.charge(request, start, request.num_computed_tokens)
        self.computed = computed

    def _victims(self, running) -> list[str]:
        order = []
        while running:
            order.append(running.pop(self.policy.select_victim(running)).request_id)
        return order


STRATEGIES = {
    "shortest-prompt-first": lambda: ranking(shortest_prompt_first),
    "fair-share": lambda: ranking(fair_share),
    **{name: (lambda name=name: BuiltIn(name)) for name in ("fcfs", "priority", "hrrn", "slo",
                                                             "fair")},
}  # fmt: skip


class PolicyServer(policy_pb2_grpc.SchedulerPolicyServicer):
    def __init__(self, strategy: str, sleep_s: float = 0.0) -> None:
        self.decide, self.sleep_s = STRATEGIES[strategy](), sleep_s

    async def Rank(self, request: policy_pb2.PolicyQuery, context) -> policy_pb2.PolicyDecision:
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)  # a slow policy, for testing the deadline
        return self.decide(request)


class PolicySettings(ServiceSettings):
    """python -m examples.policy_server: an example SchedulerPolicy service."""

    model_config = SettingsConfigDict(
        env_prefix="FLAGSTOP_POLICY_", cli_prog_name="python -m examples.policy_server"
    )

    strategy: Literal[tuple(STRATEGIES)] = "shortest-prompt-first"  # type: ignore[valid-type]
    port: Port = 50060
    sleep_ms: NonNegativeFloat = 0.0
    """answer this late (to test the scheduler's deadline)"""


async def serve(settings: PolicySettings) -> None:
    server = new_server(settings.port, settings.host, TLSConfig.from_settings(settings))
    policy_pb2_grpc.add_SchedulerPolicyServicer_to_server(
        PolicyServer(settings.strategy, settings.sleep_ms / 1000), server
    )
    health = Health(server, [SERVICE_NAME])
    await server.start()
    health.set_ready(True)

    async def drain() -> None:
        health.set_ready(False)

    await run_until_signalled(server, drain)


if __name__ == "__main__":
    run_service(PolicySettings, serve)
