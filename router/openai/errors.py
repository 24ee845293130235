"""The HTTP front's guards: every refusal and failure as OpenAI's error object. The
exception handlers (a request's own errors, pydantic's validation), Contained (any
failure nobody foresaw: a 500 and one log line, never Starlette's plain-text 500 with
a traceback) and BodyLimit (413)."""

import logging
import uuid
from typing import Any

import grpc
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from flagstop.router.pending import RETRY_AFTER_S, RequestFailed
from flagstop.scheduler_svc.core.limits import RequestRejected

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
log = logging.getLogger("flagstop.router.openai.app")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# Anthropic's error types, for the Messages API's routes.
ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                  403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                  429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
ANTHROPIC_ROUTES = "/v1/messages"


def anthropic_error(failure: "OpenAIError") -> dict[str, Any]:
    return {"type": ANTHROPIC_TYPE.get(failure.status, "api_error"), "message": failure.message}


def json_response(body, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def error_response(status: int, message: str, param: str | None = None, code=None) -> Response:
    error_type = ERROR_TYPE.get(status, "server_error")
    body = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    return Response(orjson.dumps(body), status, retry_after(status), media_type="application/json")


def retry_after(status: int) -> dict[str, str] | None:
    """Refused for load (429: a full queue or a policy's shed; 503): when to retry."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None


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


def refusal(request: Request, failure: OpenAIError) -> Response:
    """An error in the shape of the API the route belongs to: Anthropic's for the
    Messages API, OpenAI's for the rest."""
    if request.url.path.startswith(ANTHROPIC_ROUTES):
        body = {"type": "error", "error": anthropic_error(failure)}
        return Response(orjson.dumps(body), failure.status, retry_after(failure.status),
                        media_type="application/json")  # fmt: skip
    return error_response(failure.status, failure.message, failure.param, failure.code)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> Response:
        return refusal(request, e)

    @app.exception_handler(RequestRejected)
    async def rejected(request: Request, e: RequestRejected) -> Response:
        return refusal(request, OpenAIError(400, str(e), e.param))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> Response:
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            message = f"the body is not valid JSON: {errors[0]['msg']}"
            return refusal(request, OpenAIError(400, message))
        first = telling_error(errors)
        where = [str(part) for part in first["loc"] if part != "body" and not _union_tag(part)]
        param = ".".join(where) or None
        message = first["msg"].removeprefix("Value error, ")
        return refusal(request, OpenAIError(400, f"{param}: {message}" if param else message,
                                            param))  # fmt: skip

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        if e.status_code in (404, 405) and e.detail in ("Not Found", "Method Not Allowed"):
            return refusal(request, OpenAIError(e.status_code, _no_route(request, e.status_code)))
        return refusal(request, OpenAIError(e.status_code, str(e.detail)))


def _no_route(request: Request, status: int) -> str:
    """A wrong URL, told apart from a missing model or adapter: the route asked for, and
    where the served ones are listed."""
    route = f"{request.method} {request.url.path}"
    if status == 405:
        return f"{route}: this route takes another method (GET /openapi.json lists each route's)"
    return (f"{route} is not served here; flagstop serves the OpenAI API under /v1 (completions, "
            "chat/completions, responses, embeddings, models), Anthropic's /v1/messages, vLLM's "
            "/tokenize, /detokenize and render routes, and /health, /ready, /metrics, "
            "/version: GET /openapi.json lists them")  # fmt: skip


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
