"""LLMService: thin gRPC servicer over the generation engine."""

from __future__ import annotations

from modalmesh import pb
from modalmesh.errors import Unimplemented
from modalmesh.service import Service


class LLMServicer(pb.llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, service: LLMService):
        self.service = service

    async def Generate(self, request, context):
        raise Unimplemented("Generate is not available yet: this build serves no language model")
        yield  # pragma: no cover - makes this an async generator like the real one

    async def Info(self, request, context):
        return self.service.info()


class LLMService(Service):
    name = "llm"
    grpc_service = pb.LLM_SERVICE
    description = "modalmesh LLM service: streaming multimodal generation."
    max_message_mb = 256  # requests carry precomputed embeddings

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.llm_pb2_grpc.add_LLMServiceServicer_to_server, LLMServicer(self))
