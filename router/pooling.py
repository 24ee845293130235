"""Pooling requests (docs/pooling.md): each input of an embedding, classification or
scoring request becomes one GenerateRequest that computes its prompt and pools it
(the scheduler's prefill-only kind), all submitted at once and collected in order.
The gRPC Embed, Classify and Score and the HTTP fronts share it.

A score's input is a (query, document) pair, tokenized as the tokenizer encodes a
pair (a cross-encoder's separators; a decoder's, the two in a row), so every
document's prompt starts with its query's tokens: a reranker's query is computed
once and then a prefix-cache hit."""

import asyncio
from dataclasses import dataclass

import grpc
import numpy as np

from flagstop.router.engine import RouterEngine
from flagstop.router.pending import Pending, RequestFailed
from flagstop.v1 import generation_pb2

# Inputs in one request: OpenAI's limit for /v1/embeddings (and documents a score's).
MAX_POOLING_INPUTS = 2048
Input = generation_pb2.EmbedInput


@dataclass(slots=True)
class Pooled:
    """A pooling request's outputs (float32 values each) and usage."""

    outputs: list[np.ndarray]
    usage: generation_pb2.Usage


async def embed(engine: RouterEngine, request: generation_pb2.EmbedRequest,
                metadata) -> generation_pb2.EmbedResponse:  # fmt: skip
    """Every input's embedding, in order, and the usage. Raises RequestFailed: a
    refused input is named (input[i]), and none of the others is run."""
    pooling = generation_pb2.PoolingParams(task=generation_pb2.POOLING_TASK_EMBED,
                                           dimensions=request.dimensions)  # fmt: skip
    if request.HasField("normalize"):
        pooling.normalize = request.normalize
    inputs = _checked(request.inputs, "input")
    pooled = await _pool(engine, [_one(request, pooling, one) for one in inputs], metadata,
                         "embeddings", "input")  # fmt: skip
    response = generation_pb2.EmbedResponse(usage=pooled.usage)
    for values in pooled.outputs:
        response.embeddings.add(values=values.tolist())
    return response


async def classify(engine: RouterEngine, request: generation_pb2.ClassifyRequest,
                   metadata) -> generation_pb2.ClassifyResponse:  # fmt: skip
    """Every input's class probabilities (or logits), in order, and the usage."""
    pooling = _classifier_params(generation_pb2.POOLING_TASK_CLASSIFY, request)
    inputs = _checked(request.inputs, "input")
    pooled = await _pool(engine, [_one(request, pooling, one) for one in inputs], metadata,
                         "classify", "input")  # fmt: skip
    labels = engine.limits.labels
    response = generation_pb2.ClassifyResponse(usage=pooled.usage)
    for probs in pooled.outputs:
        response.classifications.add(probs=probs.tolist(), label=labels[int(probs.argmax())])
    return response


async def score(engine: RouterEngine, request: generation_pb2.ScoreRequest, metadata,
                names: tuple[str, str] = ("queries", "documents")
                ) -> generation_pb2.ScoreResponse:  # fmt: skip
    """Every (query, document) pair's score, in the documents' order or ranked, and
    the usage. names: the request's fields as its front calls them (refusals name
    them: text_2[3])."""
    pooling = _classifier_params(generation_pb2.POOLING_TASK_SCORE, request)
    requests = [_one(request, pooling, Input(token_ids=ids))
                for ids in pair_ids(engine.tokenizer, _pairs(request, names))]  # fmt: skip
    pooled = await _pool(engine, requests, metadata, "score", names[1])
    scores = [generation_pb2.DocumentScore(index=i, score=float(values[0]))
              for i, values in enumerate(pooled.outputs)]  # fmt: skip
    if request.ranked:
        scores.sort(key=lambda s: -s.score)
        scores = scores[: request.top_n or None]
    return generation_pb2.ScoreResponse(scores=scores, usage=pooled.usage)


def pair_ids(tokenizer, pairs: list[tuple[Input, Input]]) -> list[list[int]]:
    """Each pair's tokens: the tokenizer's encoding of two texts as a pair (all pairs
    in one call: the Rust tokenizer's batch), else the query's tokens then the
    document's (token ids as given, text without special tokens)."""
    if all(q.text and d.text for q, d in pairs):
        return tokenizer([q.text for q, _ in pairs], [d.text for _, d in pairs]).input_ids
    return [_ids(tokenizer, q) + _ids(tokenizer, d) for q, d in pairs]


