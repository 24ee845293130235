"""The router's OpenAI-compatible HTTP front (FastAPI on uvicorn, on the router's own
event loop beside the gRPC server): /v1/models, /v1/completions, /v1/chat/completions
with Server-Sent Events, /health, /ready and /metrics. Every request goes through the
same RouterEngine as a gRPC one; errors come back in OpenAI's shape."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai_responses import Choice, ResponseBuilder, TokenTexts
from flagstop.router.output import Pending, RequestFailed

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,  # e.g. a LoRA load on an engine without slots
    grpc.StatusCode.ALREADY_EXISTS: 400,  # a LoRA name loaded already (vLLM's 400)
    grpc.StatusCode.ABORTED: 409,  # a request whose LoRA adapter was replaced under it
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
              413: "invalid_request_error", 429: "rate_limit_error",
              500: "internal_error"}  # fmt: skip
DONE = b"data: [DONE]\n\n"
log = logging.getLogger("flagstop.router.http")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code=None) -> Response:
    error_type = ERROR_TYPE.get(status, "server_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return Response(orjson.dumps(body), status, media_type="application/json")


def from_failure(e: RequestFailed) -> OpenAIError:
    return OpenAIError(HTTP_STATUS.get(e.code, 500), e.message, e.param)


def internal_error(e: Exception, request_id: str) -> OpenAIError:
    """An unexpected failure of one request: logged once, on one line (the traceback
    at debug level), answered with the request id to quote."""
    log.error("request %s failed: %s: %s", request_id, type(e).__name__, e)
    log.debug("request %s", request_id, exc_info=e)
    return OpenAIError(500, f"internal error; quote request id {request_id} when reporting it")


def stream_error(failure: OpenAIError) -> dict[str, Any]:
    error_type = ERROR_TYPE.get(failure.status, "server_error")
    return {"error": {"message": failure.message, "type": error_type, "param": failure.param,
                      "code": failure.status}}  # fmt: skip


def token_id_texts(token_id: int) -> str:
    return f"token_id:{token_id}"


# Characters JSON leaves unescaped that str.splitlines() splits at: clients that read
# a stream with it (httpx's aiter_lines) would cut an event in two. SSE itself splits
# at CR and LF only, which JSON escapes.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def json_line(obj: Any) -> bytes:
    """obj as JSON on one line, whoever splits the lines."""
    data = orjson.dumps(obj)
    if not data.isascii():
        for raw, escaped in _LINE_BREAKS:
            if raw in data:
                data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    return b"data: " + json_line(obj) + b"\n\n"


class OpenAIFront:
    """The routes' logic: requests to GenerateRequests, chunks to the API's shapes."""

    def __init__(self, engine: RouterEngine, chat: ChatTemplate) -> None:
        self.engine, self.chat = engine, chat
        self.texts = TokenTexts(engine.tokenizer)

    def check_model(self, name: str) -> str:
        """The model a request names: the base model or one of its LoRA adapters
        (vLLM's convention); 404 model_not_found otherwise."""
        served = self.engine.model_info.model_name
        if self.engine.limits is None:
            raise OpenAIError(503, "the router is not connected to a scheduler yet; retry")
        if name != served and name not in self.engine.replicas.adapters():
            message = f"model {name!r} is not served here; this router serves {served!r}"
            if adapters := sorted(self.engine.replicas.adapters()):
                message += f" and its LoRA adapters {', '.join(map(repr, adapters))}"
            raise OpenAIError(404, message, "model", "model_not_found")
        return name

    def lora_name(self, model: str) -> str:
        """The adapter a checked model name runs ("": the base model)."""
        return "" if model == self.engine.model_info.model_name else model

    def with_adapter(self, requests, model: str) -> list:
        lora_name = self.lora_name(self.check_model(model))
        for request in requests:
            request.lora_name = lora_name
        return requests

    def submit(self, requests, metadata, operation: str) -> list[Pending]:
        """All of a response's choices, or none (one refused releases the others)."""
        pendings: list[Pending] = []
        try:
            for request in requests:
                pendings.append(self.engine.submit(request, metadata, operation))
        except RequestFailed as e:
            for pending in pendings:
                self.engine.release(pending)
            raise from_failure(e) from None
        return pendings

    def builder(self, body, kind: str) -> ResponseBuilder:
        texts = token_id_texts if body.return_tokens_as_token_ids else self.texts
        return ResponseBuilder(kind, self.check_model(body.model), texts,
                               with_logprobs=body.wants_logprobs,
                               continuous_usage=body.continuous_usage)  # fmt: skip

    def choices(self, body, pendings: list[Pending], make: Callable[[int, Pending], Choice]):
        """A Choice per pending; the first of each prompt counts in usage."""
        n = max(1, body.n)
        choices = []
        for i, pending in enumerate(pendings):
            choice = make(i, pending)
            choice.prompt_token_ids, choice.counts_prompt = pending.prompt_token_ids, i % n == 0
            choices.append(choice)
        return choices

    async def respond(
        self, http: Request, body, kind: str, requests, make: Callable[[int, Pending], Choice]
    ) -> Response:
        """Submit a response's requests and answer: whole, or as Server-Sent Events.
        make: each choice's Choice (echo, tools), given its index and request."""
        builder = self.builder(body, kind)
        operation = "chat" if kind == "chat" else "text_completion"
        requests = self.with_adapter(requests, body.model)
        pendings = self.submit(requests, list(http.headers.items()), operation)
        choices = self.choices(body, pendings, make)
        builder.usage.prompt_tokens = sum(len(c.prompt_token_ids) for c in choices
                                          if c.counts_prompt)  # fmt: skip
        if body.stream:
            stream = self.stream(builder, choices, pendings, body.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        await until_disconnected(http, self.collect(builder, choices, pendings))
        return Response(orjson.dumps(builder.response(choices)), media_type="application/json")

    async def collect(
        self, builder: ResponseBuilder, choices: list[Choice], pendings: list[Pending]
    ) -> list[Choice]:
        async def one(choice: Choice, pending: Pending) -> None:
            async for chunk in self.engine.stream(pending):
                builder.apply(choice, chunk)

        try:
            async with asyncio.TaskGroup() as group:
                for choice, pending in zip(choices, pendings, strict=True):
                    group.create_task(one(choice, pending))
        except* RequestFailed as failures:
            raise from_failure(failures.exceptions[0]) from None
        finally:
            for pending in pendings:
                self.engine.release(pending)
        return choices

    async def stream(
        self, builder: ResponseBuilder, choices: list[Choice], pendings: list[Pending],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """SSE: a chunk per new piece of each choice, a usage chunk when asked, [DONE].
        A failure after the first bytes becomes an error event."""
        try:
            if builder.kind == "chat":
                yield sse(builder.role_chunk(range(len(pendings))))
            async for index, chunk in merged(self.engine, pendings):
                piece = builder.apply(choices[index], chunk)
                if piece is not None:
                    yield sse(builder.chunk([piece]))
            if include_usage:
                yield sse(builder.usage_chunk())
        except RequestFailed as e:
            yield sse(stream_error(from_failure(e)))
        except Exception as e:  # one request's bug: its stream ends, the process goes on
            yield sse(stream_error(internal_error(e, pendings[0].request_id)))
        finally:
            for pending in pendings:
                self.engine.release(pending)
        yield DONE


async def merged(engine: RouterEngine, pendings: list[Pending]):
    """(choice index, chunk) of every choice as they come. One choice streams directly;
    several are pumped by a task each into one queue."""
    if len(pendings) == 1:
        async for chunk in engine.stream(pendings[0]):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pending: Pending) -> None:
        try:
            async for chunk in engine.stream(pending):
                queue.put_nowait((index, chunk, None))
        except RequestFailed as e:
            queue.put_nowait((index, None, e))
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(pendings)]
    try:
        remaining = len(tasks)
        while remaining:
            index, chunk, failure = await queue.get()
            if failure is not None:
                raise failure
            if chunk is None:
                remaining -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnected(http: Request, work):
    """The work's result, or cancelled when the client goes away first (its requests
    are released, their blocks freed)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise OpenAIError(499, "the client went away")
    return task.result()
