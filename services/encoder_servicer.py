"""EncoderService servicer shared by the vision and the audio encoder."""

from __future__ import annotations

from modalmesh import pb
from modalmesh.errors import Unimplemented


class EncoderServicer(pb.encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, service):
        self.service = service

    async def Encode(self, request, context):
        raise Unimplemented(f"Encode is not available yet: this {self.service.name} build serves no encoder model")

    async def Info(self, request, context):
        return self.service.info()


def register_encoder(service, server) -> None:
    server.add_service(
        pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, EncoderServicer(service)
    )
