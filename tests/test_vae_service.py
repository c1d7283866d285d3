"""`python -m services.vae` over gRPC: outputs vs diffusers, tiling, bad input, concurrency; the batcher in-process."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from modalmesh import pb
from modalmesh.errors import FailedPrecondition, ResourceExhausted
from modalmesh.metrics import Metrics
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.service import build_parser
from modalmesh.testing import tiny
from services.vae.config import VAEConfig
from services.vae.engine import TilingRequest, to_uint8, to_unit
from services.vae.batcher import DecodeBatcher, JobResult
from services.vae.inputs import DecodeJob, OutputFormat
from services.vae.server import VAEDecoderService

diffusers = pytest.importorskip("diffusers")

FLAGS = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu", "--grace-period", "10",
         "--max-batch", "4", "--max-images", "4", "--max-latent-side", "200", "--max-message-mb", "1"]


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return tiny.ensure("vae", tmp_path_factory.mktemp("vae_service"))


@pytest.fixture(scope="module")
def service(vae_dir):
    proc = ServiceProcess("vae", [*FLAGS, "--model", str(vae_dir)]).start()
    try:
        proc.wait_serving(timeout=120)
        channel = grpc.insecure_channel(proc.target)
        yield proc, pb.vae_pb2_grpc.VAEServiceStub(channel)
        channel.close()
        assert proc.terminate(timeout=30) == 0
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def ref(vae_dir):
    model = diffusers.AutoencoderKL.from_pretrained(vae_dir).eval()
    cfg = VAEConfig.from_dir(vae_dir)

    @torch.inference_mode()
    def decode(z, skip_scaling=False):  # what a diffusers pipeline does with latents, before post-processing
        return model.decode(z if skip_scaling else z / model.config.scaling_factor).sample

    assert cfg.scaling_factor == model.config.scaling_factor
    return decode


def request(z, output=pb.TENSOR_FLOAT, **kw):
    return pb.DecodeRequest(latents=to_proto(z), output=output, **kw)


def latents(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def metric(proc, name, **labels):
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def eventually(read, want: float, timeout: float = 10.0) -> float:
    """`read()` once it reaches `want`, or its value when `timeout` has passed: for a metric the server
    updates just after the reply it counts."""
    deadline = time.monotonic() + timeout
    value = read()
    while value < want and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def test_info_describes_the_served_vae(service):
    _, stub = service
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert (info.service, info.architecture, info.dtype, info.ready) == ("vae", "AutoencoderKL", "float32", True)
    assert info.extra["latent_channels"] == "4" and info.extra["scale_factor"] == "2"
    assert info.extra["tile_latent_size"] == "16" and info.extra["max_batch"] == "4"
    assert info.extra["cuda_graph_batches"] == "0"  # CPU: no graphs
    assert [a.component for a in info.attention] == ["vae"]
    assert info.weights_fingerprint.startswith("sha256:")


def test_float_and_uint8_pixels_match_diffusers(service, ref):
    _, stub = service
    z = latents(2, 4, 6, 5)
    want = ref(z)
    got = from_proto(stub.Decode(request(z, pb.TENSOR_FLOAT), timeout=30).pixels)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 12, 10)
    torch.testing.assert_close(got, to_unit(want), atol=1e-4, rtol=0)
    u8 = from_proto(stub.Decode(request(z, pb.TENSOR_UINT8), timeout=30).pixels)
    assert u8.dtype == torch.uint8 and u8.shape == (2, 12, 10, 3)
    diff = (u8.int() - to_uint8(want).int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99  # only rounding ties may differ


def test_png_decodes_back_to_the_same_pixels(service):
    _, stub = service
    z = latents(3, 4, 7, 4, seed=1)
    reply = stub.Decode(request(z, pb.PNG), timeout=30)
    assert len(reply.png) == 3 and reply.tiles == 1 and not reply.HasField("pixels")
    u8 = from_proto(stub.Decode(request(z, pb.TENSOR_UINT8), timeout=30).pixels)
    for png, pixels in zip(reply.png, u8):
        image = Image.open(io.BytesIO(png))
        assert image.format == "PNG" and image.mode == "RGB" and image.size == (8, 14)
        assert np.array_equal(np.asarray(image), pixels.numpy())


def test_skip_scaling_and_half_precision_latents(service, ref):
    _, stub = service
    z = latents(1, 4, 6, 6, seed=2)
    scaled = from_proto(stub.Decode(request(z), timeout=30).pixels)
    unscaled = from_proto(stub.Decode(request(z / 0.18215, skip_scaling=True), timeout=30).pixels)
    torch.testing.assert_close(scaled, unscaled, atol=1e-5, rtol=0)
    torch.testing.assert_close(unscaled, to_unit(ref(z / 0.18215, skip_scaling=True)), atol=1e-4, rtol=0)
    for dtype in (torch.float16, torch.bfloat16):
        got = from_proto(stub.Decode(request(z.to(dtype)), timeout=30).pixels)
        torch.testing.assert_close(got, to_unit(ref(z.to(dtype).float())), atol=1e-4, rtol=0)


def test_tiling_modes_through_the_service(service, ref):
    proc, stub = service
    before = metric(proc, "modalmesh_vae_tiles_total")
    z = latents(2, 4, 24, 20, seed=3)  # larger than the 16-latent threshold
    untiled = stub.Decode(request(z, tiling=pb.TilingOptions(mode=pb.TilingOptions.OFF)), timeout=60)
    auto = stub.Decode(request(z), timeout=60)
    small = stub.Decode(request(z, tiling=pb.TilingOptions(mode=pb.TilingOptions.ON, tile_latent_size=8,
                                                           overlap_latent=2)), timeout=60)
    assert (untiled.tiles, auto.tiles, small.tiles) == (1, 4, 12)
    exact = to_unit(ref(z))
    torch.testing.assert_close(from_proto(untiled.pixels), exact, atol=1e-4, rtol=0)
    for reply in (auto, small):
        err = (from_proto(reply.pixels) - exact).abs()
        assert err.max() < 0.25 and err.mean() < 0.05  # [0, 1] pixels: half the [-1, 1] tolerance
    assert metric(proc, "modalmesh_vae_tiles_total") - before == 2 * (4 + 12)


BAD = {
    "wrong channels": (request(latents(1, 3, 8, 8)), "3 channels, but this VAE takes 4"),
    "integer latents": (request(torch.ones(1, 4, 8, 8, dtype=torch.int32)), "INT32 is not a float type"),
    "uint8 latents": (request(torch.ones(1, 4, 8, 8, dtype=torch.uint8)), "not a float type"),
    "nan": (request(torch.full((1, 4, 8, 8), float("nan"))), "256 value(s) are NaN or infinite"),
    "inf": (request(latents(1, 4, 8, 8).index_fill_(3, torch.tensor([0]), float("inf"))), "NaN or infinite"),
    "3-d": (request(latents(4, 8, 8)), "is not (B, C, h, w)"),
    "empty batch": (request(torch.zeros(0, 4, 8, 8)), "is empty"),
    "too large": (request(torch.zeros(1, 4, 201, 8)), "exceeds the largest latent side 200"),
    "too many images": (request(torch.zeros(5, 4, 8, 8)), "5 images in one request; the limit is 4"),
    "reply too large": (request(torch.zeros(1, 4, 200, 200)), "would exceed --max-message-mb 1"),
    "no latents": (pb.DecodeRequest(), "latents: missing"),
    "short data": (pb.DecodeRequest(latents=pb.Tensor(dtype=pb.FLOAT32, shape=[1, 4, 8, 8], data=b"\0" * 12)),
                   "data holds 12 bytes"),
    "unknown output": (pb.DecodeRequest(latents=to_proto(torch.zeros(1, 4, 8, 8)), output=7), "unknown format 7"),
    "overlap >= tile": (request(latents(1, 4, 8, 8), tiling=pb.TilingOptions(tile_latent_size=8, overlap_latent=8)),
                        "overlap_latent 8 must be smaller than the tile (8)"),
    "tiny tile": (request(latents(1, 4, 8, 8), tiling=pb.TilingOptions(tile_latent_size=2)), "below the minimum"),
    "too many tiles": (request(latents(1, 4, 200, 200), pb.PNG, tiling=pb.TilingOptions(
        mode=pb.TilingOptions.ON, tile_latent_size=4, overlap_latent=3)), "tiles per image (limit 1024)"),
}


def test_bad_inputs_are_invalid_argument_and_the_service_stays_up(service):
    proc, stub = service
    for case, (req, message) in BAD.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Decode(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert message in err.value.details(), (case, err.value.details())
    # The server counts a call once it has sent its status, so the client can see the last error a moment
    # before the count does (CI saw 15 of 16 once): wait for the count, a bounded while.
    assert eventually(lambda: metric(proc, "modalmesh_requests_total", rpc="Decode", code="INVALID_ARGUMENT"),
                      len(BAD)) >= len(BAD)
    with grpc.insecure_channel(proc.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert from_proto(stub.Decode(request(latents(1, 4, 4, 4)), timeout=30).pixels).shape == (1, 3, 8, 8)


def test_concurrent_requests_are_batched_and_answered_each_with_its_own_pixels(service, ref):
    proc, stub = service
    images_before = metric(proc, "modalmesh_decoded_images_total")
    batches_before = metric(proc, "modalmesh_batch_size_count")
    shapes = [(1, 4, 6, 6), (2, 4, 6, 6), (1, 4, 5, 7)] * 4
    zs = [latents(*shape, seed=10 + i) for i, shape in enumerate(shapes)]
    futures = [stub.Decode.future(request(z), timeout=60) for z in zs]
    for z, future in zip(zs, futures):
        torch.testing.assert_close(from_proto(future.result().pixels), to_unit(ref(z)), atol=1e-4, rtol=0)
    images = sum(s[0] for s in shapes)
    assert metric(proc, "modalmesh_decoded_images_total") - images_before == images
    batches = metric(proc, "modalmesh_batch_size_count") - batches_before
    assert 1 <= batches <= len(shapes)
    assert metric(proc, "modalmesh_attention_backend_info", component="vae") == 1
    # a pool and a backend, as every service: the workspace budget, nothing in use between decodes
    assert metric(proc, "modalmesh_kv_pool_capacity_tokens", pool="vae_workspace") > 0
    assert metric(proc, "modalmesh_kv_pool_used_tokens", pool="vae_workspace") == 0


def test_a_non_vae_checkpoint_fails_start_up_with_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    result = subprocess.run([sys.executable, "-m", "services.vae", "--model", str(tmp_path), "--port", "0",
                             "--metrics-port", "-1", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert result.returncode == 2
    assert "no diffusers AutoencoderKL config" in result.stderr and "LlamaForCausalLM" in result.stderr


# ---- in-process: the batcher and a service without a model ---------------------------------------
def job(shape, output=OutputFormat.FLOAT, tiling=TilingRequest()):
    return DecodeJob(z=torch.zeros(shape), tiling=tiling, output=output)


class GatedRun:
    """A fake decoder call that records its batches; the first call waits for a gate."""

    def __init__(self):
        self.batches: list[list[tuple]] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def __call__(self, jobs, abandoned):
        self.started.set()
        self.gate.wait(timeout=30)
        self.batches.append([tuple(j.z.shape) for j in jobs])
        return [JobResult(torch.zeros(1), tiles=len(self.batches)) for _ in jobs]


def test_batcher_groups_equal_shapes_up_to_max_batch_and_bounds_its_queue():
    async def scenario():
        run = GatedRun()
        metrics = Metrics("vae", process_metrics=False)
        batcher = DecodeBatcher(run, max_queue=5, max_batch=4, metrics=metrics)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(job((1, 4, 8, 8))))
        await asyncio.to_thread(run.started.wait, 30)  # the worker is busy with `first`
        a = (1, 4, 6, 6)
        waiting = [asyncio.ensure_future(batcher.submit(job(s))) for s in
                   [a, (2, 4, 6, 6), (1, 4, 6, 8), (2, 4, 6, 6), a]]
        await asyncio.sleep(0)  # let them enqueue
        assert metrics.registry.get_sample_value("modalmesh_queue_depth", {"service": "vae"}) == 5
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await batcher.submit(job(a))
        run.gate.set()
        await asyncio.gather(first, *waiting)
        await batcher.stop()
        return run.batches

    batches = asyncio.run(scenario())
    # The oldest job heads each batch; equal shapes fill it up to 4 images (a later 1-image job
    # takes the room a 2-image one does not fit in); other shapes keep their place in line.
    assert batches == [[(1, 4, 8, 8)], [(1, 4, 6, 6), (2, 4, 6, 6), (1, 4, 6, 6)], [(1, 4, 6, 8)], [(2, 4, 6, 6)]]


def test_batcher_skips_cancelled_jobs_and_reports_errors_to_every_caller():
    async def scenario():
        run = GatedRun()
        batcher = DecodeBatcher(run, max_queue=8, max_batch=8)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(job((1, 4, 8, 8))))
        await asyncio.to_thread(run.started.wait, 30)
        gone = asyncio.ensure_future(batcher.submit(job((1, 4, 5, 5))))
        kept = asyncio.ensure_future(batcher.submit(job((3, 4, 5, 5))))
        await asyncio.sleep(0)
        gone.cancel()  # the client went away while queued
        run.gate.set()
        await asyncio.gather(first, kept)
        batcher.run = lambda jobs, abandoned: (_ for _ in ()).throw(RuntimeError("device lost"))
        failing = [asyncio.ensure_future(batcher.submit(job((1, 4, 5, 5)))) for _ in range(2)]
        errors = await asyncio.gather(*failing, return_exceptions=True)
        await batcher.stop()
        return run.batches, errors

    batches, errors = asyncio.run(scenario())
    assert batches == [[(1, 4, 8, 8)], [(3, 4, 5, 5)]]
    assert [str(e) for e in errors] == ["device lost", "device lost"]


def test_without_a_model_decode_is_a_failed_precondition():
    parser = build_parser("vae", "", max_message_mb=VAEDecoderService.max_message_mb)
    VAEDecoderService.add_arguments(parser)
    service = VAEDecoderService(parser.parse_args(["--device", "cpu"]), Metrics("vae", process_metrics=False))

    async def call():
        await service.load()
        return await service.decode(request(latents(1, 4, 4, 4)))

    with pytest.raises(FailedPrecondition, match="start it with --model DIR"):
        asyncio.run(call())
    assert service.info().extra["model"] == "none"


def test_channels_last_is_on_by_default_only_on_cuda_with_the_fused_kernels():
    """NHWC needs the fused GroupNorm to pay (PyTorch's copies NHWC to NCHW and back); a flag overrides."""
    from services.vae import flags
    from services.vae.config import VAEServiceConfig

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def settings(*argv):
        return VAEServiceConfig.from_args(flags.parser().parse_args(["--model", "x", *argv]))

    assert settings().use_channels_last(cuda) and not settings().use_channels_last(cpu)
    assert not settings("--no-fused-kernels").use_channels_last(cuda)
    assert not settings("--no-channels-last").use_channels_last(cuda)
    assert settings("--channels-last").use_channels_last(cpu)
    assert settings("--channels-last", "--no-fused-kernels").use_channels_last(cuda)


def test_cuda_graphs_are_on_unless_turned_off():
    from services.vae import flags
    from services.vae.config import VAEServiceConfig

    def settings(*argv):
        return VAEServiceConfig.from_args(flags.parser().parse_args(["--model", "x", *argv]))

    assert settings().cuda_graphs and not settings("--no-cuda-graphs").cuda_graphs
