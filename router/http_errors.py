"""The HTTP front's guards: every refusal and failure as OpenAI's error object. The
exception handlers (a request's own errors, pydantic's validation), Contained (any
failure nobody foresaw: a 500 and one log line, never Starlette's plain-text 500 with
a traceback) and BodyLimit (413)."""

import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from flagstop.router.openai_server import OpenAIError, error_response, internal_error
from flagstop.scheduler_svc.core.limits import RequestRejected


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
