"""python -m executor: serve a model over gRPC to one scheduler."""

import logging
from pathlib import Path

from executor.config import ExecutorConfig
from executor.model_runner import ModelRunner
from executor.service import SERVICE_NAME, ExecutorService
from flagstop import wire
from flagstop.telemetry import Telemetry, start_metrics_server
from flagstop.v1 import executor_pb2_grpc


def parse_args(argv: list[str] | None = None):
    p = wire.EnvArgumentParser("FLAGSTOP_EXECUTOR_", prog="python -m executor", description=__doc__)
    p.add_argument("--model", default="models/flagstop-tiny", help="a local HF checkpoint dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides sizing)")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="KV cache size on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: triton on CUDA, torch on the CPU")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=8003, help="Prometheus /metrics; 0: off")
    wire.add_tls_args(p)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(args) -> ExecutorConfig:
    return ExecutorConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, seed=args.seed,
    )  # fmt: skip


async def serve(args) -> None:
    runner = ModelRunner(config_from_args(args))
    service = ExecutorService(runner, Path(args.model).name, Telemetry("flagstop-executor"))
    start_metrics_server(args.metrics_port, args.host)
    server = wire.new_server(args.port, args.host, wire.TLSConfig.from_args(args))
    executor_pb2_grpc.add_ExecutorServicer_to_server(service, server)
    health = wire.add_health_and_reflection(server, [SERVICE_NAME])
    await server.start()
    wire.set_serving(health, [SERVICE_NAME], True)
    logging.getLogger("flagstop.executor").info(
        "serving %s on %s:%d: %d KV blocks of %d tokens on %s",
        args.model, args.host, args.port, runner.num_blocks, runner.block_size, runner.device,
    )  # fmt: skip

    async def drain() -> None:
        wire.set_serving(health, [SERVICE_NAME], False)

    await wire.run_until_signalled(server, drain)


if __name__ == "__main__":
    wire.main(parse_args, serve)
