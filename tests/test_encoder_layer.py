"""The shared encoder layer (cache, batcher, Encode) with a toy model, through a real gRPC server."""

import asyncio
import hashlib

import grpc
import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument, ResourceExhausted
from modalmesh.metrics import Metrics
from modalmesh.rpc.codec import describe, from_proto, to_proto
from modalmesh.rpc.server import GrpcServer, ServerConfig
from modalmesh.service import build_parser
from services.encoder.batcher import Batcher
from services.encoder.cache import Answer, EmbeddingCache
from services.encoder.model import EncodedItem, EncoderModel, PreparedItem
from services.encoder.service import EncoderService


class DoublingModel(EncoderModel):
    """Rows = the item's samples times two, one row per sample (width 3); records its batches."""

    modality = pb.AUDIO
    hidden_size = output_hidden_size = 3
    architecture = "Doubling"

    def __init__(self):
        self.batches: list[int] = []

    def prepare(self, item, index, key=None):
        if not item.HasField("pcm"):
            raise InvalidArgument(f"items[{index}]: expected pcm")
        x = from_proto(item.pcm, name=f"items[{index}].pcm").float()
        if not torch.isfinite(x).all():
            raise InvalidArgument(f"items[{index}]: non-finite samples")
        return PreparedItem({"x": x}, cost=x.numel(), cache_key=hashlib.sha256(item.pcm.data).digest())

    def encode(self, batch):
        self.batches.append(len(batch))
        packed = torch.cat([p.inputs["x"] for p in batch]) * 2  # one op over the whole batch
        rows = packed[:, None].expand(-1, 3)
        return [EncodedItem(r.clone(), valid_length=r.shape[0]) for r in rows.split([p.cost for p in batch])]


class KeyedDoublingModel(DoublingModel):
    """Knows its cache key before preparing (as the vision and audio models do); counts prepare calls."""

    def __init__(self):
        super().__init__()
        self.prepared = 0

    def cache_key(self, item, index):
        return hashlib.sha256(item.pcm.data).digest() if item.HasField("pcm") else None

    def prepare(self, item, index, key=None):
        self.prepared += 1
        self.keys_given = getattr(self, "keys_given", 0) + (key is not None)
        return super().prepare(item, index, key)


class ToyEncoderService(EncoderService):
    name = "audio_encoder"
    modality = pb.AUDIO

    model_class = DoublingModel

    def build_model(self):
        return self.model_class()


def _item(values):
    return pb.EncodeItem(pcm=to_proto(torch.tensor(values, dtype=torch.float32)), sample_rate=16000)


# -- cache --------------------------------------------------------------------------------------
def test_cache_is_lru_bounded_in_bytes_and_reports_the_pool():
    metrics = Metrics("audio_encoder", process_metrics=False)
    payload = torch.ones(4, 3)
    one = Answer(pb.Embedding(embedding=describe(payload), num_placeholder_tokens=4), payload)
    size = one.nbytes
    assert size > 48  # the tensor's bytes and the message's
    cache = EmbeddingCache(2 * size + 1, bytes_per_row=12, metrics=metrics)
    cache.put(b"a", one)
    cache.put(b"b", one)
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", one)  # evicts b
    hit = cache.get(b"c")
    assert cache.get(b"b") is None and hit.meta.cache_hit and not one.meta.cache_hit
    assert hit.tensor is payload  # a hit shares the tensor, copies nothing
    assert list(hit.meta.embedding.shape) == [4, 3]
    assert cache.used_bytes == 2 * size and cache.used_rows == 8
    get = metrics.registry.get_sample_value
    labels = {"service": "audio_encoder", "pool": "embedding_cache"}
    assert get("modalmesh_kv_pool_used_tokens", labels) == 8
    assert get("modalmesh_cache_hits_total", labels) == 2 and get("modalmesh_cache_misses_total", labels) == 1
    huge = Answer(pb.Embedding(embedding=describe(torch.ones(100, 3)), num_placeholder_tokens=100), torch.ones(100, 3))
    cache.put(b"huge", huge)  # bigger than the cache: not stored, nothing evicted
    assert len(cache) == 2


# -- batcher ------------------------------------------------------------------------------------
def _prepared(cost, tag):
    return PreparedItem({"tag": torch.tensor(tag)}, cost=cost, cache_key=bytes([tag]))


