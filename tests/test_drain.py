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
    # reply still being sent was cut off (UNAVAILABLE "Cancelling all calls"). A call now counts as in
    # flight until it has ended on the wire.
    import asyncio

    from modalmesh.rpc.server import GrpcServer, ServerConfig

    size = 32 << 20

    class Big(pb.encoder_pb2_grpc.EncoderServiceServicer):
        def __init__(self, server):
            self.server = server

        async def Encode(self, request, context):
            await self.server.draining.wait()
            return pb.EncodeResponse(model_id="x" * size)

        async def Info(self, request, context):
            return pb.ServiceInfo(service="big")

    async def body():
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, grace_seconds=20, max_message_bytes=64 << 20))
        server.add_service(pb.ENCODER_SERVICE, pb.encoder_pb2_grpc.add_EncoderServiceServicer_to_server, Big(server))
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                call = asyncio.ensure_future(stub.Encode(pb.EncodeRequest(), timeout=30))
                await stub.Info(pb.InfoRequest(), timeout=10)  # the Encode is in the server's hands
                await server.drain()
                assert len((await call).model_id) == size
                await asyncio.wait_for(server.interceptor.wait_idle(), 10)  # the ended call was counted out
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))
