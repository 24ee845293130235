"""How every flagstop process serves and connects: message-size limits and keepalive
matched on both ends, TLS (mutual between services), and the bootstrap of a service
process: settings, logging, serve until SIGTERM/SIGINT, drain, exit 0."""

import asyncio
import contextlib
import ctypes
import gc
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
import uvloop

from flagstop import logs
from flagstop.settings import ServiceSettings, SettingsInvalid

# A prompt of a long-context model is ~0.5 MB of token ids, a step far less; an image's
# pixels are the largest message: a 4-megapixel one is 96 MiB in float32 (the CPU's
# dtype), 48 MiB in bfloat16 (bench/multimodal_bench.py). The router refuses a
# request whose images' pixels pass MAX_MEDIA_BYTES.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_MEDIA_BYTES = 192 * 1024 * 1024
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
    # gRPC's own reconnect backoff grows to 120 s: a peer restarted after a long outage
    # (an executor, a scheduler, a remote policy) would then sit unused for minutes.
    # Capped like our own retry loops (flagstop.reconnect), at 0.5 s: with 2 s the
    # two backoffs stacked, and a stack on the tiny model came up in 6.8 s against
    # 4.1 s now (the executor serves at ~3.6 s). A refused connect costs next to
    # nothing, so polling a peer that is not there yet twice a second is cheap.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    # Accept the clients' keepalive pings (the default minimum is 5 minutes).
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # gRPC's default SO_REUSEPORT would let a second process bind a port already
    # served, and the two would silently split its connections: a taken port must
    # stop start-up instead.
    ("grpc.so_reuseport", 0),
    # Past 1,000 calls waiting for the application to pick them up, gRPC core refuses
    # new ones as a bare CANCELLED before any handler sees them (randomly, up to a hard
    # 3,000): a burst of 2,000 streams lost ~10% of them. Our own admission queue
    # bounds the backlog instead, and refuses with a status and a message.
    ("grpc.server.max_pending_requests", 1 << 16),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 16),
]


class StartupError(RuntimeError):
    """The process cannot start as configured; the message says what to change."""


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """One process's certificate and key, presented on both ends of its links (so
    every internal link is mutually authenticated), and the CA its peers' chain to."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> "TLSConfig | None":
        paths = (settings.tls_cert, settings.tls_key, settings.tls_ca)
        if not all(paths):
            return None  # the settings already refused some without the others
        return cls(*(path.read_bytes() for path in paths))

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca,
            require_client_auth=require_client_cert,
        )  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


GrpcServerKind = Literal["grpcio", "native"]


def _server(kind: GrpcServerKind, tls: TLSConfig | None, options, interceptors):
    if kind == "grpcio":
        return grpc.aio.server(options=options, interceptors=interceptors)
    if tls is not None:  # refused by the settings already (RouterSettings)
        raise ValueError("pygrpc-native serves plaintext only")
    import pygrpc_native.aio  # only where chosen: a young library, kept off the default

    return pygrpc_native.aio.server(options=options, interceptors=interceptors)


def new_server(
    port: int,
    host: str = "127.0.0.1",
    tls: TLSConfig | None = None,
    *,
    require_client_cert: bool = True,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
    reuse_port: bool = False,
    kind: GrpcServerKind = "grpcio",
) -> grpc.aio.Server:
    """A larger message than max_receive_bytes is refused with RESOURCE_EXHAUSTED.
    reuse_port: share the port with the processes of the same user bound to it.
    kind: grpcio's own server, or native (pygrpc-native: its HTTP/2 in Rust, the
    same servicers; plaintext only, so TLS is refused)."""
    replaced = {"grpc.max_receive_message_length", "grpc.so_reuseport"}
    options = [o for o in SERVER_OPTIONS if o[0] not in replaced]
    options += [("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.so_reuseport", int(reuse_port))]  # fmt: skip
    server = _server(kind, tls, options, interceptors)
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.server_credentials(require_client_cert))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise StartupError(f"cannot listen on {address}: is the port taken?")
    return server


async def run_until_signalled(
    server: grpc.aio.Server,
    drain: Callable[[], Awaitable[None]],
    *background: Coroutine[Any, Any, None],
    grace_s: float = 10.0,
) -> None:
    """Serve (the server is started) with the background tasks running until SIGTERM
    or SIGINT, then drain (stop admitting, finish or abort the work in flight) and
    stop; the process exits 0. A background task that fails (a StartupError, say)
    stops the server and raises."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signalled = asyncio.create_task(stop.wait())
    tasks = [asyncio.create_task(coroutine) for coroutine in background]
    try:
        pending = {signalled, *tasks}
        while signalled in pending:  # a task that returns is done; one that fails ends all
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t for t in done if t is not signalled and t.exception() is not None]
            if failed:
                await server.stop(0)
                raise failed[0].exception()
        await drain()
        await server.stop(grace_s)
    finally:
        for task in (signalled, *tasks):
            task.cancel()


S = TypeVar("S", bound=ServiceSettings)


def load_or_exit(settings_cls: type[S], argv: list[str] | None = None) -> S:
    """The settings, or one line on stderr and exit 2 (argparse's code for bad usage)."""
    try:
        return settings_cls.load(sys.argv[1:] if argv is None else argv)
    except SettingsInvalid as e:
        print(f"{settings_cls.prog()}: {e}", file=sys.stderr)
        sys.exit(2)


def run_service(
    settings_cls: type[S], serve: Callable[[S], Awaitable[None]], settings: S | None = None
) -> None:
    """A service's entry point: settings, logging, then serve(settings) until signalled.
    A start-up failure the operator must fix (a port taken, a model that does not
    load) ends with one line and exit 1, not a traceback."""
    settings = settings or load_or_exit(settings_cls)
    logs.configure(settings.log_level, settings.log_format)
    try:  # uvloop: ~10% less CPU per token than asyncio's loop (bench/overhead_bench.py)
        uvloop.run(serve(settings))
    except StartupError as e:
        print(f"{settings_cls.prog()}: {e}", file=sys.stderr)
        sys.exit(1)


def freeze_startup_heap() -> None:
    """Once a service has started: what start-up made (modules, the tokenizer,
    protobuf descriptors, settings) lives as long as the process, so it leaves the
    garbage collector's generations (gc.freeze). A full collection would otherwise
    walk all of it again, a pause of the whole event loop: 60 ms over the router's
    115k objects, 22 ms over the scheduler's 49k, 109 ms over the executor's imports
    alone (2-core machine, 2026-12-07); frozen, ~0."""
    gc.collect()
    gc.freeze()


def die_with_parent() -> None:
    """For Popen(preexec_fn=...): the child dies with the process that started it, even
    by SIGKILL (Linux prctl PR_SET_PDEATHSIG), instead of serving on as an orphan."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
