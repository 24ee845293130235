"""What the OpenAI routes share: OpenAIFront turns a body's choices into
GenerateRequests on the same RouterEngine as a gRPC request, and their chunks into the
API's shapes, whole or as Server-Sent Events; the routes' dependencies (the front, the
API key)."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import orjson
from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse

from flagstop.router.auth import REFUSAL
from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai.bodies import Choice, ResponseBuilder, TokenTexts
from flagstop.router.openai.chat_path import ChatPath
from flagstop.router.openai.errors import OpenAIError, from_failure, internal_error, stream_error
from flagstop.router.openai.harmony import HarmonyPath
from flagstop.router.openai.outputs import Rendered
from flagstop.router.openai.reasoning import HARMONY
from flagstop.router.openai.sse import DONE, sse
from flagstop.router.pending import Pending, RequestFailed
from flagstop.router.settings import RouterSettings
from flagstop.scheduler_svc.core.limits import RequestRejected

log = logging.getLogger("flagstop.router.http")


def token_id_texts(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_path(chat: ChatTemplate, settings: RouterSettings, tokenizer) -> ChatPath:
    if settings.reasoning_parser == HARMONY:
        return HarmonyPath(chat, settings, tokenizer)
    return ChatPath(chat, settings, tokenizer)


CACHE_TTL_HEADER = "x-flagstop-cache-ttl"


def cache_ttl_header(pendings: list[Pending]) -> dict[str, str]:
    """A retention cut to --max-cache-ttl-s is said, never silent: the ttl it got."""
    clamped = [p.retention_clamped_s for p in pendings if p.retention_clamped_s is not None]
    return {CACHE_TTL_HEADER: f"{min(clamped):g}; clamped"} if clamped else {}


class OpenAIFront:
    """The routes' logic: requests to GenerateRequests, chunks to the API's shapes."""

    def __init__(self, engine: RouterEngine, chat: ChatTemplate, settings: RouterSettings) -> None:
        self.engine, self.chat, self.settings = engine, chat, settings
        self.texts = TokenTexts(engine.tokenizer)
        self.chat_path = chat_path(chat, settings, engine.tokenizer)

    def check_model(self, name: str) -> str:
        """The model a request names: the base model or one of its LoRA adapters
        (vLLM's convention); 404 model_not_found otherwise."""
        try:  # readiness as the engine has it (/ready, and gRPC's health): one rule
            self.engine.check_serving()
        except RequestFailed as e:
            raise from_failure(e) from None
        served = self.engine.model_info.model_name
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

    async def render(self, body) -> Rendered:
        """A chat body's prompt, with its images fetched and processed: its token ids
        then the processor's (each image's placeholder expanded). Raises OpenAIError
        (400; a text-only model refuses images before its template sees them)."""
        images, media = body.image_refs(), self.engine.media
        try:
            if images and not media.accepts_images:
                await media.process("", images, add_special_tokens=False)  # its refusal
            prompt = self.chat_path.render(body)
            if not images:
                return prompt
            processed = await self.engine.process_media(prompt.text, images, False)
        except RequestRejected as e:
            raise OpenAIError(400, str(e), e.param) from None
        assert processed is not None
        return Rendered(prompt.text, processed.token_ids, processed)

    def submit(self, requests, metadata, operation: str, media=None) -> list[Pending]:
        """All of a response's choices, or none (one refused releases the others)."""
        pendings: list[Pending] = []
        try:
            for request in requests:
                pendings.append(self.engine.submit(request, metadata, operation, media))
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

    async def start_one(self, http: Request, body, operation: str):
        """A chat-shaped request of one choice (Responses, Messages: body is its chat
        request) rendered, submitted, and its reader made: (builder, choice, pending)."""
        path = self.chat_path
        prompt = await self.render(body)
        outputs = path.outputs(body, prompt)
        requests = self.with_adapter(path.requests(body, prompt), body.model)
        [pending] = self.submit(requests, list(http.headers.items()), operation, prompt.media)
        builder = self.builder(body, "chat")
        [choice] = self.choices(body, [pending], lambda i, p: Choice(i, output=outputs()))
        builder.usage.prompt_tokens = len(pending.prompt_token_ids)
        return builder, choice, pending

    async def respond(
        self, http: Request, body, kind: str, requests, make: Callable[[int, Pending], Choice],
        media=None,
    ) -> Response:  # fmt: skip
        """Submit a response's requests and answer: whole, or as Server-Sent Events.
        make: each choice's Choice (echo, tools), given its index and request; media:
        the prompt's processed images (with_images)."""
        builder = self.builder(body, kind)
        operation = "chat" if kind == "chat" else "text_completion"
        requests = self.with_adapter(requests, body.model)
        pendings = self.submit(requests, list(http.headers.items()), operation, media)
        choices = self.choices(body, pendings, make)
        builder.usage.prompt_tokens = sum(len(c.prompt_token_ids) for c in choices
                                          if c.counts_prompt)  # fmt: skip
        headers = cache_ttl_header(pendings)
        if body.stream:
            chunks = await self.started(http, merged(self.engine, pendings), pendings)
            stream = self.stream(builder, choices, pendings, body.include_usage, chunks)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **headers})  # fmt: skip
        await until_disconnected(http, self.collect(builder, choices, pendings))
        return Response(orjson.dumps(builder.response(choices)), media_type="application/json",
                        headers=headers)  # fmt: skip

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

    async def started(self, http: Request, chunks: AsyncIterator, pendings: list[Pending]):
        """A stream's chunks once its first one has come: the response's headers wait
        for it, so a request refused before its first token (a full queue, a policy
        that sheds it, a replica lost) answers its own status, a 429 with Retry-After,
        not a 200 with an error event. The first chunk is the first token's, which the
        first byte waited for anyway: time to first token is unchanged
        (bench/http_bench.py). A client gone meanwhile releases the requests."""
        try:
            first = await until_disconnected(http, anext(chunks))
        except BaseException as e:
            for pending in pendings:
                self.engine.release(pending)
            if isinstance(e, RequestFailed):
                raise from_failure(e) from None
            raise
        return primed(first, chunks)

    async def stream(
        self, builder: ResponseBuilder, choices: list[Choice], pendings: list[Pending],
        include_usage: bool, chunks: AsyncIterator,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """SSE: a chunk per new piece of each choice, a usage chunk when asked, [DONE].
        A failure after the first bytes becomes an error event."""
        try:
            if builder.kind == "chat":
                yield sse(builder.role_chunk(range(len(pendings))))
            async for index, chunk in chunks:
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


async def primed(first, rest: AsyncIterator) -> AsyncIterator:
    """A stream whose first item was taken already (OpenAIFront.started)."""
    yield first
    async for item in rest:
        yield item


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


def front_of(request: Request) -> OpenAIFront:
    """The routes' dependency: the app's front (create_app sets it)."""
    return request.app.state.front


def authorized(request: Request) -> None:
    """The /v1 routes' dependency: the API key, when one is set."""
    keys = request.app.state.front.engine.keys
    if not keys.matches(request.headers.get("authorization")):
        raise OpenAIError(401, REFUSAL, code="invalid_api_key")


# A route's parameter `front: Front` is the app's front.
Front = Annotated[OpenAIFront, Depends(front_of)]
