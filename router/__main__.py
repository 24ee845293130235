"""python -m router: the client-facing gRPC server (flagstop.v1.Generation)."""

from transformers import AutoTokenizer

from flagstop import wire
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import generation_pb2_grpc
from router.auth import ApiKeyCheck
from router.service import SERVICE_NAME, RouterOptions, RouterService


def parse_args(argv: list[str] | None = None):
    p = wire.EnvArgumentParser("FLAGSTOP_ROUTER_", prog="python -m router", description=__doc__)
    p.add_argument("--model", default="models/flagstop-tiny", help="tokenizer (model) directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--scheduler", default="127.0.0.1:50052", help="scheduler address")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="admission queue bound; past it RESOURCE_EXHAUSTED")  # fmt: skip
    p.add_argument("--max-queued-tokens", type=int, default=1 << 20,
                   help="prompt tokens in the admission queue at most; past it "
                   "RESOURCE_EXHAUSTED")  # fmt: skip
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest client message; past it RESOURCE_EXHAUSTED")  # fmt: skip
    p.add_argument("--scheduler-timeout", type=float, default=60.0,
                   help="seconds requests wait for a lost scheduler; then UNAVAILABLE")  # fmt: skip
    p.add_argument("--api-key", default=None,
                   help="require 'authorization: Bearer KEY' metadata (UNAUTHENTICATED "
                   "otherwise); better set by FLAGSTOP_ROUTER_API_KEY")  # fmt: skip
    wire.add_tls_args(p)
    p.add_argument("--tls-require-client-cert", action="store_true",
                   help="clients must show a certificate from --tls-ca too")  # fmt: skip
    p.add_argument("--router-id", default=None, help="default: random")
    p.add_argument("--metrics-port", type=int, default=8001, help="Prometheus /metrics; 0: off")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tls = wire.TLSConfig.from_args(args)
    options = RouterOptions(
        args.scheduler, args.max_queued_requests, args.max_queued_tokens,
        scheduler_timeout_s=args.scheduler_timeout, tls=tls,
    )  # fmt: skip
    if args.router_id:
        options.router_id = args.router_id
    server = wire.new_server(
        args.port, args.host, tls, require_client_cert=args.tls_require_client_cert,
        max_receive_bytes=args.max_request_bytes,
        interceptors=(ApiKeyCheck(args.api_key),) if args.api_key else (),
    )  # fmt: skip
    health = wire.add_health_and_reflection(server, [SERVICE_NAME])
    service = RouterService(tokenizer, options, health, Telemetry("flagstop-router"))
    start_metrics_server(args.metrics_port, args.host)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    await server.start()
    await wire.run_until_signalled(server, service.drain, service.run())


if __name__ == "__main__":
    wire.main(parse_args, serve)
