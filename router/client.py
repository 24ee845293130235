"""flagstop-client "PROMPT" (python -m flagstop.router.client): stream a generation
from a flagstop router."""

import argparse
import asyncio
import json
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagstop.health import READINESS
from flagstop.scheduler_svc.core.request import FinishReason
from flagstop.server import channel
from flagstop.v1 import generation_pb2, generation_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="flagstop-client", description=__doc__)
    p.add_argument("prompt", nargs="?", default="", help="prompt text")
    p.add_argument("--prompt-ids", default="", help="comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="default 1.0; 0 is greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--addr", default="127.0.0.1:50051", help="router address")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="deadline in seconds, waiting for the router included",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="without --timeout: seconds to wait for the router to serve (a cold "
        "`make serve` takes 10-20 s on 2 cores)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p.parse_args(argv)


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        prompt=args.prompt, min_tokens=args.min_tokens, top_k=args.top_k, stop=args.stop,
        ignore_eos=args.ignore_eos, priority=args.priority,
    )  # fmt: skip
    if args.prompt_ids:
        request.prompt_token_ids.extend(int(t) for t in args.prompt_ids.split(","))
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    return request


async def wait_for_router(ch: grpc.aio.Channel, args: argparse.Namespace) -> None:
    """A router that is starting, restarting, busy accepting a burst of connections, or
    up but not serving yet (its scheduler not connected: `make serve`'s first seconds)
    is waited for, within the deadline, instead of failing the first attempt: until
    its readiness entry (grpc.health.v1) says SERVING."""
    wait_s = args.timeout if args.timeout is not None else args.connect_timeout
    try:
        await asyncio.wait_for(_serving(ch), wait_s)
    except TimeoutError:
        if ch.get_state() == grpc.ChannelConnectivity.READY:
            message = f"the router at {args.addr} was not serving within {wait_s:g} s"
        else:
            message = f"no router answered at {args.addr} within {wait_s:g} s"
        raise ConnectionError(message) from None


async def _serving(ch: grpc.aio.Channel) -> None:
    """Polled with Check, not Watch: a Watch holds a thread of the server's health
    servicer (the synchronous one, in an asyncio server) that a client gone never
    frees, and the server's shutdown waits for it (measured: a router that never
    exited)."""
    health = health_pb2_grpc.HealthStub(ch)
    request = health_pb2.HealthCheckRequest(service=READINESS)
    while True:
        try:
            reply = await health.Check(request, wait_for_ready=True, timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:  # a router restarting: ask the next one
            pass
        await asyncio.sleep(0.1)


async def generate(args: argparse.Namespace) -> dict:
    async with channel(args.addr) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        start, ttft = time.perf_counter(), None
        await wait_for_router(ch, args)
        result = {"text": "", "token_ids": [], "finish_reason": None}
        # wait_for_ready: a connection lost between the wait and the call is retried
        # within the deadline too, rather than failing at once (UNAVAILABLE).
        request, remaining = build_request(args), None
        if args.timeout is not None:
            remaining = max(0.0, args.timeout - (time.perf_counter() - start))
        async for chunk in stub.Generate(request, timeout=remaining, wait_for_ready=True):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - start
            result["text"] += chunk.text
            result["token_ids"] += list(chunk.token_ids)
            if not args.json:
                print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                result["finish_reason"] = FinishReason(chunk.finish_reason).label
                result["prompt_tokens"] = chunk.usage.prompt_tokens
                result["completion_tokens"] = chunk.usage.completion_tokens
        result["ttft_s"], result["e2e_s"] = ttft, time.perf_counter() - start
        return result


def main() -> None:
    args = parse_args()
    try:
        result = asyncio.run(generate(args))
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)
    except ConnectionError as e:
        print(f"error: UNAVAILABLE: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(result) if args.json else "")


if __name__ == "__main__":
    main()