def test_batcher_respects_budget_runs_oversized_items_alone_and_keeps_order():
    async def body():
        seen = []

        def run(batch, abandoned):
            seen.append([int(p.inputs["tag"]) for p in batch])
            return [int(p.inputs["tag"]) * 10 for p in batch]

        batcher = Batcher(run, max_batch_tokens=10, window_s=0.05)
        batcher.start()
        results = await asyncio.gather(
            batcher.submit([_prepared(4, 1), _prepared(4, 2)]),
            batcher.submit([_prepared(25, 3)]),
            batcher.submit([_prepared(3, 4), _prepared(3, 5)]),
        )
        await batcher.stop()
        assert results == [[10, 20], [30], [40, 50]]
        assert seen == [[1, 2], [3], [4, 5]]  # 4+4 fits, 25 alone, 3+3 together

    asyncio.run(asyncio.wait_for(body(), 30))


def test_batcher_rejects_when_full_and_delivers_errors_to_the_batch_only():
    async def body():
        def run(batch, abandoned):
            if any(int(p.inputs["tag"]) == 66 for p in batch):
                raise RuntimeError("kernel exploded")
            return [0] * len(batch)

        batcher = Batcher(run, max_batch_tokens=1, max_queue=2, window_s=0.0)
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await batcher.submit([_prepared(1, 1), _prepared(1, 2), _prepared(1, 3)])
        batcher.start()
        bad, good = await asyncio.gather(batcher.submit([_prepared(1, 66)]), batcher.submit([_prepared(1, 7)]),
                                         return_exceptions=True)
        assert isinstance(bad, RuntimeError) and good == [0]
        await batcher.stop()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_batcher_caps_queued_cost_not_only_items():
    async def body():
        batcher = Batcher(lambda batch, abandoned: [0] * len(batch), max_batch_tokens=4, max_queue=100, max_queue_tokens=10)
        waiting = asyncio.ensure_future(batcher.submit([_prepared(8, 1)]))  # no worker yet: it stays queued
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="8 tokens of work waiting, limit 10"):
            await batcher.submit([_prepared(5, 2)])
        batcher.start()
        assert await waiting == [0]
        assert await batcher.submit([_prepared(5, 2)]) == [0]  # room again
        await batcher.stop()

    asyncio.run(asyncio.wait_for(body(), 30))


# -- through gRPC -------------------------------------------------------------------------------
async def _serve(tmp_path, *flags):
    (tmp_path / "config.json").write_text("{}")
    parser = build_parser("audio_encoder", "")
    ToyEncoderService.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--device", "cpu", *flags])
    metrics = Metrics("audio_encoder", process_metrics=False)
    service = ToyEncoderService(args, metrics)
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0), metrics)
    service.register(server)
    port = await server.start()
    await service._startup()
    await server.set_serving(True)
    return service, server, port, metrics


