"""VAE decoder vs diffusers AutoencoderKL (CPU, FP32): configs, legacy checkpoints, scaling, attention precision."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modalmesh.attention import Platform, configure, registry
from modalmesh.attention import selector as selector_mod
from modalmesh.attention.backends.naive import NaiveBackend
from modalmesh.attention.capability import ALL_FEATURES, BackendSpec, Target
from modalmesh.errors import ConfigError
from modalmesh.testing import tiny
from modalmesh.weights import MissingWeightsError, UnexpectedWeightsError, WeightMismatchError
from services.vae.config import VAEConfig, find_vae_dir
from services.vae.engine import OFF, TilingRequest, VAEEngine, to_uint8, to_unit
from services.vae.models.autoencoder_kl import LEGACY_ATTENTION
from services.vae.weights import build_decoder, load_decoder

diffusers = pytest.importorskip("diffusers")
AutoencoderKL = diffusers.AutoencoderKL

TOL = dict(atol=1e-4, rtol=0)
CPU = torch.device("cpu")


def make_vae(out, seed=0, **overrides):
    """A tiny random AutoencoderKL saved with diffusers' save_pretrained."""
    torch.manual_seed(seed)
    kw = dict(in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
              up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
              norm_num_groups=4, sample_size=32)
    kw.update(overrides)
    n = len(kw["block_out_channels"])
    kw["down_block_types"], kw["up_block_types"] = ("DownEncoderBlock2D",) * n, ("UpDecoderBlock2D",) * n
    vae = AutoencoderKL(**kw)
    # Random norms and biases too, so a mis-wired GroupNorm or bias cannot hide behind init defaults.
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    vae.save_pretrained(out, safe_serialization=True)
    return out


