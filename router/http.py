"""The router's HTTP server: the OpenAI routes, /health (liveness), /ready
(readiness) and /metrics, the API key, the body size limit and TLS, served by
uvicorn on the router's own event loop."""

import contextlib
import socket
import ssl

import orjson
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flagstop.router import responses_events
from flagstop.router.auth import REFUSAL, BearerKey
from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.http_errors import BodyLimit, Contained, add_error_handlers
from flagstop.router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from flagstop.router.openai_responses import Choice
from flagstop.router.openai_server import (
    OpenAIError,
    OpenAIFront,
    from_failure,
    until_disconnected,
)
from flagstop.router.output import RequestFailed
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
from flagstop.router.tool_calls import parser_factory
from flagstop.server import StartupError
from flagstop.telemetry import metrics_registry


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

    def model_cards() -> dict[str, dict]:
        """The base model and each LoRA adapter, its parent the base (vLLM's cards)."""
        info = engine.model_info
        front.check_model(info.model_name)
        base = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flagstop",
                "root": info.model_name, "parent": None,
                "max_model_len": info.max_model_len}  # fmt: skip
        cards = {info.model_name: base}
        for name, adapter in sorted(engine.replicas.adapters().items()):
            cards[name] = {**base, "id": name, "root": adapter.path, "parent": info.model_name}
        return cards

    @app.get("/v1/models", dependencies=v1)
    async def models() -> Response:
        return json_response({"object": "list", "data": list(model_cards().values())})

    @app.get("/v1/models/{model_id:path}", dependencies=v1)
    async def model(model_id: str) -> Response:
        cards = model_cards()
        front.check_model(model_id)
        return json_response(cards[model_id])

    @app.post("/v1/load_lora_adapter", dependencies=v1)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's runtime load: on every replica; 200 with its message, or the error."""
        try:
            await engine.load_lora(body.lora_name, body.lora_path, body.load_inplace)
        except RequestFailed as e:
            raise from_failure(e) from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")  # fmt: skip

    @app.post("/v1/unload_lora_adapter", dependencies=v1)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        try:
            await engine.unload_lora(body.lora_name)
        except RequestFailed as e:
            raise from_failure(e) from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")  # fmt: skip

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, http: Request) -> Response:
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
        parser = parser_factory(body, settings.tool_call_parser)
        return await front.respond(http, body, "chat", requests,
                                   lambda i, pending: Choice(i, tools=parser()))  # fmt: skip

    @app.post("/v1/responses", dependencies=v1)
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        served = front.check_model(body.model)
        try:
            as_chat = chat_request(body)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        prompt = chat.render([m.as_template_input() for m in as_chat.messages],
                             as_chat.template_tools())  # fmt: skip
        parser = parser_factory(as_chat, settings.tool_call_parser)
        requests = front.with_adapter([as_chat.choice_request(prompt, 0)], body.model)
        [pending] = front.submit(requests, list(http.headers.items()), "responses")
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


def json_response(body, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


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