def test_concurrent_requests_batch_together_and_get_their_own_rows(tmp_path):
    async def body():
        service, server, port, metrics = await _serve(tmp_path, "--batch-window-ms", "200")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                requests = [pb.EncodeRequest(items=[_item([i, i + 0.5]), _item([-i] * (i + 1))]) for i in range(6)]
                replies = await asyncio.gather(*(stub.Encode(r) for r in requests))
            for i, reply in enumerate(replies):
                first, second = (from_proto(e.embedding) for e in reply.embeddings)
                assert torch.equal(first, torch.tensor([[2 * i] * 3, [2 * i + 1] * 3], dtype=torch.float32))
                assert second.shape == (i + 1, 3) and torch.all(second == -2 * i)
                assert reply.embeddings[1].num_placeholder_tokens == i + 1
                assert reply.modality == pb.AUDIO and reply.weights_fingerprint.startswith("sha256:")
            assert len(service.model.batches) < len(requests)  # they were batched across requests
            assert sum(service.model.batches) == 12  # every (distinct) item encoded exactly once
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_cache_hits_return_identical_bytes_and_bad_items_fail_cleanly(tmp_path):
    async def body():
        service, server, port, metrics = await _serve(tmp_path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                first = await stub.Encode(pb.EncodeRequest(items=[_item([1.0, 2.0])]))
                again = await stub.Encode(pb.EncodeRequest(items=[_item([1.0, 2.0]), _item([1.0, 2.0])]))
                assert not first.embeddings[0].cache_hit and again.embeddings[0].cache_hit
                assert again.embeddings[0].embedding.data == first.embeddings[0].embedding.data
                assert again.embeddings[1].embedding.data == first.embeddings[0].embedding.data
                assert service.model.batches == [1]  # the repeats never reached the model

                for bad, message in [
                    (pb.EncodeRequest(items=[_item([1.0]), _item([float("nan")])]), "items[1]: non-finite samples"),
                    (pb.EncodeRequest(items=[_item([1.0]), pb.EncodeItem(data=b"x")]), "items[1]: expected pcm"),
                    (pb.EncodeRequest(), "items: the request has no items"),
                    (pb.EncodeRequest(items=[pb.EncodeItem(pcm=pb.Tensor(dtype=pb.FLOAT32, shape=[2], data=b"1"))]),
                     "items[0].pcm: data holds 1 bytes"),
                ]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Encode(bad)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert message in err.value.details()
                ok = await stub.Encode(pb.EncodeRequest(items=[_item([3.0])]))  # the service is fine
                assert from_proto(ok.embeddings[0].embedding).tolist() == [[6.0, 6.0, 6.0]]
                info = await stub.Info(pb.InfoRequest())
                assert info.output_hidden_size == 3 and info.pools[0].name == "embedding_cache"
        finally:
            await server.stop(0)
            await service.close()
        get = metrics.registry.get_sample_value
        assert get("modalmesh_encoded_items_total", {"service": "audio_encoder", "modality": "audio"}) == 4
        assert get("modalmesh_requests_total", {"service": "audio_encoder", "rpc": "Encode",
                                                "code": "INVALID_ARGUMENT"}) == 4

    asyncio.run(asyncio.wait_for(body(), 60))


def test_repeated_content_with_an_early_key_is_prepared_and_encoded_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyEncoderService, "model_class", KeyedDoublingModel)

    async def body():
        service, server, port, _ = await _serve(tmp_path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                reply = await stub.Encode(pb.EncodeRequest(items=[_item([1.0, 2.0]), _item([5.0]), _item([1.0, 2.0])]))
            assert service.model.prepared == 2 and service.model.batches == [2]
            assert service.model.keys_given == 2  # the keys already made are handed to prepare, not made again
            assert reply.embeddings[0].embedding.data == reply.embeddings[2].embedding.data
            assert from_proto(reply.embeddings[2].embedding).tolist() == [[2.0] * 3, [4.0] * 3]
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 60))


class ViewsModel(DoublingModel):
    """Answers as views into one batch output (what the encoders may now return, on their device)."""

    def encode(self, batch):
        self.batches.append(len(batch))
        packed = (torch.cat([p.inputs["x"] for p in batch]) * 2)[:, None].expand(-1, 3).contiguous()
        return [EncodedItem(r, valid_length=r.shape[0]) for r in packed.split([p.cost for p in batch])]


def test_answers_that_view_one_batch_output_own_their_bytes_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyEncoderService, "model_class", ViewsModel)

    async def body():
        service, server, port, _ = await _serve(tmp_path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                reply = await stub.Encode(pb.EncodeRequest(items=[_item([1.0, 2.0]), _item([5.0] * 7)]))
            assert from_proto(reply.embeddings[0].embedding).tolist() == [[2.0] * 3, [4.0] * 3]
            assert from_proto(reply.embeddings[1].embedding).tolist() == [[10.0] * 3] * 7
            assert service.model.batches == [2]
            # Each cached answer holds its own rows (2 and 7 of 3 floats), not the 9-row batch output.
            entries = list(service.cache._entries.values())
            assert sorted(a.tensor.untyped_storage().nbytes() for a in entries) == [2 * 12, 7 * 12]
            assert service.cache.used_bytes == sum(12 * a.tensor.shape[0] + a.meta.ByteSize() for a in entries)
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 60))


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_worker_keeps_at_most_batches_in_flight_queued_on_the_device(in_flight):
    """Pipelining with a bound: a batch's answers go back as soon as its work is queued, but the worker waits
    for the batch `batches_in_flight` back (its CUDA event), so arrivals pile into the next full batch
    instead of a stream of small ones. Fake events record which batches were waited for; each waited for
    has its device span (begun to ready) observed."""
    import collections

    from modalmesh.metrics import Metrics
    from services.encoder.config import EncoderServiceConfig

    class Event:
        def __init__(self, n):
            self.n, self.waited = n, False

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, end):  # milliseconds, as torch's
            return 1000.0 * (end.n - self.n)

    metrics = Metrics("vision_encoder", process_metrics=False)
    worker = type("Worker", (), {"_inflight": collections.deque(), "metrics": metrics, "_begun_free": [],
                                 "config": EncoderServiceConfig(batches_in_flight=in_flight)})()
    events = [(Event(10 * n), Event(10 * n + n + 1)) for n in range(5)]  # batch n spans n + 1 seconds
    for i, (begun, ready) in enumerate(events):
        EncoderService._bound_inflight(worker, begun, ready)
        assert len(worker._inflight) == min(i + 1, in_flight)
    assert [ready.waited for _, ready in events] == [n < 5 - in_flight for n in range(5)]  # the last ones queued
    waited = 5 - in_flight

    def sample(suffix):
        return metrics.registry.get_sample_value(f"modalmesh_encoder_batch_seconds_{suffix}",
                                                 {"service": "vision_encoder", "phase": "device"})

    assert (sample("count"), sample("sum")) == (waited, sum(n + 1 for n in range(waited)))
    assert worker._begun_free == [begun for begun, _ in events[:waited]]  # timed: free to record again


