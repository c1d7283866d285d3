"""Backend selection against faked platforms, overrides, the FP32 contract, metrics and Info."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from prometheus_client import CollectorRegistry

from modalmesh import pb
from modalmesh.attention import (
    ENV_VAR,
    Attention,
    AttentionSelector,
    Needs,
    Platform,
    attention_choices,
    parse_backend_spec,
    registry,
)
from modalmesh.errors import ConfigError
from modalmesh.metrics import Metrics

HOPPER = Platform.cuda((9, 0), "NVIDIA H200")
SM100 = Platform.cuda((10, 0), "NVIDIA B200")
SM103 = Platform.cuda((10, 3), "NVIDIA B300")
AMPERE = Platform.cuda((8, 0), "NVIDIA A100")
MI355 = Platform.rocm("gfx950", (9, 5))
MI300 = Platform.rocm("gfx942", (9, 4))
CPU = Platform.cpu()

BF16_HD128 = Needs(torch.bfloat16, 128, causal=True)
BF16_HD64 = Needs(torch.bfloat16, 64)
FP32_HD64 = Needs(torch.float32, 64)
VARLEN = Needs(torch.bfloat16, 80, layouts=("varlen",))
PAGED = Needs(torch.bfloat16, 128, layouts=("paged",), causal=True, gqa=True, page_size=16)


def _never_called(*args, **kwargs):
    raise AssertionError("selection must not run kernels on a faked platform")


def _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                      softmax_scale=None, causal=False, window_size=(-1, -1), block_table=None):
    _never_called()


def _kernel_module(name: str, *, kvcache: bool = True) -> types.ModuleType:
    """A stand-in for an installed flash kernel package (probing reads its functions' signatures)."""
    module = types.ModuleType(name)
    module.flash_attn_func, module.flash_attn_varlen_func = _never_called, _varlen_signature
    if kvcache:
        module.flash_attn_with_kvcache = _never_called
    return module


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    """No real flash kernels here; each test states which fake ones exist."""
    for name in ("flash_attn_interface", "fa3_fwd_interface", "flash_attn", "triton"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.delenv(ENV_VAR, raising=False)
    registry.forget_probes()
    yield
    registry.forget_probes()


@pytest.fixture
def with_fa3(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", _kernel_module("flash_attn_interface"))


@pytest.fixture
def with_fa2(monkeypatch):
    module = _kernel_module("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", module)


@pytest.fixture
def raising_fa3(tmp_path, monkeypatch):
    """An FA3 wheel that is installed but fails to load (MiMo-V2 on Blackwell)."""
    (tmp_path / "flash_attn_interface.py").write_text(
        "raise RuntimeError('FlashAttention-3 was not compiled for this GPU (sm103)')\n")
    monkeypatch.delitem(sys.modules, "flash_attn_interface")
    monkeypatch.syspath_prepend(str(tmp_path))


def select(platform, needs, spec="", component="llm", **kw):
    metrics = Metrics("test", CollectorRegistry())
    return AttentionSelector(spec, platform=platform, metrics=metrics).select(component, needs, **kw)


# ---- automatic choice per platform ------------------------------------------------------------
def test_hopper_with_fa3_follows_the_measured_ranking(with_fa3):
    hd128 = select(HOPPER, BF16_HD128)
    assert hd128.backend == "fa3" and hd128.source == "auto" and "fa3 710" in hd128.reason
    hd64 = select(HOPPER, BF16_HD64)
    assert hd64.backend == "sdpa_cudnn" and "sdpa_cudnn 425" in hd64.reason
    assert hd64.rejected["fa3"].startswith("usable; not chosen")
    assert select(HOPPER, VARLEN).backend == "fa3"
    assert select(HOPPER, PAGED).backend == "fa3"


def test_hopper_ranking_depends_on_length_and_dtype(with_fa3):
    # Whisper's 1500 frames: fa3 beat cuDNN at hd64 (475 vs 384 TFLOP/s); at 1024 cuDNN won.
    whisper = select(HOPPER, Needs(torch.bfloat16, 64, seqlen_hint=1500), component="audio_encoder")
    assert whisper.backend == "fa3" and "s1500" in whisper.reason
    assert select(HOPPER, Needs(torch.bfloat16, 64, seqlen_hint=1024)).backend == "sdpa_cudnn"
    # FP32 (VAE): math beat efficient up to s16384; unknown or longer lengths keep the memory-lean kernel.
    vae = select(HOPPER, Needs(torch.float32, 512, seqlen_hint=4096), component="vae")
    assert vae.backend == "sdpa_math" and "fp32" in vae.reason
    assert select(HOPPER, Needs(torch.float32, 512), component="vae").backend == "sdpa_efficient"
    assert select(HOPPER, Needs(torch.float32, 512, seqlen_hint=16384), component="vae").backend == "sdpa_math"
    assert select(HOPPER, Needs(torch.float32, 512, seqlen_hint=65536), component="vae").backend == "sdpa_efficient"
    # bf16 past the flash kernels' head dims: two GEMMs per query block (FP32 above never goes there)
    bf16 = select(HOPPER, Needs(torch.bfloat16, 512, seqlen_hint=16384), component="vae")
    assert bf16.backend == "matmul_chunked" and "hd512" in bf16.reason
    assert select(HOPPER, Needs(torch.bfloat16, 128)).backend != "matmul_chunked"


def test_hopper_without_fa3_records_why(with_fa2):
    choice = select(HOPPER, BF16_HD128)
    assert choice.backend == "sdpa_cudnn"
    assert "flash_attn_interface" in choice.rejected["fa3"] and "fa3_fwd_interface" in choice.rejected["fa3"]
    assert select(HOPPER, VARLEN).backend == "torch_varlen"
    # 16-token pages: FA2 and torch varlen need multiples of 256, so SDPA gathers pages.
    paged = select(HOPPER, PAGED)
    assert paged.backend == "sdpa_efficient"
    assert "page size 16 not a multiple of 256" in paged.rejected["fa2"]
    assert select(HOPPER, Needs(torch.bfloat16, 128, layouts=("paged",), page_size=256)).backend == "fa2"


def test_hopper_with_forward_only_fa3_wheel(monkeypatch):
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", _kernel_module("fa3_fwd_interface", kvcache=False))
    assert select(HOPPER, BF16_HD128).backend == "fa3"
    fp16 = select(HOPPER, Needs(torch.float16, 128))
    assert fp16.backend == "sdpa_cudnn" and "dtype float16 unsupported" in fp16.rejected["fa3"]
    window = select(HOPPER, Needs(torch.bfloat16, 128, window=(64, 0), layouts=("varlen",)))
    assert window.backend == "torch_varlen" and "no window support" in window.rejected["fa3"]
    assert "no paged support" in select(HOPPER, PAGED).rejected["fa3"]


@pytest.mark.parametrize("platform", [SM100, SM103], ids=["sm100", "sm103"])
def test_blackwell_never_picks_fa3_and_a_raising_fa3_import_is_harmless(platform, raising_fa3):
    choice = select(platform, BF16_HD128)
    assert choice.backend == "sdpa_cudnn"
    assert "compute capability <= sm90" in choice.rejected["fa3"]
    assert select(platform, VARLEN).backend == "torch_varlen"
    probe = registry.probe("fa3")  # even probing it directly reports, never raises
    assert not probe.ok and "not compiled for this GPU" in probe.reason


def test_hopper_with_a_raising_fa3_falls_back(raising_fa3):
    choice = select(HOPPER, BF16_HD128)
    assert choice.backend == "sdpa_cudnn"
    assert "RuntimeError: FlashAttention-3 was not compiled" in choice.rejected["fa3"]


def test_ampere(with_fa2):
    assert select(AMPERE, BF16_HD128).backend == "fa2"
    assert "compute capability >= sm90" in select(AMPERE, BF16_HD128).rejected["fa3"]
    assert select(AMPERE, VARLEN).backend == "fa2"


def test_ampere_without_flash_attn():
    assert select(AMPERE, BF16_HD128).backend == "sdpa_flash"
    assert select(AMPERE, VARLEN).backend == "torch_varlen"


def test_rocm():
    gfx950 = select(MI355, BF16_HD128)
    assert gfx950.backend == "sdpa_math" and "gfx95" in gfx950.reason
    assert select(MI300, BF16_HD128).backend == "sdpa_flash"
    assert select(MI300, VARLEN).backend == "sdpa_efficient"  # flash SDPA takes no mask on GPUs


def test_cpu():
    assert select(CPU, FP32_HD64).backend == "sdpa_flash"
    assert select(CPU, Needs(torch.float32, 64, layouts=("paged",), causal=True)).backend == "sdpa_flash"
    # CPU flash cannot take a value head dim different from the q/k one.
    distinct_v = select(CPU, Needs(torch.float32, 64, v_head_dim=32))
    assert distinct_v.backend == "sdpa_math" and "no v_head_dim support" in distinct_v.rejected["sdpa_flash"]


def test_rejections_cover_every_other_backend(with_fa3):
    choice = select(HOPPER, BF16_HD128)
    assert set(choice.rejected) == set(registry.names()) - {"fa3"}
    assert all(choice.rejected.values())


# ---- FP32 contract ------------------------------------------------------------------------------
def test_fp32_never_reaches_a_kernel_that_rejects_it(with_fa3, with_fa2):
    for platform in (HOPPER, SM103, AMPERE):
        choice = select(platform, FP32_HD64)
        assert choice.backend == "sdpa_efficient", platform
        for name in ("fa3", "fa2", "sdpa_cudnn", "sdpa_flash", "torch_varlen"):
            assert "dtype float32 unsupported" in choice.rejected[name] or "compute capability" in choice.rejected[
                name], (platform, name)


def test_component_override_casts_global_override_does_not(with_fa3):
    explicit = select(HOPPER, FP32_HD64, spec="vae=fa3", component="vae")
    assert explicit.backend == "fa3" and explicit.cast_dtype == torch.bfloat16
    assert explicit.reason == "component override (computes in bfloat16)"
    everywhere = select(HOPPER, FP32_HD64, spec="fa3", component="vae")
    assert everywhere.backend == "sdpa_efficient" and everywhere.cast_dtype is None
    assert everywhere.rejected["fa3"].startswith("global override skipped: dtype float32 unsupported")
    # The same global override is taken by a bf16 component.
    assert select(HOPPER, BF16_HD64, spec="fa3").backend == "fa3"


# ---- overrides ----------------------------------------------------------------------------------
def test_parse_backend_spec():
    spec = parse_backend_spec(" LLM=fa3, vision-encoder=SDPA-cudnn ,sdpa_math,audio_encoder=auto")
    assert spec.everything == "sdpa_math"
    assert dict(spec.per_component) == {"llm": "fa3", "vision_encoder": "sdpa_cudnn", "audio_encoder": "auto"}
    assert spec.lookup("vae") == ("sdpa_math", "global override")
    assert spec.lookup("audio_encoder") == (None, "auto")
    assert parse_backend_spec("").lookup("llm") == (None, "auto")


@pytest.mark.parametrize("text, message", [
    ("flash3", "unknown backend 'flash3'; valid: sdpa_cudnn, sdpa_flash"),
    ("llm=fa4", "unknown backend 'fa4'"),
    ("fa3,sdpa_math", "more than one backend for all components"),
    ("llm=fa3,llm=fa2", "llm given twice"),
    ("llm=fa3,", "empty entry"),
    ("9llm=fa3", "is not a component name"),
])
def test_bad_backend_spec(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_backend_spec(text)


def test_overrides_win_in_order(with_fa3):
    spec = "vision_encoder=sdpa_math,sdpa_efficient"
    vision = select(HOPPER, VARLEN, spec=spec, component="vision-encoder")
    assert (vision.backend, vision.reason, vision.component) == ("sdpa_math", "component override", "vision_encoder")
    llm = select(HOPPER, BF16_HD128, spec=spec, default="fa3")
    assert (llm.backend, llm.reason) == ("sdpa_efficient", "global override")
    exempt = select(HOPPER, BF16_HD128, spec="llm=auto,sdpa_efficient")
    assert exempt.backend == "fa3" and exempt.source == "auto"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "audio_encoder=sdpa_math")
    selector = AttentionSelector(platform=CPU, metrics=Metrics("t", CollectorRegistry()))
    assert selector.select("audio_encoder", FP32_HD64).backend == "sdpa_math"
    assert selector.select("vae", FP32_HD64).backend == "sdpa_flash"


def test_override_unavailable_on_this_platform_fails_at_start_up():
    with pytest.raises(ConfigError) as info:
        AttentionSelector("llm=fa3", platform=CPU)
    text = str(info.value)
    assert "fa3 (for llm) cannot run on cpu" in text and "runs on cuda" in text
    assert "Usable here: sdpa_flash, sdpa_math, torch_naive" in text


def test_override_whose_kernel_is_missing_fails_at_start_up():
    with pytest.raises(ConfigError, match=r"fa3 \(for all components\) cannot run on cuda sm90.*flash_attn_interface"):
        AttentionSelector("fa3", platform=HOPPER)


def test_override_that_cannot_serve_the_component_fails_with_alternatives(with_fa3):
    selector = AttentionSelector("llm=fa3", platform=HOPPER)  # runs here...
    with pytest.raises(ConfigError) as info:  # ...but not with a distinct value head dim
        selector.select("llm", Needs(torch.bfloat16, 128, v_head_dim=64))
    text = str(info.value)
    assert "fa3 requested for llm (component override)" in text and "no v_head_dim support" in text
    assert "Usable alternatives: sdpa_efficient, sdpa_math, torch_naive" in text


def test_override_outside_the_supported_set_fails(with_fa3):
    with pytest.raises(ConfigError, match="not in the component's supported set"):
        select(HOPPER, BF16_HD64, spec="vae=fa3", component="vae", supported=["sdpa_math", "sdpa-efficient"])


# ---- declared defaults and supported sets -----------------------------------------------------
def test_component_default_and_supported_set(with_fa3):
    default = select(HOPPER, BF16_HD128, component="vae", default="sdpa_efficient")
    assert (default.backend, default.reason) == ("sdpa_efficient", "component default")
    unusable = select(CPU, FP32_HD64, component="vae", default="sdpa_cudnn")
    assert unusable.backend == "sdpa_flash" and unusable.source == "auto"
    assert unusable.rejected["sdpa_cudnn"].startswith("component default unusable: not available on cpu")
    limited = select(HOPPER, BF16_HD128, supported=["sdpa_math", "sdpa_efficient"])
    assert limited.backend == "sdpa_efficient"
    assert limited.rejected["fa3"] == "not in the component's supported set"
    with pytest.raises(ValueError, match="not registered"):
        select(CPU, FP32_HD64, supported=["flash9"])


def test_automatic_choice_never_fails_while_sdpa_math_exists():
    odd = Needs(torch.float64, 7, v_head_dim=3, layouts=("varlen", "paged"), causal=True, window=(5, 0),
                gqa=True, page_size=3)
    for platform in (HOPPER, SM103, AMPERE, MI355, MI300, CPU, Platform.cuda((7, 0))):
        assert select(platform, odd).backend == "sdpa_math"


# ---- observability ------------------------------------------------------------------------------
def test_choice_is_exported_logged_once_and_in_info(caplog):
    metrics = Metrics("vision_encoder", CollectorRegistry())
    selector = AttentionSelector("", platform=CPU, metrics=metrics)
    with caplog.at_level(logging.INFO, logger="modalmesh.attention.selector"):
        layers = [Attention(4, 16, component="vision_encoder", layouts=("varlen",), dtype=torch.float32,
                            selector=selector) for _ in range(3)]
    assert all(layer.backend_name == "sdpa_flash" for layer in layers)
    assert [r.message for r in caplog.records].count(
        f"attention vision_encoder -> sdpa_flash ({layers[0].selection.reason})") == 1
    labels = dict(service="vision_encoder", component="vision_encoder", backend="sdpa_flash",
                  reason=layers[0].selection.reason)
    assert metrics.registry.get_sample_value("modalmesh_attention_backend_info", labels) == 1

    info = pb.ServiceInfo(service="vision_encoder", attention=attention_choices(selector))
    choice = pb.ServiceInfo.FromString(info.SerializeToString()).attention[0]
    assert (choice.component, choice.backend) == ("vision_encoder", "sdpa_flash")
    assert choice.reason.startswith("auto: CPU")
    rejected = {r.backend: r.reason for r in choice.rejected}
    assert set(rejected) == set(registry.names()) - {"sdpa_flash"}
    assert rejected["fa3"].startswith("not available on cpu")


def test_unused_component_overrides_are_reported():
    selector = AttentionSelector("visoin_encoder=sdpa_math,llm=sdpa_math", platform=CPU,
                                 metrics=Metrics("t", CollectorRegistry()))
    selector.select("llm", FP32_HD64)
    assert selector.unused_overrides() == ["visoin_encoder"]


# ---- the process's selector ---------------------------------------------------------------------
def test_configure_installs_the_selector_layers_use_by_default(monkeypatch):
    import modalmesh.attention.selector as selector_module
    from modalmesh.attention import configure, current_selector

    monkeypatch.setattr(selector_module, "_CURRENT", None)
    with pytest.raises(ConfigError, match="unknown backend 'sdpa'"):
        configure("sdpa", platform=CPU)
    selector = configure("vae=sdpa-math", platform=CPU, metrics=Metrics("vae", CollectorRegistry()))
    assert current_selector() is selector
    assert Attention(1, 32, component="vae", dtype=torch.float32).backend_name == "sdpa_math"


def test_layers_built_on_the_meta_device_select_and_smoke_test_normally():
    from modalmesh.attention import detect_platform

    selector = AttentionSelector("", platform=detect_platform("cpu"), metrics=Metrics("t", CollectorRegistry()))
    with torch.device("meta"):  # how models are built before weights load
        attn = Attention(4, 32, component="llm", num_kv_heads=2, causal=True, window=[8, 0],
                         layouts=["varlen", "paged"], dtype=torch.float32, selector=selector)
    assert attn.backend_name == "sdpa_flash" and attn.needs.window == (8, 0)
