"""RPC plumbing: tensor codec, server bootstrap, client channels, status mapping."""

from modalmesh.rpc.channel import aio_channel, normalize_target, sync_channel
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.server import GrpcServer, ServerConfig, serve_until_signal

__all__ = [
    "GrpcServer",
    "ServerConfig",
    "aio_channel",
    "from_proto",
    "normalize_target",
    "serve_until_signal",
    "sync_channel",
    "to_proto",
]
