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


class _RunningBatch:
    """A CUDA event of a batch still on the GPU: `synchronize` blocks until `finish()`; counts its waits."""

    def __init__(self, error=None):
        import threading

        self.done, self.error, self.synchronized, self.queried = threading.Event(), error, 0, 0

    def query(self):
        self.queried += 1
        return self.done.is_set()

    def synchronize(self):
        self.synchronized += 1
        self.done.wait(30)
        if self.error is not None:
            raise self.error

    def finish(self):
        self.done.set()


def test_answers_of_a_running_batch_wait_in_one_thread_not_on_the_loop_nor_a_thread_each():
    """While a batch runs on the GPU its answers wait for its event without holding the event loop (it
    would stop taking requests in: 3.7 items a batch with 64 clients on an H200) and without a sender
    thread each (the threads then capped the service: 8 threads, 265 img/s, GPU and CPU half idle).
    One waiter synchronizes once per batch and wakes every answer of it."""

    class Recording(ThreadPoolExecutor):
        used = 0

        def submit(self, *args, **kwargs):
            Recording.used += 1
            return super().submit(*args, **kwargs)

    batch = _RunningBatch()
    xs = [torch.randn(3, 64) for _ in range(32)]

    async def body(sender):
        calls = [asyncio.create_task(sender.respond(pb.EncodeResponse(model_id="m"), [_answer(x, batch)], None))
                 for x in xs]
        for _ in range(20):  # the loop keeps running (the sleeps end) while the batch does
            await asyncio.sleep(0.005)
        assert not any(c.done() for c in calls)
        batch.finish()
        return await asyncio.gather(*calls)

    with Recording(1) as pool:
        sender = EmbeddingSender(shm=None, executor=pool)
        try:
            replies = asyncio.run(asyncio.wait_for(body(sender), 30))
        finally:
            sender.close()
    assert Recording.used == 0 and batch.synchronized == 1
    for x, reply in zip(xs, replies):
        rest, payloads = wire.strip(reply, wire.ENCODE_RESPONSE_BYTES)
        assert torch.equal(from_payload(pb.EncodeResponse.FromString(rest).embeddings[0].embedding, payloads[0]), x)


def test_a_failed_batch_event_fails_every_answer_of_it_and_a_caller_gone_leaves_the_others_theirs():
    from modalmesh.cuda_events import EventWaiter

    waiter = EventWaiter()
    failed, running = _RunningBatch(RuntimeError("CUDA error: an illegal memory access")), _RunningBatch()

    async def body():
        gone = asyncio.create_task(waiter.wait(running))
        stays = asyncio.create_task(waiter.wait(running))
        errors = [asyncio.create_task(waiter.wait(failed)) for _ in range(3)]
        await asyncio.sleep(0.01)
        gone.cancel()
        failed.finish()
        running.finish()
        results = await asyncio.gather(*errors, return_exceptions=True)
        await stays
        return results, gone.cancelled()

    try:
        results, cancelled = asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        waiter.close()
    assert [str(r) for r in results] == ["CUDA error: an illegal memory access"] * 3 and cancelled
    assert failed.synchronized == 1 and running.synchronized == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_device_answer_put_into_shared_memory_leaves_no_cuda_error_behind(tmp_path):
    """The exporter page-locked each slab with cudaHostRegister and let a refusal pass as "not page-locked";
    but the refusal stayed behind as the thread's CUDA error, and the next kernel there raised it ("CUDA
    error: invalid argument" on the H200 host, where the driver refuses /dev/shm mappings): a CUDA IPC
    read or an unrelated request failed later."""
    exporter = ShmExporter(directory=tmp_path)
    try:
        x = torch.randn(256, 3584, device="cuda").to(torch.bfloat16)
        ref = exporter.export(pb.Tensor(dtype=pb.BFLOAT16, shape=[256, 3584]), x)
        assert ref is not None and ref.HasField("shared_memory")
        assert torch.equal((x.float() * 2).cpu(), x.cpu().float() * 2)  # a kernel, then its check
    finally:
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
            for _ in range(2):  # the second time through a reused pinned buffer and a reused slab
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


