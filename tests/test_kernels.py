"""The fused Triton kernels (modalmesh.kernels) equal the unfused PyTorch path they replace.

Each kernel is checked through the layer that calls it, against the same layer
built without it: RMSNorm and LayerNorm (with and without the residual add),
GatedMLP's SiLU * up, MLP's quick GELU (and, on CUDA, its tanh GELU in the GEMM
epilogue), RoPE + the paged KV write (the rotated q, and every slot of the
pool afterwards), and GroupNorm (+ SiLU) in NCHW and channels-last, alone and
through the VAE decoder. float32 must agree to float32 rounding; bfloat16 to one
rounding of the activation dtype.

They run on CUDA (the device machine). Without a GPU they run only under
Triton's interpreter (``TRITON_INTERPRET=1`` with Triton installed), which is
how they are debugged on a CPU host; CI has neither and skips them.
"""

import contextlib
import os

import pytest
import torch

from modalmesh import kernels
from modalmesh.attention.paged import store_kv
from modalmesh.kernels import norm as norm_kernels
from modalmesh.layers import MLP, GatedMLP, GroupNorm, LayerNorm, RMSNorm
from modalmesh.layers.rotary import RotaryEmbedding
from modalmesh.testing.precision import ieee_fp32_convolutions

DEVICES = []
if kernels.triton_importable() and torch.cuda.is_available():
    DEVICES.append("cuda")
