"""flagstop-executor (python -m flagstop.executor): serve a model over gRPC to one
scheduler."""

import logging
from pathlib import Path

from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.service import SERVICE_NAME, ExecutorService
from flagstop.executor.settings import ExecutorSettings
from flagstop.health import Health
from flagstop.server import StartupError, TLSConfig, new_server, run_service, run_until_signalled
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import executor_pb2_grpc

log = logging.getLogger("flagstop.executor")


async def serve(settings: ExecutorSettings) -> None:
    try:
        runner = ModelRunner(settings)
    except (OSError, ValueError, RuntimeError) as e:
        raise StartupError(f"cannot load {settings.model}: {e}") from None
    server = new_server(settings.port, settings.host, TLSConfig.from_settings(settings))
    health = Health(server, [SERVICE_NAME])
    service = ExecutorService(runner, Path(settings.model).name, Telemetry("flagstop-executor"))
    executor_pb2_grpc.add_ExecutorServicer_to_server(service, server)
    start_metrics_server(settings.metrics_port, settings.host)
    await server.start()
    health.set_ready(True)
    log.info("serving %s on %s:%d: %d KV blocks of %d tokens on %s", settings.model,
             settings.host, settings.port, runner.num_blocks, runner.block_size,
             runner.device)  # fmt: skip

    async def drain() -> None:
        health.set_ready(False)

    await run_until_signalled(server, drain)


def main() -> None:
    run_service(ExecutorSettings, serve)


if __name__ == "__main__":
    main()
