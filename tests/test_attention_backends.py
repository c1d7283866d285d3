"""Every backend agrees with torch_naive: FP32 on CPU, bf16 on CUDA (those need a GPU).

Expected values never come from the backend machinery under test: dense cases
call `reference_attention` directly, packed cases loop over sequences, paged
cases attend over the dense per-sequence k/v that were scattered into pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from modalmesh.attention import PagedMetadata, Platform, VarlenMetadata, registry, store_kv
from modalmesh.attention.backends.naive import reference_attention
from modalmesh.attention.capability import Needs, unmet

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


@dataclass(frozen=True)
class Case:
    id: str
    layout: str
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    v_head_dim: int | None = None
    causal: bool = False
    window: tuple[int, int] | None = None
    batch: int = 2  # dense
    s_q: int = 7  # dense
    s_k: int | None = None  # dense; None = s_q
    seqlens: tuple[int, ...] = ()  # varlen
    strategy: str | None = None  # varlen: SDPA layout
    query_lens: tuple[int, ...] = ()  # paged
    context_lens: tuple[int, ...] = ()  # paged
    page_size: int = 4

    def needs(self, dtype) -> Needs:
        offset = self.layout == "dense" and self.causal and (self.s_k or self.s_q) != self.s_q
        return Needs(dtype, self.head_dim, self.v_head_dim, (self.layout,), self.causal, self.window,
                     self.kv_heads != self.heads, self.page_size if self.layout == "paged" else None, offset)


CASES = [
    Case("dense-odd-hd13", "dense", head_dim=13),
    Case("dense-hd1", "dense", heads=2, kv_heads=2, head_dim=1, s_q=5),
    Case("dense-causal-gqa", "dense", heads=6, kv_heads=2, head_dim=8, causal=True, s_q=9),
    Case("dense-mqa-hd64", "dense", heads=4, kv_heads=1, head_dim=64, causal=True, s_q=33),
    Case("dense-window-odd", "dense", head_dim=5, window=(3, 1), s_q=11),
    Case("dense-causal-window", "dense", heads=4, kv_heads=1, head_dim=16, causal=True, window=(2, -1), s_q=10),
    Case("dense-window-left-only", "dense", head_dim=8, window=(-1, 2), s_q=8),
    Case("dense-v-head-dim", "dense", head_dim=12, v_head_dim=7, causal=True),
    Case("dense-sq-lt-sk-causal", "dense", head_dim=8, causal=True, s_q=3, s_k=8),
    Case("dense-hd128", "dense", heads=2, kv_heads=2, head_dim=128, causal=True, s_q=17, batch=1),
    Case("dense-hd512-gqa-sq-ne-sk", "dense", heads=4, kv_heads=2, head_dim=512, s_q=9, s_k=23),  # the VAE's dim
    Case("varlen-unequal-causal", "varlen", seqlens=(5, 1, 3), causal=True),
    Case("varlen-single-token", "varlen", seqlens=(1,), head_dim=8),
    Case("varlen-padded-gqa", "varlen", heads=6, kv_heads=3, head_dim=24, seqlens=(4, 4, 4), strategy="padded"),
    Case("varlen-blockdiag-gqa", "varlen", heads=6, kv_heads=3, head_dim=24, seqlens=(4, 4, 4), strategy="block_diag"),
    Case("varlen-window-long-short", "varlen", head_dim=8, seqlens=(9, 1, 1, 1, 1), window=(2, 2)),
    Case("varlen-window-padded", "varlen", head_dim=8, seqlens=(9, 1, 2), window=(2, 2), strategy="padded"),
    Case("varlen-empty-sequence", "varlen", head_dim=9, seqlens=(3, 0, 2), causal=True, strategy="padded"),
    Case("varlen-v-head-dim", "varlen", head_dim=8, v_head_dim=20, seqlens=(2, 5)),
    Case("paged-prefill-no-prefix", "paged", heads=4, kv_heads=2, query_lens=(5, 3), context_lens=(5, 3), causal=True),
    Case("paged-prefill-prefix", "paged", heads=4, kv_heads=2, query_lens=(3, 2), context_lens=(9, 6), causal=True),
    Case("paged-decode", "paged", heads=4, kv_heads=1, query_lens=(1, 1, 1), context_lens=(7, 1, 13), causal=True),
    Case("paged-mixed-page1", "paged", query_lens=(1, 4), context_lens=(5, 6), causal=True, page_size=1),
    Case("paged-window-page16", "paged", head_dim=32, query_lens=(2, 1), context_lens=(20, 17), causal=True,
         window=(4, 0), page_size=16),
    Case("paged-odd-hd", "paged", head_dim=11, query_lens=(2,), context_lens=(6,), causal=True),
    # continuous batching: decode rows, a new prompt and a chunk continuing its prefix in one step
    Case("paged-mixed-continuous", "paged", heads=6, kv_heads=2, head_dim=32, query_lens=(1, 5, 1, 3),
         context_lens=(9, 5, 4, 11), causal=True),
    Case("paged-mixed-window", "paged", heads=4, kv_heads=2, head_dim=16, query_lens=(1, 6, 2),
         context_lens=(12, 6, 9), causal=True, window=(3, 0)),
]


def _seed(case: Case) -> int:
    return sum(map(ord, case.id))


def make_inputs(case: Case, device, dtype):
    """(call args for the backend, expected output) for one case."""
    gen = torch.Generator().manual_seed(_seed(case))
    dv = case.v_head_dim or case.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    kw = dict(causal=case.causal, scale=case.head_dim**-0.5, window=case.window)
    if case.layout == "dense":
        s_k = case.s_k or case.s_q
        q, k, v = rand(case.batch, case.s_q, case.heads, case.head_dim), rand(
            case.batch, s_k, case.kv_heads, case.head_dim), rand(case.batch, s_k, case.kv_heads, dv)
        return ("dense", (q, k, v), kw), reference_attention(q, k, v, **kw)
    if case.layout == "varlen":
        meta = VarlenMetadata.from_seqlens(case.seqlens, device, sdpa_strategy=case.strategy)
        total = sum(case.seqlens)
        q, k, v = rand(total, case.heads, case.head_dim), rand(total, case.kv_heads, case.head_dim), rand(
            total, case.kv_heads, dv)
        parts, start = [], 0
        for n in case.seqlens:
            s = slice(start, start + n)
            parts.append(reference_attention(q[s], k[s], v[s], **kw))
            start += n
        return ("varlen", (q, k, v, meta), kw), torch.cat(parts)
    return _paged_inputs(case, rand, device, dtype, kw)


def _paged_inputs(case, rand, device, dtype, kw):
    page, dv = case.page_size, case.v_head_dim or case.head_dim
    pages_per_seq = [math.ceil(c / page) for c in case.context_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages stay random: reading one is a bug the test sees
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(7)).tolist()  # pages out of order
    table = torch.zeros(len(case.context_lens), max(pages_per_seq), dtype=torch.int32)
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    k_cache = rand(num_pages, page, case.kv_heads, case.head_dim)
    v_cache = rand(num_pages, page, case.kv_heads, dv)
    # Dense history per sequence; the prefix goes into the pool by hand, the new tokens via store_kv.
    ks = [rand(c, case.kv_heads, case.head_dim) for c in case.context_lens]
    vs = [rand(c, case.kv_heads, dv) for c in case.context_lens]
    for b, c in enumerate(case.context_lens):
        for pos in range(c - case.query_lens[b]):
            slot_page, offset = table[b, pos // page].item(), pos % page
            k_cache[slot_page, offset], v_cache[slot_page, offset] = ks[b][pos], vs[b][pos]
    meta = PagedMetadata.build(case.query_lens, case.context_lens, table.to(device), page)
    new_k = torch.cat([ks[b][c - n:] for b, (n, c) in enumerate(zip(case.query_lens, case.context_lens))])
    new_v = torch.cat([vs[b][c - n:] for b, (n, c) in enumerate(zip(case.query_lens, case.context_lens))])
    store_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    q = rand(sum(case.query_lens), case.heads, case.head_dim)
    parts, start = [], 0
    for b, n in enumerate(case.query_lens):
        parts.append(reference_attention(q[start:start + n], ks[b], vs[b], **kw))
        start += n
    return ("paged", (q, k_cache, v_cache, meta), kw), torch.cat(parts)


def run_backend(backend, call):
    layout, args, kw = call
    return getattr(backend, layout)(*args, **kw)


# ---- CPU, FP32 -------------------------------------------------------------------------------
CPU = Platform.cpu()
CPU_BACKENDS = ("sdpa_flash", "sdpa_math", "torch_naive")


def test_cpu_backend_set_is_what_the_agreement_tests_cover():
    usable = [n for n in registry.names()
              if registry.spec(n).targets_for(CPU)[0] and registry.probe(n).ok]
    assert usable == list(CPU_BACKENDS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cpu_fp32_agrees_with_naive(name, case):
    probe = registry.probe(name)
    why = unmet(probe.spec, case.needs(torch.float32), CPU)
    if why:  # declared unsupported: the selector never routes this case here
        assert name == "sdpa_flash" and case.v_head_dim, why  # the only gap on CPU
        return
    call, expected = make_inputs(case, "cpu", torch.float32)
    out = run_backend(probe.backend, call)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **FP32)


def test_reference_matches_hand_computed_softmax():
    """The oracle itself, against scalar Python: causal, window, GQA head mapping, scale."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, 3, generator=gen), torch.randn(5, 2, 3, generator=gen), torch.randn(
        5, 2, 2, generator=gen)
    scale, window = 0.7, (2, 0)
    out = reference_attention(q.double(), k.double(), v.double(), causal=True, scale=scale, window=window)
    for i in range(5):
        for h in range(4):
            g = h // 2  # kv head g serves q heads 2g, 2g+1
            keys = [j for j in range(5) if j <= i and j >= i - 2]
            logits = [scale * sum(q[i, h, d].item() * k[j, g, d].item() for d in range(3)) for j in keys]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            want = [sum(w * v[j, g, e].item() for w, j in zip(weights, keys)) / sum(weights) for e in range(2)]
            assert out[i, h].tolist() == pytest.approx(want, abs=1e-12)