if kernels.triton_importable() and os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES.append("cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _exact(device, dtype):
    """Equal bits: what one float32 -> dtype rounding gives on CUDA. Triton's interpreter truncates
    float32 -> bfloat16 instead of rounding to nearest, so on the CPU allow that one ulp."""
    return dict(atol=0, rtol=0) if device == "cuda" or dtype == torch.float32 else TOL[dtype]
# Without a device the parametrised tests are reported as skipped (empty parameter set).


def _pair(make, device, dtype):
    """The same layer twice, unfused and fused, with equal random weights."""
    torch.manual_seed(0)
    ref, fused = make(False), make(True)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    fused.load_state_dict(ref.state_dict())
    return ref.to(device, dtype), fused.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_equals_the_pytorch_path(device, dtype, hidden, with_residual, monkeypatch):
    ref, fused = _pair(lambda f: RMSNorm(hidden, 1e-6, fused=f), device, dtype)
    x = torch.randn(7, hidden, device=device, dtype=dtype) * 3
    _assert_norms_agree(ref, fused, x, with_residual, _count_kernel_calls(monkeypatch), "rms_norm")


def _assert_norms_agree(ref, fused, x: torch.Tensor, with_residual: bool, calls: dict, kernel: str) -> None:
    residual = torch.randn_like(x) if with_residual else None
    with torch.inference_mode():
        want = ref(x, residual)
        assert not calls
        got = fused(x, residual)
    assert calls == {kernel: 1}  # the kernel did run
    if with_residual:
        torch.testing.assert_close(got[1], want[1], **_exact(x.device.type, x.dtype))  # the sum, rounded alike
        want, got = want[0], got[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[x.dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80, 1152])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_kernel_equals_the_pytorch_path(device, dtype, hidden, with_residual, bias, monkeypatch):
    ref, fused = _pair(lambda f: LayerNorm(hidden, 1e-6, bias=bias, fused=f), device, dtype)
    x = torch.randn(7, hidden, device=device, dtype=dtype) * 3 + 1.5  # a mean the centring must remove
    _assert_norms_agree(ref, fused, x, with_residual, _count_kernel_calls(monkeypatch), "layer_norm")


def test_layer_norm_kernel_takes_only_rows_it_can_read_whole():
    from modalmesh.kernels import layer_norm

    x, w = torch.randn(4, 6, 32), torch.ones(32)
    assert layer_norm.fusable(x, None, w, None) and layer_norm.fusable(x, torch.randn(4, 6, 32), w, w)
    assert not layer_norm.fusable(x.transpose(1, 2), None, w, None)  # columns strided
    assert not layer_norm.fusable(x, torch.randn(1, 6, 32), w, None)  # a broadcast residual is not a stream
    assert not layer_norm.fusable(torch.randn(2, 16384), None, torch.ones(16384), None)  # past one program
    # mixed dtypes: PyTorch's add promotes and F.layer_norm returns x's dtype, where the kernel would not
    assert not layer_norm.fusable(x.bfloat16(), torch.randn(4, 6, 32), w.bfloat16(), None)
    assert not layer_norm.fusable(x.bfloat16(), None, w, None)
    assert not layer_norm.fusable(x.bfloat16(), None, w.bfloat16(), w)


def test_rms_norm_kernel_takes_only_a_residual_of_the_rows_own_shape_and_dtype():
    """The kernel reads the residual row by row and rounds the sum to x's dtype: a broadcast residual was
    read past its end (the sum off by 1e35), and a float32 one rounded where PyTorch's add promotes."""
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    assert norm_kernels.fusable(x, None) and norm_kernels.fusable(x, torch.randn_like(x))
    assert not norm_kernels.fusable(x, torch.randn(64, dtype=torch.bfloat16))
    assert not norm_kernels.fusable(x, torch.randn(6, 64))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_with_a_float32_residual_takes_the_pytorch_path(device, monkeypatch):
    """(LayerNorm's mixed dtypes are an error in PyTorch's CUDA path, so only its `fusable` is tested.)"""
    calls = _count_kernel_calls(monkeypatch)
    x = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        _, total = RMSNorm(64, fused=True).to(device, torch.bfloat16)(x, torch.randn(5, 64, device=device))
    assert not calls and total.dtype == torch.float32  # PyTorch's add promotes; the kernel would round


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quick_gelu_kernel_equals_the_pytorch_path(device, dtype, monkeypatch):
    ref, fused = _pair(lambda f: MLP(40, 1100, "quick_gelu", fused=f, tp_rank=0, tp_size=1), device, dtype)
    x = torch.randn(9, 40, device=device, dtype=dtype)
    calls = _count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        want = ref(x)
        assert not calls
        torch.testing.assert_close(fused(x), want, atol=TOL[dtype]["atol"] * float(want.abs().max()), rtol=0)
        assert calls == {"quick_gelu": 1}  # the kernel did run
        # the activation alone, with the PyTorch path's three roundings (sigmoids differing in float32 ulps)
        from modalmesh.kernels.activation import quick_gelu
        h = ref.fc1(x) * 4
        torch.testing.assert_close(quick_gelu(h), h * torch.sigmoid(1.702 * h), **TOL[dtype])


@pytest.mark.skipif("cuda" not in DEVICES, reason="the tanh GELU epilogue is cuBLASLt's (on the CPU the op is erf)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_tanh_gelu_in_the_gemm_epilogue_equals_the_pytorch_path(dtype, monkeypatch):
    from modalmesh.layers import mlp

    calls = []
    monkeypatch.setattr(mlp, "linear_gelu_tanh", lambda *a, _f=mlp.linear_gelu_tanh: calls.append(1) or _f(*a))
    ref, fused = _pair(lambda f: MLP(1152, 4304, "gelu_pytorch_tanh", fused=f, tp_rank=0, tp_size=1), "cuda", dtype)
    x = torch.randn(3, 729, 1152, device="cuda", dtype=dtype)
    with torch.inference_mode():
        h = ref.fc1(x)
        want_h = torch.nn.functional.gelu(h.float(), approximate="tanh")  # before the activation's rounding
        got_h = mlp.linear_gelu_tanh(fused.fc1, x)
        want, got = ref(x), fused(x)
    assert len(calls) == 2  # the forward took the epilogue
    # the epilogue rounds once (GEMM + bias + GELU in float32); PyTorch rounds the GEMM's output first
    torch.testing.assert_close(got_h.float(), want_h, atol=TOL[dtype]["atol"] * float(want_h.abs().max()), rtol=0)
    torch.testing.assert_close(got, want, atol=TOL[dtype]["atol"] * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_of_heads_in_a_strided_view_falls_back_or_fuses_correctly(device):
    """Qwen3's per-head q/k norm runs on a (T, H, D) view into the qkv projection's output."""
    ref, fused = _pair(lambda f: RMSNorm(32, 1e-6, fused=f), device, torch.float32)
    qkv = torch.randn(5, 6 * 32, device=device)
    q = qkv[:, :4 * 32].view(5, 4, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fused(q), ref(q), **TOL[torch.float32])
        torch.testing.assert_close(fused(q.contiguous()), ref(q), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [48, 1100])
def test_silu_and_mul_kernel_equals_the_pytorch_path(device, dtype, intermediate):
    ref, fused = _pair(lambda f: GatedMLP(40, intermediate, "silu", fused=f, tp_rank=0, tp_size=1), device, dtype)
    assert fused.fused and not ref.fused
    x = torch.randn(9, 40, device=device, dtype=dtype)
    with torch.inference_mode():
        want = ref(x)
        # down_proj sums rows of the activation: one ulp of a term, relative to the largest output
        torch.testing.assert_close(fused(x), want, atol=TOL[dtype]["atol"] * float(want.abs().max()), rtol=0)
        # the activation alone, on the gate|up projection: one rounding of the dtype at most
        gate_up = fused.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        from modalmesh.kernels.activation import silu_and_mul
        torch.testing.assert_close(silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, **TOL[dtype])


GROUP_NORM_CASES = [  # (N, C, H, W, groups): channels per group 4 / 3 (not a power of two) / 16 / 1
    (2, 32, 9, 7, 8), (1, 12, 33, 65, 4), (1, 64, 40, 40, 4), (3, 6, 1, 5, 6),
    (1, 8, 64, 64, 2),  # 4,096 pixels: several chunks per group in both layouts, merged by group_moments
    (2, 8, 1, 1, 4),  # one pixel (a 1x1 latent): Triton compiles an int argument of 1 as a constant
    (1, 320, 5, 7, 32),  # channels-last in two channel blocks (256 + 64) whose groups of 10 straddle them
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("case", GROUP_NORM_CASES, ids=lambda c: "x".join(map(str, c)))
def test_group_norm_kernel_equals_the_pytorch_path(device, dtype, layout, silu, case):
    _check_group_norm(device, dtype, layout, silu, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", GROUP_NORM_CASES[1::3], ids=lambda c: "x".join(map(str, c)))
def test_group_norm_kernel_merges_tiles_within_a_program(device, layout, case, monkeypatch):
    """One stats program per channel block, walking every tile of the pixels (what a 1024² image does with
    many tiles per chunk); the cases above have a tile per chunk at these sizes."""
    from modalmesh.kernels import group_norm as gn

    monkeypatch.setattr(gn, "DEFAULT", gn.LaunchConfig(programs=1))
    _check_group_norm(device, torch.float32, layout, True, case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", GROUP_NORM_CASES[::3], ids=lambda c: "x".join(map(str, c)))
def test_group_norm_apply_walks_several_tiles_per_program(device, layout, case, monkeypatch):
    """Three apply tiles per program (the last program's may lie past the pixels' end), four warps."""
    from modalmesh.kernels import group_norm as gn

    monkeypatch.setattr(gn, "DEFAULT", gn.LaunchConfig(apply_tile=64, apply_tiles=3, apply_warps=4))
    calls = []
    real = gn._kernels()[2]

    class Spy:  # the launch's grid and its TILES, then the real kernel
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((grid, kw["TILES"]))
                return real[grid](*args, **kw)
            return launch

    kernels = gn._kernels()
    monkeypatch.setattr(gn, "_kernels", lambda: (*kernels[:2], Spy()))
    _check_group_norm(device, torch.float32, layout, True, case)
    n, c, h, w, _ = case
    block_s, block_c = gn._tile(1 if layout == "channels_last" else h * w, c, 64, gn.DEFAULT.apply_block_c)
    tiles = min(3, -(-(h * w) // block_s))
    assert calls == [((-(-(h * w) // (block_s * tiles)), n, -(-c // block_c)), tiles)], calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_group_norm_kernel_skips_tiles_past_the_end_of_the_last_chunk(device, layout, monkeypatch):
    """Six programs over 4,096 pixels: chunks of three tiles, so the last chunk walks a tile with no pixels,
    which must add nothing to the moments."""
    from modalmesh.kernels import group_norm as gn

    monkeypatch.setattr(gn, "DEFAULT", gn.LaunchConfig(programs=6))
    case = (1, 8, 64, 64, 2)
    stride_c = 1 if layout == "channels_last" else 64 * 64
    block_s, _, chunks, iters = gn.plan(1, 8, 64 * 64, stride_c, gn.DEFAULT)
    assert chunks * iters > -(-64 * 64 // block_s)  # the case does reach past the end
    _check_group_norm(device, torch.float32, layout, True, case)


def test_group_norm_kernel_takes_only_what_group_norm_defines():
    """Checked before any kernel runs (no GPU needed): anything else goes to F.group_norm, which raises its
    own error for shapes it refuses instead of the kernel reading out of bounds."""
    from modalmesh.kernels import group_norm as gn

    x = torch.randn(2, 8, 3, 3)
    w, b = torch.ones(8), torch.zeros(8)
    assert gn.fusable(x, 4, w, b) and gn.fusable(x.contiguous(memory_format=torch.channels_last), 4, w, b)
    assert gn.fusable(x.bfloat16(), 4, w, b) and gn.fusable(x[:, :, :1, :1], 8, w, b)
    refused = {
        "no affine": gn.fusable(x, 4, None, None),
        "no bias": gn.fusable(x, 4, w, None),
        "groups do not divide the channels": gn.fusable(x, 3, w, b),
        "zero groups": gn.fusable(x, 0, w, b),
        "an affine of other channels": gn.fusable(x, 4, torch.ones(4), torch.zeros(4)),
        "integers": gn.fusable(x.to(torch.int32), 4, w, b),
        "float64": gn.fusable(x.double(), 4, w, b),
        "no spatial dims": gn.fusable(x[:, :, 0, 0], 4, w, b),
        "empty": gn.fusable(x[:0], 4, w, b),
        "pixels that do not flatten": gn.fusable(x[:, :, :, 1:], 4, w, b),
    }
    assert not any(refused.values()), [k for k, v in refused.items() if v]
    layer = GroupNorm(4, 8, fused=True)
    with pytest.raises(RuntimeError):  # PyTorch's own error for 6 channels into a layer of 8
        layer(torch.randn(1, 6, 2, 2))


def _check_group_norm(device, dtype, layout, silu, case):
    n, c, h, w, groups = case
    ref, fused = _pair(lambda f: GroupNorm(groups, c, 1e-6, silu=silu, fused=f), device, dtype)
    torch.manual_seed(2)
    x = (torch.randn(n, c, h, w, device=device) * 3 + 20).to(dtype)  # an offset mean: the variance must not cancel
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        want, got = ref(x), fused(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == x.stride()  # the output keeps the input's memory format
    # Against float64 on the same (rounded) input and parameters
    xd, w, bias = x.double(), ref.weight.double(), ref.bias.double()
    exact = torch.nn.functional.group_norm(xd, groups, w, bias, ref.eps)
    exact = torch.nn.functional.silu(exact) if silu else exact
    ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, want))
    if dtype == torch.float32:
        # y = x * a + b' with a = rstd * weight, b' = bias - a * mean cancels at this mean, so float32 rounding
        # alone errs by a few ulps of |x * a| + |b'| (PyTorch's own path as well)
        grouped = xd.reshape(n, groups, -1)
        mean = grouped.mean(-1).repeat_interleave(c // groups, 1)
        a = (grouped.var(-1, unbiased=False) + ref.eps).rsqrt().repeat_interleave(c // groups, 1) * w
        scale = (xd.abs().amax((2, 3)) * a.abs() + (bias - a * mean).abs()).max().item()
        assert ours <= 8 * torch.finfo(torch.float32).eps * scale, (ours, theirs)
    else:
        # PyTorch keeps a bfloat16 GroupNorm's mean and rstd in bfloat16 (native_group_norm returns them in the
        # input's dtype; on CUDA the output is computed from those), so at this mean it errs by up to half an
        # ulp of 20 times rstd * weight; ours keeps them in float32. Ours must be at least as close to float64,
        # within one rounding of the output (two with SiLU; the interpreter truncates instead of rounding)
        ulp = 2.0 ** -7 * exact.abs().max().item()
        assert ours <= theirs + (2 if silu else 1) * ulp, (ours, theirs, ulp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", GROUP_NORM_CASES[::2], ids=lambda c: "x".join(map(str, c)))
def test_group_norm_kernel_adds_a_pre_bias_first(device, dtype, layout, case):
    """GroupNorm(x + p) with p per channel (a convolution's bias left out of it): the kernel adds p in float32
    in both passes, PyTorch's path rounds x + p first. Both against float64."""
    n, c, h, w, groups = case
    ref, fused = _pair(lambda f: GroupNorm(groups, c, 1e-6, silu=True, fused=f), device, dtype)
    torch.manual_seed(5)
    x = (torch.randn(n, c, h, w, device=device) * 3).to(dtype)
    pre = (torch.randn(c, device=device) * 4 + 10).to(dtype)  # differs per channel: shifts the group's variance
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        got, want = fused(x, pre_bias=pre), ref(x, pre_bias=pre)
    assert got.stride() == x.stride() and got.dtype == dtype
    exact = torch.nn.functional.group_norm(x.double() + pre.double()[:, None, None], groups, ref.weight.double(),
                                           ref.bias.double(), ref.eps)
    exact = torch.nn.functional.silu(exact)
    ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, want))
    if dtype == torch.float32:
        assert ours <= 1e-5 * exact.abs().max().item(), (ours, theirs)
    else:
        assert ours <= theirs + 2 * 2.0 ** -7 * exact.abs().max().item(), (ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 6, 9, 7), (1, 320, 5, 3), (1, 4, 1, 1)])
def test_bias_and_residual_add_kernel_equals_the_pytorch_path(device, dtype, layout, shape):
    from modalmesh.kernels import residual as rk

    torch.manual_seed(6)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    h, r = (torch.randn(*shape, device=device).to(dtype).contiguous(memory_format=fmt) for _ in range(2))
    bias = torch.randn(shape[1], device=device).to(dtype)
    assert rk.fusable(h, bias, r)
    got, want = rk.add_bias_residual(h, bias, r), rk.reference(h, bias, r)
    assert got.stride() == h.stride() and got.dtype == dtype
    if dtype == torch.float32:  # both round h + b, then the sum, in float32
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:  # ours rounds once, PyTorch's path twice: ours is within half an ulp of float64 (on CUDA)
        exact = h.double() + bias.double()[:, None, None] + r.double()
        ours, theirs = ((t.double() - exact).abs() for t in (got, want))
        if device == "cuda":
            assert ours.max() <= theirs.max() and (ours <= 2.0 ** -8 * exact.abs()).all()
        else:  # Triton's interpreter truncates to bfloat16: within one ulp
            assert (ours <= 2.0 ** -7 * exact.abs()).all()


def test_bias_and_residual_add_takes_only_dense_pairs_of_one_layout():
    from modalmesh.kernels import residual as rk

    h = torch.randn(2, 4, 3, 5)
    b = torch.randn(4)
    cl = h.contiguous(memory_format=torch.channels_last)
    assert rk.fusable(h, b, h.clone()) and rk.fusable(cl, b, cl.clone())
    refused = {
        "layouts differ": rk.fusable(h, b, cl),
        "shapes differ": rk.fusable(h, b, h[:1]),
        "dtypes differ": rk.fusable(h, b, h.double()),
        "a strided view": rk.fusable(h[..., :4], b, h[..., :4].clone()),
        "not 4-D": rk.fusable(h.flatten(2), b, h.flatten(2)),
        "a bias of other channels": rk.fusable(h, torch.randn(3), h),
        "integers": rk.fusable(h.int(), b, h.int()),
    }
    assert not any(refused.values()), [k for k, v in refused.items() if v]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("programs", [1024, 6])
@pytest.mark.parametrize("case", GROUP_NORM_CASES, ids=lambda c: "x".join(map(str, c)))
def test_residual_add_with_moments_equals_the_add_then_the_norms_own_statistics(device, dtype, layout, programs,
                                                                                case, monkeypatch):
    """The residual add that takes the next GroupNorm's statistics: its sum bit for bit the residual kernel's,
    its moments bit for bit those the norm's own stats pass takes of that sum, and so the norm from them bit
    for bit the norm alone (6 programs: chunks of several tiles, the last reaching past the pixels)."""
    from modalmesh.kernels import group_norm as gn
    from modalmesh.kernels import residual as rk

    monkeypatch.setattr(gn, "DEFAULT", gn.LaunchConfig(programs=programs))
    n, c, height, width, groups = case
    torch.manual_seed(9)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    h, r = ((torch.randn(n, c, height, width, device=device) * 3 + 20).to(dtype).contiguous(memory_format=fmt)
            for _ in range(2))
    bias = torch.randn(c, device=device) * 4  # float32, as the folded biases are
    weight, beta = torch.randn(c, device=device).to(dtype), torch.randn(c, device=device).to(dtype)
    out, moments = gn.add_with_moments(h, bias, r)
    want = rk.add_bias_residual(h, bias, r)
    assert out.stride() == want.stride() and out.dtype == dtype
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    own = gn._partial_moments(out, None, gn.DEFAULT)
    assert moments.chunk_s == own.chunk_s and moments.covers(out)
    torch.testing.assert_close(moments.mean, own.mean, atol=0, rtol=0)
    torch.testing.assert_close(moments.m2, own.m2, atol=0, rtol=0)
    want = gn.group_norm(out, groups, weight, beta, 1e-6, silu=True)
    passes = []
    monkeypatch.setattr(gn, "_partial_moments", lambda *a, **k: passes.append(1))
    got = gn.group_norm(out, groups, weight, beta, 1e-6, silu=True, moments=moments)
    assert not passes  # the norm started from the add's moments: no stats pass of its own
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 5, 6, 4, 7), (1, 3, 4, 1, 1), (1, 8, 320, 9, 3), (1, 4, 4, 40, 33)])
@pytest.mark.parametrize("programs", [1024, 1])
def test_upsampled_conv_as_phases_equals_interpolate_then_conv(device, dtype, layout, shape, programs, monkeypatch):
    """Nearest 2x upsample + 3x3 convolution (padding 1) as four 2x2 convolutions on the input, interleaved with the
    bias by the stats pass: equal to F.interpolate then conv2d up to the summed taps' rounding and the convolutions'
    sum order (against float64 no worse than that path, in half precision), and its moments bit for bit the norm's
    own pass over the output (a 1x1 input, channels across two blocks, 5,280 output pixels over several chunks;
    one program per channel block: every tile of the output in one chunk)."""
    from modalmesh.kernels import group_norm as gn

    monkeypatch.setattr(gn, "DEFAULT", gn.LaunchConfig(programs=programs))
    n, ci, co, h, w = shape
    torch.manual_seed(10)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(n, ci, h, w, device=device).to(dtype).contiguous(memory_format=fmt)
    weight = (torch.randn(co, ci, 3, 3, device=device) / (3 * ci ** 0.5)).to(dtype)
    bias = torch.randn(co, device=device).to(dtype)
    with ieee_fp32_convolutions() if device == "cuda" else contextlib.nullcontext():
        got, moments = gn.upsampled_conv_with_moments(x, gn.phase_weights(weight), bias)
        want = torch.nn.functional.conv2d(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"),
                                          weight, bias, padding=1)
    assert got.shape == want.shape and got.dtype == dtype
    if (h, w) != (1, 1):
        assert got.is_contiguous(memory_format=fmt)
    exact = torch.nn.functional.conv2d(torch.nn.functional.interpolate(x.double(), scale_factor=2.0),
                                       weight.double(), bias.double(), padding=1)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5 * float(exact.abs().max()), rtol=0)
    else:  # the phase kernels' taps are summed then rounded to the dtype: within two roundings of the output
        ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, want))
        ulp = (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10) * exact.abs().max().item()
        assert ours <= theirs + 2 * ulp, (ours, theirs, ulp)
    own = gn._partial_moments(got, None, gn.DEFAULT)
    assert moments.covers(got) and moments.chunk_s == own.chunk_s
    torch.testing.assert_close(moments.mean, own.mean, atol=0, rtol=0)
    torch.testing.assert_close(moments.m2, own.m2, atol=0, rtol=0)


def test_phase_weights_sum_the_taps_each_phase_reads():
    """Nearest 2x upsampling repeats each input row twice, so output row 2i reads x[i - 1] through kernel row 0 and
    x[i] through rows 1 and 2; row 2i + 1 reads x[i] through rows 0 and 1 and x[i + 1] through row 2 (columns
    alike): a kernel of distinct powers of two shows which taps each 2x2 tap sums."""
    from modalmesh.kernels import group_norm as gn

    weight = (2.0 ** torch.arange(9.0)).view(1, 1, 3, 3)  # tap (r, c) = 2 ** (3r + c)
    phases = gn.phase_weights(weight).view(2, 2, 2, 2)  # (a, b, window row, window col)

    def taps(*pairs):
        return sum(2.0 ** (3 * r + c) for r, c in pairs)

    assert phases[0, 0].tolist() == [[taps((0, 0)), taps((0, 1), (0, 2))],
                                     [taps((1, 0), (2, 0)), taps((1, 1), (1, 2), (2, 1), (2, 2))]]
    assert phases[1, 1].tolist() == [[taps((0, 0), (0, 1), (1, 0), (1, 1)), taps((0, 2), (1, 2))],
                                     [taps((2, 0), (2, 1)), taps((2, 2))]]
    assert phases[0, 1].tolist() == [[taps((0, 0), (0, 1)), taps((0, 2))],
                                     [taps((1, 0), (1, 1), (2, 0), (2, 1)), taps((1, 2), (2, 2))]]
    assert phases[1, 0].tolist() == [[taps((0, 0), (1, 0)), taps((0, 1), (0, 2), (1, 1), (1, 2))],
                                     [taps((2, 0)), taps((2, 1), (2, 2))]]
    with pytest.raises(ValueError, match="phase weights of"):  # the 3x3 kernel itself, not its phases
        gn.upsampled_conv_with_moments(torch.randn(1, 1, 2, 2), weight, torch.zeros(1))


def test_group_norm_takes_moments_only_of_its_own_input():
    """Checked before any kernel runs: moments of another tensor, even one of x's shape, or beside a pre_bias
    (they are of x itself); and the residual add with moments takes only a pair it can read through h's strides."""
    from modalmesh.kernels import group_norm as gn

    x = torch.randn(1, 8, 4, 4)
    w, b = torch.ones(8), torch.zeros(8)

    def moments_of(t):
        return gn.Moments(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), 8, gn.Moments.identity(t))

    assert moments_of(x).covers(x)
    refused = {"a pre_bias": dict(moments=moments_of(x), pre_bias=torch.zeros(8)),
               "another tensor of x's shape": dict(moments=moments_of(x.clone())),
               "x's storage in another layout": dict(moments=moments_of(x.view(1, 8, 16, 1))),
               "a bigger tensor": dict(moments=moments_of(torch.randn(1, 8, 5, 5)))}
    for kwargs in refused.values():
        with pytest.raises(ValueError, match="moments are of x itself"):
            gn.group_norm(x, 4, w, b, 1e-5, **kwargs)
    cl = x.contiguous(memory_format=torch.channels_last)
    for h, r, bias in ((x, cl, torch.zeros(8)), (x, x[:, :, :2], torch.zeros(8)), (x, x.double(), torch.zeros(8)),
                       (x, x.clone(), torch.zeros(4))):
        with pytest.raises(ValueError, match="add_with_moments: h and residual of one shape"):
            gn.add_with_moments(h, bias, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 4096), (2, 9000), (4, 1)])
def test_scaled_softmax_kernel_equals_softmax_then_one_rounding(device, dtype, shape):
    """Float32 scores in, probabilities in `dtype` out (attention's two-GEMM path): rows of one block, of several
    (9,000 scores: blocks of 4,096 and a partial one), of one score; large scores, so the max matters."""
    from modalmesh.kernels import softmax as sk

    torch.manual_seed(8)
    scores = torch.randn(*shape, device=device) * 40
    got = sk.scaled_softmax(scores, 0.3, dtype)
    want = sk.reference(scores, 0.3, dtype)
    assert got.dtype == dtype and got.shape == scores.shape
    # float32: the kernel's exp and sum order; half precision: one rounding of a value in [0, 1] (the interpreter
    # truncates), so within one ulp at 1
    atol = 2e-6 if dtype == torch.float32 else 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    torch.testing.assert_close(got.float().sum(-1), torch.ones(shape[:-1], device=device), atol=shape[-1] * atol,
                               rtol=0)


@pytest.mark.skipif(not (kernels.triton_importable() and torch.cuda.is_available()), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_group_norm_kernel_at_a_vae_stage_of_1024_squared(layout):
    """SDXL's last up block at 1024²: 16M-element groups, and 65,536 pixel tiles in channels-last (more than a
    CUDA grid's second axis takes)."""
    _check_group_norm("cuda", torch.bfloat16, layout, True, (1, 128, 1024, 1024, 32))


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_kernel_takes_views_and_falls_back_where_pixels_do_not_flatten(device, monkeypatch):
    from modalmesh.kernels import group_norm as gn

    calls = []
    monkeypatch.setattr(gn, "group_norm", lambda *a, _fn=gn.group_norm, **k: calls.append(1) or _fn(*a, **k))
    ref, fused = _pair(lambda f: GroupNorm(4, 8, 1e-5, silu=True, fused=f), device, torch.float32)
    base = torch.randn(2, 12, 10, 11, device=device)
    channels = base[:, 2:10]  # a channel slice: strided, but its pixels still flatten
    columns = base[:, :8, :, 1:]  # a column slice: rows and columns no longer flatten to one stride
    with torch.inference_mode():
        torch.testing.assert_close(fused(channels), ref(channels), **TOL[torch.float32])
        assert len(calls) == 1
        torch.testing.assert_close(fused(columns), ref(columns), **TOL[torch.float32])
        assert len(calls) == 1  # the PyTorch path
    assert not gn.fusable(columns, 4, ref.weight, ref.bias) and gn.fusable(channels, 4, ref.weight, ref.bias)


@pytest.mark.parametrize("device", DEVICES)
def test_vae_decoder_with_fused_kernels_equals_the_unfused_decoder(device, tmp_path, monkeypatch):
    from modalmesh.kernels import group_norm as gn
    from modalmesh.testing import tiny
    from services.vae.config import VAEConfig
    from services.vae.weights import build_decoder, load_decoder

    calls, adds, upconvs, passes = [], [], [], []
    monkeypatch.setattr(gn, "group_norm", lambda *a, _fn=gn.group_norm, **k: calls.append(k) or _fn(*a, **k))
    monkeypatch.setattr(gn, "add_with_moments", lambda *a, _fn=gn.add_with_moments: adds.append(1) or _fn(*a))
    monkeypatch.setattr(gn, "upsampled_conv_with_moments",
                        lambda *a, _fn=gn.upsampled_conv_with_moments: upconvs.append(1) or _fn(*a))
    monkeypatch.setattr(gn, "_partial_moments", lambda *a, _fn=gn._partial_moments, **k: passes.append(1) or _fn(*a, **k))
    vae_dir = tiny.ensure("vae", tmp_path)
    cfg = VAEConfig.from_dir(vae_dir)
    models = []
    for fused in (False, True):
        model = build_decoder(cfg, dtype=torch.float32, fused_kernels=fused)
        load_decoder(model, vae_dir, device=torch.device(device), dtype=torch.float32)
        models.append(model)
    z = torch.randn(1, cfg.latent_channels, 12, 10, device=device)
    # IEEE convolutions: cuDNN's TF32 algorithms differ between NCHW and channels-last by more than the kernels do
    with torch.inference_mode(), ieee_fp32_convolutions() if device == "cuda" else contextlib.nullcontext():
        want = models[0](z)
        assert not calls
        got = models[1](z)
        got_cl = models[1](z.contiguous(memory_format=torch.channels_last))
    # the resnets' GroupNorm+SiLU and the attention's GroupNorm
    assert {k["silu"] for k in calls} == {True, False}
    # Per decode (two: NCHW, channels-last): every resnet's residual add takes moments, and so does each upsampler
    # (its 2x2 phase convolutions interleaved); the norm after a resnet or an upsampler starts from them, except
    # where a resnet's output goes to an upsampler (a convolution), whose moments go unused
    ups = sum(b.upsamplers is not None for b in models[1].decoder.up_blocks)
    resnets = sum(len(b.resnets) for b in models[1].decoder.up_blocks) + 2
    assert len(adds) == 2 * resnets and len(upconvs) == 2 * ups > 0
    assert sum(k["moments"] is not None for k in calls) == 2 * resnets
    assert len(passes) == len(calls) + 2 * ups  # one stats pass per norm, its own or its input's writer's
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)
    torch.testing.assert_close(got_cl, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_upsampler_phase_kernels_follow_the_loaded_weights(device, tmp_path):
    """The upsamplers' 2x2 phase kernels are made from the loaded weights and kept: for weights loaded under
    inference_mode, which carry no version counter (reading it raised on CUDA, in the FP32 parity test), and made
    again when the weights change in place afterwards (same storage, a new version)."""
    from modalmesh.testing import tiny
    from services.vae.config import VAEConfig
    from services.vae.weights import build_decoder, load_decoder

    vae_dir = tiny.ensure("vae", tmp_path)
    cfg = VAEConfig.from_dir(vae_dir)

    def unfused_of(model):
        ref = build_decoder(cfg, dtype=torch.float32, fused_kernels=False)
        load_decoder(ref, vae_dir, device=torch.device(device), dtype=torch.float32)
        ref.load_state_dict(model.state_dict())  # the model's weights as they are now
        return ref

    z = torch.randn(1, cfg.latent_channels, 6, 5, device=device)
    ieee = ieee_fp32_convolutions if device == "cuda" else contextlib.nullcontext
    fused = build_decoder(cfg, dtype=torch.float32, fused_kernels=True)
    with torch.inference_mode():
        load_decoder(fused, vae_dir, device=torch.device(device), dtype=torch.float32)
        with ieee():
            want = unfused_of(fused)(z)
            torch.testing.assert_close(fused(z), want, atol=1e-4 * float(want.abs().max()), rtol=0)
            for p in fused.parameters():  # in place, still under inference_mode: no version to see it by
                p.mul_(0.5)
            want = unfused_of(fused)(z)
            torch.testing.assert_close(fused(z), want, atol=1e-4 * float(want.abs().max()), rtol=0)
    fused = build_decoder(cfg, dtype=torch.float32, fused_kernels=True)
    load_decoder(fused, vae_dir, device=torch.device(device), dtype=torch.float32)
    with torch.no_grad(), ieee():
        fused(z)  # phase kernels made from the loaded weights
        for p in fused.parameters():
            p.mul_(0.5)
        want = unfused_of(fused)(z)
        torch.testing.assert_close(fused(z), want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(16, 80), (3, 32)])
def test_vision_rotary_kernel_equals_apply_rotary(device, dtype, heads, dim):
    """q and k as strided views of one qkv projection (as VisionAttention has them); cos/sin whose two halves
    differ (the towers' repeat them, the kernel must not rely on it)."""
    from modalmesh.kernels.rotary import qk_fusable, rotate_qk
    from services.vision_encoder.models.common import apply_rotary

    torch.manual_seed(3)
    tokens = 37
    q, k, _ = torch.randn(tokens, 3, heads, dim, device=device).to(dtype).unbind(1)
    angles = torch.rand(tokens, dim, device=device) * 50
    cos, sin = angles.cos(), angles.sin()
    assert qk_fusable(q, k, cos, sin) and not q.is_contiguous()
    got_q, got_k = rotate_qk(q, k, cos, sin)
    assert got_q.is_contiguous() and got_q.dtype == dtype
    torch.testing.assert_close(got_q, apply_rotary(q, cos, sin), **TOL[dtype])
    torch.testing.assert_close(got_k, apply_rotary(k, cos, sin), **TOL[dtype])
    # q and k with strides of their own: each is addressed by its own
    k_own = k.contiguous()
    assert k_own.stride() != q.stride()
    got_q2, got_k2 = rotate_qk(q, k_own, cos, sin)
    torch.testing.assert_close(got_q2, got_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k2, got_k, atol=0, rtol=0)


def _count_kernel_calls(monkeypatch) -> dict:
    from modalmesh.kernels import activation, layer_norm, norm, rotary

    calls = {}
    for module, name in ((norm, "rms_norm"), (layer_norm, "layer_norm"), (activation, "silu_and_mul"),
                         (activation, "quick_gelu"), (rotary, "rotate_qk")):
        def counted(*args, _fn=getattr(module, name), _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "siglip"])
def test_vision_tower_with_fused_kernels_equals_the_unfused_tower(device, family, tmp_path, monkeypatch):
    from modalmesh.testing import tiny
    from services.vision_encoder.model import build_encoder_model

    calls = _count_kernel_calls(monkeypatch)
    path = tiny.ensure(family, tmp_path)
    # no graphs: on CUDA their capture at build runs the fused tower before the unfused one runs, and counts its kernels
    towers = [build_encoder_model(path, device=device, dtype=torch.float32,
                                  options={"fused_kernels": f, "cuda_graphs": False}).tower for f in (False, True)]
    towers[1].load_state_dict(towers[0].state_dict())
    torch.manual_seed(4)
    if family == "siglip":
        size = towers[0].image_size
        pixels = torch.randn(3, towers[0].in_channels, size, size, device=device)
        forward = [lambda t=t: t(pixels) for t in towers]
    else:
        grids = [(1, 4, 6), (2, 4, 4)]
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), towers[0].patch_dim, device=device)
        forward = [lambda t=t: t(pixels, grids) for t in towers]
    with torch.inference_mode():
        want = forward[0]()
        assert not calls
        got = forward[1]()
    layers = towers[0].cfg.num_layers
    expected = {  # every residual add rides a norm: 2 a layer, the last one the final norm's
        "qwen2_vl": {"rotate_qk": layers, "layer_norm": 2 * layers + 1, "quick_gelu": layers},
        "qwen2_5_vl": {"rotate_qk": layers, "rms_norm": 2 * layers + 1, "silu_and_mul": layers},
        "siglip": {"layer_norm": 2 * layers + 1},  # its tanh GELU is the GEMM epilogue's, on CUDA
    }[family]
    assert calls == expected, calls  # the fused path did run
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["whisper", "qwen2_audio"])
def test_audio_tower_with_fused_kernels_equals_the_unfused_tower(device, family, tmp_path, monkeypatch):
    from modalmesh.testing import tiny
    from services.audio_encoder.model import build_encoder_model

    calls = _count_kernel_calls(monkeypatch)
    path = tiny.ensure(family, tmp_path)
    models = [build_encoder_model(path, device=device, dtype=torch.float32,
                                  options={"fused_kernels": f, "warmup": False, "cuda_graphs": False})
              for f in (False, True)]  # no graphs: their capture at build would run the fused tower first
    models[1].module.load_state_dict(models[0].module.state_dict())
    dims = models[0].dims
    torch.manual_seed(5)
    mel = torch.randn(2, dims.n_mels, dims.window_frames, device=device)
    if family == "whisper":
        forward = [lambda m=m: m.module(mel) for m in models]
    else:  # packed windows, pooled by 2 after the layers: the stream is summed before the pooling
        lengths = [dims.max_source_positions, dims.max_source_positions // 2]
        forward = [lambda m=m: m.module.audio_tower(mel, lengths, pool=2) for m in models]
    with torch.inference_mode():
        want = forward[0]()
        assert not calls
        got = forward[1]()
    assert calls == {"layer_norm": 2 * dims.layers + 1}, calls
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_gated_mlp_fuses_only_silu():
    assert not GatedMLP(8, 16, "gelu_pytorch_tanh", fused=True, tp_rank=0, tp_size=1).fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
], ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("heads", [(4, 2, 32), (28, 4, 128), (6, 1, 64)], ids=["gqa2", "qwen7b", "mqa"])
def test_rope_and_kv_write_kernel_equals_rotary_then_store(device, dtype, rope, heads):
    hq, hk, dim = heads
    tokens, pages, page = 11, 8, 16
    rotary = RotaryEmbedding(dim, dim, 256, rope).to(device)
    torch.manual_seed(1)
    # q, k, v are views into one projection output, as QKVParallelLinear.split gives them
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device=device, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hk * dim, hk * dim], dim=-1))
    positions = torch.randint(0, 200, (tokens,), device=device)
    slots = torch.randperm(pages * page, device=device)[:tokens]
    caches = {name: [torch.randn(pages, page, hk, dim, device=device, dtype=dtype) for _ in range(2)]
              for name in ("ref", "fused")}
    caches["fused"] = [c.clone() for c in caches["ref"]]
    assert rotary.can_fuse(positions, q)
    with torch.inference_mode():
        want_q, want_k = rotary(positions, q, k)
        store_kv(want_k, v, *caches["ref"], slots)
        got_q = rotary.rotate_and_store(positions, q, k, v, caches["fused"], slots)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(caches["fused"][0], caches["ref"][0], **TOL[dtype])
    torch.testing.assert_close(caches["fused"][1], caches["ref"][1], atol=0, rtol=0)  # v is copied


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, section", [((28, 4, 128), (16, 24, 24)), ((4, 2, 16), (2, 3, 3)),
                                           ((4, 2, 16), (1, 2, 5))], ids=["qwen2vl7b", "tiny", "uneven"])
