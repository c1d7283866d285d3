"""gRPC clients of the services behind the gateway, with their health followed live.

Each backend has one channel (``dns:///`` + round_robin, as every modalmesh client)
and a task that watches its ``grpc.health.v1`` status (the Watch stream, re-opened
with back-off when the service goes away; a stream that ends on a backend whose
one `Check` still says SERVING — its connection aged out — is re-opened at once,
the backend never marked down). When the LLM turns SERVING its Info is
fetched again: the model id the gateway serves is the LLM's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb
from modalmesh.rpc.channel import aio_channel

log = logging.getLogger(__name__)

SERVING = "SERVING"
UNREACHABLE = "UNREACHABLE"


class Backend:
    def __init__(self, name: str, target: str, stub_cls, *, max_message_bytes: int,
                 on_change: Callable[[], None] | None = None, info_timeout: float = 10.0, security=None):
        self.name = name
        self.target = target
        self.channel = aio_channel(target, max_message_bytes=max_message_bytes, security=security)
        self.stub = stub_cls(self.channel)
        self.status = "UNKNOWN"
        self.detail = "not checked yet"
        self.info: pb.ServiceInfo | None = None
        self._on_change = on_change
        self._info_timeout = info_timeout
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.status == SERVING and self.info is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=f"health-{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()

    async def refresh_info(self) -> pb.ServiceInfo:
        self.info = await self.stub.Info(pb.InfoRequest(), timeout=self._info_timeout)
        return self.info

    def _set(self, status: str, detail: str) -> None:
        changed = status != self.status
        self.status, self.detail = status, detail
        if changed:
            log.info("%s (%s): %s%s", self.name, self.target, status, f" ({detail})" if detail else "")
            if self._on_change is not None:
                self._on_change()

    async def _watch(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        backoff = 0.05
        while True:
            call = health.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for reply in call:
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                    if status == SERVING:
                        await self.refresh_info()  # the served model may have changed with a restart
                    else:
                        self.info = None
                    self._set(status, "")
                    backoff = 0.05
                down = "health stream ended"
            except grpc.aio.AioRpcError as exc:
                down = f"{exc.code().name}: {exc.details()}"
            finally:
                call.cancel()
            # A stream also ends when its connection ages out (GOAWAY) on a healthy backend: ask once,
            # on a fresh connection, before sending requests away from it.
            if await self._still_serving(health):
                backoff = 0.05
                continue
            self.info = None
            self._set(UNREACHABLE, down)
            await asyncio.sleep(backoff)  # back-off while the service is away
            backoff = min(backoff * 2, 2.0)

    async def _still_serving(self, health) -> bool:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
