"""Embeddings (docs/pooling.md): each input of a pooling model's request becomes one
GenerateRequest that computes its prompt and pools it (the scheduler's prefill-only
kind), all submitted at once and collected in order. The gRPC Embed and the HTTP
/v1/embeddings fronts share it."""

import asyncio

import grpc
import numpy as np

from flagstop.router.engine import RouterEngine
from flagstop.router.pending import Pending, RequestFailed
from flagstop.v1 import generation_pb2

# Inputs in one request: OpenAI's limit for /v1/embeddings.
MAX_EMBED_INPUTS = 2048


def embed_requests(request: generation_pb2.EmbedRequest) -> list[generation_pb2.GenerateRequest]:
    """A pooling request per input. Raises RequestFailed for a request with none, or
    too many, or an input that is neither text nor token ids."""
    if not request.inputs:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "no input: send at least one",
                            "input")  # fmt: skip
    if len(request.inputs) > MAX_EMBED_INPUTS:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{len(request.inputs)} inputs in one request, more than "
                            f"{MAX_EMBED_INPUTS}: split them", "input")  # fmt: skip
    pooling = generation_pb2.PoolingParams(task=generation_pb2.POOLING_TASK_EMBED,
                                           dimensions=request.dimensions)  # fmt: skip
    if request.HasField("normalize"):
        pooling.normalize = request.normalize
    return [_one(request, pooling, i, one) for i, one in enumerate(request.inputs)]


def _one(request, pooling, i: int, one: generation_pb2.EmbedInput):
    if one.text and one.token_ids:
        raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT,
                            f"input[{i}]: give text or token_ids, not both", "input")  # fmt: skip
    return generation_pb2.GenerateRequest(
        prompt=one.text, prompt_token_ids=one.token_ids, pooling=pooling,
        lora_name=request.lora_name, labels=request.labels, priority=request.priority,
        cache_salt=request.cache_salt, tenant=request.tenant,
        request_class=request.request_class,
    )  # fmt: skip


async def embed(engine: RouterEngine, request: generation_pb2.EmbedRequest,
                metadata) -> generation_pb2.EmbedResponse:  # fmt: skip
    """Every input's embedding, in order, and the usage. Raises RequestFailed: a
    refused input is named (input[i]), and none of the others is run."""
    pendings: list[Pending] = []
    try:
        for i, one in enumerate(embed_requests(request)):
            pendings.append(_submit(engine, one, metadata, i))
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_pooled(engine, p)) for p in pendings]
    except* RequestFailed as failures:
        raise failures.exceptions[0] from None
    finally:
        for pending in pendings:
            engine.release(pending)
    response = generation_pb2.EmbedResponse()
    for task, pending in zip(tasks, pendings, strict=True):
        response.embeddings.add(values=np.frombuffer(task.result(), "<f4").tolist())
        response.usage.prompt_tokens += len(pending.prompt_token_ids)
        response.usage.cached_tokens += pending.num_cached_tokens
    return response


def _submit(engine: RouterEngine, request, metadata, i: int) -> Pending:
    try:
        return engine.submit(request, metadata, "embeddings")
    except RequestFailed as e:
        if e.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise RequestFailed(e.code, f"input[{i}]: {e.message}", e.param) from None


async def _pooled(engine: RouterEngine, pending: Pending) -> bytes:
    """Its pooled output (float32 little-endian), once the request ends."""
    async for _ in engine.stream(pending):
        pass
    return pending.pooled
