"""The router's gRPC front (flagstop.v1.Generation): a thin shell over RouterEngine."""

import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from flagstop.router.engine import RouterEngine
from flagstop.router.pending import RequestFailed
from flagstop.router.pooling import classify, embed, score
from flagstop.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("flagstop.router")


async def _internal_error(context, e: Exception, request_id: str) -> None:
    """An unexpected failure of one request: logged on one line (the traceback at
    debug level), answered INTERNAL with the request id to quote."""
    log.error("request %s failed: %s: %s", request_id, type(e).__name__, e)
    log.debug("request %s", request_id, exc_info=e)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error; quote request id {request_id} when reporting it"
    )


class Undecodable:
    """A request message that does not parse (a string field that is not UTF-8):
    answered INVALID_ARGUMENT by the method, where gRPC's own would say UNKNOWN."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(message_cls):
    def decode(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return Undecodable(str(e))

    return decode


def add_to_server(service: "GenerationService", server) -> None:
    """generation_pb2_grpc's registration, with decoding failures kept for the
    methods to refuse."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=_tolerant(generation_pb2.GenerateRequest),
            response_serializer=generation_pb2.GenerateResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo,
            request_deserializer=_tolerant(generation_pb2.GetModelInfoRequest),
            response_serializer=generation_pb2.GetModelInfoResponse.SerializeToString,
        ),
        "LoadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            service.LoadLoRAAdapter,
            request_deserializer=_tolerant(generation_pb2.LoadLoRAAdapterRequest),
            response_serializer=generation_pb2.LoadLoRAAdapterResponse.SerializeToString,
        ),
        "UnloadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            service.UnloadLoRAAdapter,
            request_deserializer=_tolerant(generation_pb2.UnloadLoRAAdapterRequest),
            response_serializer=generation_pb2.UnloadLoRAAdapterResponse.SerializeToString,
        ),
        **{name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=_tolerant(getattr(generation_pb2, f"{name}Request")),
            response_serializer=getattr(generation_pb2, f"{name}Response").SerializeToString,
        ) for name in ("Embed", "Classify", "Score")},
    }  # fmt: skip
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, Undecodable):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request does not parse: {request.error} (strings must be UTF-8)",
        )


SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine

    async def GetModelInfo(self, request, context) -> generation_pb2.GetModelInfoResponse:
        await _refuse_undecodable(request, context)
        try:
            self.engine.check_serving()
        except RequestFailed as e:
            await context.abort(e.code, e.message)
        model = generation_pb2.ModelInfo()
        model.CopyFrom(self.engine.model_info)
        del model.lora_adapters[:]
        model.lora_adapters.extend(self.engine.replicas.adapters().values())
        return generation_pb2.GetModelInfoResponse(model=model)

    async def LoadLoRAAdapter(self, request, context) -> generation_pb2.LoadLoRAAdapterResponse:
        await _refuse_undecodable(request, context)
        try:
            return await self.engine.load_lora(
                request.lora_name, request.lora_path, request.load_inplace
            )
        except RequestFailed as e:
            await context.abort(e.code, e.message)

    async def UnloadLoRAAdapter(self, request, context) -> generation_pb2.UnloadLoRAAdapterResponse:
        await _refuse_undecodable(request, context)
        try:
            await self.engine.unload_lora(request.lora_name)
        except RequestFailed as e:
            await context.abort(e.code, e.message)
        return generation_pb2.UnloadLoRAAdapterResponse()

    async def Embed(self, request: generation_pb2.EmbedRequest,
                    context) -> generation_pb2.EmbedResponse:  # fmt: skip
        return await self._pooling(embed, request, context)

    async def Classify(self, request: generation_pb2.ClassifyRequest,
                       context) -> generation_pb2.ClassifyResponse:  # fmt: skip
        return await self._pooling(classify, request, context)

    async def Score(self, request: generation_pb2.ScoreRequest,
                    context) -> generation_pb2.ScoreResponse:  # fmt: skip
        return await self._pooling(score, request, context)

    async def _pooling(self, pool, request, context):
        """A pooling request (router/pooling.py), its refusal the call's status."""
        await _refuse_undecodable(request, context)
        try:
            return await pool(self.engine, request, context.invocation_metadata())
        except RequestFailed as e:
            await context.abort(e.code, e.message, e.trailing_metadata)
        except Exception as e:  # one request's bug: the others and the process go on
            await _internal_error(context, e, uuid.uuid4().hex)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        await _refuse_undecodable(request, context)
        if request.HasField("pooling"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "pooling is set by the router: ask Embed, Classify or Score",
            )
        request_id = None
        try:
            media = await self.engine.process_images(request) if request.images else None
            pending = self.engine.submit(request, context.invocation_metadata(), media=media)
            request_id = pending.request_id
            async for chunk in self.engine.stream(pending):
                yield chunk
        except RequestFailed as e:
            await context.abort(e.code, e.message, e.trailing_metadata)
        except Exception as e:  # one request's bug: the others and the process go on
            await _internal_error(context, e, request_id or uuid.uuid4().hex)
