"""python -m scheduler_svc: the scheduling service between routers and an executor."""

from flagstop import wire
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import scheduler_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.policy import POLICIES
from scheduler_svc.policy_client import POLICY_SERVICE
from scheduler_svc.service import SERVICE_NAME, SchedulerService, ServiceOptions
from scheduler_svc.telemetry import SchedulerTelemetry


def parse_args(argv: list[str] | None = None):
    p = wire.EnvArgumentParser(
        "FLAGSTOP_SCHEDULER_", prog="python -m scheduler_svc", description=__doc__
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052)
    p.add_argument("--executor", default="127.0.0.1:50053", help="executor address")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget")
    p.add_argument("--max-num-seqs", type=int, default=128, help="running requests at most")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the executor's")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", choices=sorted(POLICIES), default="fcfs",
                   help="remote: a SchedulerPolicy service at --policy-addr")  # fmt: skip
    p.add_argument("--policy-addr", default="127.0.0.1:50060", help="the remote policy")
    p.add_argument("--policy-deadline-ms", type=float, default=20.0,
                   help="past it the query is dropped and FCFS used meanwhile")  # fmt: skip
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="waiting here at most; the rest stay queued at the routers")  # fmt: skip
    p.add_argument("--max-steps-in-flight", type=int, choices=[1, 2], default=2,
                   help="2: plan step N+1 while step N runs (no executor idle)")  # fmt: skip
    p.add_argument("--executor-heartbeat-timeout", type=float, default=30.0,
                   help="seconds a step or heartbeat may go unanswered before the "
                   "executor counts as hung (lost)")  # fmt: skip
    p.add_argument("--executor-timeout", type=float, default=60.0,
                   help="seconds requests wait for a lost executor; then UNAVAILABLE")  # fmt: skip
    wire.add_tls_args(p)
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics; 0: off")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(args) -> SchedulerConfig:
    # Provisional max_model_len and block_size: the executor's Describe settles them.
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        policy=args.policy,
    )


async def serve(args) -> None:
    tls = wire.TLSConfig.from_args(args)
    server = wire.new_server(args.port, args.host, tls)
    health = wire.add_health_and_reflection(server, [SERVICE_NAME])
    if args.policy == "remote":
        wire.set_serving(health, [POLICY_SERVICE], False, overall=False)
    options = ServiceOptions(
        args.executor, args.max_model_len, args.max_waiting_requests, args.max_steps_in_flight,
        args.policy_addr, args.policy_deadline_ms / 1000,
        heartbeat_timeout_s=args.executor_heartbeat_timeout,
        executor_timeout_s=args.executor_timeout, tls=tls,
    )  # fmt: skip
    telemetry = SchedulerTelemetry(Telemetry("flagstop-scheduler"))
    service = SchedulerService(config_from_args(args), options, health, telemetry)
    start_metrics_server(args.metrics_port, args.host)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    await server.start()  # NOT_SERVING until the executor has described itself
    await service.connect_executor()
    await wire.run_until_signalled(server, service.drain, service.run())


if __name__ == "__main__":
    wire.main(parse_args, serve)
