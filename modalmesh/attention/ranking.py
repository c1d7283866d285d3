"""Automatic ranking: which backend to try first, per platform, layout and head dim.

Data, not code: the first `RankRule` matching the platform and the component's
primary layout and head dim gives the order; each rule carries the measurement
(or the admission that there is none) that justifies it, and that text becomes
the selection's reason. Backends a rule does not name follow in registration
order; the reference backend comes last. Ranking only orders: capabilities,
the supported set and the kernel probe decide what is usable at all.

Measurements, one H200 (bf16, TFLOP/s, torch SDPA pinned per kernel):
  hd128 s4096 non-causal: fa3 710, sdpa_cudnn 668-677, sdpa_flash 355, sdpa_efficient 173
  hd128 s4096 causal:     fa3 667, sdpa_cudnn 559
  hd64  s1024:            sdpa_cudnn 425, fa3 365, sdpa_flash 278
  packed varlen hd128:    fa3 633, torch_varlen 317
One H100 (bf16, 2026-12-06): hd512 s16384 matmul_chunked 324, sdpa_efficient 121; s4096 341, 122.
CPU (this dev box, FP32, 2 threads, GFLOP/s): sdpa_flash 67-83, sdpa_math 21-26.
`python bench/attention.py` re-measures and says whether each pick is within 5%
of the fastest correct backend; update these rules from its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modalmesh.attention import registry

_H200_HD128 = "H200 bf16 hd128 s4096: fa3 710 TFLOP/s (causal 667) > sdpa_cudnn 668-677 (559) > sdpa_flash 355"
_H200_HD64 = "H200 bf16 hd64 s1024: sdpa_cudnn 425 TFLOP/s > fa3 365 > sdpa_flash 278"
_H200_HD64_LONG = "H200 bf16 hd64 s1500 (Whisper): fa3 475 TFLOP/s > sdpa_cudnn 384 > sdpa_flash 276"
_H200_FP32 = ("H200 fp32 hd512 (VAE mid-block): sdpa_math 37.9 TFLOP/s > sdpa_efficient 31.0 at s4096, "
              "41.8 > 39.6 at s16384")
_H100_HD512 = ("H100 bf16 hd512 (VAE mid-block): matmul_chunked 324 TFLOP/s > sdpa_efficient 121 at s16384, "
               "341 > 122 at s4096")
_H200_VARLEN = "H200 bf16 packed hd128: fa3 633 TFLOP/s > torch_varlen 317"
_PAGED = "native paged-KV kernels first (triton_paged: no page gather, CUDA-graph safe), SDPA gathers pages"
_FP32 = ("sdpa_efficient", "sdpa_math")  # what FP32 falls to on GPUs


@dataclass(frozen=True)
class RankRule:
    kind: str  # platform kind
    order: tuple[str, ...]
    why: str
    layout: str | None = None  # None: any
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    arch_prefixes: tuple[str, ...] = ()
    max_head_dim: int | None = None  # applies to head dims <= this
    min_head_dim: int | None = None  # applies to head dims >= this
    dtypes: tuple[torch.dtype, ...] = ()  # empty: any
    # Sequence-length bounds need the component's seqlen hint; without one such a rule does not match.
    min_seqlen: int | None = None
    max_seqlen: int | None = None

    def matches(self, platform, layout: str, head_dim: int, dtype: torch.dtype | None = None,
                seqlen: int | None = None) -> bool:
        cap = platform.capability
        if self.dtypes and dtype not in self.dtypes:
            return False
        if (self.min_seqlen is not None or self.max_seqlen is not None) and seqlen is None:
            return False
        if (self.min_seqlen is not None and seqlen < self.min_seqlen) or (
                self.max_seqlen is not None and seqlen > self.max_seqlen):
            return False
        return (
            platform.kind == self.kind
            and (self.layout is None or self.layout == layout)
            and (self.min_capability is None or (cap is not None and cap >= self.min_capability))
            and (self.max_capability is None or (cap is not None and cap <= self.max_capability))
            and (not self.arch_prefixes or platform.arch_name.startswith(self.arch_prefixes))
            and (self.max_head_dim is None or head_dim <= self.max_head_dim)
            and (self.min_head_dim is None or head_dim >= self.min_head_dim)
        )


HOPPER = dict(kind="cuda", min_capability=(9, 0), max_capability=(9, 0))
BLACKWELL = dict(kind="cuda", min_capability=(10, 0))
AMPERE_ADA = dict(kind="cuda", min_capability=(8, 0), max_capability=(8, 9))

RANKING: tuple[RankRule, ...] = (
    # Hopper FP32 (the VAE contract): no fused kernel takes it; math beat efficient up to s16384
    # (its score matrix is 1 GiB per image there); beyond that, the memory-lean kernel.
    RankRule(**HOPPER, layout="dense", dtypes=(torch.float32,), max_seqlen=16384, why=_H200_FP32,
             order=("sdpa_math", "sdpa_efficient")),
    # Hopper, half precision past the flash kernels' head dims (the VAE's 512): two GEMMs beat efficient SDPA.
    RankRule(**HOPPER, layout="dense", min_head_dim=257, why=_H100_HD512,
             order=("matmul_chunked", *_FP32)),
    # Hopper: FA3 wins at head dim 128 and at hd64 beyond ~1k tokens, cuDNN at hd64 s1024 (measured).
    RankRule(**HOPPER, layout="dense", max_head_dim=64, min_seqlen=1280, why=_H200_HD64_LONG,
             order=("fa3", "sdpa_cudnn", "sdpa_flash", "fa2", "torch_varlen", *_FP32)),
    RankRule(**HOPPER, layout="dense", max_head_dim=64, why=_H200_HD64,
             order=("sdpa_cudnn", "fa3", "sdpa_flash", "fa2", "torch_varlen", *_FP32)),
    RankRule(**HOPPER, layout="dense", why=_H200_HD128,
             order=("fa3", "sdpa_cudnn", "sdpa_flash", "fa2", "torch_varlen", *_FP32)),
    RankRule(**HOPPER, layout="varlen", why=_H200_VARLEN, order=("fa3", "torch_varlen", "fa2", *_FP32)),
    RankRule(**HOPPER, layout="paged", why=_PAGED, order=("triton_paged", "fa3", "fa2", "torch_varlen", *_FP32)),
    # Blackwell (sm100/sm103): no FA3 build exists; FA4 would slot in first once registered.
    RankRule(**BLACKWELL, layout="dense", why="sm100+: no FA3; cuDNN then flash SDPA (unmeasured)",
             order=("sdpa_cudnn", "sdpa_flash", "fa2", "torch_varlen", *_FP32)),
    RankRule(**BLACKWELL, layout="varlen", why="sm100+: no FA3; torch varlen (unmeasured)",
             order=("torch_varlen", "fa2", *_FP32)),
    RankRule(**BLACKWELL, layout="paged", why=_PAGED, order=("fa2", "torch_varlen", "triton_paged", *_FP32)),
    # Ampere / Ada: FA2 is what torch's flash SDPA wraps; cuDNN attention is not torch's pick there.
    RankRule(**AMPERE_ADA, layout="dense", why="sm8x: flash kernels first, as torch orders them (unmeasured)",
             order=("fa2", "sdpa_flash", "torch_varlen", "sdpa_cudnn", *_FP32)),
    RankRule(**AMPERE_ADA, why="sm8x: FA2 varlen/paged first (unmeasured)",
             order=("fa2", "torch_varlen", *_FP32)),
    RankRule("cuda", why="pre-Ampere CUDA: memory-efficient SDPA", order=_FP32),
    # ROCm: on gfx95x (MI355) SDPA math is the dependable path (issue 3); elsewhere torch's order.
    RankRule("rocm", arch_prefixes=("gfx95",), why="ROCm gfx95x: SDPA math (issue 3)",
             order=("sdpa_math", "sdpa_efficient", "sdpa_flash")),
    RankRule("rocm", why="ROCm: flash, efficient, math SDPA (unmeasured)",
             order=("sdpa_flash", "sdpa_efficient", "sdpa_math")),
    RankRule("cpu", why="CPU FP32: sdpa_flash 67-83 GFLOP/s > sdpa_math 21-26 (2 threads)",
             order=("sdpa_flash", "sdpa_math")),
)


def rank(platform, layout: str, head_dim: int, rules: tuple[RankRule, ...] = RANKING, *,
         dtype: torch.dtype | None = None, seqlen: int | None = None) -> tuple[list[str], str]:
    """Every registered backend, best first, and why the order is what it is."""
    rule = next((r for r in rules if r.matches(platform, layout, head_dim, dtype, seqlen)), None)
    names = registry.names()
    named = [n for n in rule.order if n in names] if rule else []
    rest = [n for n in names if n not in named]
    rest.sort(key=lambda n: registry.spec(n).reference)  # stable: registration order, reference last
    return named + rest, (rule.why if rule else f"no ranking for {platform.describe()}: registration order")
