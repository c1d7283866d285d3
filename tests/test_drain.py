"""SIGTERM drain in a real process: in-flight calls finish, new calls are refused, exit 0."""

import threading

import grpc

from modalmesh import pb
from modalmesh.launcher import ServiceProcess


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
