"""The one servicer every service registers: each RPC forwards to a method of the service.

    server.add_service(pb.VAE_SERVICE, pb.vae_pb2_grpc.add_VAEServiceServicer_to_server,
                       ForwardingServicer(service, Decode=service.decode))

``Info`` always forwards to ``service.info()``. A forwarded method takes the request; if
it has a ``timeout`` parameter it also gets the seconds the caller has left (None: no
deadline). It returns the response, an awaitable of it, or — for a server-streaming
RPC — is an async generator of responses. Errors travel as raised: the status
interceptor (rpc/interceptor.py) turns them into codes. The servicer holds no logic,
so the gRPC context never reaches a service.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class ForwardingServicer:
    def __init__(self, service: Any, **rpcs: Callable):
        self.service = service
        self.Info = _unary(lambda request: service.info())
        for name, method in rpcs.items():
            if not name[:1].isupper():
                raise ValueError(f"{name}: RPC names are CamelCase, as in the .proto")
            wants_timeout = "timeout" in inspect.signature(method).parameters
            handler = _streaming(method, wants_timeout) if inspect.isasyncgenfunction(method) else _unary(
                method, wants_timeout)
            setattr(self, name, handler)

    @property
    def rpcs(self) -> list[str]:
        return sorted(name for name in vars(self) if name[:1].isupper())


def _unary(method: Callable, wants_timeout: bool = False):
    async def handler(request, context):
        result = method(request, timeout=context.time_remaining()) if wants_timeout else method(request)
        return await result if inspect.isawaitable(result) else result

    return handler


def _streaming(method: Callable, wants_timeout: bool):
    async def handler(request, context):
        responses = method(request, timeout=context.time_remaining()) if wants_timeout else method(request)
        async for response in responses:
            yield response

    return handler