# ---- negotiation, refusal and fallback of the CUDA IPC path (faked where CUDA is absent) ----------------
def test_a_caller_can_never_send_a_cuda_ipc_handle():
    from modalmesh.errors import InvalidArgument
    from modalmesh.rpc.codec import from_proto

    sneaky = pb.Tensor(dtype=pb.FLOAT32, shape=[2], cuda_ipc=pb.CudaIpcRef(handle=b"\x01" * 64, nbytes=8))
    with pytest.raises(InvalidArgument, match=r"pcm: a CUDA IPC handle \(cuda_ipc\) is not accepted here"):
        from_proto(sneaky, name="pcm")


def test_an_encode_request_carrying_a_handle_is_refused_naming_the_field(tmp_path):
    import grpc

    from tests.test_encoder_layer import _serve

    async def body():
        service, server, port, _ = await _serve(tmp_path, "--batch-window-ms", "0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb.encoder_pb2_grpc.EncoderServiceStub(channel)
                pcm = pb.Tensor(dtype=pb.FLOAT32, shape=[2], cuda_ipc=pb.CudaIpcRef(handle=b"\x01" * 64, nbytes=8))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Encode(pb.EncodeRequest(items=[pb.EncodeItem(pcm=pcm, sample_rate=16000)]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "items[0].pcm: a CUDA IPC handle (cuda_ipc) is not accepted" in err.value.details()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_cuda_ipc_is_offered_only_with_shared_memory_and_a_cuda_device(tmp_path):
    from modalmesh.rpc.transfer import CUDA_IPC, GRPC, SHARED_MEMORY, EmbeddingReceiver

    probe = ShmProbe(tmp_path)
    try:
        for receiver, paths in [
            (EmbeddingReceiver(probe=probe, device=torch.device("cuda", 0)), {GRPC, SHARED_MEMORY, CUDA_IPC}),
            (EmbeddingReceiver(probe=probe, device=None), {GRPC, SHARED_MEMORY}),  # on the CPU: no handle to open
            (EmbeddingReceiver(probe=None, device=torch.device("cuda", 0)), {GRPC}),  # not the same host
            (EmbeddingReceiver(probe=probe, device=torch.device("cuda", 0), cuda_ipc=False), {GRPC, SHARED_MEMORY}),
        ]:
            request = pb.EncodeRequest()
            assert receiver.offer(request) == paths
            assert request.transfer.cuda_ipc == (CUDA_IPC in paths)
        request = pb.EncodeRequest()
        receiver = EmbeddingReceiver(probe=probe, device=torch.device("cuda", 0))
        assert receiver.offer(request, {CUDA_IPC}) == {GRPC, SHARED_MEMORY} and not request.transfer.cuda_ipc
        assert receiver.offer(pb.EncodeRequest(), {SHARED_MEMORY}) == {GRPC}  # IPC rides on the probe
    finally:
        probe.close()


def test_the_sender_uses_cuda_ipc_only_when_offered_and_for_device_answers(tmp_path):
    class FakeIpc:
        def __init__(self):
            self.calls = 0

        def export(self, meta, tensor, ready):
            self.calls += 1
            return pb.Tensor(dtype=meta.dtype, shape=meta.shape, cuda_ipc=pb.CudaIpcRef(nbytes=1))

    exporter, probe = ShmExporter(directory=tmp_path), ShmProbe(tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            sender = EmbeddingSender(shm=exporter, executor=pool)
            sender.ipc = FakeIpc()
            options = probe.options()
            options.cuda_ipc = True
            reply, _ = _respond(sender, [_answer(torch.randn(4096, 64))], options)
            # A host tensor has no handle to give: shared memory, and the IPC exporter is never asked.
            assert reply.embeddings[0].embedding.HasField("shared_memory") and sender.ipc.calls == 0
            reply, _ = _respond(sender, [_answer(torch.randn(4096, 64))], probe.options())
            assert reply.embeddings[0].embedding.HasField("shared_memory")

            class DeviceTensor:  # what the sender asks of an answer on a GPU (none here): 2 MiB of bf16
                device = torch.device("cuda", 0)

                def numel(self):
                    return 1 << 20

                def element_size(self):
                    return 2

            on_gpu = Answer(pb.Embedding(embedding=pb.Tensor(dtype=pb.BFLOAT16, shape=[1024, 1024])), DeviceTensor())
            reply, _ = _respond(sender, [on_gpu], options)  # offered, and on a GPU: the handle
            assert reply.embeddings[0].embedding.HasField("cuda_ipc") and sender.ipc.calls == 1
            shared = []
            sender.shm.export = lambda meta, tensor, ready=None: shared.append(tensor) or pb.Tensor(
                dtype=meta.dtype, shape=meta.shape, shared_memory=pb.SharedMemoryRef(name="x", nbytes=1))
            reply, _ = _respond(sender, [on_gpu], probe.options())  # not offered: shared memory, no handle
            assert reply.embeddings[0].embedding.HasField("shared_memory") and sender.ipc.calls == 1
            assert shared == [on_gpu.tensor]
    finally:
        probe.close()
        exporter.close()


class _FakeIpcReader:
    def __init__(self, error):
        self.error = error
        self.reads = 0

    def start(self, message, *, name, device):
        self.reads += 1
        raise self.error

    def close(self):
        pass


@pytest.mark.parametrize("error, stays_on", [
    (RuntimeError("CUDA error: invalid resource handle"), False),  # CUDA refuses handles: off for the pool
    (None, True),  # the lease went stale (SharedMemoryGone): this item again, the path stays on
])
def test_a_failed_cuda_ipc_answer_is_asked_again_by_shared_memory(tmp_path, error, stays_on):
    from modalmesh.rpc.shm import SharedMemoryGone
    from modalmesh.rpc.codec import to_proto
    from services.llm.encoders import EncoderPool
    from tests.helpers.echo_service import build

    async def body():
        server, servicer = build()
        exporter = ShmExporter()
        servicer.shared_memory, servicer.cuda_ipc = exporter, exporter
        port = await server.start()
        probe = ShmProbe()
        metrics = Metrics("llm", process_metrics=False)
        pool = EncoderPool(pb.IMAGE, f"127.0.0.1:{port}", probe=probe, metrics=metrics)
        pool.receiver.cuda_ipc = True  # as on CUDA; the reader is faked
        pool.receiver._ipc_reader = fake = _FakeIpcReader(error or SharedMemoryGone("items[3].embedding: gone"))
        x = torch.randn(5, 8)
        try:
            reply, tensor = await pool.encode_one(pb.EncodeItem(pcm=to_proto(x)), 3, timeout=30)
            return x, reply, tensor, servicer, pool.receiver.cuda_ipc, fake.reads, metrics
        finally:
            await pool.close()
            probe.close()
            exporter.close()
            await server.stop(0)

    x, reply, tensor, servicer, ipc_on, reads, metrics = asyncio.run(asyncio.wait_for(body(), 60))
    assert reads == 1 and servicer.encode_calls == 2 and servicer.cuda_ipc_offers == 1
    assert reply.embeddings[0].embedding.HasField("shared_memory") and torch.equal(tensor, x)
    assert ipc_on == stays_on
    get = metrics.registry.get_sample_value
    labels = {"service": "llm", "direction": "received"}
    assert get("modalmesh_transfer_bytes_total", {**labels, "path": "shared_memory"}) == x.numel() * 4
    assert get("modalmesh_transfer_bytes_total", {**labels, "path": "cuda_ipc"}) is None


class _FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_event(self, event):
        self.waited.append(event)


class _NeverWaitedFor:
    """A batch's `ready` event that no host may wait for."""

    def synchronize(self):
        raise AssertionError("the host waited for the batch")

    def query(self):
        raise AssertionError("the host asked whether the batch is done")


def _fake_streams(monkeypatch):
    """cuda_ipc's streams and torch.cuda.stream faked (no CUDA here): returns (current, ipc)."""
    import contextlib

    from modalmesh.rpc import cuda_ipc

    current, ipc = ["compute"], _FakeStream("ipc")

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], getattr(s, "name", s)
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(cuda_ipc, "transfer_stream", lambda device: "transfer")
    monkeypatch.setattr(cuda_ipc, "ipc_stream", lambda device: ipc)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "stream", stream)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "_lazy_init", lambda: None)
    return current, ipc


def test_a_cuda_ipc_export_is_ordered_after_its_batch_on_the_gpu_not_waited_for(tmp_path, monkeypatch):
    """torch records the reader's IPC event on the exporter's current stream, and makes the reader's current
    stream wait for it when the handle opens. The export shares on the IPC stream after making it wait for
    the batch's `ready` event: the answer goes out while the batch runs, and the reader's copy waits for
    it on the GPU. Before, the event loop synchronized on `ready` first (and then shared on the transfer
    stream). Shared from the compute stream, the event would be reached only after the batches queued
    since; the reader opens on the IPC stream too, never the caller's (the LLM engine's)."""
    from modalmesh.rpc import cuda_ipc

    current, ipc = _fake_streams(monkeypatch)
    seen = {}

    def share(tensor):
        seen["share"] = current[0]
        return pb.CudaIpcRef(nbytes=8)

    def new_shared_cuda(*args):
        seen["open"] = current[0]
        raise RuntimeError("no CUDA here: the stream it opened on is all this test asks")

    monkeypatch.setattr(cuda_ipc, "share", share)
    monkeypatch.setattr(cuda_ipc.torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda, raising=False)

    class DeviceTensor:  # what export asks of a CUDA tensor
        device = torch.device("cuda", 0)

        def is_contiguous(self):
            return True

    exporter, ready = ShmExporter(directory=tmp_path), _NeverWaitedFor()
    try:
        ref = cuda_ipc.CudaIpcExporter(exporter).export(pb.Tensor(dtype=pb.FLOAT32, shape=[2]), DeviceTensor(),
                                                       ready)
        assert ref is not None and ref.HasField("cuda_ipc")
        with pytest.raises(RuntimeError, match="no CUDA here"):
            cuda_ipc.copy_shared(pb.CudaIpcRef(nbytes=8), torch.device("cuda", 0))
    finally:
        exporter.close()
    assert seen == {"share": "ipc", "open": "ipc"} and ipc.waited == [ready] and current == ["compute"]


def test_a_read_keeps_its_producer_allocation_mapped_a_while_and_lets_go_on_the_transfer_stream(monkeypatch):
    """The last storage read from each producer allocation is kept: while it lives torch keeps the allocation
    mapped, so the next read from it opens and closes no handle (the close was 42 % of the client's busy
    event loop on the H200). It goes when a later read of the same allocation replaces it, when unused for
    `keep_s`, past `max_mapped`, or at close; always on the transfer stream (torch synchronizes the current
    stream when it frees such a storage, and the IPC stream may hold copies waiting for other batches).
    Each read's lease is handed back once it is done."""
    from modalmesh.rpc import cuda_ipc

    current, _ = _fake_streams(monkeypatch)
    clock = [100.0]
    monkeypatch.setattr(cuda_ipc.time, "monotonic", lambda: clock[0])
    events = []

    class Mapping:
        def __init__(self, name):
            self.name = name

        def __del__(self):
            events.append((f"freed {self.name}", current[0]))

    class Leases:
        def hand_back(self, lease, name):
            events.append((f"handed back {name}", current[0]))

    def read(name, handle):
        pending = cuda_ipc.PendingCopy(torch.empty(2), _NeverWaitedFor(), Mapping(name), pb.SharedMemoryRef(), name,
                                       handle)
        reader.finish(pending)
        assert pending.storage is None

    reader = cuda_ipc.CudaIpcReader(Leases(), keep_s=1.0, max_mapped=2)
    read("a1", b"A")
    assert events == [("handed back a1", "compute")]  # kept mapped
    read("a2", b"A")  # the same allocation: a1 goes, a2 keeps it mapped
    read("b1", b"B")
    read("c1", b"C")  # past max_mapped: the least recently read (A's) goes
    assert events[1:] == [("freed a1", "transfer"), ("handed back a2", "compute"), ("handed back b1", "compute"),
                          ("freed a2", "transfer"), ("handed back c1", "compute")]
    clock[0] += 5  # B and C unused since: both go at the next read
    del events[:]
    read("d1", b"D")
    assert events == [("freed b1", "transfer"), ("freed c1", "transfer"), ("handed back d1", "compute")]
    del events[:]
    reader.close()
    assert events == [("freed d1", "transfer")] and current == ["compute"]


class _QueuedCopy:
    """CudaIpcReader.start's part, faked: the copy stays queued (its event running) until `finish()`."""

    def __init__(self):
        self.copy, self.finished = _RunningBatch(), []

    def start(self, message, *, name, device):
        from modalmesh.rpc.cuda_ipc import PendingCopy

        return PendingCopy(torch.arange(2.0), self.copy, object(), message.cuda_ipc.lease, name)

    def finish(self, pending):
        assert pending.copied.done.is_set(), "let go of the producer's memory while the copy may read it"
        self.finished.append(pending.name)

    def close(self):
        pass


def _ipc_message():
    return pb.Tensor(dtype=pb.FLOAT32, shape=[2], cuda_ipc=pb.CudaIpcRef(nbytes=8))


def test_a_cuda_ipc_read_awaits_its_copy_off_the_event_loop():
    """The copy waits on the GPU for the producer's batch; the reader's event loop goes on meanwhile (before,
    `synchronize` held it: 36 % of the client's loop on the H200) and the mapping is let go once it is done."""
    from modalmesh.rpc.transfer import EmbeddingReceiver

    receiver = EmbeddingReceiver(device=torch.device("cpu"))
    receiver._ipc_reader = fake = _QueuedCopy()

    async def body():
        read = asyncio.create_task(receiver.take(_ipc_message(), None, name="items[0]"))
        ticks = 0
        for _ in range(10):  # the loop keeps running while the copy is queued
            await asyncio.sleep(0.005)
            ticks += 1
        assert not read.done() and fake.finished == []
        fake.copy.finish()
        return ticks, await read

    try:
        ticks, tensor = asyncio.run(asyncio.wait_for(body(), 30))
    finally:
        receiver.close()
    assert ticks == 10 and torch.equal(tensor, torch.arange(2.0)) and fake.finished == ["items[0]"]
    assert fake.copy.synchronized == 1  # by the waiter thread


def test_a_cancelled_cuda_ipc_read_lets_go_of_the_memory_only_once_its_copy_is_done():
    from modalmesh.rpc.transfer import EmbeddingReceiver

    receiver = EmbeddingReceiver(device=torch.device("cpu"))
    receiver._ipc_reader = fake = _QueuedCopy()

    async def body():
        read = asyncio.create_task(receiver.take(_ipc_message(), None, name="items[0]"))
        await asyncio.sleep(0.01)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert fake.finished == []  # the copy is still queued: the mapping stays open
        fake.copy.finish()
        for _ in range(200):
            if fake.finished:
                break
            await asyncio.sleep(0.005)
        return fake.finished

    try:
        assert asyncio.run(asyncio.wait_for(body(), 30)) == ["items[0]"]
    finally:
        receiver.close()


def test_answers_by_cuda_ipc_go_out_while_their_batch_runs_and_the_others_wait_for_it(tmp_path):
    """A reply of CUDA IPC answers alone is sent with the batch still running (the fake event would fail the
    test if waited for); a reply with an answer that must be copied through the host waits for the batch."""

    class FakeIpc:
        def export(self, meta, tensor, ready):
            return pb.Tensor(dtype=meta.dtype, shape=meta.shape, cuda_ipc=pb.CudaIpcRef(nbytes=1))

    class DeviceTensor:  # 2 MiB of bf16 on a GPU (none here)
        device = torch.device("cuda", 0)

        def numel(self):
            return 1 << 20

        def element_size(self):
            return 2

    exporter, probe = ShmExporter(directory=tmp_path), ShmProbe(tmp_path)
    try:
        with ThreadPoolExecutor(2) as pool:
            sender = EmbeddingSender(shm=exporter, executor=pool)
            sender.ipc = FakeIpc()
            options = probe.options()
            options.cuda_ipc = True
            on_gpu = Answer(pb.Embedding(embedding=pb.Tensor(dtype=pb.BFLOAT16, shape=[1024, 1024])), DeviceTensor(),
                            _NeverWaitedFor())
            reply, _ = _respond(sender, [on_gpu, on_gpu], options)
            assert all(e.embedding.HasField("cuda_ipc") for e in reply.embeddings)
            batch = _RunningBatch()
            small = _answer(torch.randn(4, 8), batch)  # under the IPC floor: shared memory, after the batch
            mixed = sender.plan([Answer(on_gpu.meta, on_gpu.tensor, batch), small], options)
            assert mixed.refs[0] is not None and mixed.refs[1] is None and mixed.waiting == [small]
            batch.finish()
            reply, _ = _respond(sender, [small], options)
            assert reply.embeddings[0].embedding.HasField("shared_memory") and batch.synchronized + batch.queried
            sender.close()
    finally:
        probe.close()
        exporter.close()


def test_awaiters_of_one_event_on_two_loops_each_get_their_own_wake_up():
    """Futures belong to a loop: an event still waited for from one loop (its awaiter gone, its loop closed)
    must not hand another loop that loop's future ("attached to a different loop")."""
    from modalmesh.cuda_events import EventWaiter

    waiter, event = EventWaiter(), _RunningBatch()

    async def abandoned():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter.wait(event), 0.01)

    async def second():
        task = asyncio.ensure_future(waiter.wait(event))
        await asyncio.sleep(0.05)  # it is waiting before the event completes
        event.finish()
        return await asyncio.wait_for(task, 30)

    try:
        asyncio.run(abandoned())  # its loop closes with the event still pending
        assert asyncio.run(second()) is True  # woken, having waited
    finally:
        waiter.close()


