"""Health over grpc.health.v1, liveness apart from readiness.

Entries every flagstop server reports:
- "liveness": SERVING while the process is up and its event loop answers, recovering
  included (a router waiting for a lost scheduler, a scheduler waiting for a lost
  executor keep their queues): a liveness probe that fails means restart it.
- "readiness", the server's own entry "" and each named service (e.g.
  flagstop.v1.Generation): SERVING while it can take work now.
- detail entries a service adds (the scheduler's flagstop.v1.SchedulerPolicy).

    python -m flagstop.health HOST:PORT [--probe live|ready] [--service NAME]

exits 0 when the entry is SERVING and 1 otherwise: the containers' health check,
needing no binary beyond the image's own Python. Kubernetes' gRPC probes ask the same
entries by name (`service: liveness`, `service: readiness`)."""

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from flagstop.server import TLSConfig

LIVENESS, READINESS = "liveness", "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """A server's health entries (liveness SERVING from the start, the rest not yet
    ready) and reflection, so that grpcurl works without the .proto files."""

    def __init__(self, server: grpc.aio.Server, service_names: list[str]) -> None:
        self.servicer = health.HealthServicer()
        self.service_names = service_names
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.servicer.set(LIVENESS, SERVING)
        self.set_ready(False)
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )

    def set_ready(self, ready: bool) -> None:
        for name in ("", READINESS, *self.service_names):
            self.servicer.set(name, SERVING if ready else NOT_SERVING)

    def set_detail(self, name: str, serving: bool) -> None:
        """An entry of its own, apart from readiness (e.g. a remote policy in use)."""
        self.servicer.set(name, SERVING if serving else NOT_SERVING)


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
    return reply.status == SERVING


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flagstop.health", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("address")
    parser.add_argument(
        "--probe", choices=["live", "ready"], default="ready",
        help="live: the liveness entry; ready: readiness (the default)",
    )  # fmt: skip
    parser.add_argument("--service", default=None, help="any other entry, by name")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate shown to the server")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA the server's certificate chains to")
    args = parser.parse_args()
    paths = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(paths) and not all(paths):
        parser.error("--tls-cert, --tls-key and --tls-ca are needed together")
    tls = TLSConfig(*(p.read_bytes() for p in paths)) if all(paths) else None
    service = args.service
    if service is None:
        service = LIVENESS if args.probe == "live" else READINESS
    sys.exit(0 if check(args.address, service, args.timeout, tls) else 1)


if __name__ == "__main__":
    main()
