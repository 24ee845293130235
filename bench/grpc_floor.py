"""What one streamed message costs a Python gRPC server with nothing else in the way:
flagstop.v1.Generation's Generate doing only the router fan-out's per-token pattern.

    python bench/grpc_floor.py --server grpcio|native --port PORT [--step-ms 8]

Every STEP ms a "step" task resolves one future per waiting stream; each stream's
handler then yields one GenerateResponse (one token id, two characters of text) until
the request's max_tokens, the last with its finish reason and usage, as the router's
last chunk. No tokenizer, no scheduler, no mailbox: the same client
(bench/overhead_bench.py --floor) divides this process's CPU by the tokens it got,
and the router's row minus this one is the router's own work per token.
(The team's ../shared/tools/grpc_floor measures the same with a message of its own.)"""

import argparse
import asyncio

import uvloop

from flagstop.server import new_server
from flagstop.v1 import generation_pb2, generation_pb2_grpc


class FloorGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.waiters: list[asyncio.Future] = []

    async def Generate(self, request, context):
        loop = asyncio.get_running_loop()
        last = request.max_tokens - 1
        for i in range(request.max_tokens):
            waiter = loop.create_future()
            self.waiters.append(waiter)
            await waiter
            if i < last:
                yield generation_pb2.GenerateResponse(token_ids=[i], text="ab")
            else:
                yield generation_pb2.GenerateResponse(
                    token_ids=[i], text="ab", finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                    usage=generation_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                               completion_tokens=request.max_tokens),
                )  # fmt: skip

    async def step(self, step_s: float) -> None:
        while True:
            await asyncio.sleep(step_s)
            waiters, self.waiters = self.waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)


async def serve(args) -> None:
    server = new_server(args.port, kind=args.server)
    floor = FloorGeneration()
    generation_pb2_grpc.add_GenerationServicer_to_server(floor, server)
    await server.start()
    stepper = asyncio.create_task(floor.step(args.step_ms / 1000))
    try:
        await server.wait_for_termination()
    finally:
        stepper.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["grpcio", "native"], default="grpcio")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=8.0)
    uvloop.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
