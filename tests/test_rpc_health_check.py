"""Client-side health checking (channel.aio_channel(health_check=True)): round_robin skips a NOT_SERVING replica.

What it is for: a draining replica says NOT_SERVING first and sends grpc's GOAWAY only once its calls have
ended (GrpcServer.drain); a channel that follows health stops sending it calls at once, so none of its calls
is cut by the GOAWAY or races it. Why it is off by default: such a channel cannot see a NOT_SERVING replica
at all, health included (the last test).
"""

import asyncio
import json
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modalmesh import pb
from modalmesh.rpc.channel import aio_channel, service_config
from tests.helpers.echo_service import build


def test_health_check_is_off_by_default_and_watches_the_whole_server_when_on():
    assert "healthCheckConfig" not in json.loads(service_config())
    config = json.loads(service_config(health_check=True))
    assert config["healthCheckConfig"] == {"serviceName": ""}  # GrpcServer.set_serving sets "" too
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]  # grpc honours it under round_robin


async def _encode(stub) -> str:
    return (await stub.Encode(pb.EncodeRequest(request_id="echo"), timeout=10)).model_id


async def _until(stub, predicate, timeout: float = 5.0) -> list[str]:
    """Call until the answers so far satisfy `predicate` (bounded); returns them."""
    answered: list[str] = []
    deadline = time.monotonic() + timeout
    while not predicate(answered):
        assert time.monotonic() < deadline, f"still {answered[-10:]} after {timeout}s"
        answered.append(await _encode(stub))
        await asyncio.sleep(0.01)
    return answered


def test_a_replica_that_says_not_serving_gets_no_more_calls_from_a_health_checking_channel():
    async def body():
        (server_a, encoder_a), (server_b, _) = build(name="a"), build(name="b")
        port_a, port_b = await server_a.start(), await server_b.start()
        try:
            await server_a.set_serving(True)
            await server_b.set_serving(True)
            async with aio_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}", health_check=True) as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                await _until(stub, lambda seen: {"a", "b"} <= set(seen))  # both picked

                await server_a.set_serving(False)
                # Its health Watch tells the channel within a round trip: at most a call or two in between.
                await _until(stub, lambda seen: seen[-3:] == ["b"] * 3)
                calls_a = encoder_a.encode_calls
                assert [await _encode(stub) for _ in range(30)] == ["b"] * 30
                assert encoder_a.encode_calls == calls_a

                await server_a.set_serving(True)  # SERVING again (a replica done loading): picked again
                await _until(stub, lambda seen: "a" in seen)
        finally:
            await server_a.stop(0)
            await server_b.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_draining_replica_loses_a_health_checking_clients_calls_before_its_goaway():
    # Calls that are not retried (retry_methods=(): as a Generate) keep coming while replica a drains: none
    # fails, and a's drain is quiet well before drain_leave_seconds. The quiet period is 2 s here, not 0.5:
    # on a loaded CI machine the client's health watch once took longer than 0.5 s to move it off a, and a
    # call that reached a as its GOAWAY went out was CANCELLED (grpc/grpc#41785)
    async def body():
        (server_a, encoder_a), (server_b, _) = build(name="a", drain_quiet_seconds=2.0), build(name="b")
        port_a, port_b = await server_a.start(), await server_b.start()
        failures: list[str] = []
        answered_after: list[str] = []
        stop = asyncio.Event()
        drained_at: list[float] = []
        try:
            await server_a.set_serving(True)
            await server_b.set_serving(True)
            async with aio_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}", retry_methods=(),
                                   health_check=True) as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                await _until(stub, lambda seen: {"a", "b"} <= set(seen))

                async def client():
                    while not stop.is_set():
                        sent_after = bool(drained_at)  # a call sent before may be read after: a's answer
                        try:
                            name = await _encode(stub)
                            if sent_after:
                                answered_after.append(name)
                        except grpc.aio.AioRpcError as exc:
                            failures.append(f"{exc.code().name}: {exc.details()}")
                        await asyncio.sleep(0.005)

                clients = [asyncio.ensure_future(client()) for _ in range(4)]
                await asyncio.sleep(0.2)
                began = time.monotonic()
                await asyncio.wait_for(server_a.drain(), 20)
                took = time.monotonic() - began
                drained_at.append(time.monotonic())
                await asyncio.sleep(0.2)
                stop.set()
                await asyncio.wait_for(asyncio.gather(*clients), 20)
        finally:
            stop.set()
            await server_a.stop(0)
            await server_b.stop(0)
        assert failures == []
        assert took < server_a.config.drain_leave_seconds, took  # quiet soon after NOT_SERVING
        assert answered_after and set(answered_after) == {"b"}
        assert encoder_a.encode_calls > 0

    asyncio.run(asyncio.wait_for(body(), 60))


def test_with_no_replica_serving_a_health_checking_channel_fails_even_health_checks():
    # Why health_check is off by default: during start-up (NOT_SERVING until loaded) a readiness probe through
    # such a channel gets UNAVAILABLE instead of the NOT_SERVING a default channel reads.
    async def body():
        server, _ = build(name="a")
        port = await server.start()  # NOT_SERVING
        try:
            async with aio_channel(f"ipv4:127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            async with aio_channel(f"ipv4:127.0.0.1:{port}", health_check=True) as channel:
                for call in (health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10),
                             pb.encoder_pb2_grpc.EncoderServiceStub(channel).Info(pb.InfoRequest(), timeout=10)):
                    try:
                        await call
                        code = None
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code()
                    assert code == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))
