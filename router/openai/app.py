"""The router's HTTP server: the OpenAI app (each surface's routes in its own module:
models.py, completions.py, responses.py, messages.py (Anthropic's), embeddings.py,
scores.py (a pooling model's), tokenize.py, ops.py), the API key, the body
size limit and TLS, served by uvicorn on the router's own event loop."""

import contextlib
import socket
import ssl

import uvicorn
from fastapi import FastAPI

from flagstop.router.chat import ChatTemplate
from flagstop.router.engine import RouterEngine
from flagstop.router.openai import (
    completions,
    embeddings,
    messages,
    models,
    ops,
    responses,
    scores,
    tokenize,
)
from flagstop.router.openai.errors import BodyLimit, Contained, add_error_handlers
from flagstop.router.openai.front import OpenAIFront
from flagstop.router.settings import RouterSettings
from flagstop.router.telemetry import engine_registry
from flagstop.server import StartupError
from flagstop.telemetry import metrics_registry


def create_app(engine: RouterEngine, settings: RouterSettings, chat: ChatTemplate) -> FastAPI:
    """Both fronts check the engine's API keys (router/auth.py)."""
    app = FastAPI(title="flagstop", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = OpenAIFront(engine, chat, settings)
    app.state.registry = metrics_registry()
    app.state.engine_registry = engine_registry(engine)
    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(Contained)
    for surface in (models, completions, responses, messages, embeddings, scores, tokenize, ops):
        app.include_router(surface.api)
    return app


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