def test_the_ipc_exporter_lets_go_of_tensors_whose_leases_came_back_oldest_first(tmp_path, monkeypatch):
    """The oldest leases are looked at until a live one; with many held, all of them (one never handed
    back must not keep the later ones to its TTL)."""
    from modalmesh.rpc import cuda_ipc

    _fake_streams(monkeypatch)
    monkeypatch.setattr(cuda_ipc, "share", lambda tensor: pb.CudaIpcRef(nbytes=8))
    monkeypatch.setattr(cuda_ipc.torch.cuda, "ipc_collect", lambda: None)

    class DeviceTensor:
        device = torch.device("cuda", 0)

        def is_contiguous(self):
            return True

    exporter, reader = ShmExporter(directory=tmp_path), ShmReader(directory=tmp_path)
    try:
        ipc = cuda_ipc.CudaIpcExporter(exporter)
        refs = [ipc.export(pb.Tensor(dtype=pb.FLOAT32, shape=[2]), DeviceTensor()).cuda_ipc.lease for _ in range(3)]
        for lease in refs[1:]:
            reader.hand_back(lease)
        assert ipc.held == 3  # the oldest is still read: the later ones wait for it
        reader.hand_back(refs[0])
        assert ipc.held == 0
        monkeypatch.setattr(cuda_ipc, "FULL_SCAN_HELD", 2)
        refs = [ipc.export(pb.Tensor(dtype=pb.FLOAT32, shape=[2]), DeviceTensor()).cuda_ipc.lease for _ in range(4)]
        for lease in refs[1:]:
            reader.hand_back(lease)
        assert ipc.held == 1  # past the bound: every lease looked at
    finally:
        reader.close()
        exporter.close()