def test_mrope_rope_and_kv_write_kernel_equals_rotary_then_store(device, dtype, heads, section):
    """M-RoPE (Qwen2-VL): each frequency section rotates by its own row of the (3, T) positions. Image tokens
    have three different positions, text tokens three equal ones; the positions are a (3, T) slice of a wider
    buffer, as the runner's packed positions are."""
    hq, hk, dim = heads
    tokens, pages, page = 13, 8, 16
    rotary = RotaryEmbedding(dim, dim, 512, {"rope_type": "default", "rope_theta": 1e6},
                             mrope_section=section).to(device)
    torch.manual_seed(2)
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, device=device, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hk * dim, hk * dim], dim=-1))
    wide = torch.randint(0, 400, (3, tokens + 5), device=device)
    wide[:, 9:] = wide[0, 9:]  # the last tokens are text: t = h = w
    positions = wide[:, :tokens]
    assert positions.stride() == (tokens + 5, 1) and (positions[0] != positions[1]).any()
    slots = torch.randperm(pages * page, device=device)[:tokens]
    ref = [torch.randn(pages, page, hk, dim, device=device, dtype=dtype) for _ in range(2)]
    fused = [c.clone() for c in ref]
    assert rotary.can_fuse(positions, q)
    with torch.inference_mode():
        want_q, want_k = rotary(positions, q, k)
        store_kv(want_k, v, *ref, slots)
        got_q = rotary.rotate_and_store(positions, q, k, v, fused, slots)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(fused[0], ref[0], **TOL[dtype])
    torch.testing.assert_close(fused[1], ref[1], atol=0, rtol=0)  # v is copied


