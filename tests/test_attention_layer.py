"""The Attention layer: dense, packed and paged calls, rotary hook, shared metadata, per-call routing."""

from __future__ import annotations

import sys

import pytest
import torch
from prometheus_client import CollectorRegistry

from modalmesh.attention import (
    Attention,
    AttentionSelector,
    BackendSpec,
    PagedMetadata,
    Platform,
    Target,
    VarlenMetadata,
    attention_metadata,
    masks,
    registry,
)
from modalmesh.attention.backends.naive import NaiveBackend, reference_attention
from modalmesh.attention.capability import ALL_FEATURES, CAUSAL
from modalmesh.metrics import Metrics

FP32 = dict(atol=1e-5, rtol=1e-5)
GEN = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def cpu_selector(spec: str = "") -> AttentionSelector:
    return AttentionSelector(spec, platform=Platform.cpu(), metrics=Metrics("test", CollectorRegistry()))


def fallbacks(selector, **labels) -> float:
    value = selector.metrics.registry.get_sample_value(
        "modalmesh_attention_fallback_total", {"service": "test", **labels})
    return value or 0.0


# ---- the three layouts --------------------------------------------------------------------------
def test_dense_call():
    attn = Attention(6, 10, num_kv_heads=3, component="audio_encoder", causal=True, window=(4, 0),
                     dtype=torch.float32, selector=cpu_selector())
    q, k, v = rand(2, 9, 6, 10), rand(2, 9, 3, 10), rand(2, 9, 3, 10)
    torch.testing.assert_close(attn(q, k, v), reference_attention(q, k, v, causal=True, scale=10**-0.5,
                                                                   window=(4, 0)), **FP32)


def test_packed_call_through_the_forward_context_builds_masks_once(monkeypatch):
    selector = cpu_selector("vision_encoder=sdpa_math")
    layers = [Attention(4, 8, component="vision_encoder", layouts=("varlen",), dtype=torch.float32,
                        selector=selector, scale=0.3) for _ in range(3)]
    lens = (5, 1, 3, 1)
    meta = VarlenMetadata.from_seqlens(lens, sdpa_strategy="block_diag")
    q, k, v = rand(10, 4, 8), rand(10, 4, 8), rand(10, 4, 8)
    calls = []
    real_allowed = masks.allowed
    monkeypatch.setattr(masks, "allowed", lambda *a: calls.append(1) or real_allowed(*a))
    with attention_metadata(meta):
        outs = [layer(q, k, v) for layer in layers]
    assert len(calls) == 1  # one mask for the whole forward, not one per layer
    expected = torch.cat([reference_attention(q[s:e], k[s:e], v[s:e], causal=False, scale=0.3, window=None)
                          for s, e in zip((0, 5, 6, 9), (5, 6, 9, 10))])
    for out in outs:
        torch.testing.assert_close(out, expected, **FP32)


def test_paged_prefill_then_decode_matches_full_causal_attention():
    """An LLM-style loop: prefill two prompts into 4-token pages, then decode three steps."""
    heads, kv_heads, dim, page = 4, 2, 8, 4
    attn = Attention(heads, dim, num_kv_heads=kv_heads, component="llm", causal=True, layouts=("paged",),
                     page_size=page, dtype=torch.float32, selector=cpu_selector())
    k_cache, v_cache = torch.zeros(10, page, kv_heads, dim), torch.zeros(10, page, kv_heads, dim)
    table = torch.tensor([[7, 2, 9], [0, 5, 3]], dtype=torch.int32)
    prompt = (6, 3)
    total = [n + 3 for n in prompt]
    qs = [rand(n, heads, dim) for n in total]
    ks = [rand(n, kv_heads, dim) for n in total]
    vs = [rand(n, kv_heads, dim) for n in total]
    outs = [[], []]
    meta = PagedMetadata.build(prompt, prompt, table, page)
    out = attn(torch.cat([qs[0][:6], qs[1][:3]]), torch.cat([ks[0][:6], ks[1][:3]]),
               torch.cat([vs[0][:6], vs[1][:3]]), meta, kv_cache=(k_cache, v_cache))
    outs[0].append(out[:6]), outs[1].append(out[6:])
    for step in range(3):
        pos = [n + step for n in prompt]
        meta = PagedMetadata.decode([p + 1 for p in pos], table, page)
        out = attn(torch.stack([qs[0][pos[0]], qs[1][pos[1]]]), torch.stack([ks[0][pos[0]], ks[1][pos[1]]]),
                   torch.stack([vs[0][pos[0]], vs[1][pos[1]]]), meta, kv_cache=(k_cache, v_cache))
        outs[0].append(out[:1]), outs[1].append(out[1:])
    for b in range(2):
        want = reference_attention(qs[b], ks[b], vs[b], causal=True, scale=dim**-0.5, window=None)
        torch.testing.assert_close(torch.cat(outs[b]), want, **FP32)


def test_empty_packed_batch():
    attn = Attention(2, 4, component="vision_encoder", layouts=("varlen",), dtype=torch.float32,
                     selector=cpu_selector())
    out = attn(rand(0, 2, 4), rand(0, 2, 4), rand(0, 2, 4), VarlenMetadata.from_seqlens([0]))
    assert out.shape == (0, 2, 4)


