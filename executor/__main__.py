"""flagstop-executor (python -m flagstop.executor): serve a model over gRPC to one
scheduler, alone or as rank 0 of a tensor-parallel group (under torchrun, the
processes with RANK > 0 follow rank 0 instead of serving). With --simulate it serves
the executor simulator, a load-test tool, and imports no torch."""

import logging
import os
from pathlib import Path

from flagstop.executor.config import ExecutorConfig
from flagstop.executor.kv_transfers.decode import LeaseClient
from flagstop.executor.service import SERVICE_NAME, ExecutorService
from flagstop.executor.settings import ExecutorSettings
from flagstop.health import Health
from flagstop.server import (
    StartupError,
    TLSConfig,
    freeze_startup_heap,
    new_server,
    run_service,
    run_until_signalled,
)
from flagstop.settings import config_from
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import executor_pb2_grpc

log = logging.getLogger("flagstop.executor")


def load_runner(settings: ExecutorConfig, membership):
    """(runner, group or None); a model that cannot be split or loaded stops start-up."""
    import torch

    from flagstop.executor.distributed import GroupDriver, join, start_group
    from flagstop.executor.model_runner import ModelRunner
    from flagstop.executor.models.config import ConfigError, ModelConfig
    from flagstop.executor.parallel import check_divisible

    try:
        mc = ModelConfig.from_pretrained(settings.model, settings.hf_overrides)
    except ConfigError as e:  # read, and names what it cannot run
        raise StartupError(f"{settings.model}/config.json: {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise StartupError(f"cannot read {settings.model}/config.json: {e}") from None
    size = settings.tensor_parallel_size
    if why := check_divisible(mc, size, settings.expert_parallel):
        raise StartupError(f"--tensor-parallel-size {size}: {why}")
    if size == 1:
        return _model_runner(settings, ModelRunner), None
    # One thread per rank unless told otherwise: ranks share the machine's cores.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group = start_group(settings, membership)
    try:
        runner = _model_runner(settings, ModelRunner, group.tp, lambda: join(group), group.device)
        driver = GroupDriver(group)
        runner.drafter.channel = driver  # rank 0 sends each step's drafts to the others
        return runner, driver
    except BaseException:
        group.stop_children()
        raise


def _model_runner(settings: ExecutorConfig, runner_class, *args):
    """The runner; a checkpoint the model's parts refuse at load (a classification
    head of the wrong shape) stops start-up naming it."""
    from flagstop.executor.models.config import ConfigError

    try:
        return runner_class(settings, *args)
    except ConfigError as e:
        raise StartupError(f"{settings.model}: {e}") from None


def simulated_runner(settings: ExecutorConfig):
    from flagstop.executor.simulator import SimulatedRunner

    if settings.tensor_parallel_size != 1:
        raise StartupError("--simulate runs one process: leave --tensor-parallel-size at 1")
    if settings.kv_offload_bytes:
        raise StartupError("--kv-offload-bytes: the simulator keeps no KV, so no host tier")
    return SimulatedRunner(settings), None


def bound_onednn_caches(config: ExecutorConfig) -> None:
    """Both caches read their capacity from the environment when torch first builds a
    primitive: set here, before torch is imported, and inherited by the ranks this
    process starts."""
    capacity = str(config.onednn_cache_capacity)
    os.environ["LRU_CACHE_CAPACITY"] = capacity  # ideep's
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity  # oneDNN's own


def with_kv_transfer_host(config: ExecutorConfig, host: str) -> ExecutorConfig:
    """--kv-role prefill or decode: the address others reach this executor at, --host
    unless set (and --host only when it names one address)."""
    if config.kv_role == "both" or config.kv_transfer_host:
        return config
    if host in ("0.0.0.0", "::", ""):
        raise StartupError(f"--kv-role {config.kv_role} with --host {host}: set "
                           "--kv-transfer-host to the address other executors reach this "
                           "one at")  # fmt: skip
    return config.model_copy(update={"kv_transfer_host": host})


async def serve(settings: ExecutorSettings) -> None:
    # What the runner and the ranks take.
    config = with_kv_transfer_host(config_from(settings, ExecutorConfig), settings.host)
    bound_onednn_caches(config)
    membership = None
    if not config.simulate:
        from flagstop.executor.distributed import Membership
        from flagstop.executor.tp_worker import follow

        membership = Membership.from_environment(config)
        if membership is not None and membership.rank != 0:
            follow(config, membership)  # torchrun's other ranks serve no gRPC
            return
    try:
        if config.simulate:
            runner, group = simulated_runner(config)
        else:
            runner, group = load_runner(config, membership)
    except StartupError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        raise StartupError(f"cannot load {settings.model}: {e}") from None
    tls = TLSConfig.from_settings(settings)
    server = new_server(settings.port, settings.host, tls)
    health = Health(server, [SERVICE_NAME])
    telemetry = Telemetry("flagstop-executor")
    kv_endpoint = ""
    if config.kv_role == "prefill":
        kv_endpoint = f"{config.kv_transfer_host}:{settings.port}"
    elif config.kv_role == "decode":  # rank 0 asks the prefill executors for leases
        runner.kv_worker.leases = LeaseClient(tls, config.kv_transfer_timeout_s)
    service = ExecutorService(runner, Path(settings.model).name, telemetry, group, kv_endpoint)
    executor_pb2_grpc.add_ExecutorServicer_to_server(service, server)
    start_metrics_server(settings.metrics_port, settings.host)
    freeze_startup_heap()
    await server.start()
    health.set_ready(True)
    what = "SIMULATED (a load-test tool, not a model)" if settings.simulate else settings.model
    role = "" if config.kv_role == "both" else f", KV role {config.kv_role}"
    log.info("serving %s on %s:%d: %d KV blocks of %d tokens on %s, tensor parallel %d%s",
             what, settings.host, settings.port, runner.num_blocks, runner.block_size,
             runner.device, runner.tensor_parallel_size, role)  # fmt: skip

    async def drain() -> None:
        health.set_ready(False)
        service.stop_group()

    await run_until_signalled(server, drain, service.keep_group_alive())


def main() -> None:
    run_service(ExecutorSettings, serve)


if __name__ == "__main__":
    main()
