"""OpenAI's /v1/embeddings on a pooling model (docs/pooling.md): one input or a batch
(strings or token ids), as float lists or base64 (float32 little-endian: what the
openai SDK asks for by default and decodes), cut to `dimensions` where the model
allows it, with the prompt tokens in usage."""

import base64
from typing import Literal

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field

from flagstop.router.openai.errors import from_failure
from flagstop.router.openai.front import Front, authorized, until_disconnected
from flagstop.router.openai.protocol import INT32_MAX, EncodableText, Int32, TokenId
from flagstop.router.pending import RequestFailed
from flagstop.router.pooling import embed
from flagstop.v1 import generation_pb2


class EmbeddingRequest(EncodableText):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None
    # vLLM's and flagstop's extras: unit length (the model's own choice by default),
    # the priority and the cache salt of GenerateRequest.
    normalize: bool | None = None
    priority: Int32 = 0
    cache_salt: str = ""

    def embed_request(self, lora_name: str) -> generation_pb2.EmbedRequest:
        request = generation_pb2.EmbedRequest(
            inputs=inputs(self.input), dimensions=self.dimensions or 0, lora_name=lora_name,
            priority=self.priority, cache_salt=self.cache_salt,
        )  # fmt: skip
        if self.normalize is not None:
            request.normalize = self.normalize
        return request


def inputs(data) -> list[generation_pb2.EmbedInput]:
    """One input or a batch: strings or token ids."""
    if isinstance(data, str) or (data and isinstance(data[0], int)):
        data = [data]
    return [generation_pb2.EmbedInput(text=one) if isinstance(one, str)
            else generation_pb2.EmbedInput(token_ids=one) for one in data]  # fmt: skip


api = APIRouter(dependencies=[Depends(authorized)])


@api.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http: Request, front: Front) -> Response:
    model = front.check_model(body.model)
    request = body.embed_request(front.lora_name(model))
    result = await pooled(http, front, embed, request)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(e.values, body)}
            for i, e in enumerate(result.embeddings)]  # fmt: skip
    body_out = {"object": "list", "data": data, "model": model, "usage": usage(result.usage)}
    return json_response(body_out)


async def pooled(http: Request, front: Front, pool, request, *args):
    """A pooling request's result (router/pooling.py), its refusal the HTTP error;
    abandoned when the client disconnects."""
    try:
        return await until_disconnected(
            http, pool(front.engine, request, list(http.headers.items()), *args)
        )
    except RequestFailed as e:
        raise from_failure(e) from None


def usage(u: generation_pb2.Usage) -> dict:
    """OpenAI's usage of a request that generates nothing."""
    return {"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens}


def json_response(body: dict) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _encoded(values, body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "base64":
        return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()
    return list(values)
