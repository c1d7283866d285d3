"""SIGTERM drain in a real process: in-flight calls finish, new calls are refused, exit 0."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from modalmesh import pb
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.process import PARENT_PID_ENV


def test_sigterm_lets_in_flight_call_finish_then_refuses_new_calls_and_exits_0():
    proc = ServiceProcess("echo", ["--port", "0", "--grace", "20"], module="tests.helpers.echo_service")
    with proc:
        proc.wait_serving(timeout=60)
        channel = grpc.insecure_channel(proc.target)
        stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
        # A slow call: the servicer holds it until the server starts draining.
        in_flight = stub.Encode.future(pb.EncodeRequest(request_id="hold"), timeout=60)
        # The call is in the server's hands once Info answers on the same connection
        # after it (HTTP/2 streams are started in order).
        stub.Info(pb.InfoRequest(), timeout=10)
        assert not in_flight.done()

        proc.send_sigterm()
        reply = in_flight.result(timeout=60)  # finished during the drain
        assert reply.model_id == "echo"

        # The server only released the held call after it began refusing new ones.
        try:
            stub.Info(pb.InfoRequest(), timeout=10)
            refused = None
        except grpc.RpcError as exc:
            refused = exc.code()
        assert refused == grpc.StatusCode.UNAVAILABLE
        channel.close()
        assert proc.proc.wait(timeout=60) == 0


def test_second_sigterm_during_drain_does_not_change_exit_code():
    proc = ServiceProcess("echo", ["--port", "0", "--grace", "20"], module="tests.helpers.echo_service")
    with proc:
        proc.wait_serving(timeout=60)
        channel = grpc.insecure_channel(proc.target)
        stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
        in_flight = stub.Encode.future(pb.EncodeRequest(request_id="hold"), timeout=60)
        stub.Info(pb.InfoRequest(), timeout=10)
        proc.proc.send_signal(15)
        proc.proc.send_signal(15)
        assert in_flight.result(timeout=60).model_id == "echo"
        channel.close()
        assert proc.proc.wait(timeout=60) == 0


# ---- orphans -------------------------------------------------------------------------------------
_LAUNCHER = """
import os, sys
from modalmesh.ops.launcher import ServiceProcess
proc = ServiceProcess("echo", ["--port", "0", "--grace", "5"], module="tests.helpers.echo_service").start()
proc.wait_listening(60)
print(proc.proc.pid, flush=True)
os._exit(0)  # the launcher crashes: no terminate(), no atexit
"""


def _gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (a zombie awaiting its new parent's reap counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_service_stops_when_its_launcher_dies():
    out = subprocess.run([sys.executable, "-c", _LAUNCHER], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    try:
        assert _gone(pid, 30), f"service {pid} outlived its launcher"
    finally:
        if not _gone(pid, 0.1):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_service_whose_launcher_is_already_gone_exits_before_listening():
    # The launcher named in the environment is not this child's parent: it died between fork and prctl.
    proc = ServiceProcess("echo", ["--port", "0"], module="tests.helpers.echo_service",
                          env={PARENT_PID_ENV: str(os.getpid() + 10_000_000)})
    with proc:
        with pytest.raises(RuntimeError, match="exited with -15 before listening"):
            proc.wait_listening(60)


# ---- a reply still on the wire when the drain ends ------------------------------------------------
def test_a_call_answered_during_the_drain_reaches_its_client_whole():
    # The drain ended once every handler had returned and then stopped the server at once: a large
    # reply still being sent was cut off (UNAVAILABLE "Cancelling all calls"). Then it stopped with a grace
    # (a GOAWAY) at its start, and each connection closed as soon as its last reply had been written to the
    # socket: the client's next WINDOW_UPDATE met a closed socket and the reset discarded what it had not
    # read (UNAVAILABLE "Connection reset by peer", 2 runs in 57 here). Now the server refuses new calls
    # itself and stops only once the reply has had time to be read.
    import asyncio

    from modalmesh.rpc.server import GrpcServer, ServerConfig

    size = 32 << 20

    async def body():
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, grace_seconds=20, max_message_bytes=64 << 20))
        servicer = _Held(lambda: server.draining, reply_bytes=size)  # made by start()
        server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer)
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
                call = asyncio.ensure_future(pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
                    pb.EncodeRequest(), timeout=30))
                await asyncio.wait_for(servicer.entered.wait(), 10)  # in its handler, not merely sent
                await server.drain()
                assert len((await call).model_id) == size
                assert server.interceptor.active == 0  # the ended call was counted out
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


class _Held(pb.encoder_pb2_grpc.EncoderServiceServicer):
    """Encode waits in its handler until `release()` returns an event that is set, then answers."""

    def __init__(self, release, reply_bytes: int = 1):
        import asyncio

        self.release, self.reply_bytes = release, reply_bytes
        self.entered = asyncio.Event()

    async def Encode(self, request, context):
        self.entered.set()
        await self.release().wait()
        return pb.EncodeResponse(model_id="x" * self.reply_bytes)

    async def Info(self, request, context):
        return pb.ServiceInfo(service="held")


def test_during_the_drain_new_calls_are_refused_and_health_answers_not_serving():
    # The drain used to begin with grpc's stop(grace): new calls, health checks among them, met a GOAWAY.
    # Now the server refuses the services' calls itself (UNAVAILABLE, naming the drain: the project's
    # channels retry it on another replica) while a load balancer's health check still gets its answer.
    import asyncio

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from modalmesh.rpc.server import GrpcServer, ServerConfig

    async def body():
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, grace_seconds=20, drain_linger_seconds=0.2))
        release = asyncio.Event()
        servicer = _Held(lambda: release)
        server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, servicer)
        port = await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                held = asyncio.ensure_future(stub.Encode(pb.EncodeRequest(), timeout=30))
                await asyncio.wait_for(servicer.entered.wait(), 10)
                draining = asyncio.ensure_future(server.drain())
                await asyncio.sleep(0.05)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Info(pb.InfoRequest(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
                check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                         timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert not draining.done()  # the held call is still in flight
                release.set()
                assert (await held).model_id == "x"
                await asyncio.wait_for(draining, 10)
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_quiet_waits_for_the_calls_and_then_the_linger():
    import asyncio
    import time

    from modalmesh.rpc.interceptor import StatusInterceptor

    async def body():
        interceptor = StatusInterceptor()
        start = time.monotonic()
        await interceptor.wait_quiet(5.0)  # no call has ended: nothing on the wire to wait for
        assert time.monotonic() - start < 1.0
        interceptor.active = 1
        quiet = asyncio.ensure_future(interceptor.wait_quiet(0.2))
        await asyncio.sleep(0.05)
        assert not quiet.done()  # a call in flight
        ended = time.monotonic()
        interceptor._call_done(None)
        await asyncio.wait_for(quiet, 5)
        assert time.monotonic() - ended >= 0.2  # then the linger

    asyncio.run(body())
