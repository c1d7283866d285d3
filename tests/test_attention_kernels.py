"""Kernel wrappers against faithful fake kernels, broken kernel packages, and smoke tests.

The fa2/fa3 wrappers cannot run their kernels here, so fake ``flash_attn`` /
``flash_attn_interface`` modules implement the documented semantics with
torch_naive and check the argument types the real kernels insist on (int32
cu_seqlens and page tables, contiguous last dims). The real kernels are covered
by the CUDA agreement tests in test_attention_backends.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from test_attention_backends import CASES, FP32, _page_multiple, make_inputs, run_backend

from modalmesh.attention import AttentionSelector, BackendSpec, Needs, Platform, Target, detect_platform, registry
from modalmesh.attention.backends.naive import NaiveBackend, reference_attention
from modalmesh.attention.capability import ALL_FEATURES, unmet
from modalmesh.attention.ranking import RankRule
from modalmesh.errors import ConfigError
from modalmesh.metrics import Metrics

HOPPER = Platform.cuda((9, 0))
REPO = Path(__file__).resolve().parents[1]


def _window(window_size):
    return None if tuple(window_size) == (-1, -1) else tuple(window_size)


def _check_int32(*tensors):
    for t in tensors:
        assert t.dtype == torch.int32, f"flash kernels take int32 index tensors, got {t.dtype}"


def _lens(cu):
    return (cu[1:] - cu[:-1]).tolist()


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_size, block_table=None, seqused_k=None):
    _check_int32(cu_q, cu_k)
    assert max_q == max(_lens(cu_q)) and max_k == max(_lens(cu_k))
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for b, (nq, nk) in enumerate(zip(_lens(cu_q), _lens(cu_k))):
        if block_table is not None:  # k/v are the page pool
            _check_int32(block_table)
            if seqused_k is not None:
                nk = seqused_k[b].item()
            pages = block_table[b, : math.ceil(nk / k.shape[1])].long()
            kb, vb = k[pages].flatten(0, 1)[:nk], v[pages].flatten(0, 1)[:nk]
        else:
            kb, vb = k[cu_k[b]:cu_k[b] + nk], v[cu_k[b]:cu_k[b] + nk]
        s = slice(cu_q[b].item(), cu_q[b].item() + nq)
        out[s] = reference_attention(q[s], kb, vb, causal=causal, scale=scale, window=_window(window_size))
    return out


def fake_fa3(name="flash_attn_interface", paged=True) -> types.ModuleType:
    m = types.ModuleType(name)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), **rest):
        assert q.stride(-1) == 1 and k.stride(-1) == 1
        out = reference_attention(q, k, v, causal=causal, scale=softmax_scale, window=_window(window_size))
        return out, torch.empty(0)  # older FA3 releases return (out, lse)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), **rest):
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), **rest):
        _check_int32(cache_seqlens)
        cu_k = torch.cat([cache_seqlens.new_zeros(1), cache_seqlens.cumsum(0).int()])
        return _varlen(q, k_cache, v_cache, cu_seqlens_q, cu_k, max_seqlen_q, int(cache_seqlens.max()),
                       softmax_scale, causal, window_size, block_table=page_table, seqused_k=cache_seqlens)

    m.flash_attn_func, m.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    if paged:
        m.flash_attn_with_kvcache = flash_attn_with_kvcache
    return m


def fake_fa2() -> types.ModuleType:
    m = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **rest):
        assert dropout_p == 0.0
        return reference_attention(q, k, v, causal=causal, scale=softmax_scale, window=_window(window_size))

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0
        return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size, block_table=block_table)

    m.flash_attn_func, m.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return m


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    for name in ("flash_attn_interface", "fa3_fwd_interface", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    registry.forget_probes()
    yield
    registry.forget_probes()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name, module, make", [("fa3", "flash_attn_interface", fake_fa3),
                                                 ("fa2", "flash_attn", fake_fa2)])
def test_flash_wrappers_pass_the_right_arguments(name, module, make, case, monkeypatch):
    monkeypatch.setitem(sys.modules, module, make())
    probe = registry.probe(name)
    assert probe.ok, probe.reason
    if case.layout == "paged":
        case = _page_multiple(case, probe.spec.page_size_multiple)
    why = unmet(probe.spec, case.needs(torch.bfloat16), HOPPER)
    if why:
        assert any(w.startswith(("head dim", "no v_head_dim")) for w in why), why  # the kernels' real limits
        return
    call, expected = make_inputs(case, "cpu", torch.float32)
    torch.testing.assert_close(run_backend(probe.backend, call), expected, **FP32)


def test_forward_only_fa3_wheel_is_narrowed(monkeypatch):
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", fake_fa3("fa3_fwd_interface", paged=False))
    probe = registry.probe("fa3")
    assert probe.ok and probe.backend.module_name == "fa3_fwd_interface"
    (target,) = probe.spec.targets
    assert target.dtypes == {torch.bfloat16} and "paged" not in target.features and "window" not in target.features
    assert registry.spec("fa3").targets[0].dtypes == {torch.bfloat16, torch.float16}  # the registration is unchanged


def test_forward_only_fa3_wheel_finds_its_config_when_called(monkeypatch):
    """fa3-fwd 0.0.3's interface imports ``flash_attn_config`` in every forward, but the wheel ships it as
    ``fa3_fwd_config``: each call raised ModuleNotFoundError until the probe aliased it."""
    interface = fake_fa3("fa3_fwd_interface", paged=False)
    dense = interface.flash_attn_func

    def flash_attn_func(q, k, v, **kw):
        from flash_attn_config import CONFIG  # as fa3_fwd_interface.round_up_headdim does

        assert not CONFIG["build_flags"]["FLASHATTENTION_DISABLE_HDIM64"]
        return dense(q, k, v, **kw)

    interface.flash_attn_func = flash_attn_func
    config = types.ModuleType("fa3_fwd_config")
    config.CONFIG = {"build_flags": {"FLASHATTENTION_DISABLE_HDIM64": False}}
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", interface)
    monkeypatch.setitem(sys.modules, "fa3_fwd_config", config)
    monkeypatch.delitem(sys.modules, "flash_attn_config", raising=False)
    try:
        probe = registry.probe("fa3")
        assert probe.ok, probe.reason
        q = torch.randn(1, 5, 2, 64)
        out = probe.backend.dense(q, q, q, causal=False, scale=0.125, window=None)
        torch.testing.assert_close(out, reference_attention(q, q, q, causal=False, scale=0.125, window=None),
                                   **FP32)
        assert sys.modules["flash_attn_config"] is config
    finally:
        sys.modules.pop("flash_attn_config", None)


# ---- broken kernel packages ------------------------------------------------------------------------
@pytest.mark.parametrize("name, module, body, reason", [
    ("fa2", "flash_attn", "raise OSError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')",
     "OSError: flash_attn_2_cuda.so: undefined symbol"),
    ("fa3", "flash_attn_interface", "import sys; sys.exit(1)", "flash_attn_interface: SystemExit: 1"),
    ("fa3", "flash_attn_interface", "flash_attn_func = None", "flash_attn_interface: AttributeError"),
])
def test_broken_kernel_package_is_recorded_not_raised(name, module, body, reason, tmp_path, monkeypatch):
    (tmp_path / f"{module}.py").write_text(body + "\n")
    monkeypatch.delitem(sys.modules, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = registry.probe(name)
    assert not probe.ok and reason in probe.reason
    assert registry.probe(name) is probe  # probed once, cached


def test_backend_with_a_missing_module_is_recorded():
    registry.register(BackendSpec("test_missing", "modalmesh.attention.backends.nope:Kernel",
                                  targets=(Target("cpu", frozenset({torch.float32}), ALL_FEATURES),)))
    try:
        probe = registry.probe("test_missing")
        assert not probe.ok and probe.reason.startswith("ModuleNotFoundError")
        with pytest.raises(ValueError, match="already registered"):
            registry.register(registry.spec("test_missing"))
    finally:
        registry.unregister("test_missing")


def test_importing_and_building_with_broken_kernels_installed(tmp_path):
    """A fresh process with broken flash packages on the path: import, build a layer, run it."""
    (tmp_path / "flash_attn_interface.py").write_text("raise RuntimeError('not compiled for sm103')\n")
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open')\n")
    script = textwrap.dedent("""
        import sys, torch
        import modalmesh.attention as attention
        assert not any(m.startswith(("flash_attn", "fa3")) for m in sys.modules), "a kernel was imported eagerly"
        attention.configure(None, device="cpu")  # as a service started with --device cpu does
        attn = attention.Attention(4, 64, component="llm", causal=True, dtype=torch.float32)
        q = torch.randn(1, 5, 4, 64)
        print(attn.backend_name, attn(q, q, q).shape[1], attention.registry.probe("fa2").reason)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "MODALMESH_ATTENTION_BACKEND": ""}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(maxsplit=2)[:2] == ["sdpa_flash", "5"]
    assert "libcudart.so.13" in result.stdout


