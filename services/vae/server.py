"""VAEService: thin gRPC servicer over the VAE decoder."""

from __future__ import annotations

import torch

from modalmesh import pb
from modalmesh.errors import Unimplemented
from modalmesh.service import Service


class VAEServicer(pb.vae_pb2_grpc.VAEServiceServicer):
    def __init__(self, service: VAEDecoderService):
        self.service = service

    async def Decode(self, request, context):
        raise Unimplemented("Decode is not available yet: this build serves no VAE")

    async def Info(self, request, context):
        return self.service.info()


class VAEDecoderService(Service):
    name = "vae"
    grpc_service = pb.VAE_SERVICE
    description = "modalmesh VAE service: latents -> PNG or pixel tensors."
    max_message_mb = 256  # responses carry full-resolution images
    auto_dtype = torch.float32  # FP32 is the VAE's default serving dtype

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.vae_pb2_grpc.add_VAEServiceServicer_to_server, VAEServicer(self))
