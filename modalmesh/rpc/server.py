"""gRPC server bootstrap shared by every service.

`GrpcServer` wraps grpc.aio with health (NOT_SERVING until the service says it is
ready), reflection, message limits, keepalive, a max connection age (so
round_robin clients re-resolve and find new replicas), the status interceptor,
and a graceful drain: health NOT_SERVING, the one-reply calls in flight end, then grpc's
GOAWAY refuses new calls, stop within a grace period (`GrpcServer.drain` says why
in that order). `serve_until_signal` runs that life cycle around a service's own
start-up and shutdown on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
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
    # The drain's first phase (GrpcServer.drain): grpc's GOAWAY waits until no call is in flight and none
    # has ended for drain_quiet_seconds, for at most drain_leave_seconds (never more than half the grace).
    drain_quiet_seconds: float = 0.5
    drain_leave_seconds: float = 5.0

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
        """NOT_SERVING; the calls with one reply in flight end before grpc's GOAWAY; new calls refused; stop.

        Why this order. grpc's stop(grace) sends a GOAWAY (GOAWAY, a PING, the final GOAWAY on its ack)
        and then closes each connection as soon as its last stream has been written to the socket. A
        call whose reply was written after that final GOAWAY (a 32 MiB Encode reply, say) could be cut
        off: the client, still reading the reply's tail from its socket, sends WINDOW_UPDATEs to a closed
        socket, the server's kernel answers with a reset and the client's kernel drops the unread tail
        (UNAVAILABLE on a call the server finished; test_a_call_answered_during_the_drain_reaches_its_
        client_whole). So where calls answered with one reply are in flight as the drain begins, the
        GOAWAY comes only once they have ended, i.e. once grpc has written their last reply and status to
        the socket (the interceptor's count, see StatusInterceptor._begin): the GOAWAY's PING then follows
        every reply byte on the connection, and grpc closes only after the client's PING ack, which the
        client sends after it has read all of them (and its WINDOW_UPDATEs for them).

        Until then (at most `drain_leave_seconds`) the server still takes new calls and serves them: none
        is refused before the GOAWAY, after which grpc refuses new streams at the transport level and
        clients retry them on another connection or replica by themselves. Clients that follow health
        (channel.aio_channel(health_check=True)) stop sending here the moment health says NOT_SERVING. (An
        earlier fix refused calls in the interceptor before the GOAWAY: round robin clients kept sending
        to the draining replica and their non-idempotent calls failed.)

        Streams of replies (an LLM's Generate, minutes long) do not hold the GOAWAY: new calls would be
        taken all that while and then cut at the grace's end. With none of the one-reply calls in flight,
        the GOAWAY goes out at once, as it always did. A stream's last replies are small (the client's
        flow-control window holds them without a WINDOW_UPDATE), so its end is not cut as a large reply's.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        await self.set_serving(False)
        if self.draining is not None:
            self.draining.set()  # services end what they were holding (their replies go out before the GOAWAY)
        # Quiet: no one-reply call in flight and none ended for drain_quiet_seconds, from now at the earliest.
        # Not the moment the last call ends: a client that sends its next call on each reply would send it
        # as the GOAWAY goes out, and grpc cancels a call that reaches a server whose stop has begun
        # (CANCELLED, not retried: grpc/grpc#41785). Clients that follow health have stopped by then.
        leave = min(self.config.drain_leave_seconds, self.config.grace_seconds / 2)
        if leave > 0 and self.interceptor.replying:
            try:
                await asyncio.wait_for(
                    self.interceptor.wait_quiet(self.config.drain_quiet_seconds, time.monotonic()), leave)
            except asyncio.TimeoutError:
                log.info("calls still coming after %.1fs (%d in flight): refusing new calls now",
                         leave, self.interceptor.active)
        grace = max(0.0, self.config.grace_seconds - (loop.time() - began))
        stopping = asyncio.ensure_future(self._server.stop(grace))
        # The grace is for the services' own calls: once they are done, end now. Health watches (a
        # gateway's, a load balancer's) never finish by themselves and would hold every drain to the full
        # grace period, so end them and let stop(grace) finish by itself. Not stop(0): that force-closes
        # every connection, replies still in its buffers included (UNAVAILABLE "Cancelling all calls").
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
