"""The router's HTTP server: the OpenAI routes, /health (liveness), /ready
(readiness) and /metrics, the API key, the body size limit and TLS, served by
uvicorn on the router's own event loop."""

import contextlib
import logging
import socket
import ssl

import orjson
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from flagstop.router.auth import REFUSAL, BearerKey
from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from flagstop.router.openai_server import OpenAIError, OpenAIFront, error_response
from flagstop.router.settings import RouterSettings
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

    app = FastAPI(title="flagstop", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    v1 = [Depends(authorized)]

    @app.get("/v1/models", dependencies=v1)
    async def models() -> Response:
        info = engine.model_info
        front.check_model(info.model_name)
        model = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "flagstop",
                 "max_model_len": info.max_model_len}  # fmt: skip
        return json_response({"object": "list", "data": [model]})

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        requests = [body.choice_request(prompt, j) for prompt in body.prompts()
                    for j in range(body.n)]  # fmt: skip
        return await front.respond(http, body, "completion", requests)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        front.check_model(body.model)
        prompt = chat.render([m.as_template_input() for m in body.messages])
        requests = [body.choice_request(prompt, j) for j in range(body.n)]
        return await front.respond(http, body, "chat", requests)

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


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, e: RequestRejected) -> Response:
        return error_response(400, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0]
        where = [str(part) for part in first["loc"] if part != "body"]
        if first["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first['msg']}")
        param = ".".join(where) or None
        message = first["msg"].removeprefix("Value error, ")
        return error_response(400, f"{param}: {message}" if param else message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        return error_response(e.status_code, str(e.detail))


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
