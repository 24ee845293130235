"""The optional API key: a bearer token in the `authorization` metadata of every
Generation call. Health and reflection stay open so that probes need no key."""

import hmac

import grpc

from flagstop.v1 import generation_pb2

PROTECTED = "/" + generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name + "/"


class ApiKeyCheck(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        # Constant time: the comparison must not tell how much of a guess was right.
        if hmac.compare_digest(given, self.expected):
            return handler
        return _deny(handler)


async def _refuse(request, context) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or wrong API key: send metadata 'authorization: Bearer <key>'",
    )


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
