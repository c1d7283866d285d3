"""RPC plumbing: tensor codec, server bootstrap, the forwarding servicer, client channels, status mapping.

Embedding transfer: transfer.py (EmbeddingSender / EmbeddingReceiver: paths, thresholds, fallbacks,
metric labels) over shm.py (same-host shared memory) and wire.py (bytes spliced past protobuf).

Names are loaded on first use, so `modalmesh.rpc.channel` (health probes, clients) does not pull
in torch through the codec: a container healthcheck runs every few seconds.
"""

import importlib

_EXPORTS = {
    "aio_channel": "channel", "normalize_target": "channel", "sync_channel": "channel",
    "from_proto": "codec", "to_proto": "codec",
    "GrpcServer": "server", "ServerConfig": "server", "serve_until_signal": "server",
    "ForwardingServicer": "servicer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'modalmesh.rpc' has no attribute {name!r}")
    return getattr(importlib.import_module(f"modalmesh.rpc.{_EXPORTS[name]}"), name)