def _ids(tokenizer, one: Input) -> list[int]:
    return list(one.token_ids) or tokenizer(one.text, add_special_tokens=False).input_ids


def _classifier_params(task, request) -> generation_pb2.PoolingParams:
    pooling = generation_pb2.PoolingParams(task=task)
    if request.HasField("activation"):
        pooling.activation = request.activation
    return pooling


def _checked(inputs, name: str) -> list[Input]:
    """Raises RequestFailed for none, too many, or an input with both text and ids."""
    if not inputs:
        raise _refusal(f"no {name}: send at least one", name)
    if len(inputs) > MAX_POOLING_INPUTS:
        raise _refusal(f"{name} has {len(inputs)} inputs, more than {MAX_POOLING_INPUTS} "
                       "in one request: split them", name)  # fmt: skip
    for i, one in enumerate(inputs):
        if one.text and one.token_ids:
            raise _refusal(f"{name}[{i}]: give text or token_ids, not both", name)
    return list(inputs)


def _pairs(request: generation_pb2.ScoreRequest, names: tuple[str, str]) -> list[tuple]:
    """One query against every document, or a query per document."""
    queries, documents = _checked(request.queries, names[0]), _checked(request.documents,
                                                                       names[1])  # fmt: skip
    if len(queries) not in (1, len(documents)):
        raise _refusal(f"{len(queries)} {names[0]} for {len(documents)} {names[1]}: send one "
                       f"(scored against each) or one per {names[1]} entry", names[0])  # fmt: skip
    for name, side in zip(names, (queries, documents), strict=True):
        if (i := next((i for i, one in enumerate(side) if not one.text and not one.token_ids),
                      None)) is not None:  # fmt: skip
            raise _refusal(f"{name}[{i}] is empty: send text or token ids", name)
    return list(zip(queries * len(documents) if len(queries) == 1 else queries, documents,
                    strict=True))  # fmt: skip


def _refusal(message: str, param: str) -> RequestFailed:
    return RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def _one(request, pooling, one: Input) -> generation_pb2.GenerateRequest:
    """A pooling request of one input, with the request's common fields (EmbedRequest,
    ClassifyRequest and ScoreRequest name them alike)."""
    return generation_pb2.GenerateRequest(
        prompt=one.text, prompt_token_ids=one.token_ids, pooling=pooling,
        lora_name=request.lora_name, labels=request.labels, priority=request.priority,
        cache_salt=request.cache_salt, tenant=request.tenant,
        request_class=request.request_class,
    )  # fmt: skip


async def _pool(engine: RouterEngine, requests: list[generation_pb2.GenerateRequest],
                metadata, operation: str, name: str) -> Pooled:  # fmt: skip
    """Every request's pooled output, in order. Raises RequestFailed: a refused one
    is named (name[i]), and none of the others is run."""
    pendings: list[Pending] = []
    try:
        for i, one in enumerate(requests):
            pendings.append(_submit(engine, one, metadata, operation, f"{name}[{i}]"))
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_pooled(engine, p)) for p in pendings]
    except* RequestFailed as failures:
        raise failures.exceptions[0] from None
    finally:
        for pending in pendings:
            engine.release(pending)
    usage = generation_pb2.Usage()
    for pending in pendings:
        usage.prompt_tokens += len(pending.prompt_token_ids)
        usage.cached_tokens += pending.num_cached_tokens
    return Pooled([np.frombuffer(t.result(), "<f4") for t in tasks], usage)


def _submit(engine: RouterEngine, request, metadata, operation: str, where: str) -> Pending:
    try:
        return engine.submit(request, metadata, operation)
    except RequestFailed as e:
        if e.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise
        raise RequestFailed(e.code, f"{where}: {e.message}", e.param) from None


async def _pooled(engine: RouterEngine, pending: Pending) -> bytes:
    """Its pooled output (float32 little-endian), once the request ends."""
    async for _ in engine.stream(pending):
        pass
    return pending.pooled