@pytest.mark.parametrize("call, message", [
    (lambda a: a(rand(2, 3, 4, 8), rand(2, 3, 2, 8), rand(2, 3, 2, 8)), "wants q"),
    (lambda a: a(rand(2, 3, 2, 8), rand(2, 3, 1, 8), rand(2, 3, 2, 8)), "do not match"),
    (lambda a: a(rand(4, 2, 8), rand(4, 2, 8), rand(4, 2, 8), VarlenMetadata.from_seqlens([2, 1])), "hold 4/4 tokens"),
    (lambda a: a(rand(1, 2, 8), rand(1, 2, 8), rand(1, 2, 8), PagedMetadata.decode([1], torch.zeros(1, 1), 4)),
     "needs kv_cache"),
])
def test_shape_errors(call, message):
    attn = Attention(2, 8, component="llm", layouts=("dense", "varlen", "paged"), dtype=torch.float32,
                     selector=cpu_selector())
    with pytest.raises(ValueError, match=message):
        call(attn)


# ---- per-call routing -----------------------------------------------------------------------------
class Bf16Only(NaiveBackend):
    """A fused-kernel stand-in that, like flash/cuDNN on a GPU, rejects anything but bf16."""

    def dense(self, q, k, v, **kw):
        assert q.dtype == torch.bfloat16, f"a bf16-only kernel was given {q.dtype}"
        return super().dense(q, k, v, **kw)


@pytest.fixture
def test_backends():
    module = sys.modules[__name__].__name__
    registry.register(BackendSpec("test_bf16_only", f"{module}:Bf16Only", cast_dtype=torch.bfloat16,
                                  targets=(Target("cpu", frozenset({torch.bfloat16}), ALL_FEATURES),)))
    registry.register(BackendSpec("test_dense_causal_only", f"{module}:NaiveBackend",
                                  targets=(Target("cpu", frozenset({torch.float32}), frozenset({CAUSAL})),)))
    yield
    registry.unregister("test_bf16_only")
    registry.unregister("test_dense_causal_only")


def test_fp32_call_to_a_global_bf16_only_override_is_rerouted_and_counted(test_backends):
    selector = cpu_selector("test_bf16_only")
    attn = Attention(2, 8, component="vae", dtype=torch.bfloat16, selector=selector)
    assert attn.backend_name == "test_bf16_only"
    q, k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    assert attn(q.bfloat16(), k.bfloat16(), v.bfloat16()).dtype == torch.bfloat16  # its own dtype: no reroute
    labels = {"component": "vae", "from": "test_bf16_only", "to": "sdpa_flash", "reason": "dtype float32"}
    assert fallbacks(selector, **labels) == 0
    for n in (1, 2):
        out = attn(q, k, v)
        assert fallbacks(selector, **labels) == n
    # Computed in FP32 (a bf16 detour would miss this tolerance by orders of magnitude).
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=False, scale=8**-0.5, window=None), **FP32)


def test_fp32_call_to_a_component_bf16_only_override_is_cast_not_rerouted(test_backends):
    selector = cpu_selector("vae=test_bf16_only")
    attn = Attention(2, 8, component="vae", dtype=torch.float32, selector=selector)
    assert attn.selection.cast_dtype == torch.bfloat16
    q, k, v = rand(1, 5, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8)
    out = attn(q, k, v)
    assert out.dtype == torch.float32
    want = reference_attention(q, k, v, causal=False, scale=8**-0.5, window=None)
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
    assert (out - want).abs().max() > 1e-4  # it really went through bf16
    assert fallbacks(selector, component="vae", **{"from": "test_bf16_only", "to": "sdpa_flash",
                                                   "reason": "dtype float32"}) == 0


def test_calls_outside_the_declared_layout_or_shape_are_rerouted(test_backends):
    selector = cpu_selector("llm=test_dense_causal_only")
    attn = Attention(2, 8, component="llm", causal=True, dtype=torch.float32, selector=selector)
    q, k, v = rand(7, 2, 8), rand(7, 2, 8), rand(7, 2, 8)
    meta = VarlenMetadata.from_seqlens([4, 3])
    out = attn(q, k, v, meta)
    assert fallbacks(selector, component="llm", **{"from": "test_dense_causal_only", "to": "sdpa_flash",
                                                   "reason": "layout varlen"}) == 1
    torch.testing.assert_close(out[4:], reference_attention(q[4:], k[4:], v[4:], causal=True, scale=8**-0.5,
                                                            window=None), **FP32)
    # Dense causal with fewer queries than keys needs bottom-right alignment this backend lacks.
    attn(rand(1, 2, 2, 8), rand(1, 5, 2, 8), rand(1, 5, 2, 8))
    assert fallbacks(selector, component="llm", **{"from": "test_dense_causal_only", "to": "sdpa_flash",
                                                   "reason": "causal offset"}) == 1


def test_cpu_tensors_under_a_gpu_selection_are_rerouted(monkeypatch):
    from test_attention_selection import _kernel_module

    monkeypatch.setitem(sys.modules, "flash_attn_interface", _kernel_module("flash_attn_interface"))
    registry.forget_probes()
    try:
        selector = AttentionSelector("", platform=Platform.cuda((9, 0)), metrics=Metrics("test", CollectorRegistry()))
        attn = Attention(2, 128, component="llm", dtype=torch.bfloat16, selector=selector)
        assert attn.backend_name == "fa3"
        q = rand(1, 3, 2, 128, dtype=torch.bfloat16)
        attn(q, q, q)  # the fake fa3 raises if called
        assert fallbacks(selector, component="llm", **{"from": "fa3", "to": "sdpa_flash", "reason": "device cpu"}) == 1
    finally:
        registry.forget_probes()
