"""python -m flagstop.health HOST:PORT [--service NAME]: exit 0 when the server reports
SERVING over grpc.health.v1, 1 otherwise. The containers' health check: it needs no
binary beyond the image's own Python."""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagstop.wire import TLSConfig, add_tls_args


def check(
    address: str, service: str = "", timeout: float = 3.0, tls: TLSConfig | None = None
) -> bool:
    channel = (
        grpc.secure_channel(address, tls.channel_credentials())
        if tls
        else grpc.insecure_channel(address)
    )
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m flagstop.health", description=__doc__)
    parser.add_argument("address")
    parser.add_argument("--service", default="", help="default: the server as a whole")
    parser.add_argument("--timeout", type=float, default=3.0)
    add_tls_args(parser)
    args = parser.parse_args()
    tls = TLSConfig.from_args(args)
    sys.exit(0 if check(args.address, args.service, args.timeout, tls) else 1)


if __name__ == "__main__":
    main()
