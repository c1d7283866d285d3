"""bench/__init__.py's shared pieces: `--peer-compile`'s modes, a peer that does not compile, the kernel profile.

The benches themselves run on a GPU; what is checked here is that a missing column or a failed compile
reports why instead of ending the run, and the profile's bookkeeping (no times are asserted).
"""

from __future__ import annotations

import math

import pytest
import torch

from bench import compile_peer, kernel_family, peer_compile_modes, profile_kernels


def test_peer_compile_modes():
    assert peer_compile_modes("none") == []
    assert peer_compile_modes("") == []
    assert peer_compile_modes("default, max-autotune") == ["default", "max-autotune"]
    with pytest.raises(SystemExit, match="fastest"):
        peer_compile_modes("default,fastest")


@pytest.mark.parametrize("name, family", [
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "conv"),  # cuDNN's conv, not a GEMM
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "GEMM"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "norm"),
    ("triton_red_fused_native_group_norm_silu_0", "norm"),
    ("void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16>", "layout"),
    ("aten::upsample_nearest2d", "upsample"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "elementwise"),
    ("aten::empty", "other"),
])
def test_kernel_family(name, family):
    assert kernel_family(name) == family


def test_a_peer_that_does_not_compile_is_a_reason_not_an_error():
    def broken(x):
        raise RuntimeError("no kernel for this peer")

    forward, seconds, why = compile_peer(broken, lambda compiled: compiled(torch.ones(2)), "default",
                                         torch.device("cpu"))
    assert forward is None and math.isnan(seconds)
    assert why  # the error, or the missing C++ compiler: either way printed, not raised


def test_profile_kernels_on_cpu():
    linear = torch.nn.Linear(32, 32)
    x = torch.randn(4, 32)
    profiled = profile_kernels({"linear+gelu": lambda: torch.nn.functional.gelu(linear(x))}, torch.device("cpu"),
                               iters=3, top=5)
    r = profiled["linear+gelu"]
    assert r["iters"] == 3 and r["kernels_per_call"] > 0
    assert math.isclose(sum(r["families"].values()), r["busy_ms"], rel_tol=1e-6)
    assert {"GEMM", "elementwise"} <= set(r["families"])
    assert len(r["top"]) <= 5 and all(count > 0 for _, _, count in r["top"])


def test_timer_times_repeat_calls_back_to_back():
    from bench import timer

    calls = []
    ms = timer(lambda: calls.append(1), torch.device("cpu"), warmup=2, iters=3, repeat=4)
    assert len(calls) == 2 + 3 * 4 and ms >= 0


def test_gemm_recorder_counts_each_product_by_layout_with_its_shape():
    # bench/gemm.py's accounting: what the towers' GEMM ceiling is computed from.
    from bench.gemm import GemmRecorder

    x, w, b = torch.randn(2, 5, 16), torch.randn(30, 16), torch.randn(30)
    q = torch.randn(3, 4, 8)
    with torch.inference_mode(), GemmRecorder() as recorder:
        for _ in range(2):
            torch.nn.functional.linear(x, w, b)  # seen whole under inference_mode: M = 2 * 5
        torch._addmm_activation(b, x[0], w.t(), use_gelu=True)
        torch.bmm(q, q.transpose(1, 2))
    by_label = {call.label(): (call, n) for call, n in recorder.counts.items()}
    assert sorted(by_label) == ["addmm+gelu 5x30x16", "bmm 3x4x4x8", "linear 10x30x16"]
    linear, n = by_label["linear 10x30x16"]
    assert n == 2 and linear.mnk == (1, 10, 30, 16) and linear.flop == 2 * 10 * 30 * 16
    assert by_label["bmm 3x4x4x8"][0].flop == 2 * 3 * 4 * 4 * 8
    # each recorded call runs again on fresh tensors of its layout, and pads N and K to 128 where they are not
    assert linear.runner(torch.device("cpu"))().shape == (2, 5, 30)
    padded = linear.padded()
    assert padded.mnk == (1, 10, 128, 128) and padded.runner(torch.device("cpu"))().shape == (10, 128)
    gelu = by_label["addmm+gelu 5x30x16"][0]
    assert gelu.padded().label() == "addmm+gelu 5x128x128"
    assert gelu.padded().runner(torch.device("cpu"))().shape == (5, 128)
    assert by_label["bmm 3x4x4x8"][0].padded() is None