@pytest.mark.parametrize("device", DEVICES)
def test_rope_kernel_takes_mrope_on_three_rows_only_and_not_partial_rotary(device):
    q = torch.randn(3, 2, 16, device=device)
    mrope = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0}, mrope_section=(2, 3, 3)).to(device)
    four = RotaryEmbedding(16, 16, 64, {"rope_theta": 10000.0}, mrope_section=(2, 2, 2, 2)).to(device)
    partial = RotaryEmbedding(16, 8, 64, {"rope_theta": 10000.0}).to(device)
    positions = torch.arange(3, device=device)
    assert mrope.can_fuse(positions.expand(3, -1), q)  # three rows, unit stride along the tokens
    assert not mrope.can_fuse(positions, q)  # M-RoPE needs its three rows
    assert not mrope.can_fuse(positions.expand(3, -1).t(), q)
    assert not four.can_fuse(positions.expand(3, -1), q)  # the kernel has three sections
    assert not partial.can_fuse(positions, q)


def _logits(path, device, fused, prompt, steps):
    from services.llm.loader import load_llm

    model, cfg, _ = load_llm(path, device=torch.device(device), dtype=torch.float32, fused_kernels=fused)
    return decode_logits(model, cfg, device, prompt, steps)


def decode_logits(model, cfg, device, prompt, steps):
    """Logits of a prefill of `prompt` and `steps` greedy decode steps, over a fresh paged pool (tests/test_gemv.py
    too)."""
    from modalmesh.attention import PagedMetadata
    from modalmesh.kv.pool import build_kv_pool
    from modalmesh.metrics import Metrics

    pool = build_kv_pool(cfg, device, max_model_len=128, dtype=torch.float32, kv_cache_tokens=256,
                         metrics=Metrics("llm", process_metrics=False))
    caches = [pool.layer(i) for i in range(cfg.num_layers)]
    ids, out = list(prompt), []
    with torch.inference_mode():
        new = ids
        for _ in range(steps + 1):
            start = len(ids) - len(new)
            assert pool.allocate("s", len(ids)) if start == 0 else pool.allocator.extend("s", len(new))
            meta = PagedMetadata.build([len(new)], [len(ids)], pool.block_table(["s"]), pool.page_size)
            hidden = model(torch.arange(start, len(ids), device=device), meta, caches,
                           input_ids=torch.tensor(new, device=device))
            logits = model.compute_logits(hidden[-1:]).cpu()
            out.append(logits)
            new = [int(logits.argmax())]
            ids = ids + new
    return torch.cat(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_vl"])
def test_decoder_with_fused_kernels_equals_the_unfused_decoder(device, family, tmp_path, monkeypatch):
    from modalmesh.testing import tiny
    from modalmesh.kernels import activation, norm, rotary

    calls = {}
    for module, name in ((norm, "rms_norm"), (activation, "silu_and_mul"), (rotary, "rope_and_store")):
        def counted(*args, _fn=getattr(module, name), _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    path = tiny.ensure(family, tmp_path)
    prompt = [5, 77, 301, 12, 9, 250, 31, 8, 100]
    want = _logits(path, device, False, prompt, 4)
    assert not calls
    got = _logits(path, device, True, prompt, 4)
    assert set(calls) == {"rms_norm", "silu_and_mul", "rope_and_store"}, calls  # the fused path did run
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_mrope_decoder_with_fused_kernels_equals_the_unfused_decoder_over_an_image(device, tmp_path):
    """Qwen2-VL's language model over a prompt with an image's grid of M-RoPE positions (three different rows
    where the image is), fused (rope_and_store with its sections) against the PyTorch path."""
    from modalmesh.attention import PagedMetadata
    from modalmesh.kernels import rotary
    from modalmesh.kv.pool import build_kv_pool
    from modalmesh.metrics import Metrics
    from modalmesh.testing import tiny
    from services.llm.loader import load_llm

    path = tiny.ensure("qwen2_vl", tmp_path)
    # text 0..2, a 3 x 4 grid at t = 3 (h 3..5, w 3..6), text again from 7
    grid = [(3, 3 + h, 3 + w) for h in range(3) for w in range(4)]
    rows = [(i, i, i) for i in range(3)] + grid + [(i, i, i) for i in range(7, 12)]
    positions = torch.tensor(rows, device=device).t().contiguous()
    tokens = positions.shape[1]
    logits, embeds = [], None
    for fused in (False, True):
        model, cfg, _ = load_llm(path, device=torch.device(device), dtype=torch.float32, fused_kernels=fused)
        if embeds is None:  # the image's rows and the text's alike: the rotation is what differs
            embeds = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(device)
        pool = build_kv_pool(cfg, device, max_model_len=128, dtype=torch.float32, kv_cache_tokens=256,
                             metrics=Metrics("llm", process_metrics=False))
        assert pool.allocate("s", tokens)
        meta = PagedMetadata.build([tokens], [tokens], pool.block_table(["s"]), pool.page_size)
        calls = []
        with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(rotary, "rope_and_store", lambda *a, _f=rotary.rope_and_store, **k: calls.append(1) or _f(*a, **k))
            hidden = model(positions, meta, [pool.layer(i) for i in range(cfg.num_layers)], inputs_embeds=embeds)
            logits.append(model.compute_logits(hidden).cpu())
        assert len(calls) == (cfg.num_layers if fused else 0)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4 * float(logits[0].abs().max()), rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case_id", ["paged-decode", "paged-prefill-prefix", "paged-mixed-page1",
                                     "paged-mixed-continuous", "paged-mixed-window", "paged-window-page16"])
