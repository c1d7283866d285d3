"""What a backend can do (capability records) and what a call needs, as data.

A `BackendSpec` lists `Target`s: one per platform family it runs on, each with
its own dtypes, head-dim limits and features, because one torch kernel differs
by platform (SDPA's flash kernel takes FP32 and masks on CPU, neither on CUDA).
`Needs` describes a component or a single call; `unmet(spec, needs, platform)`
says, in words, why a backend cannot serve it (empty list: it can).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Features a target may declare. Dense (B, S, H, D) without a mask is implied.
CAUSAL = "causal"
WINDOW = "window"  # sliding window (left, right)
VARLEN = "varlen"  # packed (T, H, D) + cu_seqlens
PAGED = "paged"  # attention over a paged KV pool
GQA = "gqa"  # fewer kv heads than q heads
V_HEAD_DIM = "v_head_dim"  # value head dim different from the q/k head dim
# Dense causal with S_q < S_k: queries are the last S_q positions (bottom-right). SDPA's
# is_causal is top-left, so kernels that take no mask cannot do it.
CAUSAL_OFFSET = "causal_offset"
ALL_FEATURES = frozenset({CAUSAL, WINDOW, VARLEN, PAGED, GQA, V_HEAD_DIM, CAUSAL_OFFSET})

LAYOUTS = ("dense", "varlen", "paged")
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Target:
    """One platform family a backend runs on, and what it supports there."""

    kind: str  # "cuda" | "rocm" | "cpu"
    dtypes: frozenset[torch.dtype]
    features: frozenset[str]
    min_capability: tuple[int, int] | None = None  # inclusive
    max_capability: tuple[int, int] | None = None  # inclusive
    arch_prefixes: tuple[str, ...] = ()  # ROCm: e.g. ("gfx90a", "gfx94"); empty: any
    max_head_dim: int | None = None
    head_dim_multiple: int = 1

    def platform_mismatch(self, platform) -> str | None:
        if platform.kind != self.kind:
            return f"runs on {self.kind}"
        cap = platform.capability
        if self.min_capability and (cap is None or cap < self.min_capability):
            return f"needs compute capability >= {_cc(self.min_capability)}"
        if self.max_capability and (cap is None or cap > self.max_capability):
            return f"needs compute capability <= {_cc(self.max_capability)}"
        if self.arch_prefixes and not platform.arch_name.startswith(self.arch_prefixes):
            return f"needs arch {'/'.join(p + '*' for p in self.arch_prefixes)}"
        return None


def _cc(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


@dataclass(frozen=True)
class BackendSpec:
    """The capability record of one backend, plus where its code lives (imported lazily)."""

    name: str
    loader: str  # "package.module:ClassName"; the class takes the spec and may narrow it in probe()
    targets: tuple[Target, ...]
    doc: str = ""
    # A fused kernel with a fixed compute dtype: when chosen *explicitly* for a component
    # it casts other float inputs to this dtype and returns the input dtype.
    cast_dtype: torch.dtype | None = None
    page_size_multiple: int = 1  # paged KV: page size must be a multiple of this
    reference: bool = False  # the test oracle: never auto-selected while anything else serves
    # Its decode reads lengths and pages from device tensors only (no host synchronisation), so a
    # decode step through it can be captured in a CUDA graph and replayed (services/llm/graphs.py).
    graph_safe: bool = False
    # It materialises the (S_q, S_k) score matrix: memory grows with the square of the sequence
    # (the VAE's untiled-decode memory estimate counts it).
    score_matrix: bool = False

    def targets_for(self, platform) -> tuple[list[Target], list[str]]:
        matching, reasons = [], []
        for target in self.targets:
            why = target.platform_mismatch(platform)
            (reasons if why else matching).append(why or target)
        return matching, reasons


@dataclass(frozen=True)
class Needs:
    """What a component (at construction) or a call (at run time) requires of a backend."""

    dtype: torch.dtype
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim
    layouts: tuple[str, ...] = ("dense",)
    causal: bool = False
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; None = no window
    gqa: bool = False
    page_size: int | None = None  # paged: tokens per page, when known
    causal_offset: bool = False  # a dense causal call with S_q != S_k (known per call only)
    # Typical sequence length, when the component knows it (Whisper: 1500): ranking may depend on it.
    seqlen_hint: int | None = None

    def __post_init__(self):
        # Needs are dict keys: keep every field hashable whatever sequence type the caller used.
        object.__setattr__(self, "layouts", tuple(self.layouts))
        if self.window is not None:
            object.__setattr__(self, "window", tuple(self.window))
        bad = [layout for layout in self.layouts if layout not in LAYOUTS]
        if bad or not self.layouts:
            raise ValueError(f"layouts {self.layouts!r}: each must be one of {LAYOUTS}")
        if self.window is not None and tuple(self.window) == (-1, -1):
            object.__setattr__(self, "window", None)

    @property
    def features(self) -> frozenset[str]:
        wanted = set()
        if self.causal:
            wanted.add(CAUSAL)
        if self.causal_offset:
            wanted.add(CAUSAL_OFFSET)
        if self.window is not None:
            wanted.add(WINDOW)
        if self.gqa:
            wanted.add(GQA)
        if self.v_head_dim is not None and self.v_head_dim != self.head_dim:
            wanted.add(V_HEAD_DIM)
        wanted.update(layout for layout in self.layouts if layout != "dense")
        return frozenset(wanted)

    @property
    def max_head_dim(self) -> int:
        return max(self.head_dim, self.v_head_dim or self.head_dim)


def unmet(spec: BackendSpec, needs: Needs, platform, *, ignore_dtype: bool = False) -> list[str]:
    """Why `spec` cannot serve `needs` on `platform`; empty when it can."""
    targets, platform_reasons = spec.targets_for(platform)
    if not targets:
        return [f"not available on {platform.describe()}: " + "; ".join(platform_reasons)]
    best: list[str] | None = None
    for target in targets:  # usually one; the first target that fits wins
        reasons = _target_unmet(spec, target, needs, ignore_dtype)
        if not reasons:
            return []
        if best is None or len(reasons) < len(best):
            best = reasons
    return best or []


def _target_unmet(spec: BackendSpec, target: Target, needs: Needs, ignore_dtype: bool) -> list[str]:
    reasons = []
    if not ignore_dtype and needs.dtype not in target.dtypes:
        names = ", ".join(sorted(dtype_name(d) for d in target.dtypes))
        reasons.append(f"dtype {dtype_name(needs.dtype)} unsupported (takes {names})")
    missing = sorted(needs.features - target.features)
    if missing:
        reasons.append("no " + ", ".join(missing) + " support")
    for dim in {needs.head_dim, needs.v_head_dim or needs.head_dim}:
        if target.max_head_dim is not None and dim > target.max_head_dim:
            reasons.append(f"head dim {dim} > {target.max_head_dim}")
        elif dim % target.head_dim_multiple:
            reasons.append(f"head dim {dim} not a multiple of {target.head_dim_multiple}")
    if "paged" in needs.layouts and needs.page_size is not None and needs.page_size % spec.page_size_multiple:
        reasons.append(f"page size {needs.page_size} not a multiple of {spec.page_size_multiple}")
    return reasons

