"""The Responses API surface (POST /v1/responses): its request becomes a chat request
(responses_request.py) run on the chat path, its output the Responses object and its
events (responses_stream.py)."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from flagstop.router.openai import responses_stream
from flagstop.router.openai.chat_request import as_chat
from flagstop.router.openai.errors import json_response
from flagstop.router.openai.front import Front, authorized, until_disconnected
from flagstop.router.openai.responses_request import ResponsesRequest
from flagstop.router.openai.responses_stream import ResponseEvents

api = APIRouter(dependencies=[Depends(authorized)])


@api.post("/v1/responses")
async def responses(body: ResponsesRequest, http: Request, front: Front) -> Response:
    served = front.check_model(body.model)
    builder, choice, pending = await front.start_one(http, as_chat(body), "responses")
    events, engine = ResponseEvents(body, served), front.engine
    if body.stream:
        chunks = await front.started(http, engine.stream(pending), [pending])
        return StreamingResponse(
            responses_stream.stream(engine, builder, choice, pending, events, chunks),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
        )  # fmt: skip
    work = responses_stream.collect(engine, builder, choice, pending, events)
    return json_response(await until_disconnected(http, work))
