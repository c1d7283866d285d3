"""The one interface every attention backend implements.

Tensors are in the model's natural layout (never (B, H, S, D)):
    dense:  q (B, S_q, H, D), k (B, S_k, H_kv, D), v (B, S_k, H_kv, Dv) -> (B, S_q, H, Dv)
    varlen: q (T, H, D), k (T, H_kv, D), v (T, H_kv, Dv) + VarlenMetadata -> (T, H, Dv)
    paged:  q (T, H, D) new tokens + the layer's k/v pool + PagedMetadata -> (T, H, Dv);
            the new tokens' k/v are already in the pool (Attention calls store_kv first).
`window` is None or (left, right) with -1 = unbounded; `scale` is a float.
A backend receives inputs in a dtype its record accepts (the layer casts or reroutes
before calling); it returns its output in the input dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from modalmesh.attention.capability import BackendSpec


class AttentionBackend(ABC):
    def __init__(self, spec: BackendSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def probe(self) -> None:
        """Import the kernel and check it is usable; raise if not. May narrow ``self.spec``.

        Called once, by the registry, which turns any exception into a recorded reason.
        """

    @abstractmethod
    def dense(self, q, k, v, *, causal: bool, scale: float, window) -> torch.Tensor: ...

    def varlen(self, q, k, v, meta, *, causal: bool, scale: float, window) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} has no packed (varlen) path")

    def paged(self, q, k_cache, v_cache, meta, *, causal: bool, scale: float, window) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} has no paged-KV path")

    def warm_paged(self, q, k_cache, v_cache, *, causal: bool, scale: float, window, max_seqs: int) -> None:
        """Before serving: compile whatever `paged` would compile on first use for a layer of this shape, in any
        step of up to `max_seqs` sequences (a JIT kernel compiles once per launch form, and a compile in a
        step stalls every request). `q` (1, H, D) in the compute dtype; the caches are the layer's. Reads the
        caches, writes nothing of them. Default: nothing to compile."""


def repeat_kv(x: torch.Tensor, num_heads: int, head_dim_axis: int = -2) -> torch.Tensor:
    """Repeat kv heads for kernels without native GQA (kv head i serves q heads i*g..(i+1)*g-1)."""
    groups = num_heads // x.shape[head_dim_axis]
    return x if groups == 1 else x.repeat_interleave(groups, dim=head_dim_axis)


def first(result):
    """Some kernel versions return (out, lse, ...), others out alone."""
    return result[0] if isinstance(result, (tuple, list)) else result
