"""python -m scheduler_svc.policy_server: an example SchedulerPolicy service, and the
template for your own (in any language: flagstop/v1/policy.proto is the contract).

Strategies: shortest-prompt-first, and fair-share (per-tenant, by the `tenant` label:
the tenant with the fewest requests running, or already ranked ahead, goes next)."""

import asyncio
from collections import defaultdict, deque

from flagstop import wire
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


STRATEGIES = {"shortest-prompt-first": shortest_prompt_first, "fair-share": fair_share}


class PolicyServer(policy_pb2_grpc.SchedulerPolicyServicer):
    def __init__(self, strategy: str, sleep_s: float = 0.0) -> None:
        self.rank, self.sleep_s = STRATEGIES[strategy], sleep_s

    async def Rank(self, request: policy_pb2.PolicyQuery, context) -> policy_pb2.PolicyDecision:
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)  # a slow policy, for testing the deadline
        return policy_pb2.PolicyDecision(admission_order=self.rank(request))


def parse_args(argv: list[str] | None = None):
    p = wire.EnvArgumentParser(
        "FLAGSTOP_POLICY_", prog="python -m scheduler_svc.policy_server", description=__doc__
    )
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="shortest-prompt-first")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50060)
    p.add_argument("--sleep-ms", type=float, default=0.0, help="answer this late (testing)")
    wire.add_tls_args(p)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args) -> None:
    server = wire.new_server(args.port, args.host, wire.TLSConfig.from_args(args))
    policy_pb2_grpc.add_SchedulerPolicyServicer_to_server(
        PolicyServer(args.strategy, args.sleep_ms / 1000), server
    )
    health = wire.add_health_and_reflection(server, [SERVICE_NAME])
    await server.start()
    wire.set_serving(health, [SERVICE_NAME], True)

    async def drain() -> None:
        wire.set_serving(health, [SERVICE_NAME], False)

    await wire.run_until_signalled(server, drain)


if __name__ == "__main__":
    wire.main(parse_args, serve)
