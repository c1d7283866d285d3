"""Our Triton kernels compile as torch.compile launches them, checked on the CPU.

Inductor launches a user's Triton kernel with its float scalars typed float64; Triton's own launcher types them
float32. `group_moments` (the VAE's GroupNorm) did not compile that way, so our decoder under torch.compile failed
on the GPU (stop 54, `bench/vae.py --ours-compile default`); nor did scaled_softmax and the two paged-attention
kernels. Every kernel of ours with a float scalar is listed here (`grep -n "@triton.jit"`). Triton's compiler needs no GPU: each kernel is
compiled here to a Hopper cubin with its float scalars as each launcher types them.
"""

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from modalmesh.attention.backends import triton_paged  # noqa: E402
from modalmesh.kernels import _paged_prefill_triton, group_norm, layer_norm, norm, softmax  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
ROW_NORM = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Out": "*bf16", "ResOut": "*bf16",
            "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "n": "i32"}

# (kernel, its signature with FLOAT for each float scalar, its constexprs)
KERNELS = {
    "group_moments": (lambda: group_norm._kernels()[1],
                      {"Mean": "*fp32", "M2": "*fp32", "W": "*bf16", "B": "*bf16", "PreBias": "*bf16",
                       "Scale": "*fp32", "Shift": "*fp32", "S": "i32", "C": "i32", "G": "i32", "cpg": "i32",
                       "chunk_s": "i32", "chunks": "i32", "total": "FLOAT", "eps": "FLOAT"},
                      {"HAS_PRE_BIAS": True, "BLOCK_K": 128, "BLOCK_CG": 16}),
    "add_layer_norm": (layer_norm._kernel,
                       {**ROW_NORM, "B": "*bf16", "eps": "FLOAT"},
                       {"HAS_RESIDUAL": True, "HAS_BIAS": True, "BLOCK": 1024}),
    "add_rms_norm": (norm._kernel, {**ROW_NORM, "eps": "FLOAT"}, {"HAS_RESIDUAL": True, "BLOCK": 1024}),
    "scaled_softmax": (softmax._kernel, {"X": "*bf16", "Out": "*bf16", "n": "i32", "scale": "FLOAT"},
                       {"BLOCK": 1024}),
}
ATTENTION_STRIDES = {f"stride_{n}": "i32" for n in ("qt", "qh", "kp", "ks", "kh", "vp", "vs", "vh", "ot", "oh", "bt")}
ATTENTION_SHAPE = {"D": 64, "D_PAD": 64, "DV": 64, "DV_PAD": 64, "PAGE": 16, "BLOCK_N": 32, "WINDOW_LEFT": -1,
                   "IEEE": False}
KERNELS["paged_decode"] = (
    lambda: triton_paged._kernel()[0],
    {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "PartM": "*fp32", "PartL": "*fp32",
     "BlockTable": "*i32", "ContextLens": "*i32", "TokenSeq": "*i32", "scale": "FLOAT", **ATTENTION_STRIDES},
    {"GROUP": 4, "GROUP_PAD": 16, **ATTENTION_SHAPE, "PER_TOKEN": False, "SPLITS": 1})
KERNELS["paged_prefill"] = (
    lambda: _paged_prefill_triton.paged_prefill,
    {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "BlockTable": "*i32", "Blocks": "*i32",
     "qk_scale": "FLOAT", **ATTENTION_STRIDES},
    {"GROUP": 4, "BLOCK_M": 64, **ATTENTION_SHAPE})


@pytest.mark.parametrize("float_type", ["fp32", "fp64"], ids=["triton-launch", "torch-compile"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_with_float_scalars_as_each_launcher_types_them(name, float_type):
    kernel, signature, constexprs = KERNELS[name]
    fn = kernel()
    assert [a for a in fn.arg_names if a not in signature and a not in constexprs] == []
    types = {k: float_type if v == "FLOAT" else v for k, v in signature.items()}
    signature = {k: types.get(k, "constexpr") for k in fn.arg_names}  # in the kernel's argument order
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=HOPPER)
    assert compiled.asm["cubin"]