def _metrics_after(tmp_path, *requests: pb.EncodeRequest):
    """The service's metrics once `requests` have been answered, one after the other."""

    async def body():
        service, server, port, metrics = await _serve(tmp_path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                for request in requests:
                    await stub.Encode(request)
        finally:
            await service.close()
            await server.stop(0)
        return metrics

    return asyncio.run(body())


def test_each_encode_call_reports_its_time_per_stage(tmp_path):
    """A miss passes every stage; a cache hit has no batch and no device stage."""
    request = pb.EncodeRequest(items=[_item([1.0, 2.0])])
    metrics = _metrics_after(tmp_path, request, request)  # the same content again: the embedding cache answers

    def count(stage):
        return metrics.registry.get_sample_value("modalmesh_encode_stage_seconds_count",
                                                 {"service": "audio_encoder", "stage": stage}) or 0

    assert {stage: count(stage) for stage in ("prepare", "batch", "device", "respond")} == {
        "prepare": 2, "batch": 1, "device": 1, "respond": 2}


def test_the_workers_batches_report_their_phases(tmp_path):
    """Two batches on the CPU: each one's launch, the worker's idle time between them; no GPU, so no wait
    for the device and no device span."""
    metrics = _metrics_after(tmp_path, pb.EncodeRequest(items=[_item([1.0, 2.0])]),
                             pb.EncodeRequest(items=[_item([3.0, 4.0])]))

    def count(phase):
        return metrics.registry.get_sample_value("modalmesh_encoder_batch_seconds_count",
                                                 {"service": "audio_encoder", "phase": phase}) or 0

    assert {phase: count(phase) for phase in ("launch", "idle", "wait", "device")} == {
        "launch": 2, "idle": 1, "wait": 0, "device": 0}


def test_the_pipelining_and_thread_knobs_flow_into_the_config_and_bad_values_are_refused(tmp_path):
    from modalmesh.errors import ConfigError
    from services.encoder.config import EncoderServiceConfig

    parser = build_parser("audio_encoder", "")
    ToyEncoderService.add_arguments(parser)
    base = ["--model", str(tmp_path), "--device", "cpu"]
    config = EncoderServiceConfig.from_args(parser.parse_args(
        [*base, "--batches-in-flight", "3", "--torch-threads", "2", "--switch-interval-ms", "0.5"]))
    assert (config.batches_in_flight, config.torch_threads, config.switch_interval_s) == (3, 2, 0.0005)
    default = EncoderServiceConfig.from_args(parser.parse_args(base))
    assert (default.batches_in_flight, default.torch_threads, default.switch_interval_s) == (2, None, None)
    for flag, value in (("--batches-in-flight", "0"), ("--torch-threads", "-1"), ("--switch-interval-ms", "0"),
                        ("--switch-interval-ms", "nan"), ("--switch-interval-ms", "inf")):
        with pytest.raises(ConfigError, match=f"{flag} must be positive"):
            EncoderServiceConfig.from_args(parser.parse_args([*base, flag, value]))
