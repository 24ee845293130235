"""flagstop-router (python -m flagstop.router): the client-facing servers, gRPC
(flagstop.v1.Generation) and the OpenAI-compatible HTTP API, over one request path."""

import asyncio
import logging
import signal
import sys

from flagstop import logs
from flagstop.health import Health
from flagstop.router.auth import ApiKeyCheck, ApiKeys
from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai.app import HttpServer, create_app
from flagstop.router.processes import supervise
from flagstop.router.service import SERVICE_NAME, GenerationService, add_to_server
from flagstop.router.settings import RouterSettings
from flagstop.router.tokenizer import load_tokenizer
from flagstop.server import (
    StartupError,
    TLSConfig,
    freeze_startup_heap,
    load_or_exit,
    new_server,
    run_service,
    run_until_signalled,
)  # fmt: skip
from flagstop.settings import SettingsInvalid
from flagstop.telemetry import Telemetry, start_metrics_server

log = logging.getLogger("flagstop.router")


async def serve(settings: RouterSettings) -> None:
    try:
        tokenizer = load_tokenizer(settings.model)
        chat = ChatTemplate(tokenizer, settings.chat_template)
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot load the tokenizer of {settings.model}: {e}") from None
    keys = ApiKeys.from_settings(settings)
    server = new_server(
        settings.port, settings.host, TLSConfig.from_settings(settings),
        require_client_cert=settings.tls_require_client_cert,
        max_receive_bytes=settings.max_request_bytes,
        interceptors=(ApiKeyCheck(keys),) if keys.required else (), reuse_port=settings.reuse_port,
        kind=settings.grpc_server,
    )  # fmt: skip
    health = Health(server, [SERVICE_NAME])
    engine = RouterEngine(tokenizer, settings, health, Telemetry("flagstop-router"), keys)
    add_to_server(GenerationService(engine), server)
    http = HttpServer(create_app(engine, settings, chat), settings) if settings.http_port else None
    start_metrics_server(settings.metrics_port, settings.host)
    freeze_startup_heap()
    await server.start()  # live, not ready until the scheduler has described itself

    async def drain() -> None:
        await engine.drain()
        if http is not None:
            http.stop()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload, engine)
    background = [engine.run()] + ([http.serve()] if http else [])
    await run_until_signalled(server, drain, *background)


def reload(engine: RouterEngine) -> None:
    """SIGHUP: the scheduler list again, from the environment and --config."""
    try:
        engine.reload(RouterSettings.load(sys.argv[1:]).scheduler)
    except SettingsInvalid as e:
        log.error("SIGHUP: %s; keeping the scheduler list", e)


def main() -> None:
    settings = load_or_exit(RouterSettings)
    if settings.processes > 1:
        logs.configure(settings.log_level, settings.log_format)
        sys.exit(supervise(settings))
    run_service(RouterSettings, serve, settings)


if __name__ == "__main__":
    main()
