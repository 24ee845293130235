"""The router's HTTP server: the OpenAI routes, /health (liveness), /ready
(readiness) and /metrics, the API key, the body size limit and TLS, served by
uvicorn on the router's own event loop."""

import contextlib
import logging
import socket
import ssl
import uuid

import orjson
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from flagstop.router import responses_events
from flagstop.router.auth import REFUSAL, BearerKey
from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from flagstop.router.openai_responses import Choice
from flagstop.router.openai_server import (
    OpenAIError,
    OpenAIFront,
    error_response,
    internal_error,
    until_disconnected,
)
from flagstop.router.responses_api import ResponsesRequest, chat_request
from flagstop.router.responses_events import ResponseEvents
from flagstop.router.settings import RouterSettings
from flagstop.router.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    tokenize,
    tokenize_response,
    tokenizer_info,
)
from flagstop.router.tool_calls import HermesParser, NamedCall, RequiredCalls
from flagstop.scheduler_svc.core.limits import RequestRejected
from flagstop.server import StartupError
from flagstop.telemetry import metrics_registry

log = logging.getLogger("flagstop.router.http")


def create_app(engine: RouterEngine, settings: RouterSettings, chat: ChatTemplate) -> FastAPI:
    front = OpenAIFront(engine, chat)
    key = BearerKey(settings.api_key.get_secret_value()) if settings.api_key else None

    def authorized(request: Request) -> None:
        if key is not None and not key.matches(request.headers.get("authorization")):
            raise OpenAIError(401, REFUSAL, code="invalid_api_key")

    # The schema is served (gateways and fuzzers read it), behind the key when set.
    app = FastAPI(title="flagstop", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(Contained)
    v1 = [Depends(authorized)]

    @app.get("/openapi.json", dependencies=v1, include_in_schema=False)
    async def openapi() -> Response:
        return json_response(app.openapi())

    def model_card() -> dict:
        info = engine.model_info
        front.check_model(info.model_name)
        return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flagstop",
                "max_model_len": info.max_model_len}  # fmt: skip

    @app.get("/v1/models", dependencies=v1)
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=v1)
    async def model(model_id: str) -> Response:
        card = model_card()
        front.check_model(model_id)
        return json_response(card)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        front.check_model(body.model)
        prompts = body.prompts()
        requests = [body.choice_request(prompt, j) for prompt in prompts
                    for j in range(body.n)]  # fmt: skip

        def make(i: int, pending) -> Choice:
            echo = None
            if body.echo:
                prompt = prompts[i // body.n]
                echo = prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
            return Choice(i, echo=echo, prompt_only=body.prompt_only)

        return await front.respond(http, body, "completion", requests, make)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        front.check_model(body.model)
        prompt = chat.render([m.as_template_input() for m in body.messages],
                             body.template_tools())  # fmt: skip
        requests = [body.choice_request(prompt, j) for j in range(body.n)]
        parser = tool_parser(body, settings.tool_call_parser)
        return await front.respond(http, body, "chat", requests,
                                   lambda i, pending: Choice(i, tools=parser()))  # fmt: skip

    @app.post("/v1/responses", dependencies=v1)
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        served = front.check_model(body.model)
        try:
            as_chat = chat_request(body, ChatCompletionRequest)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        prompt = chat.render([m.as_template_input() for m in as_chat.messages],
                             as_chat.template_tools())  # fmt: skip
        parser = tool_parser(as_chat, settings.tool_call_parser)
        [pending] = front.submit([as_chat.choice_request(prompt, 0)], list(http.headers.items()),
                                 "responses")  # fmt: skip
        builder = front.builder(as_chat, "chat")
        [choice] = front.choices(as_chat, [pending], lambda i, p: Choice(i, tools=parser()))
        builder.usage.prompt_tokens = len(pending.prompt_token_ids)
        events = ResponseEvents(body, served)
        if body.stream:
            return StreamingResponse(
                responses_events.stream(engine, builder, choice, pending, events),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )  # fmt: skip
        work = responses_events.collect(engine, builder, choice, pending, events)
        return json_response(await until_disconnected(http, work))

    @app.post("/tokenize", dependencies=v1)
    async def tokenize_route(body: TokenizeRequest) -> Response:
        if body.model is not None:
            front.check_model(body.model)
        try:
            token_ids = tokenize(body, engine.tokenizer, chat)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        max_model_len = engine.model_info.max_model_len
        return json_response(tokenize_response(token_ids, engine.tokenizer, max_model_len,
                                               body.return_token_strs))  # fmt: skip

    @app.post("/detokenize", dependencies=v1)
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        if body.model is not None:
            front.check_model(body.model)
        vocab_size = len(engine.tokenizer)
        if bad := [t for t in body.tokens if t >= vocab_size]:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary", "tokens")
        return json_response({"prompt": engine.tokenizer.decode(body.tokens)})

    @app.get("/tokenizer_info", dependencies=v1)
    async def tokenizer_info_route() -> Response:
        return json_response(tokenizer_info(engine.tokenizer, chat))

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "live"})

    @app.get("/ready")
    async def ready() -> Response:
        return json_response({"ready": engine.ready}, 200 if engine.ready else 503)

    registry = metrics_registry()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def tool_parser(body: ChatCompletionRequest, configured: str | None):
    """What makes each choice's tool-call parser (or None), by the request's mode."""
    mode = body.tool_mode
    if mode == "named":
        name = body.named_tool.function.name  # type: ignore[union-attr]
        return lambda: NamedCall(name)
    if mode == "required":
        return RequiredCalls
    if mode == "auto":
        if configured is None:
            raise OpenAIError(400, 'tool_choice "auto" needs the router started with '
                              "--tool-call-parser (hermes); or send tool_choice "
                              '"required", a named function or "none"', "tool_choice")  # fmt: skip
        return HermesParser
    return lambda: None


