"""flagstop-scheduler (python -m flagstop.scheduler_svc): the scheduling service between
routers and an executor."""

from flagstop.health import Health
from flagstop.scheduler_svc.policy_client import POLICY_SERVICE
from flagstop.scheduler_svc.service import SERVICE_NAME, SchedulerService
from flagstop.scheduler_svc.settings import SchedulerSettings
from flagstop.scheduler_svc.telemetry import SchedulerTelemetry
from flagstop.server import (
    TLSConfig,
    freeze_startup_heap,
    new_server,
    run_service,
    run_until_signalled,
)
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import scheduler_pb2_grpc


async def serve(settings: SchedulerSettings) -> None:
    server = new_server(settings.port, settings.host, TLSConfig.from_settings(settings))
    health = Health(server, [SERVICE_NAME])
    if settings.policy == "remote":
        health.set_detail(POLICY_SERVICE, False)
    telemetry = SchedulerTelemetry(Telemetry("flagstop-scheduler"))
    service = SchedulerService(settings, health, telemetry)
    start_metrics_server(settings.metrics_port, settings.host)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    freeze_startup_heap()
    await server.start()  # live, not ready until the executor has described itself
    await run_until_signalled(server, service.drain, service.run())


def main() -> None:
    run_service(SchedulerSettings, serve)


if __name__ == "__main__":
    main()
