"""modalmesh.rpc.transfer: the sender's paths, the receiver's offers and fallbacks (CPU; CUDA where marked)."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.rpc import wire
from modalmesh.rpc.codec import describe, from_payload
from modalmesh.rpc.shm import ShmExporter, ShmProbe, ShmReader
from modalmesh.rpc.transfer import INLINE_BYTES, EmbeddingSender
from services.encoder.cache import Answer


def _answer(tensor, ready=None):
    return Answer(pb.Embedding(embedding=describe(tensor), num_placeholder_tokens=tensor.shape[0]), tensor, ready)


def _respond(sender, answers, options):
    response = pb.EncodeResponse(model_id="m")
    out = asyncio.run(sender.respond(response, answers, options))
    if isinstance(out, bytes):
        rest, payloads = wire.strip(out, wire.ENCODE_RESPONSE_BYTES)
        return pb.EncodeResponse.FromString(rest), payloads
    return out, [None] * len(out.embeddings)


@pytest.mark.parametrize("rows", [3, INLINE_BYTES // (64 * 4) + 1])  # on the event loop, and in the pool
def test_the_bytes_path_carries_each_answer_exactly_and_counts_it(rows):
    metrics = Metrics("vision_encoder", process_metrics=False)
    with ThreadPoolExecutor(2) as pool:
        sender = EmbeddingSender(shm=None, executor=pool, metrics=metrics)
        x, y = torch.randn(rows, 64), torch.randn(2, 64).to(torch.bfloat16)
        reply, payloads = _respond(sender, [_answer(x), _answer(y)], None)
    assert torch.equal(from_payload(reply.embeddings[0].embedding, payloads[0]), x)
    assert torch.equal(from_payload(reply.embeddings[1].embedding, payloads[1]), y)
    sent = metrics.registry.get_sample_value("modalmesh_transfer_bytes_total",
                                             {"service": "vision_encoder", "direction": "sent", "path": "grpc"})
    assert sent == x.numel() * 4 + y.numel() * 2


def test_the_shared_memory_path_puts_tensors_into_slabs(tmp_path):
    metrics = Metrics("vision_encoder", process_metrics=False)
    exporter, probe, reader = ShmExporter(directory=tmp_path), ShmProbe(tmp_path), ShmReader(tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            sender = EmbeddingSender(shm=exporter, executor=pool, metrics=metrics)
            x = torch.randn(5, 64).to(torch.bfloat16)
            reply, payloads = _respond(sender, [_answer(x)], probe.options())
        assert reply.embeddings[0].embedding.HasField("shared_memory") and payloads == [None]
        assert torch.equal(reader.read(reply.embeddings[0].embedding), x)
        sent = metrics.registry.get_sample_value(
            "modalmesh_transfer_bytes_total", {"service": "vision_encoder", "direction": "sent", "path": "shared_memory"})
        assert sent == x.numel() * 2
    finally:
        reader.close()
        probe.close()
        exporter.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_answers_go_by_bytes_and_by_shared_memory_equal_to_the_cpu_path(tmp_path):
    exporter, probe, reader = ShmExporter(directory=tmp_path), ShmProbe(tmp_path), ShmReader(tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            sender = EmbeddingSender(shm=exporter, executor=pool)
            host = torch.randn(256, 3584).to(torch.bfloat16)
            device = host.cuda()
            ready = torch.cuda.Event()
            ready.record()
            for _ in range(2):  # the second time through a reused pinned buffer and a registered slab
                reply, payloads = _respond(sender, [_answer(device, ready)], None)
                assert torch.equal(from_payload(reply.embeddings[0].embedding, payloads[0]), host)
                reply, _ = _respond(sender, [_answer(device, ready)], probe.options())
                assert torch.equal(reader.read(reply.embeddings[0].embedding), host)
                assert torch.equal(reader.read(_respond(sender, [_answer(device, ready)], probe.options())[0]
                                               .embeddings[0].embedding, device="cuda").cpu(), host)
    finally:
        reader.close()
        probe.close()
        exporter.close()