def test_reference_single_key_returns_value_and_masked_row_is_zero():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 3)
    torch.testing.assert_close(reference_attention(q, k, v, causal=False, scale=1.0, window=None), v)
    # Query before every key (S_q > S_k, bottom-right causal): nothing visible -> zeros, not NaN.
    q2, k2, v2 = torch.randn(3, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out = reference_attention(q2, k2, v2, causal=True, scale=1.0, window=None)
    assert torch.equal(out[:2], torch.zeros(2, 1, 4)) and torch.allclose(out[2], v2[0])


# matmul_chunked runs on CUDA only (half-precision products with float32 output); its blocking and math are
# the same on CPU, where the products run in float32 and the softmax is PyTorch's (or, under TRITON_INTERPRET,
# the kernel's): bf16 inputs against the float32 oracle of the same bf16 values.
@pytest.mark.parametrize("workspace,steps", [(None, (8, 40)), (420 * 120, (3, 40)), (420 * 16, (1, 16))],
                         ids=["whole", "heads-per-step", "query-blocks"])
def test_matmul_chunked_agrees_with_naive_in_every_blocking(monkeypatch, workspace, steps):
    from modalmesh.attention.backends import chunked_matmul

    if workspace is not None:
        monkeypatch.setattr(chunked_matmul, "WORKSPACE_BYTES", workspace)
    # 2 x 4 heads of 40 queries over 70 keys, 2 bytes a probability and 4 a score: 420 bytes per query
    assert chunked_matmul.blocks(8, 40, 70, 2) == steps
    case = Case("chunked", "dense", heads=4, kv_heads=2, head_dim=64, batch=2, s_q=40, s_k=70)
    call, _ = make_inputs(case, "cpu", torch.bfloat16)
    q, k, v = call[1]
    expected = reference_attention(q.float(), k.float(), v.float(), causal=False, scale=0.125, window=None)
    out = registry.probe("matmul_chunked").backend.dense(q, k, v, causal=False, scale=0.125, window=None)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, **BF16)


