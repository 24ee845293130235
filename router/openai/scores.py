"""A classification model's routes in vLLM's shapes (docs/pooling.md): /classify (each
input's class probabilities), /score (text_1 against text_2: one against each, or
pairwise) and /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's: one query's
documents ranked by relevance, top_n of them, with or without their text)."""

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from flagstop.router.openai.embeddings import inputs, json_response, pooled, usage
from flagstop.router.openai.front import Front, authorized
from flagstop.router.openai.protocol import INT32_MAX, EncodableText, Int32, TokenId
from flagstop.router.pooling import classify, score
from flagstop.v1 import generation_pb2

Input = generation_pb2.EmbedInput


class PoolingBody(EncodableText):
    model: str
    # vLLM's: the class probabilities (true, default) or the head's logits.
    use_activation: bool | None = None
    priority: Int32 = 0
    cache_salt: str = ""

    def common(self, front: Front, model: str) -> dict:
        """The fields every pooling request of router/pooling.py takes."""
        fields = {"lora_name": front.lora_name(model), "priority": self.priority,
                  "cache_salt": self.cache_salt}  # fmt: skip
        if self.use_activation is not None:
            fields["activation"] = self.use_activation
        return fields


class ClassifyBody(PoolingBody):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]


class ScoreBody(PoolingBody):
    text_1: str | list[str]
    text_2: str | list[str]


class Document(BaseModel):
    text: str


class RerankBody(PoolingBody):
    query: str
    documents: list[str | Document]
    top_n: int = Field(0, ge=0, le=INT32_MAX)  # 0: all
    return_documents: bool = True


api = APIRouter(dependencies=[Depends(authorized)])


@api.post("/classify")
@api.post("/v1/classify")
async def classify_route(body: ClassifyBody, http: Request, front: Front) -> Response:
    model = front.check_model(body.model)
    request = generation_pb2.ClassifyRequest(inputs=inputs(body.input),
                                             **body.common(front, model))  # fmt: skip
    result = await pooled(http, front, classify, request)
    data = [{"index": i, "label": c.label, "probs": list(c.probs), "num_classes": len(c.probs)}
            for i, c in enumerate(result.classifications)]  # fmt: skip
    return json_response({"id": _id("classify"), "object": "list", "created": int(time.time()),
                          "model": model, "data": data, "usage": usage(result.usage)})  # fmt: skip


@api.post("/score")
@api.post("/v1/score")
async def score_route(body: ScoreBody, http: Request, front: Front) -> Response:
    model = front.check_model(body.model)
    request = generation_pb2.ScoreRequest(queries=_texts(body.text_1),
                                          documents=_texts(body.text_2),
                                          **body.common(front, model))  # fmt: skip
    result = await pooled(http, front, score, request, ("text_1", "text_2"))
    data = [{"index": s.index, "object": "score", "score": s.score} for s in result.scores]
    return json_response({"id": _id("score"), "object": "list", "created": int(time.time()),
                          "model": model, "data": data, "usage": usage(result.usage)})  # fmt: skip


@api.post("/rerank")
@api.post("/v1/rerank")
@api.post("/v2/rerank")
async def rerank_route(body: RerankBody, http: Request, front: Front) -> Response:
    model = front.check_model(body.model)
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    request = generation_pb2.ScoreRequest(
        queries=[Input(text=body.query)], documents=_texts(texts), ranked=True,
        top_n=body.top_n, **body.common(front, model),
    )  # fmt: skip
    result = await pooled(http, front, score, request, ("query", "documents"))
    results = [{"index": s.index, "relevance_score": s.score,
                **({"document": {"text": texts[s.index]}} if body.return_documents else {})}
               for s in result.scores]  # fmt: skip
    tokens = result.usage.prompt_tokens
    return json_response({"id": _id("rerank"), "model": model, "results": results,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


def _texts(data: str | list[str]) -> list[Input]:
    return [Input(text=one) for one in ([data] if isinstance(data, str) else data)]


def _id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"
