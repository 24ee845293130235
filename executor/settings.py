"""The executor service's settings: flags, FLAGSTOP_EXECUTOR_* variables, --config."""

from pydantic_settings import SettingsConfigDict

from flagstop.executor.config import ExecutorConfig
from flagstop.settings import Port, ServiceSettings


class ExecutorSettings(ServiceSettings, ExecutorConfig):
    """python -m flagstop.executor: serve a model over gRPC to one scheduler."""

    model_config = SettingsConfigDict(
        env_prefix="FLAGSTOP_EXECUTOR_", cli_prog_name="flagstop-executor"
    )

    port: Port = 50053
    metrics_port: Port = 8003
    """Prometheus /metrics; 0: off"""
