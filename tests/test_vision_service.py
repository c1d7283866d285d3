"""The vision encoder through gRPC: batching across clients, the cache, bad items, Info, the CLI."""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.server import GrpcServer, ServerConfig
from modalmesh.service import build_parser
from modalmesh.testing import tiny
from modalmesh.weights.fingerprint import checkpoint_fingerprint
from services.vision_encoder.server import VisionEncoderService

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    path = tiny.ensure("qwen2_vl", tmp_path_factory.mktemp("vision_svc"))
    return path, Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _png(h: int, w: int, seed: int) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _reference(ref, path, data: bytes) -> tuple[torch.Tensor, list[int]]:
    from transformers import Qwen2VLImageProcessorPil

    batch = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    with torch.no_grad():
        rows = ref.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    return rows, batch["image_grid_thw"][0].tolist()


async def _serve(path, *flags):
    parser = build_parser("vision_encoder", "")
    VisionEncoderService.add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--metrics-port", "-1", *flags])
    metrics = Metrics("vision_encoder", process_metrics=False)
    service = VisionEncoderService(args, metrics)
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0), metrics)
    service.register(server)
    port = await server.start()
    await service._startup()
    await server.set_serving(True)
    calls = []
    encode = service.model.encode
    service.model.encode = lambda batch: calls.append([p.cost for p in batch]) or encode(batch)
    return service, server, port, metrics, calls


def test_concurrent_clients_batch_together_and_get_their_own_rows(qwen):
    path, ref = qwen
    sizes = [(56, 56), (100, 150), (224, 180), (40, 300), (90, 90), (150, 60)]
    images = [[_png(h, w, seed=i), _png(w, h, seed=100 + i)] for i, (h, w) in enumerate(sizes)]

    async def body():
        service, server, port, metrics, calls = await _serve(path, "--batch-window-ms", "300",
                                                              "--max-batch-tokens", "100000")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                requests = [pb.EncodeRequest(items=[pb.EncodeItem(data=d) for d in pair]) for pair in images]
                return await asyncio.gather(*(stub.Encode(r) for r in requests)), calls, service
        finally:
            await server.stop(0)
            await service.close()

    replies, calls, service = asyncio.run(asyncio.wait_for(body(), 120))
    assert len(calls) < len(images) and sum(len(c) for c in calls) == 12  # batched across clients, once each
    fingerprint = checkpoint_fingerprint(path)
    for pair, reply in zip(images, replies):
        assert reply.modality == pb.IMAGE and reply.weights_fingerprint == fingerprint
        for data, emb in zip(pair, reply.embeddings):
            want, grid = _reference(ref, path, data)
            got = from_proto(emb.embedding)
            assert list(emb.grid_thw) == grid and emb.num_placeholder_tokens == got.shape[0] == want.shape[0]
            assert got.dtype == torch.float32 and got.shape[1] == 64
            assert (got - want).abs().max().item() <= TOL


def test_cache_bad_items_info_and_metrics(qwen):
    path, ref = qwen
    good = _png(70, 110, seed=7)

    async def body():
        service, server, port, metrics, calls = await _serve(path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                first = await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=good)]))
                again = await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=good)]))
                assert not first.embeddings[0].cache_hit and again.embeddings[0].cache_hit
                assert again.embeddings[0].embedding.data == first.embeddings[0].embedding.data
                assert len(calls) == 1  # the hit never reached the model
                smaller = await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=good, max_pixels=28 * 28 * 4)]))
                assert not smaller.embeddings[0].cache_hit and list(smaller.embeddings[0].grid_thw) == [1, 2, 4]
                assert smaller.embeddings[0].num_placeholder_tokens == 2

                bad_requests = [
                    (pb.EncodeRequest(items=[pb.EncodeItem(data=good), pb.EncodeItem(data=b"\x89PNG junk")]),
                     "items[1]: data is not a decodable"),
                    (pb.EncodeRequest(items=[pb.EncodeItem(pixels=to_proto(torch.zeros(5, 5, 2, dtype=torch.uint8)))]),
                     "items[0].pixels: shape [5, 5, 2]"),
                    (pb.EncodeRequest(items=[pb.EncodeItem(data=good),
                                             pb.EncodeItem(pixels=to_proto(torch.zeros(0, 4, 3, dtype=torch.uint8)))]),
                     "items[1]: image has zero size"),
                ]
                # Bad requests run concurrently with a good one, which is unaffected.
                other = _png(60, 60, seed=8)
                results = await asyncio.gather(
                    *(stub.Encode(r) for r, _ in bad_requests),
                    stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(data=other)])), return_exceptions=True)
                for (_, message), err in zip(bad_requests, results):
                    assert isinstance(err, grpc.aio.AioRpcError), err
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
                want, _ = _reference(ref, path, other)
                assert (from_proto(results[-1].embeddings[0].embedding) - want).abs().max().item() <= TOL

                info = await stub.Info(pb.InfoRequest())
        finally:
            await server.stop(0)
            await service.close()
        return info, metrics

    info, metrics = asyncio.run(asyncio.wait_for(body(), 120))
    assert info.ready and info.architecture == "Qwen2VLForConditionalGeneration"
    assert (info.hidden_size, info.output_hidden_size, info.modality) == (32, 64, pb.IMAGE)
    assert info.extra["tower"] == "Qwen2VisionTransformer" and info.extra["max_pixels"] == str(28 * 28 * 64)
    assert [a.component for a in info.attention] == ["vision_encoder"] and info.attention[0].backend
    assert info.pools[0].name == "embedding_cache" and info.pools[0].used_tokens > 0
    get = metrics.registry.get_sample_value
    svc = {"service": "vision_encoder"}
    assert get("modalmesh_encoded_items_total", {**svc, "modality": "image"}) == 4
    assert get("modalmesh_batch_tokens_count", svc) >= 3
    # Lookups happen before decoding, so the good items of the bad requests above count as hits too.
    assert get("modalmesh_cache_hits_total", {**svc, "pool": "embedding_cache"}) >= 1
    assert get("modalmesh_attention_backend_info", {**svc, "component": "vision_encoder",
                                                    "backend": info.attention[0].backend,
                                                    "reason": info.attention[0].reason}) == 1
    assert get("modalmesh_requests_total", {**svc, "rpc": "Encode", "code": "INVALID_ARGUMENT"}) == 3


def test_cli_serves_a_checkpoint_and_drains(qwen, tmp_path):
    path, ref = qwen
    data = _png(80, 120, seed=3)
    proc = ServiceProcess("vision_encoder", ["--model", str(path), "--port", "0", "--metrics-port", "-1",
                                             "--device", "cpu", "--host", "127.0.0.1"])
    with proc:
        proc.wait_serving(timeout=120)
        with grpc.insecure_channel(proc.target) as channel:
            reply = pb.encoder_pb2_grpc.EncoderServiceStub(channel).Encode(
                pb.EncodeRequest(items=[pb.EncodeItem(data=data)]), timeout=60)
        assert proc.terminate(timeout=30) == 0
    want, grid = _reference(ref, path, data)
    assert list(reply.embeddings[0].grid_thw) == grid
    assert (from_proto(reply.embeddings[0].embedding) - want).abs().max().item() <= TOL
