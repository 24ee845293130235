"""flagstop-router (python -m flagstop.router): the client-facing gRPC server
(flagstop.v1.Generation)."""

from transformers import AutoTokenizer

from flagstop.health import Health
from flagstop.router.auth import ApiKeyCheck
from flagstop.router.service import SERVICE_NAME, RouterService
from flagstop.router.settings import RouterSettings
from flagstop.server import StartupError, TLSConfig, new_server, run_service, run_until_signalled
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import generation_pb2_grpc


async def serve(settings: RouterSettings) -> None:
    try:
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot load the tokenizer of {settings.model}: {e}") from None
    api_key = settings.api_key.get_secret_value() if settings.api_key else None
    server = new_server(
        settings.port, settings.host, TLSConfig.from_settings(settings),
        require_client_cert=settings.tls_require_client_cert,
        max_receive_bytes=settings.max_request_bytes,
        interceptors=(ApiKeyCheck(api_key),) if api_key else (),
    )  # fmt: skip
    health = Health(server, [SERVICE_NAME])
    service = RouterService(tokenizer, settings, health, Telemetry("flagstop-router"))
    start_metrics_server(settings.metrics_port, settings.host)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    await server.start()  # live, not ready until the scheduler has described itself
    await run_until_signalled(server, service.drain, service.run())


def main() -> None:
    run_service(RouterSettings, serve)


if __name__ == "__main__":
    main()
