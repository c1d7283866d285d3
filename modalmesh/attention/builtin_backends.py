"""The built-in attention backends as data: one capability record each (`BUILTIN_SPECS`).

Each record says where the backend runs, what it takes there, and facts the services
read (``graph_safe``, ``score_matrix``), plus where its code lives (``loader``, imported
only when the registry probes it). Limits are the documented/observed ones of the
kernels as torch and the wheels ship them; where unsure they are conservative, and
`probe` narrows them further for the versions actually installed. The registry
registers these records when it is imported; nothing here imports the registry or a
kernel. A new kernel is one module in backends/ plus one record below.
"""

from __future__ import annotations

import torch

from modalmesh.attention.capability import (
    ALL_FEATURES,
    CAUSAL,
    CAUSAL_OFFSET,
    FLOAT_DTYPES,
    GQA,
    HALF_DTYPES,
    PAGED,
    V_HEAD_DIM,
    VARLEN,
    WINDOW,
    BackendSpec,
    Target,
)

_HERE = "modalmesh.attention.backends"
F32_AND_HALF = HALF_DTYPES | {torch.float32}
MASKED = ALL_FEATURES  # a mask-taking kernel does all of these
UNMASKED = frozenset({CAUSAL, GQA})  # is_causal only: no windows, no packed/paged batches
FLASH = frozenset({CAUSAL, CAUSAL_OFFSET, WINDOW, VARLEN, PAGED, GQA})  # native varlen/paged, one head dim


def _everywhere(dtypes, features) -> tuple[Target, ...]:
    return tuple(Target(kind, dtypes, features) for kind in ("cuda", "rocm", "cpu"))


BUILTIN_SPECS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "sdpa_cudnn", f"{_HERE}.sdpa:SdpaCudnn",
        targets=(Target("cuda", HALF_DTYPES, UNMASKED, min_capability=(8, 0), max_head_dim=128, head_dim_multiple=8),),
        doc="torch SDPA pinned to cuDNN attention (rejects FP32; measured on H200)",
        cast_dtype=torch.bfloat16,
    ),
    BackendSpec(
        "sdpa_flash", f"{_HERE}.sdpa:SdpaFlash",
        targets=(
            Target("cuda", HALF_DTYPES, UNMASKED, min_capability=(8, 0), max_head_dim=256, head_dim_multiple=8),
            Target("rocm", HALF_DTYPES, UNMASKED, max_head_dim=256, head_dim_multiple=8),
            # torch's CPU flash kernel takes FP32, masks and GQA, but not a distinct value head dim.
            Target("cpu", FLOAT_DTYPES, ALL_FEATURES - {V_HEAD_DIM}),
        ),
        doc="torch SDPA pinned to its flash kernel (rejects FP32 on GPUs; measured on H200)",
        cast_dtype=torch.bfloat16,
    ),
    BackendSpec(
        "sdpa_efficient", f"{_HERE}.sdpa:SdpaEfficient",
        targets=(
            Target("cuda", F32_AND_HALF, MASKED, min_capability=(5, 0), head_dim_multiple=8),
            Target("rocm", F32_AND_HALF, MASKED, head_dim_multiple=8),
        ),
        doc="torch SDPA pinned to memory-efficient attention (FP32-capable, takes masks)",
    ),
    BackendSpec(
        "sdpa_math", f"{_HERE}.sdpa:SdpaMath",
        targets=_everywhere(FLOAT_DTYPES, ALL_FEATURES),
        doc="torch SDPA pinned to the math kernel: every platform, dtype, head dim and layout",
        score_matrix=True,
    ),
    BackendSpec(
        "torch_varlen", f"{_HERE}.torch_varlen:TorchVarlen",
        targets=(Target("cuda", HALF_DTYPES, FLASH, min_capability=(8, 0), max_head_dim=256, head_dim_multiple=8),),
        doc="torch.nn.attention.varlen.varlen_attn (torch's flash kernels with cu_seqlens)",
        cast_dtype=torch.bfloat16,
        page_size_multiple=256,
    ),
    BackendSpec(
        "fa2", f"{_HERE}.fa2:FlashAttn2",
        targets=(Target("cuda", HALF_DTYPES, FLASH, min_capability=(8, 0), max_head_dim=256),),
        doc="flash-attn 2 (flash_attn package)",
        cast_dtype=torch.bfloat16,
        page_size_multiple=256,
    ),
    BackendSpec(
        "fa3", f"{_HERE}.fa3:FlashAttn3",
        # Hopper only: FA3 has no sm100+/sm103 build (the MiMo-V2-on-Blackwell crash).
        targets=(Target("cuda", HALF_DTYPES, FLASH, min_capability=(9, 0), max_capability=(9, 0),
                        max_head_dim=256, head_dim_multiple=8),),
        doc="FlashAttention-3 (flash_attn_interface, or fa3_fwd_interface: bf16, no window, no paged)",
        cast_dtype=torch.bfloat16,
    ),
    BackendSpec(
        "triton_paged", f"{_HERE}.triton_paged:TritonPaged",
        targets=(Target("cuda", F32_AND_HALF, frozenset({CAUSAL, CAUSAL_OFFSET, WINDOW, PAGED, GQA, V_HEAD_DIM}),
                        min_capability=(8, 0), max_head_dim=256),),
        doc="our Triton paged-KV kernels: decode (CUDA-graph safe) and chunks over a cached prefix; new prompts go to the "
            "fastest varlen kernel",
        graph_safe=True,
    ),
    BackendSpec(
        "matmul_chunked", f"{_HERE}.chunked_matmul:ChunkedMatmul",
        # fp16 / bf16 products with float32 output: cuBLAS on Ampere and later
        targets=(Target("cuda", HALF_DTYPES, frozenset({GQA}), min_capability=(8, 0), head_dim_multiple=8),),
        doc="dense attention as cuBLAS GEMMs per block of queries, float32 scores, one-pass softmax "
            "(head dims past the flash kernels: the VAE's 512)",
        cast_dtype=torch.bfloat16,
    ),
    BackendSpec(
        "torch_naive", f"{_HERE}.naive:NaiveBackend",
        targets=_everywhere(FLOAT_DTYPES, ALL_FEATURES),
        doc="reference: plain matmul/softmax with FP32 accumulation (the test oracle)",
        reference=True,
        score_matrix=True,
    ),
)
