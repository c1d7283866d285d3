"""gRPC server bootstrap shared by every service.

`GrpcServer` wraps grpc.aio with health (NOT_SERVING until the service says it is
ready), reflection, message limits, keepalive, a max connection age (so
round_robin clients re-resolve and find new replicas), the status interceptor,
and a graceful drain: health NOT_SERVING, refuse new calls, let in-flight calls
finish within a grace period, stop. `serve_until_signal` runs that life cycle
around a service's own start-up and shutdown on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from modalmesh.metrics import Metrics
from modalmesh.rpc.interceptor import StatusInterceptor
from modalmesh.rpc.security import INSECURE, Security

log = logging.getLogger(__name__)

MiB = 1 << 20
FOREVER_MS = 2**31 - 1  # grpc's "infinite" for its millisecond options


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # only this machine unless told otherwise (--host 0.0.0.0 in containers)
    port: int = 50051
    max_message_bytes: int = 64 * MiB
    grace_seconds: float = 30.0
    # Clients re-resolve DNS when a connection ages out (GOAWAY): new replicas get traffic. In-flight
    # calls are never cut by default — a Generate stream can run for many minutes — so the grace is
    # unlimited; 0 turns ageing off.
    max_connection_age_ms: int = 5 * 60_000
    max_connection_age_grace_ms: int = FOREVER_MS
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    reflection: bool = True
    security: Security = INSECURE  # TLS and the shared token

    def options(self) -> list[tuple[str, int]]:
        ageing = [("grpc.max_connection_age_ms", self.max_connection_age_ms),
                  ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms)]
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            *(ageing if self.max_connection_age_ms > 0 else []),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),
        ]


class BindError(OSError):
    """The gRPC server could not bind its address; `reason` is the operating system's word for why."""

    def __init__(self, address: str, reason: str | None):
        super().__init__(f"cannot bind gRPC server to {address}: {reason or 'unknown reason'}")
        self.address, self.reason = address, reason


def _bind_reason(host: str, port: int) -> str | None:
    """Why binding failed, asked of the OS by binding once more (gRPC's own error names no errno)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        return exc.strerror
    return None


class _HealthServicer(health.aio.HealthServicer):
    """grpc's health servicer, whose Watch streams the drain can end (they never end by themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self._ending = asyncio.Event()

    def end_watches(self) -> None:
        self._ending.set()

    async def Watch(self, request, context) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        ending = asyncio.ensure_future(self._ending.wait())
        try:
            await asyncio.wait({watching, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
            watching.cancel()  # a request only: a pending task is not done() until it has run
        if watching.done():
            return watching.result()  # it ended by itself
        await asyncio.wait({watching})  # let it clean up, then end the stream
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details("the server is shutting down")


class GrpcServer:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics
        self.interceptor = StatusInterceptor(metrics, config.security)
        self._server = grpc.aio.server(interceptors=[self.interceptor], options=config.options())
        self.health = _HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._services: list[str] = []
        self.port: int | None = None
        self.draining: asyncio.Event | None = None

    def add_service(self, full_name: str, add_to_server: Callable, servicer) -> None:
        """Register a servicer, e.g. add_service(pb.LLM_SERVICE, add_LLMServiceServicer_to_server, s)."""
        add_to_server(servicer, self._server)
        self._services.append(full_name)

    @property
    def service_names(self) -> list[str]:
        return list(self._services)

    async def start(self) -> int:
        self.draining = asyncio.Event()
        if self.config.reflection:
            reflection.enable_server_reflection(
                [*self._services, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
            )
        address = f"{self.config.host}:{self.config.port}"
        credentials = self.config.security.server_credentials()
        try:
            self.port = (self._server.add_secure_port(address, credentials) if credentials is not None
                         else self._server.add_insecure_port(address))
        except RuntimeError:  # grpcio raises "Failed to bind" where older releases returned 0
            self.port = 0
        if not self.port:
            raise BindError(address, _bind_reason(self.config.host, self.config.port))
        await self.set_serving(False)
        await self._server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self._services):
            await self.health.set(name, status)
        if self.metrics is not None:
            self.metrics.ready.set(1 if serving else 0)

    async def drain(self) -> None:
        """NOT_SERVING, refuse new calls, finish in-flight calls within the grace period."""
        await self.set_serving(False)
        stopping = asyncio.ensure_future(self._server.stop(self.config.grace_seconds))
        await asyncio.sleep(0)  # let stop() begin refusing new calls before waking anyone
        if self.draining is not None:
            self.draining.set()
        # The grace is for the services' own calls: once they are done, end now. Health watches (a
        # gateway's, a load balancer's) never finish by themselves and would hold every drain to the full
        # grace period, so end them and let stop(grace) finish by itself. Not stop(0): a call is done for
        # the interceptor once grpc has taken its last reply and status, which may still be in the
        # connection's buffers (a 32 MiB reply is); stop(0) force-closes every connection and cut such
        # replies off (UNAVAILABLE "Cancelling all calls", or a reset after the GOAWAY). stop(grace)
        # closes each connection only after its last stream has been written out, and ends when all are.
        idle = asyncio.ensure_future(self.interceptor.wait_idle())
        await asyncio.wait({stopping, idle}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            self.health.end_watches()
        idle.cancel()
        await stopping

    async def stop(self, grace: float | None = None) -> None:
        await self._server.stop(grace)


async def serve_until_signal(
    server: GrpcServer,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
    on_listening: Callable[[int], None] | None = None,
    stop_event: asyncio.Event | None = None,
) -> int:
    """Start, run `startup` (loading, warm-up), go SERVING, drain on SIGTERM/SIGINT.

    Returns the process exit code: 0 after a clean drain, 1 if start-up failed.
    """
    loop = asyncio.get_running_loop()
    stop = stop_event or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    await server.start()
    if on_listening is not None:
        on_listening(server.port)
    exit_code = 0
    if startup is not None:
        starting = asyncio.ensure_future(startup())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            log.info("stop requested during start-up")
        elif starting.exception() is not None:
            log.error("start-up failed: %s", starting.exception(), exc_info=starting.exception())
            exit_code = 1
            stop.set()
        stopping.cancel()
    if not stop.is_set():
        await server.set_serving(True)
        log.info("SERVING %s on port %d", ", ".join(server.service_names), server.port)
        await stop.wait()
    log.info("draining (grace %.1fs)", server.config.grace_seconds)
    await server.drain()
    if shutdown is not None:
        await shutdown()
    log.info("stopped")
    return exit_code