def test_matmul_chunked_refuses_masks():
    backend = registry.probe("matmul_chunked").backend
    q = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16)
    for kw in (dict(causal=True, window=None), dict(causal=False, window=(2, 2))):
        with pytest.raises(ValueError, match="takes no mask"):
            backend.dense(q, q, q, scale=1.0, **kw)


# ---- CUDA, bf16 (run on the H200 through the device tool) ------------------------------------------
# Kernels outside the install (the `flash` extra, the carried FA3 wheel): the only backends that may be
# missing on a CUDA machine, and only because their package is not installed.
OPTIONAL_WHEELS = {"fa2", "fa3"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_bf16_every_backend_agrees_with_naive(case):
    from modalmesh.attention import detect_platform

    platform = detect_platform("cuda")
    ran, gaps = [], {}
    for name in registry.names():
        probe = registry.probe(name)
        if not probe.ok:
            assert name in OPTIONAL_WHEELS and probe.reason.startswith(("ImportError", "ModuleNotFoundError")), (
                f"{name} failed to load on {platform.describe()}: {probe.reason}")
            continue
        this = case if case.layout != "paged" else _page_multiple(case, probe.spec.page_size_multiple)
        why = unmet(probe.spec, this.needs(torch.bfloat16), platform)
        if why:  # declared unsupported: the selector never routes this case here
            gaps[name] = why
            continue
        call, _ = make_inputs(this, "cuda", torch.bfloat16)
        # Oracle in FP32 from the same bf16-rounded inputs.
        ref_call = (call[0], tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                   for a in call[1]), call[2])
        expected = run_backend(registry.probe("torch_naive").backend, ref_call)
        out = run_backend(probe.backend, call)
        assert out.dtype == torch.bfloat16, name
        torch.testing.assert_close(out.float(), expected, **BF16, msg=lambda m, n=name: f"{n}: {m}")
        ran.append(name)
    assert "torch_naive" in ran and len(ran) > 1, (ran, gaps)


def _page_multiple(case: Case, multiple: int) -> Case:
    from dataclasses import replace

    return case if case.page_size % multiple == 0 else replace(case, page_size=multiple)
