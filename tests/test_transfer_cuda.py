"""CUDA IPC through the real services (CUDA only): an encoder on this GPU, the LLM's encoder pool in this process."""

import asyncio
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.metrics import Metrics
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.shm import SHM_DIR, ShmExporter, ShmProbe, shm_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not shm_available(),
                                reason="needs CUDA and a writable /dev/shm")


def _metric(proc, name, **labels):
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_an_embedding_read_through_cuda_ipc_equals_the_bytes_path_and_its_lease_is_handed_back(tmp_path):
    from bench.transfer import make_checkpoint, smooth_png
    from services.llm.encoders import EncoderPool

    ckpt = make_checkpoint(tmp_path / "ckpt")  # Qwen2-VL-7B-wide rows: a 448x448 image is 1.8 MB, over the IPC floor
    vision = ServiceProcess("vision_encoder", ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                                               "--model", str(ckpt), "--device", "cuda", "--dtype", "bfloat16"]).start()
    try:
        vision.wait_serving(timeout=600)
        item = pb.EncodeItem(data=smooth_png(448), max_pixels=448 * 448)

        async def body():
            probe = ShmProbe()
            metrics = Metrics("llm", process_metrics=False)
            ipc = EncoderPool(pb.IMAGE, vision.target, probe=probe, device=torch.device("cuda"), metrics=metrics)
            plain = EncoderPool(pb.IMAGE, vision.target, device=torch.device("cuda"))  # message bytes
            try:
                reply, tensor = await ipc.encode_one(item, 0, timeout=300)
                _, expected = await plain.encode_one(item, 0, timeout=300)
                again, second = await ipc.encode_one(item, 0, timeout=300)  # a cache hit: the same storage again
                return reply, tensor, expected, again, second, metrics
            finally:
                await ipc.close()
                await plain.close()
                probe.close()

        reply, tensor, expected, again, second, metrics = asyncio.run(asyncio.wait_for(body(), 600))
        message = reply.embeddings[0].embedding
        assert message.HasField("cuda_ipc") and again.embeddings[0].embedding.HasField("cuda_ipc")
        assert tensor.device.type == "cuda" and expected.device.type == "cuda"
        assert tensor.dtype == torch.bfloat16 and tensor.shape == (256, 3584)
        assert torch.equal(tensor.cpu(), expected.cpu()) and torch.equal(second.cpu(), expected.cpu())
        # The last lease (its one-page slab may be the first one's, handed back and reused) is handed back:
        # the encoder may let the tensor go.
        lease = again.embeddings[0].embedding.cuda_ipc.lease
        words = (SHM_DIR / lease.name).read_bytes()
        assert int.from_bytes(words[:8], "little") == lease.lease == int.from_bytes(words[8:16], "little")
        nbytes = tensor.numel() * tensor.element_size()
        assert metrics.registry.get_sample_value("modalmesh_transfer_bytes_total", {
            "service": "llm", "direction": "received", "path": "cuda_ipc"}) == 2 * nbytes
        assert _metric(vision, "modalmesh_transfer_bytes_total", direction="sent", path="cuda_ipc") == 2 * nbytes
        assert _metric(vision, "modalmesh_transfer_bytes_total", direction="sent", path="grpc") == nbytes
    finally:
        vision.terminate(timeout=60)


_ROWS = 1 << 20  # 4 MiB of float32


def _produce_while_the_batch_runs(conn, directory: str) -> None:
    """Another process's answer, exported while the batch that makes it still runs on the GPU."""
    from pathlib import Path

    from modalmesh.rpc.cuda_ipc import CudaIpcExporter

    exporter = ShmExporter(directory=Path(directory))
    try:
        ipc = CudaIpcExporter(exporter)
        # A first export, waited for: CUDA IPC's own first-use costs (seconds on the H200 host) are paid here,
        # not while the batch below runs.
        warm = torch.zeros(_ROWS, device="cuda")
        torch.cuda.synchronize()
        assert ipc.export(pb.Tensor(dtype=pb.FLOAT32, shape=[_ROWS]), warm) is not None
        import time

        out = torch.empty(_ROWS, device="cuda")
        values = torch.arange(_ROWS, device="cuda", dtype=torch.float32)
        began, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        # The batch: seconds of real GPU work (fp32 matmuls) queued before the answer is written. On the H200,
        # a batch of torch.cuda._sleep had finished by the time the export returned, in two runs.
        work = torch.randn(8192, 8192, device="cuda")
        for _ in range(300):
            work = torch.tanh(work @ work * 1e-4)
        out.copy_(values)
        ready.record()
        start = time.perf_counter()
        running_before = not ready.query()
        ref = ipc.export(pb.Tensor(dtype=pb.FLOAT32, shape=[_ROWS]), out, ready)
        exported_s = time.perf_counter() - start
        running = not ready.query()
        ready.synchronize()
        seen = (f"batch running before the export: {running_before}, after: {running}; export {exported_s:.3f} s; "
                f"the batch took {began.elapsed_time(ready) / 1e3:.3f} s on the GPU")
        conn.send((ref.SerializeToString(), running, seen))
        conn.recv()  # the reader is done
        torch.cuda.synchronize()
    finally:
        exporter.close()


def test_a_cuda_ipc_answer_sent_while_its_batch_runs_is_read_only_once_the_batch_is_done(tmp_path):
    """The export orders torch's IPC event after the batch on the GPU and the reader's copy waits for it
    there: no host waits, and the reader still gets the finished answer, not the memory before it."""
    import multiprocessing

    from modalmesh.rpc.cuda_ipc import CudaIpcReader
    from modalmesh.rpc.shm import ShmReader

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    producer = ctx.Process(target=_produce_while_the_batch_runs, args=(child, str(tmp_path)))
    producer.start()
    try:
        assert parent.poll(300), "the producer sent nothing"
        wire, running, seen = parent.recv()
        print(seen)
        assert running, seen  # the answer went out with its batch still running
        message = pb.Tensor.FromString(wire)
        reader = CudaIpcReader(ShmReader(directory=tmp_path))
        pending = reader.start(message, name="items[0]", device=torch.device("cuda"))
        pending.copied.synchronize()
        reader.finish(pending)
        assert torch.equal(pending.tensor.cpu(), torch.arange(_ROWS, dtype=torch.float32))
        lease = message.cuda_ipc.lease
        words = (tmp_path / lease.name).read_bytes()
        assert int.from_bytes(words[8:16], "little") == lease.lease  # handed back
        parent.send("done")
        producer.join(60)
        assert producer.exitcode == 0
    finally:
        if producer.is_alive():
            producer.kill()
