"""Client channels: target normalisation, round_robin over replicas, UNAVAILABLE retried elsewhere."""

import asyncio
import json

import grpc
import pytest

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.rpc.channel import aio_channel, normalize_target, service_config
from tests.helpers.echo_service import build


@pytest.mark.parametrize(
    "target, expected",
    [
        ("vision_encoder:50051", "dns:///vision_encoder:50051"),
        ("  localhost:1  ", "dns:///localhost:1"),
        ("dns:///vision_encoder:50051", "dns:///vision_encoder:50051"),
        ("ipv4:127.0.0.1:50061,127.0.0.1:50062", "ipv4:127.0.0.1:50061,127.0.0.1:50062"),
        ("unix:/tmp/llm.sock", "unix:/tmp/llm.sock"),
    ],
)
def test_normalize_target(target, expected):
    assert normalize_target(target) == expected


def test_empty_target_is_rejected():
    with pytest.raises(ValueError):
        normalize_target(" ")


def test_service_config_is_round_robin_with_unavailable_retries():
    config = json.loads(service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    policy = config["methodConfig"][0]["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert {"service": pb.ENCODER_SERVICE, "method": "Encode"} in config["methodConfig"][0]["name"]


def _calls(metrics: Metrics, code: str = "OK") -> float:
    return metrics.registry.get_sample_value(
        "modalmesh_requests_total", {"service": "echo", "rpc": "Encode", "code": code}) or 0


def test_round_robin_spreads_calls_and_unavailable_is_retried_on_another_replica():
    async def body():
        metrics_a, metrics_b = Metrics("echo", process_metrics=False), Metrics("echo", process_metrics=False)
        server_a, encoder_a = build(metrics=metrics_a, name="a")
        server_b, encoder_b = build(metrics=metrics_b, name="b")
        port_a, port_b = await server_a.start(), await server_b.start()
        try:
            async with aio_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                await channel.channel_ready()
                answered = [(await stub.Encode(pb.EncodeRequest(request_id="echo"), timeout=10)).model_id
                            for _ in range(20)]
                assert set(answered) == {"a", "b"}
                assert _calls(metrics_a) >= 5 and _calls(metrics_b) >= 5

                # Replica a starts refusing with UNAVAILABLE: clients never see it.
                encoder_a.refuse = True
                server_a_calls_before = encoder_a.encode_calls
                for _ in range(10):
                    reply = await stub.Encode(pb.EncodeRequest(request_id="echo"), timeout=10)
                    assert reply.model_id == "b"
                assert encoder_a.encode_calls > server_a_calls_before  # a was tried and refused
        finally:
            await server_a.stop(0)
            await server_b.stop(0)

    asyncio.run(asyncio.wait_for(body(), 60))