CONFIGS = {
    "sd_4ch_post_quant": {},
    "sd_4ch_no_post_quant": dict(use_quant_conv=False, use_post_quant_conv=False),
    "sd3_16ch_no_post_quant": dict(latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609,
                                   use_quant_conv=False, use_post_quant_conv=False),
    "flux_16ch_post_quant": dict(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159),
    "sdxl_3_levels_mean_std": dict(block_out_channels=(8, 16, 16), layers_per_block=2, scaling_factor=0.13025,
                                   latents_mean=(0.1, -0.2, 0.3, 0.0), latents_std=(1.1, 0.9, 1.3, 0.7)),
    "two_heads_worth_no_mid_attention": dict(mid_block_add_attention=False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vae_ckpts")
    out = {name: make_vae(root / name, seed=i, **kw) for i, (name, kw) in enumerate(CONFIGS.items())}
    out["tiny_vae"] = tiny.ensure("vae", root)
    out["tiny_vae16"] = tiny.ensure("vae16", root)
    return out


def ours(vae_dir, dtype=torch.float32):
    model = build_decoder(VAEConfig.from_dir(vae_dir), dtype=dtype)
    report = load_decoder(model, vae_dir, device=CPU, dtype=dtype, metrics=False)
    return model, report


_REFERENCES: dict = {}


def reference(vae_dir):
    """diffusers' model of a checkpoint (cached: several tests compare against the same one)."""
    key = str(vae_dir)
    if key not in _REFERENCES:
        _REFERENCES[key] = AutoencoderKL.from_pretrained(vae_dir).eval()
    return _REFERENCES[key]


@torch.inference_mode()
def assert_parity(model, ref, channels, shape=(2, 12, 10)):
    torch.manual_seed(1)
    z = torch.randn(shape[0], channels, *shape[1:])
    want = ref.decode(z).sample
    got = model(z)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)
    return z, got


@pytest.mark.parametrize("name", [*CONFIGS, "tiny_vae", "tiny_vae16"])
def test_decode_matches_diffusers(ckpts, name):
    model, report = ours(ckpts[name])
    cfg = model.config
    assert cfg.use_post_quant_conv == (model.post_quant_conv is not None)
    assert all(n.startswith(("decoder.", "post_quant_conv.")) for n in report.loaded)  # encoder never read
    assert_parity(model, reference(ckpts[name]), cfg.latent_channels)


@pytest.mark.parametrize("shape", [(1, 8, 5, 7), (2, 3, 4, 4), (1, 16, 1, 9)])
def test_nearest_upsample_equals_interpolate_in_either_memory_format(shape):
    from services.vae.models.autoencoder_kl import upsample_nearest_2x

    x = torch.randn(*shape)
    want = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
    for fmt in (torch.contiguous_format, torch.channels_last):
        got = upsample_nearest_2x(x.contiguous(memory_format=fmt))
        assert got.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_channels_last_decode_matches_diffusers_and_stays_channels_last(ckpts):
    """What the service runs on CUDA (--channels-last): every layer keeps NHWC, the answer is diffusers'."""
    model, _ = ours(ckpts["tiny_vae"])
    model.to(memory_format=torch.channels_last)
    layouts = []
    hooks = [m.register_forward_hook(lambda m, a, out: layouts.append(
        (type(m).__name__, out.is_contiguous(memory_format=torch.channels_last))))
        for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        torch.manual_seed(1)
        z = torch.randn(2, model.config.latent_channels, 12, 10).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            got = model(z)
    finally:
        for hook in hooks:
            hook.remove()
    assert layouts and all(cl for _, cl in layouts), layouts
    with torch.inference_mode():
        want = reference(ckpts["tiny_vae"]).decode(z.contiguous()).sample
    torch.testing.assert_close(got, want, **TOL)


def test_configs_cover_4_and_16_channels_with_and_without_post_quant_conv(ckpts):
    seen = {(VAEConfig.from_dir(p).latent_channels, VAEConfig.from_dir(p).use_post_quant_conv) for p in ckpts.values()}
    assert seen >= {(4, True), (4, False), (16, True), (16, False)}


def _resave(src, dst, rename=lambda k: k, reshape=lambda k, t: t, extra=None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    state = {rename(k): reshape(k, v).contiguous() for k, v in state.items()}
    state.update(extra or {})
    save_file(state, str(dst / "diffusion_pytorch_model.safetensors"))
    return dst


OLD = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def _old_name(key):
    for new, old in OLD.items():
        key = key.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
    return key


def _as_conv1x1(key, t):
    is_proj = ".attentions." in key and key.endswith(".weight") and any(p in key for p in (*OLD, *OLD.values()))
    return t[:, :, None, None] if is_proj and t.dim() == 2 else t


@pytest.mark.parametrize("variant", ["old_names", "conv1x1", "old_names_conv1x1"])
def test_legacy_attention_checkpoints_load_and_match(ckpts, tmp_path, variant):
    src = ckpts["sd_4ch_post_quant"]
    rename = _old_name if "old_names" in variant else (lambda k: k)
    reshape = _as_conv1x1 if "conv1x1" in variant else (lambda k, t: t)
    legacy = _resave(src, tmp_path / variant, rename, reshape)
    keys = load_file(str(legacy / "diffusion_pytorch_model.safetensors")).keys()
    if "old_names" in variant:
        assert "decoder.mid_block.attentions.0.proj_attn.weight" in keys
        assert not any(".to_q." in k for k in keys)
    model, _ = ours(legacy)
    assert_parity(model, reference(src), 4)


def test_legacy_mapper_rewrites_only_mid_block_attention():
    assert LEGACY_ATTENTION.apply("decoder.mid_block.attentions.0.query.bias") == \
        "decoder.mid_block.attentions.0.to_q.bias"
    assert LEGACY_ATTENTION.apply("decoder.mid_block.attentions.0.proj_attn.weight") == \
        "decoder.mid_block.attentions.0.to_out.0.weight"
    assert LEGACY_ATTENTION.apply("decoder.up_blocks.0.resnets.0.conv1.weight") == \
        "decoder.up_blocks.0.resnets.0.conv1.weight"


def test_encoder_tensors_are_not_read_and_decoder_loading_is_strict(ckpts, tmp_path):
    src = ckpts["tiny_vae"]
    # Junk under encoder.* is never opened; junk under decoder.* is an error naming it.
    junk_encoder = _resave(src, tmp_path / "junk_enc", extra={"encoder.not_a_real_layer": torch.zeros(3)})
    ours(junk_encoder)
    junk_decoder = _resave(src, tmp_path / "junk_dec", extra={"decoder.mid_block.bogus.weight": torch.zeros(3)})
    with pytest.raises(UnexpectedWeightsError, match="decoder.mid_block.bogus.weight"):
        ours(junk_decoder)
    bad_kernel = _resave(src, tmp_path / "bad_kernel",
                         reshape=lambda k, t: t[:, :, None, None].expand(-1, -1, 3, 3)
                         if k.endswith("attentions.0.to_q.weight") else t)
    with pytest.raises(WeightMismatchError, match="not a 1x1 convolution"):
        ours(bad_kernel)


def test_a_missing_decoder_tensor_is_named(ckpts, tmp_path):
    src = ckpts["tiny_vae"]
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    del state["decoder.conv_out.bias"]
    save_file(state, str(tmp_path / "gone" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(MissingWeightsError, match=r"decoder\.conv_out\.bias"):
        ours(tmp_path / "gone")


def test_pipeline_layout_and_non_vae_directories(ckpts, tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    (pipe / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    _resave(ckpts["tiny_vae"], pipe / "vae")
    assert find_vae_dir(pipe) == pipe / "vae"
    assert find_vae_dir(ckpts["tiny_vae"]) == ckpts["tiny_vae"]
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ConfigError, match="no diffusers AutoencoderKL config.*LlamaForCausalLM"):
        find_vae_dir(llama)
    raw = json.loads((ckpts["tiny_vae"] / "config.json").read_text())
    with pytest.raises(ConfigError, match="AutoencoderTiny"):
        VAEConfig.from_dict({**raw, "_class_name": "AutoencoderTiny"})
    with pytest.raises(ConfigError, match="only UpDecoderBlock2D"):
        VAEConfig.from_dict({**raw, "up_block_types": ["AttnUpDecoderBlock2D"] * 2})


# ---- scaling as the pipelines do it -------------------------------------------------------------
def _pipeline_unscale(vae, latents):
    """The diffusers pipelines' own lines (SD, SDXL with latents_mean/std, SD3 / FLUX)."""
    c = vae.config
    if getattr(c, "latents_mean", None) is not None and getattr(c, "latents_std", None) is not None:
        mean = torch.tensor(c.latents_mean).view(1, 4, 1, 1)
        std = torch.tensor(c.latents_std).view(1, 4, 1, 1)
        return latents * std / c.scaling_factor + mean  # StableDiffusionXLPipeline
    if getattr(c, "shift_factor", None) is not None:
        return (latents / c.scaling_factor) + c.shift_factor  # StableDiffusion3Pipeline, FluxPipeline
    return latents / c.scaling_factor  # StableDiffusionPipeline


@pytest.mark.parametrize("name", ["sd_4ch_post_quant", "sd3_16ch_no_post_quant", "flux_16ch_post_quant",
                                  "sdxl_3_levels_mean_std"])
def test_scaling_and_shift_applied_as_diffusers_pipelines(ckpts, name):
    cfg = VAEConfig.from_dir(ckpts[name])
    ref = reference(ckpts[name])
    torch.manual_seed(2)
    latents = torch.randn(2, cfg.latent_channels, 6, 5) * 2
    torch.testing.assert_close(cfg.unscale(latents), _pipeline_unscale(ref, latents), atol=0, rtol=0)
    engine = VAEEngine(cfg, ours(ckpts[name])[0], device=CPU, dtype=torch.float32)
    got = engine.decode(cfg.unscale(latents), TilingRequest(mode=OFF)).pixels
    with torch.inference_mode():
        want = ref.decode(_pipeline_unscale(ref, latents)).sample
    torch.testing.assert_close(got, want, **TOL)


def test_pixel_conversion_matches_diffusers_image_processor():
    from diffusers.image_processor import VaeImageProcessor

    torch.manual_seed(3)
    x = torch.randn(2, 3, 9, 7) * 0.8
    x[0, 0, 0, :3] = torch.tensor([-5.0, 5.0, 0.0])  # clamping at both ends
    proc = VaeImageProcessor()
    np_images = proc.postprocess(x, output_type="np")  # (B, H, W, 3) float in [0, 1]
    torch.testing.assert_close(to_unit(x), torch.from_numpy(np_images).permute(0, 3, 1, 2), atol=0, rtol=0)
    pil = proc.postprocess(x, output_type="pil")
    import numpy as np

    assert torch.equal(to_uint8(x), torch.from_numpy(np.stack([np.asarray(p) for p in pil])))


# ---- attention precision contract ---------------------------------------------------------------
class Bf16OnlyNaive(NaiveBackend):
    def dense(self, q, k, v, **kw):
        assert q.dtype == torch.bfloat16, f"a bf16-only kernel was given {q.dtype}"
        return super().dense(q, k, v, **kw)


@pytest.fixture
def process_selector(monkeypatch):
    """Give each test its own process-wide attention selector (the model builds layers through it)."""
    monkeypatch.setattr(selector_mod, "_CURRENT", None)
    registry.register(BackendSpec("test_vae_bf16_fused", f"{__name__}:Bf16OnlyNaive", cast_dtype=torch.bfloat16,
                                  targets=(Target("cpu", frozenset({torch.bfloat16}), ALL_FEATURES),)))
    yield lambda spec: configure(spec, platform=Platform.cpu())
    registry.unregister("test_vae_bf16_fused")


def test_fp32_default_stays_fp32_and_explicit_fused_backend_casts(ckpts, process_selector):
    src = ckpts["sd_4ch_post_quant"]
    ref = reference(src)
    process_selector(None)
    model, _ = ours(src)
    attn = model.decoder.mid_block.attentions[0].attn
    assert attn.selection.cast_dtype is None and attn.backend_name in {"sdpa_flash", "sdpa_math"}
    assert_parity(model, ref, 4)

    process_selector("vae=test_vae_bf16_fused")
    model, _ = ours(src)
    attn = model.decoder.mid_block.attentions[0].attn
    assert attn.backend_name == "test_vae_bf16_fused" and attn.selection.cast_dtype == torch.bfloat16
    torch.manual_seed(1)
    z = torch.randn(2, 4, 12, 10)
    with torch.inference_mode():
        got, want = model(z), ref.decode(z).sample
    assert got.dtype == torch.float32  # q/k/v went through bf16, the output came back in FP32
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)

    process_selector("sdpa_math")  # a global override of an FP32-capable backend applies to the VAE too
    model, _ = ours(src)
    assert model.decoder.mid_block.attentions[0].attn.backend_name == "sdpa_math"
    assert_parity(model, ref, 4)


def test_bfloat16_decoding_is_close_to_fp32(ckpts):
    src = ckpts["sd3_16ch_no_post_quant"]
    fp32, _ = ours(src)
    bf16, _ = ours(src, torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    torch.manual_seed(4)
    z = torch.randn(1, 16, 8, 8)
    with torch.inference_mode():
        a, b = fp32(z), bf16(z.bfloat16())
    assert b.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a, atol=0.1, rtol=0)


# ---- backend facts come from the backend's record ------------------------------------------------
def test_the_untiled_estimate_counts_a_score_matrix_when_the_backend_record_says_so(ckpts, monkeypatch):
    """Not a list of names in the VAE: a backend registered with score_matrix=True is counted."""
    monkeypatch.setattr(selector_mod, "_CURRENT", None)
    targets = (Target("cpu", frozenset({torch.float32}), ALL_FEATURES),)
    loader = "modalmesh.attention.backends.naive:NaiveBackend"
    registry.register(BackendSpec("test_vae_quadratic", loader, targets=targets, score_matrix=True))
    registry.register(BackendSpec("test_vae_flash_like", loader, targets=targets))
    try:
        src = ckpts["sd_4ch_post_quant"]
        cfg = VAEConfig.from_dir(src)
        need = {}
        for name in ("test_vae_quadratic", "test_vae_flash_like"):
            configure(f"vae={name}", platform=Platform.cpu())
            model, _ = ours(src)
            engine = VAEEngine(cfg, model, device=CPU, dtype=torch.float32)
            assert engine.attention_backend == name
            need[name] = engine.untiled_bytes(2, 8, 6)
        heads = cfg.block_out_channels[-1] // cfg.attention_head_dim
        assert need["test_vae_quadratic"] - need["test_vae_flash_like"] == 2 * 2 * heads * (8 * 6) ** 2 * 4
    finally:
        registry.unregister("test_vae_quadratic")
        registry.unregister("test_vae_flash_like")