def test_triton_paged_mixed_steps_agree_with_naive(device, case_id):
    """The paged kernel's per-token path (mixed steps: each token a decode query of its own) and its
    decode path, against the reference attention over each sequence's dense history."""
    from modalmesh.attention import registry
    from test_attention_backends import CASES, make_inputs, run_backend

    case = next(c for c in CASES if c.id == case_id)
    probe = registry.probe("triton_paged")
    assert probe.ok, probe.reason
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    call, expected = make_inputs(case, device, dtype)
    out = run_backend(probe.backend, call)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[dtype])


def _compiled_forms(fn) -> int:
    """How many launch forms (specialisations) of a Triton kernel this process has compiled."""
    return sum(len(caches[0]) for caches in fn.device_caches.values())


@pytest.mark.skipif("cuda" not in DEVICES, reason="Triton compiles launch forms on a GPU only")
def test_warm_paged_compiles_every_form_the_steps_then_take():
    """After `warm_paged`, eager steps of any mix of up to max_seqs sequences — decode rows, chunks over a
    prefix, new prompts — and decode steps compile nothing more: a compile mid-serving held the engine thread
    for most of a second (issue 18). The shape (20 heads over 4, head dim 96, pages of 32) is this test's
    alone, so no other test has compiled its forms before."""
    from modalmesh.attention import PagedMetadata, registry
    from modalmesh.kernels import paged_prefill as prefill_module

    backend = registry.probe("triton_paged").backend
    heads, kv_heads, dim, page, max_seqs, pages = 20, 4, 96, 32, 24, 256
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    kernels_ = (*backend._decode, prefill_module._kernel())
    before = [_compiled_forms(fn) for fn in kernels_]
    backend.warm_paged(torch.zeros(1, heads, dim, device="cuda", dtype=torch.bfloat16), k_cache, v_cache,
                       causal=True, scale=dim ** -0.5, window=None, max_seqs=max_seqs)
    warmed = [_compiled_forms(fn) for fn in kernels_]
    assert all(w > b for w, b in zip(warmed, before)), (before, warmed)  # decode, its combine, prefill
    with torch.inference_mode():
        for n in range(1, max_seqs - 1):
            query_lens = [1] * n + [40, 12]  # n decode rows, a chunk over a prefix, a new prompt
            context_lens = [33 + 7 * i for i in range(n)] + [300, 12]
            table = torch.randperm(pages, device="cuda", dtype=torch.int32)[:(n + 2) * 10].view(n + 2, 10)
            q = torch.randn(sum(query_lens), heads, dim, device="cuda", dtype=torch.bfloat16)
            for lens, ctx, rows in ((query_lens, context_lens, n + 2), (query_lens[:n], context_lens[:n], n)):
                meta = PagedMetadata.build(lens, ctx, table[:rows], page)
                backend.paged(q[:sum(lens)], k_cache, v_cache, meta, causal=True, scale=dim ** -0.5, window=None)
    torch.cuda.synchronize()
    assert [_compiled_forms(fn) for fn in kernels_] == warmed


