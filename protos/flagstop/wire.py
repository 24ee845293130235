"""Conventions every flagstop process applies on the wire: message-size limits and
keepalive matched on both ends, health and reflection on every server, graceful
shutdown on SIGTERM/SIGINT, and flags that environment variables can set."""

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# A prompt of a long-context model is ~0.5 MB of token ids; 64 MiB bounds any step.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE,
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # Accept the clients' keepalive pings (the default minimum is 5 minutes).
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """One process's certificate and key, presented on both ends of its links (so
    every internal link is mutually authenticated), and the CA its peers' chain to."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TLSConfig | None":
        paths = (args.tls_cert, args.tls_key, args.tls_ca)
        if not any(paths):
            return None
        if not all(paths):
            raise SystemExit("--tls-cert, --tls-key and --tls-ca are needed together")
        return cls(*(Path(path).read_bytes() for path in paths))

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca,
            require_client_auth=require_client_cert,
        )  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", help="PEM certificate: served, and shown to servers")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA that peers' certificates must chain to")


def channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


class EnvArgumentParser(argparse.ArgumentParser):
    """Every --some-flag can also be set by PREFIX_SOME_FLAG; the flag wins."""

    def __init__(self, env_prefix: str, **kwargs: Any) -> None:
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)
        self.env_prefix = env_prefix

    def add_argument(self, *flags: str, **kwargs: Any) -> argparse.Action:
        long_flags = [f for f in flags if f.startswith("--")]
        if long_flags and kwargs.get("action") not in ("help", "version"):
            env = self.env_prefix + long_flags[0][2:].upper().replace("-", "_")
            kwargs["help"] = f"{kwargs.get('help', '')} [env {env}]".strip()
            if env in os.environ:
                kwargs["default"] = self._from_env(os.environ[env], kwargs)
                kwargs["required"] = False
        return super().add_argument(*flags, **kwargs)

    @staticmethod
    def _from_env(value: str, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("action") == "store_true":
            return value.lower() in ("1", "true", "yes", "on")
        convert = kwargs.get("type", str)
        return convert(value)


def new_server(
    port: int,
    host: str = "127.0.0.1",
    tls: TLSConfig | None = None,
    *,
    require_client_cert: bool = True,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
) -> grpc.aio.Server:
    """A larger message than max_receive_bytes is refused with RESOURCE_EXHAUSTED."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, tls.server_credentials(require_client_cert))
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server


def add_health_and_reflection(
    server: grpc.aio.Server, service_names: list[str]
) -> health.HealthServicer:
    """Standard grpc.health.v1 (starting NOT_SERVING) and reflection, so that grpcurl
    works without the .proto files."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return health_servicer


def set_serving(
    health_servicer: health.HealthServicer, names: list[str], serving: bool, overall: bool = True
) -> None:
    """overall: the server's own entry ("") too, not only the named services'."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names] if overall else names:
        health_servicer.set(name, status)


async def run_until_signalled(
    server: grpc.aio.Server,
    drain: Callable[[], Awaitable[None]],
    *background: Coroutine[Any, Any, None],
    grace_s: float = 10.0,
) -> None:
    """Serve (the server is started) with the background tasks running until SIGTERM
    or SIGINT, then drain (stop admitting, finish or abort the work in flight) and
    stop; the process exits 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(coroutine) for coroutine in background]
    try:
        await stop.wait()
        await drain()
        await server.stop(grace_s)
    finally:
        for task in tasks:
            task.cancel()


def main(
    parse_args: Callable[[], argparse.Namespace], serve: Callable[..., Awaitable[None]]
) -> None:
    """A service's entry point: flags, logging, then serve(args) until signalled."""
    args = parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args))
