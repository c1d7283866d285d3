"""The generated protobuf / gRPC stubs of proto/modalmesh/v1, from one place.

The stubs are generated from proto/ by modalmesh/_protogen.py (``make protos``) and committed:
``from modalmesh import pb; pb.Tensor(...); pb.llm_pb2_grpc.LLMServiceStub``.
"""

try:
    from modalmesh.v1 import (
        common_pb2,
        encoder_pb2,
        encoder_pb2_grpc,
        llm_pb2,
        llm_pb2_grpc,
        tensor_pb2,
        vae_pb2,
        vae_pb2_grpc,
    )
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "modalmesh protobuf stubs are missing from modalmesh/v1/: they are committed; "
        "restore them (git checkout modalmesh/v1) or regenerate them with `make protos`."
    ) from exc

_MESSAGE_MODULES = (tensor_pb2, common_pb2, encoder_pb2, llm_pb2, vae_pb2)

# Re-export every message and enum (pb.Tensor, pb.FLOAT32, pb.GenerateRequest, ...).
for _module in _MESSAGE_MODULES:
    for _name in dir(_module):
        if not _name.startswith("_") and _name != "DESCRIPTOR":
            globals()[_name] = getattr(_module, _name)

ENCODER_SERVICE = "modalmesh.v1.EncoderService"
LLM_SERVICE = "modalmesh.v1.LLMService"
VAE_SERVICE = "modalmesh.v1.VAEService"
