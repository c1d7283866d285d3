"""A real grpc.aio server on 127.0.0.1: health, reflection, Info, error mapping, metrics."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.server import serve_until_signal
from tests.helpers.echo_service import build

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def _health(channel, service=""):
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


def test_health_goes_from_not_serving_to_serving_after_startup():
    async def body():
        server, _ = build()
        loaded = asyncio.Event()
        stop = asyncio.Event()
        listening = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            serve_until_signal(server, startup=loaded.wait, on_listening=listening.set_result, stop_event=stop)
        )
        port = await listening
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _health(channel) == NOT_SERVING
            assert await _health(channel, pb.ENCODER_SERVICE) == NOT_SERVING
            # Watch the transition instead of polling for it.
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == NOT_SERVING
            loaded.set()  # the service finished loading its weights
            assert (await watch.read()).status == SERVING
            watch.cancel()
            assert await _health(channel, pb.ENCODER_SERVICE) == SERVING
            stop.set()
            assert await task == 0

    run(body())


def test_failed_startup_exits_1_and_never_serves():
    async def body():
        server, _ = build()

        async def broken_load():
            raise FileNotFoundError("model.safetensors missing")

        assert await serve_until_signal(server, startup=broken_load) == 1

    run(body())


def test_reflection_lists_services_and_info_answers():
    async def body():
        server, _ = build(name="reflect-me")
        port = await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)

                async def requests():
                    yield reflection_pb2.ServerReflectionRequest(list_services="")

                names = set()
                async for reply in stub.ServerReflectionInfo(requests()):
                    names |= {s.name for s in reply.list_services_response.service}
                assert {pb.ENCODER_SERVICE, "grpc.health.v1.Health"} <= names
                info = await pb.encoder_pb2_grpc.EncoderServiceStub(channel).Info(pb.InfoRequest())
                assert info.service == "reflect-me" and info.ready
        finally:
            await server.stop(0)

    run(body())


def test_errors_map_to_status_codes_with_one_line_messages_and_metrics():
    async def body():
        metrics = Metrics("echo", process_metrics=False)
        server, _ = build(metrics=metrics)
        port = await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                good = pb.EncodeRequest(request_id="echo")
                good.items.add(pcm=to_proto(__import__("torch").arange(6.0).reshape(3, 2)))
                reply = await stub.Encode(good)
                assert from_proto(reply.embeddings[0].embedding).tolist() == [[0, 1], [2, 3], [4, 5]]

                bad = pb.EncodeRequest(request_id="echo")
                bad.items.add(pcm=pb.Tensor(dtype=pb.FLOAT32, shape=[4], data=b"\0" * 15))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "items[0].pcm: data holds 15 bytes but shape [4] of FLOAT32 needs 16"

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(request_id="busy"))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(request_id="boom"))
                assert err.value.code() == grpc.StatusCode.INTERNAL
                details = err.value.details()
                assert "\n" not in details and "secret" not in details and "Traceback" not in details
                assert "RuntimeError" in details

                # The server survived every failure.
                assert (await stub.Info(pb.InfoRequest())).service == "echo"
        finally:
            await server.stop(0)

        def count(code):
            return metrics.registry.get_sample_value(
                "modalmesh_requests_total", {"service": "echo", "rpc": "Encode", "code": code})

        assert count("OK") == 1
        assert count("INVALID_ARGUMENT") == 1
        assert count("RESOURCE_EXHAUSTED") == 1
        assert count("INTERNAL") == 1
        assert metrics.registry.get_sample_value(
            "modalmesh_request_duration_seconds_count", {"service": "echo", "rpc": "Encode", "code": "OK"}) == 1
        assert metrics.registry.get_sample_value(
            "modalmesh_requests_in_flight", {"service": "echo", "rpc": "Encode"}) == 0
        assert metrics.registry.get_sample_value("modalmesh_ready", {"service": "echo"}) == 1

    run(body())


def test_message_size_limit_is_enforced():
    async def body():
        server, _ = build()
        port = await server.start()
        await server.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 128 << 20)]
            ) as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                req = pb.EncodeRequest(request_id="echo")
                req.items.add(pcm=pb.Tensor(dtype=pb.UINT8, shape=[65 << 20], data=bytes(65 << 20)))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(req)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    run(body())
