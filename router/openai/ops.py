"""What operators and gateways ask: /health (liveness), /ready (readiness), /metrics
(the router's series and, as a vLLM server shows them on its one port, the engine's
load), /version, and /openapi.json (the schema gateways and fuzzers read; behind the
key when set)."""

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flagstop.router.openai.errors import json_response
from flagstop.router.openai.front import Front, authorized

api = APIRouter()


@api.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
async def openapi(request: Request) -> Response:
    return json_response(request.app.openapi())


@api.get("/health")
async def health() -> Response:
    return json_response({"status": "live"})


@api.get("/ready")
async def ready(front: Front) -> Response:
    ready = front.engine.ready
    return json_response({"ready": ready}, 200 if ready else 503)


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    body = generate_latest(state.registry) + generate_latest(state.engine_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@api.get("/version")
async def version_route() -> Response:
    return json_response({"version": _version()})


def _version() -> str:
    try:
        return version("flagstop")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
