"""VAE decoder on CUDA: FP32 and bf16 parity with diffusers, FP32 attention contract, tiling, the service.

Skipped without CUDA. FP32 parity runs with TF32 off (cuDNN convolutions use TF32
by default; both sides would, but not identically enough for 1e-4).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from modalmesh import pb
from modalmesh.attention import configure
from modalmesh.attention import selector as selector_mod
from modalmesh.ops.launcher import ServiceProcess
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.testing import tiny
from modalmesh.testing.precision import ieee_fp32_convolutions
from services.vae.config import VAEConfig
from services.vae.engine import OFF, ON, TilingDefaults, TilingRequest, VAEEngine, to_unit
from services.vae.weights import build_decoder, load_decoder_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
diffusers = pytest.importorskip("diffusers")

CUDA = torch.device("cuda")
BLOCKS = {
    "sd_tiny": dict(block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1),
    "sd3_16ch": dict(block_out_channels=(32, 64), norm_num_groups=8, layers_per_block=1, latent_channels=16,
                     shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False),
    "sdxl_shape": dict(block_out_channels=(128, 256, 512, 512), norm_num_groups=32, layers_per_block=2,
                       scaling_factor=0.13025),
}


@pytest.fixture(autouse=True)
def cuda_selector(monkeypatch):
    monkeypatch.setattr(selector_mod, "_CURRENT", None)
    configure(None, device=CUDA)
    yield


@pytest.fixture
def no_tf32():
    with ieee_fp32_convolutions():
        yield


def pair(name, dtype):
    """diffusers' random AutoencoderKL of config `name` and ours with the same weights, both on CUDA in `dtype`."""
    torch.manual_seed(0)
    kw = dict(in_channels=3, out_channels=3, latent_channels=4, sample_size=256)
    kw.update(BLOCKS[name])
    n = len(kw["block_out_channels"])
    ref = diffusers.AutoencoderKL(**kw, down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n).eval()
    cfg = VAEConfig.from_dict({"_class_name": "AutoencoderKL", **dict(ref.config)})
    model = build_decoder(cfg, dtype=dtype, seqlen_hint=32 * 32)
    load_decoder_state(model, ref.state_dict(), device=CUDA, dtype=dtype)
    return ref.to(CUDA, dtype), model, cfg


def latents(cfg, side=32, batch=2):
    return torch.randn(batch, cfg.latent_channels, side, side, device=CUDA,
                       generator=torch.Generator(CUDA).manual_seed(1))


@pytest.mark.parametrize("name", list(BLOCKS))
@torch.inference_mode()
def test_fp32_parity_on_cuda(name, no_tf32):
    ref, model, cfg = pair(name, torch.float32)
    attn = model.decoder.mid_block.attentions[0].attn
    assert attn.backend_name in {"sdpa_math", "sdpa_efficient"} and attn.selection.cast_dtype is None
    z = latents(cfg)
    want, got = ref.decode(z).sample, model(z)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("name", list(BLOCKS))
@torch.inference_mode()
def test_bf16_parity_on_cuda_is_as_close_to_fp32_as_diffusers_bf16(name, no_tf32):
    ref32, model32, cfg = pair(name, torch.float32)
    z = latents(cfg)
    exact = ref32.decode(z).sample
    ref16, model16, _ = pair(name, torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    ours = (model16(z.bfloat16()).float() - exact).abs()
    theirs = (ref16.decode(z.bfloat16()).sample.float() - exact).abs()
    assert ours.mean() <= 1.5 * theirs.mean() + 1e-3, (ours.mean().item(), theirs.mean().item())
    assert ours.max() <= 2.0 * theirs.max() + 1e-2, (ours.max().item(), theirs.max().item())


def test_tiled_decode_on_cuda(no_tf32):
    ref, model, cfg = pair("sd_tiny", torch.float32)
    engine = VAEEngine(cfg, model, device=CUDA, dtype=torch.float32)
    z = latents(cfg, side=48, batch=1)
    untiled = engine.decode(z, TilingRequest(mode=OFF))
    tiled = engine.decode(z, TilingRequest(mode=ON, tile=32, overlap=8))
    assert tiled.tiles == 4 and tiled.pixels.device.type == "cuda"
    err = (tiled.pixels - untiled.pixels).abs()
    assert err.max() < 0.5 and err.mean() < 0.05
    assert engine.budget_bytes() > 0  # AUTO's memory check reads the device's free memory


@pytest.mark.parametrize("dtype, channels_last", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-nchw", "bf16-nhwc"])  # the second is the service's default on CUDA
def test_tile_shaped_decodes_replayed_from_graphs_equal_eager_ones(dtype, channels_last, no_tf32):
    _, model, cfg = pair("sd_tiny", dtype)
    tiling = TilingDefaults(tile=32, overlap=8, threshold=32, batch=3)
    kw = dict(device=CUDA, dtype=dtype, tiling=tiling, channels_last=channels_last)
    eager, graphed = VAEEngine(cfg, model, **kw), VAEEngine(cfg, model, **kw, cuda_graphs=True)
    tol = dict(atol=1e-5 if dtype == torch.float32 else 2.0 ** -7, rtol=0)  # the same kernels; bf16: an ulp at 1
    graphed.warm_up()  # captures: the warm-up decodes the tile's shape, which fits
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 3] and graphed.graph_pool_bytes > 0
    replays = graphed.graphs.replays
    z = latents(cfg, side=32, batch=3)
    torch.testing.assert_close(graphed.decode(z, TilingRequest(OFF)).pixels, eager.decode(z, TilingRequest(OFF)).pixels,
                               **tol)
    assert graphed.graphs.replays == replays + 1
    z = latents(cfg, side=48, batch=1)  # four tiles of 32: replays of 3 and 1
    got, want = (e.decode(z, TilingRequest(ON)) for e in (graphed, eager))
    assert got.tiles == want.tiles == 4 and graphed.graphs.replays == replays + 3
    torch.testing.assert_close(got.pixels, want.pixels, **tol)
    graphed.decode(latents(cfg, side=24, batch=1), TilingRequest(OFF))  # another shape runs eagerly
    assert graphed.graphs.replays == replays + 3


def test_service_on_cuda_matches_diffusers(tmp_path):
    vae_dir = tiny.ensure("vae16", tmp_path)
    ref = diffusers.AutoencoderKL.from_pretrained(vae_dir).to(CUDA).eval()
    proc = ServiceProcess("vae", ["--model", str(vae_dir), "--device", "cuda", "--host", "127.0.0.1",
                                  "--port", "0", "--metrics-port", "-1"])
    with proc:
        proc.wait_serving(timeout=180)
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb.vae_pb2_grpc.VAEServiceStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            assert info.device.startswith("cuda") and info.dtype == "float32"
            assert info.extra["cuda_graph_batches"] == "4"  # tile-shaped decodes captured before SERVING
            z = torch.randn(2, 16, 8, 8)
            reply = stub.Decode(pb.DecodeRequest(latents=to_proto(z), output=pb.TENSOR_FLOAT), timeout=60)
        assert proc.terminate(timeout=60) == 0
    with torch.inference_mode():
        want = to_unit(ref.decode((z / 1.5305 + 0.0609).to(CUDA)).sample).cpu()
    torch.testing.assert_close(from_proto(reply.pixels), want, atol=1e-3, rtol=0)  # TF32 convolutions allowed