# ---- smoke tests on real (detected) hardware ---------------------------------------------------------
class WrongResults(NaiveBackend):
    def dense(self, q, k, v, **kw):
        return torch.zeros_like(q)


class NoKernelImage(NaiveBackend):
    def dense(self, q, k, v, **kw):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


@pytest.fixture
def broken_backends():
    for name, cls in (("test_wrong", "WrongResults"), ("test_no_image", "NoKernelImage")):
        registry.register(BackendSpec(name, f"{__name__}:{cls}",
                                      targets=(Target("cpu", frozenset({torch.float32}), ALL_FEATURES),)))
    yield
    registry.unregister("test_wrong")
    registry.unregister("test_no_image")


def test_smoke_test_rejects_kernels_that_load_but_fail(broken_backends):
    rules = (RankRule("cpu", order=("test_wrong", "test_no_image", "sdpa_flash"), why="test"),)
    selector = AttentionSelector("", platform=detect_platform("cpu"), rules=rules,
                                 metrics=Metrics("t", CollectorRegistry()))
    assert selector.smoke
    choice = selector.select("llm", Needs(torch.float32, 16))
    assert choice.backend == "sdpa_flash"
    assert choice.rejected["test_wrong"].startswith("smoke test (dense): differs from torch_naive")
    assert choice.rejected["test_no_image"].startswith("smoke test failed: RuntimeError: CUDA error: no kernel image")
    with pytest.raises(ConfigError, match="test_wrong requested for llm.*smoke test"):
        AttentionSelector("test_wrong", platform=detect_platform("cpu")).select("llm", Needs(torch.float32, 16))


def test_smoke_test_passes_every_layout_of_the_real_cpu_kernels(monkeypatch):
    import modalmesh.attention.selector as selector_module

    ran = []
    real = selector_module.smoke_test
    monkeypatch.setattr(selector_module, "smoke_test", lambda *a: ran.append(a[0].name) or real(*a))
    selector = AttentionSelector("", platform=detect_platform("cpu"), metrics=Metrics("t", CollectorRegistry()))
    needs = Needs(torch.float32, 24, layouts=("dense", "varlen", "paged"), causal=True, window=(3, 0), gqa=True)
    assert selector.select("llm", needs).backend == "sdpa_flash"
    assert ran == ["sdpa_flash"]