class _EagerReplay:
    """Stands in for a captured CUDA graph where none can be captured: replay re-runs the forward into
    the captured output, from the same static buffers."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())


def _fake_capture(graphs):
    graphs.outputs = {n: graphs._forward(n).clone() for n in graphs.sizes}
    graphs.graphs = {n: _EagerReplay(lambda n=n: graphs._forward(n), graphs.outputs[n]) for n in graphs.sizes}


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_steps_through_the_graph_inputs_equal_eager_steps(family, tmp_path):
    """Every step the way a captured graph takes it — decode rows padded to a batch bucket, mixed steps
    padded to a token bucket with per-token attention — against plain eager steps: the same greedy tokens
    and logprobs, for staggered requests whose steps mix decode rows, new prompts and prompt chunks.

    On the CPU, with no graph to capture, a stand-in replays the forward from the same static buffers, and
    the CPU attention backend takes the per-token form as a decode batch (`per_token_as_decode`); on CUDA
    the real graphs are compared in test_llm_cuda.py."""
    import queue

    from modalmesh.testing import tiny
    from modalmesh.metrics import Metrics
    from services.llm.config import LLMConfig
    from services.llm.engine import LLMEngine
    from services.llm.graphs import DecodeGraphs, MixedGraphs
    from services.llm.inputs import PreparedPrompt
    from services.llm.runner import ModelRunner
    from services.llm.sampling import SamplingParams

    from transformers import AutoTokenizer

    path = tiny.ensure(family, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [[5, 77, 301, 12, 9, 250, 31], [400, 3], list(range(40, 73)), [7] * 3, [9, 8, 1, 2, 3]]
    results = {}
    for graphs in (False, True):
        metrics = Metrics("llm", process_metrics=False)
        config = LLMConfig(model_dir=path, device_type="cpu", max_model_len=128, kv_cache_tokens=1024,
                           max_batch_tokens=24, max_num_seqs=4, dtype=torch.float32)
        runner = ModelRunner(config, metrics)
        if graphs:
            runner.graphs = DecodeGraphs(runner.model, runner.pool, runner.kv_caches, runner.device, max_batch=4,
                                         max_model_len=128, uses_mrope=runner.uses_mrope)
            runner.mixed_graphs = MixedGraphs(runner.model, runner.pool, runner.kv_caches, runner.device,
                                              max_tokens=16, max_seqs=4, max_model_len=128,  # steps of 24: eager
                                              uses_mrope=runner.uses_mrope, scratch_slot=runner.graphs.scratch_slot,
                                              hidden_size=runner.model_config.hidden_size, dtype=torch.float32)
            # The decode graphs' stand-in would feed the CPU backend dummy host lengths (the captured decode
            # meta is for device-side kernels only): here decode steps take the mixed graphs too.
            runner.graphs.bucket = lambda n: 0
            with torch.inference_mode():
                _fake_capture(runner.mixed_graphs)
        kinds = []
        execute = runner.execute
        runner.execute = lambda inputs, prev=None: (kinds.append((inputs.graph_batch, inputs.graph_tokens)),
                                                    execute(inputs, prev))[1]
        engine = LLMEngine(runner, tokenizer, eos_token_ids=(), metrics=metrics)
        engine.start()
        outs = []
        try:
            for i, p in enumerate(prompts):
                out = queue.Queue()
                engine.add(f"r{i}", PreparedPrompt(list(p)),
                           SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True, logprobs=1), out.put)
                outs.append(out)
            got = []
            for out in outs:
                ids, lps = [], []
                while True:
                    d = out.get(timeout=120)
                    assert d.error is None, d.error
                    ids += d.token_ids
                    lps += d.logprobs
                    if d.finish_reason:
                        break
                got.append((ids, lps))
        finally:
            engine.stop()
        results[graphs] = got
        if graphs:  # mixed graphs ran, and so did eager steps past the largest token bucket
            assert any(t for _, t in kinds) and any(not t for _, t in kinds), kinds
    for (ids, lps), (ids_ref, lps_ref) in zip(results[True], results[False]):
        assert ids == ids_ref
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("per_token", [False, True])
def test_paged_decode_split_across_programs_equals_reference(device, splits, per_token):
    """Flash-decoding: each (row, kv head)'s context split across `splits` programs and combined, against
    softmax attention over each row's dense history. Contexts shorter than one block per split (empty
    splits), a padding row of context 0 (output 0), a sliding window, and per-token rows (a mixed step's
    form) are all in it."""
    from modalmesh.attention.backends.triton_paged import paged_decode

    torch.manual_seed(splits)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    page, kv_heads, group, dim = 16, 2, 4, 64
    contexts = [1, 7, 33, 150, 0, 301]
    pages_per = [max(1, -(-c // page)) for c in contexts]
    num_pages = sum(pages_per) + 1
    k_cache = torch.randn(num_pages, page, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, device=device, dtype=dtype)
    perm = torch.randperm(num_pages - 1).tolist()  # pages scattered through the pool
    table, start = [], 0
    for n in pages_per:
        table.append(perm[start:start + n] + [0] * (max(pages_per) - n))
        start += n
    block_table = torch.tensor(table, dtype=torch.int32, device=device)
    rows = len(contexts)
    q = torch.randn(rows, kv_heads * group, dim, device=device, dtype=dtype)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    token_seq = None
    if per_token:  # row i reads sequence rows-1-i, to the same causal length
        token_seq = torch.arange(rows - 1, -1, -1, dtype=torch.int32, device=device)
        ctx = ctx.flip(0)
    for window in (None, (40, 0)):
        out = paged_decode(q, k_cache, v_cache, block_table, ctx, scale=dim ** -0.5, window=window,
                           token_seq=token_seq, splits=splits)
        for i in range(rows):
            seq = token_seq[i].item() if per_token else i
            n = int(ctx[i])
            if n == 0:
                assert not out[i].float().abs().any()
                continue
            slots = [table[seq][t // page] * page + t % page for t in range(n)]
            lo = 0 if window is None else max(0, n - 1 - window[0])
            k = k_cache.view(-1, kv_heads, dim)[slots][lo:].float().repeat_interleave(group, dim=1)
            v = v_cache.view(-1, kv_heads, dim)[slots][lo:].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", q[i].float(), k) * dim ** -0.5
            want = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
            torch.testing.assert_close(out[i].float(), want, **TOL[dtype])


def test_decode_splits_fill_the_gpu_from_host_values_only():
    """The split count depends on the batch and head counts alone (fixed per captured graph), never more
    than MAX_SPLITS, 1 once the rows alone fill the SMs; always 1 off CUDA."""
    from modalmesh.attention.backends import triton_paged as tp

    tp._SMS[7] = 132  # an H200's SM count, for a fake device index
    cuda7 = torch.device("cuda", 7)
    assert [tp.decode_splits(b, 4, cuda7) for b in (1, 2, 4, 8, 16, 32, 256)] == [16, 16, 8, 4, 2, 1, 1]
    assert tp.decode_splits(1, 4, torch.device("cpu")) == 1
    del tp._SMS[7]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["small", "default"])
@pytest.mark.parametrize("window", [None, (21, 0)])
def test_paged_prefill_chunks_over_a_prefix_equal_reference(device, config, window):
    """Prompt chunks that continue a cached prefix, in blocks of tokens that read each key block once, against
    causal softmax attention over each sequence's dense history. Chunks longer than a block (several blocks,
    a partial last one), a prefix not a multiple of the key block, a whole prompt with no prefix, a single
    token, and chunks in q rows between rows the kernel must leave alone (a step's new prompts)."""
    from modalmesh.kernels.paged_prefill import DEFAULT, LaunchConfig, paged_prefill, plan_blocks

    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    page, kv_heads, group, dim = 16, 2, 3, 64  # a group of 3: blocks of tokens that do not fill BLOCK_M evenly
    cfg = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1) if config == "small" else DEFAULT
    per_block = cfg.block_m // group
    query_lens = [90, 7, 0, 1, 23, 5]
    context_lens = [90 + 77, 7 + 3, 9, 50, 23, 5 + 130]
    skipped = {1}  # q rows of sequence 1 belong to another kernel: untouched
    pages_per = [-(-c // page) for c in context_lens]
    num_pages = sum(pages_per) + 1
    k_cache = torch.randn(num_pages, page, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, device=device, dtype=dtype)
    perm = torch.randperm(num_pages - 1).tolist()
    table, start = [], 0
    for n in pages_per:
        table.append(perm[start:start + n] + [0] * (max(pages_per) - n))
        start += n
    block_table = torch.tensor(table, dtype=torch.int32, device=device)
    rows = [0]
    for n in query_lens:
        rows.append(rows[-1] + n)
    q = torch.randn(rows[-1], kv_heads * group, dim, device=device, dtype=dtype)
    seqs = [b for b in range(len(query_lens)) if b not in skipped]
    plan = plan_blocks(query_lens, context_lens, rows, group=group, config=cfg, device=device, seqs=seqs)
    assert max(n for _, _, n, _ in plan.blocks) == per_block and any(n < per_block for _, _, n, _ in plan.blocks)
    out = torch.full((rows[-1], kv_heads * group, dim), 7.0, device=device, dtype=dtype)
    paged_prefill(q, k_cache, v_cache, block_table, plan, scale=dim ** -0.5, window=window, out=out)
    for b, (n, c) in enumerate(zip(query_lens, context_lens)):
        got = out[rows[b]:rows[b + 1]].float()
        if b in skipped:
            assert (got == 7.0).all()
            continue
        slots = [table[b][t // page] * page + t % page for t in range(c)]
        k = k_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(group, dim=1)
        v = v_cache.view(-1, kv_heads, dim)[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[rows[b]:rows[b + 1]].float(), k) * dim ** -0.5
        pos = torch.arange(c - n, c, device=device)[:, None]
        keys = torch.arange(c, device=device)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= keys >= pos - window[0]
        scores = scores.masked_fill(~visible, float("-inf"))
        want = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(got, want, **TOL[dtype])
