"""A tensor-parallel rank other than 0: it loads its shard and follows rank 0's steps,
serving no gRPC. Started by rank 0 (python -m flagstop.executor.tp_worker, its settings
in the environment), or by torchrun as flagstop-executor with RANK > 0."""

import logging
import os
import sys

import torch

from flagstop import logs
from flagstop.executor.config import ExecutorConfig
from flagstop.executor.convert import plan_from_proto
from flagstop.executor.distributed import (
    Membership,
    join,
    leave,
    report_error,
    spawned_config,
    start_group,
)
from flagstop.executor.model_runner import ModelRunner
from flagstop.executor.tp_messages import LORA_LOAD, LORA_UNLOAD, MEDIA, RESET, STEP, STOP
from flagstop.server import StartupError
from flagstop.v1 import executor_pb2, generation_pb2

log = logging.getLogger("flagstop.executor.tp")


def follow(config: ExecutorConfig, membership: Membership) -> None:
    """Until rank 0 says stop; raises when the group is lost."""
    group = start_group(config, membership)
    try:
        runner = ModelRunner(config, group.tp, after_load=lambda: join(group), device=group.device)
    except StartupError:
        raise
    except Exception as e:  # this rank's shard: tell rank 0 why
        report_error(group, e)
        raise
    runner.drafter.channel = FollowerDrafts(group)
    log.info("rank %d of %d ready on %s", membership.rank, membership.world_size, group.device)
    while True:
        kind, tokens, counts, payload = group.receive()
        if kind == STEP:
            runner.advance_sampled(tokens, counts)
            runner.execute_shard(plan_from_proto(executor_pb2.StepRequest.FromString(payload)))
        elif kind == RESET:
            runner.reset()
        elif kind == LORA_LOAD:
            load = generation_pb2.LoadLoRAAdapterRequest.FromString(payload)
            runner.lora.register_in_background(load.lora_name, load.lora_path)
        elif kind == LORA_UNLOAD:
            runner.unload_lora(
                generation_pb2.UnloadLoRAAdapterRequest.FromString(payload).lora_name
            )
        elif kind == MEDIA:
            for item in executor_pb2.PrepareMediaRequest.FromString(payload).items:
                runner.prepare_media(item.hash, item.pixel_values, list(item.shape), item.dtype,
                                     list(item.grid))  # fmt: skip
        elif kind == STOP:
            leave(group)
            return


class FollowerDrafts:
    """A rank other than 0 takes each step's drafts from rank 0."""

    def __init__(self, group) -> None:
        self.group = group

    def receive(self):
        return self.group.receive_drafts()


def main() -> None:
    config = spawned_config()
    logs.configure("INFO", "text")
    membership = Membership.from_environment(config)
    assert membership is not None, "started without RANK/WORLD_SIZE"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        follow(config, membership)
    except Exception as e:
        log.error("rank %d stops: %s", membership.rank, e)
        sys.exit(1)


if __name__ == "__main__":
    main()
