"""The optional API key: a bearer token in the `authorization` metadata of every
Generation call and header of every OpenAI API call. Health, readiness, reflection and
metrics stay open so that probes and scrapers need no key."""

import hmac

import grpc

from flagstop.v1 import generation_pb2

PROTECTED = "/" + generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name + "/"
REFUSAL = "missing or wrong API key: send 'authorization: Bearer <key>'"


class BearerKey:
    """The `authorization: Bearer <key>` check, written once for both fronts."""

    __slots__ = ("expected",)

    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    def matches(self, given: str | bytes | None) -> bool:
        given = given.encode() if isinstance(given, str) else (given or b"")
        # Constant time: the comparison must not tell how much of a guess was right.
        return hmac.compare_digest(given, self.expected)


class ApiKeyCheck(grpc.aio.ServerInterceptor):
    def __init__(self, key: BearerKey) -> None:
        self.key = key

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        return handler if self.key.matches(given) else _deny(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        _refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
