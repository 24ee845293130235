"""Load against a running stack, shared by the tests and the benchmarks: many short
streams at once, and what each process holds in memory after them."""

import asyncio
from pathlib import Path

from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))


async def many_streams(router: str, n: int, max_tokens: int = 4) -> list[int]:
    """n concurrent streams of max_tokens each (distinct prompts, seeded sampling);
    returns how many tokens each got."""
    async with channel(router) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> int:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=[0, 3 + i % 500, 7], max_tokens=max_tokens, ignore_eos=True,
                seed=i,
            )  # fmt: skip
            return sum([len(c.token_ids) async for c in stub.Generate(request, timeout=120)])

        return await asyncio.gather(*(one(i) for i in range(n)))