def json_response(body, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, e: RequestRejected) -> Response:
        return error_response(400, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {errors[0]['msg']}")
        first = telling_error(errors)
        where = [str(part) for part in first["loc"] if part != "body" and not _union_tag(part)]
        param = ".".join(where) or None
        message = first["msg"].removeprefix("Value error, ")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        return error_response(e.status_code, str(e.detail))


def telling_error(errors: list[dict]) -> dict:
    """Of a field's errors (one per member of a union type), the one that says most:
    a value out of range over "should be a string" of a member it never meant."""

    def rank(error: dict) -> tuple[bool, int]:
        return (not error["type"].endswith("_type"), len(error["loc"]))

    return max(errors, key=rank) if len(errors) > 1 else errors[0]


def _union_tag(part) -> bool:
    """pydantic names a union's member in an error's location: `str`, `list[int]`,
    `NamedToolChoice`, `literal[...]`; field names are snake_case."""
    if not isinstance(part, str):
        return False
    return part in {"str", "int", "float", "bool", "dict"} or "[" in part or part[:1].isupper()


class Contained:
    """Any unexpected failure of one request becomes the OpenAI error object (500,
    internal_error) and one log line with its request id (x-request-id, or a new
    one); the process and every other request go on. Outermost, so that nothing is
    answered as Starlette's plain-text 500 with a traceback in the log."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
            failure = internal_error(e, given[:64] or uuid.uuid4().hex)
            if not started:
                await error_response(failure.status, failure.message)(scope, receive, send)


class BodyLimit:
    """413 for a body over max_bytes, by its Content-Length or as it arrives."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise OpenAIError(413, self._message())
            return message

        try:
            await self.app(scope, counted, send)
        except OpenAIError:
            await self._refuse(scope, receive, send)

    def _message(self) -> str:
        return f"the body is larger than --max-request-bytes ({self.max_bytes} bytes)"

    async def _refuse(self, scope, receive, send) -> None:
        await error_response(413, self._message())(scope, receive, send)


class _Server(uvicorn.Server):
    # The router installs its own SIGTERM/SIGINT handlers (drain, then stop).
    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving the app on a socket bound up front (a taken port stops
    start-up with one line)."""

    def __init__(self, app: FastAPI, settings: RouterSettings) -> None:
        self.socket = bind(settings.host, settings.http_port, settings.reuse_port)
        tls = {}
        if settings.tls_cert:
            tls = dict(
                ssl_certfile=str(settings.tls_cert), ssl_keyfile=str(settings.tls_key),
                ssl_ca_certs=str(settings.tls_ca),
                ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_require_client_cert
                else ssl.CERT_NONE,
            )  # fmt: skip
        config = uvicorn.Config(
            app, loop="none", lifespan="off", access_log=False, log_config=None,
            timeout_graceful_shutdown=5, **tls,
        )  # fmt: skip
        self.server = _Server(config)

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.socket])

    def stop(self) -> None:
        self.server.should_exit = True


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # router processes sharing the port (--processes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port} (HTTP): {e.strerror}") from None
    sock.set_inheritable(True)
    return sock
