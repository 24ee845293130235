"""The router's gRPC front (flagstop.v1.Generation): a thin shell over RouterEngine."""

from collections.abc import AsyncIterator

import grpc

from flagstop.router.engine import RouterEngine
from flagstop.router.output import RequestFailed
from flagstop.v1 import generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine

    async def GetModelInfo(self, request, context) -> generation_pb2.GetModelInfoResponse:
        if self.engine.limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a scheduler yet")
        return generation_pb2.GetModelInfoResponse(model=self.engine.model_info)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            pending = self.engine.submit(request, context.invocation_metadata())
            async for chunk in self.engine.stream(pending):
                yield chunk
        except RequestFailed as e:
            await context.abort(e.code, e.message)
