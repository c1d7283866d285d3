"""Batch metadata for packed and paged attention, built once per forward pass.

A model's forward builds one `VarlenMetadata` (packed sequences) or one
`PagedMetadata` (LLM over the paged KV pool) and hands it to every attention
layer, either as an argument or through `attention_metadata(meta)`. Anything a
backend derives from it (masks, pad indices, page-gather indices) is memoised
on the object with `meta.cached(key, build)`, so 32 layers share one copy and
no layer recomputes or re-synchronises with the host.

Host-side lengths travel with the device tensors so nothing here needs a
device->host copy, except `VarlenMetadata.from_cu_seqlens` (one copy per forward).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass(eq=False)
class VarlenMetadata:
    """Packed sequences: tokens of all sequences concatenated along dim 0, no padding."""

    cu_seqlens: torch.Tensor  # int32 (B + 1,): sequence b is tokens cu[b]:cu[b+1]
    max_seqlen: int
    seqlens: tuple[int, ...]  # host copy of the lengths
    # How mask-based kernels (SDPA) lay the batch out: "block_diag", "padded", or None to pick
    # the smaller mask (see masks.py). Native varlen kernels ignore it.
    sdpa_strategy: str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.sdpa_strategy not in (None, "block_diag", "padded"):
            raise ValueError(f"sdpa_strategy must be None, 'block_diag' or 'padded', not {self.sdpa_strategy!r}")

    @classmethod
    def from_seqlens(
        cls, seqlens: Sequence[int], device: torch.device | str = "cpu", *, sdpa_strategy: str | None = None
    ) -> VarlenMetadata:
        seqlens = tuple(int(n) for n in seqlens)
        if not seqlens or min(seqlens) < 0:
            raise ValueError(f"seqlens must be a non-empty list of lengths >= 0, got {seqlens!r}")
        cu = host_to_device([0, *accumulate(seqlens)], torch.int32, device)
        return cls(cu, max(seqlens), seqlens, sdpa_strategy)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, *, sdpa_strategy: str | None = None) -> VarlenMetadata:
        """From a cumulative-lengths tensor (one host copy: do it once per forward, not per layer)."""
        host = [int(x) for x in cu_seqlens.tolist()]
        if len(host) < 2 or host[0] != 0:
            raise ValueError("cu_seqlens must start at 0 and hold at least one sequence")
        seqlens = tuple(b - a for a, b in zip(host, host[1:]))
        if min(seqlens) < 0:
            raise ValueError("cu_seqlens must be non-decreasing")
        return cls(cu_seqlens.to(torch.int32), max(seqlens), seqlens, sdpa_strategy)

    @property
    def batch_size(self) -> int:
        return len(self.seqlens)

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def cached(self, key, build: Callable[[], object]):
        """Memoise something derived from this batch (a mask, an index) for every layer."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def positions(self) -> torch.Tensor:
        """(T,) int64: each token's position inside its own sequence (for rotary)."""
        return self.cached("positions", lambda: _positions(self.seqlens, self.seqlens, self.device))

    @property
    def sequence_ids(self) -> torch.Tensor:
        """(T,) int64: which sequence each token belongs to."""
        return self.cached("sequence_ids", lambda: _sequence_ids(self.seqlens, self.device))


@dataclass(eq=False)
class PagedMetadata:
    """New tokens of B sequences (packed) attending over their pages of the KV pool.

    The pool layout is owned by the KV package; the contract, per layer:
    ``k_cache (num_pages, page_size, num_kv_heads, head_dim)``, ``v_cache`` the same
    with ``v_head_dim``; a token's slot is ``page * page_size + offset``.
    """

    slot_mapping: torch.Tensor  # int64 (T,): where each new token's k/v is written
    block_table: torch.Tensor  # int32 (B, max_pages_per_seq): each sequence's pages in order
    context_lens: torch.Tensor  # int32 (B,): tokens in the cache per sequence, new ones included
    cu_seqlens_q: torch.Tensor  # int32 (B + 1,): new tokens of sequence b are q[cu[b]:cu[b+1]]
    query_lens: tuple[int, ...]  # host copies
    context_lens_host: tuple[int, ...]
    page_size: int
    # Every token a decode query of its own (mixed steps replayed from CUDA graphs): token i reads
    # block-table row token_seq[i] up to its causal length token_ctx[i], both int32 (T,) on the device.
    # Then the host fields above describe nothing a kernel may read; only graph-safe backends take these.
    token_seq: torch.Tensor | None = None
    token_ctx: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_table: torch.Tensor,
        page_size: int,
        *,
        slot_mapping: torch.Tensor | None = None,
    ) -> PagedMetadata:
        """Prefill (with or without a cached prefix) and decode alike: sequence b has
        `query_lens[b]` new tokens, which are the last of its `context_lens[b]` tokens."""
        query_lens = tuple(int(n) for n in query_lens)
        context_lens = tuple(int(n) for n in context_lens)
        if len(query_lens) != len(context_lens) or not query_lens:
            raise ValueError("query_lens and context_lens must be non-empty and of equal length")
        if any(q < 0 or q > c for q, c in zip(query_lens, context_lens)):
            raise ValueError(f"each query_len must be in 0..context_len: {query_lens} vs {context_lens}")
        if block_table.dim() != 2 or block_table.shape[0] != len(query_lens):
            raise ValueError(
                f"block_table must be (batch={len(query_lens)}, max_pages), got {tuple(block_table.shape)}")
        need = max(-(-c // page_size) for c in context_lens)
        if need > block_table.shape[1]:
            raise ValueError(f"block_table holds {block_table.shape[1]} pages per sequence; {need} are needed")
        device = block_table.device
        block_table = block_table.to(torch.int32)
        if slot_mapping is None:
            positions = _positions(query_lens, context_lens, device)
            seq = _sequence_ids(query_lens, device)
            pages = block_table[seq, torch.div(positions, page_size, rounding_mode="floor")].long()
            slot_mapping = pages * page_size + positions % page_size
        return cls(
            slot_mapping=slot_mapping.to(torch.int64),
            block_table=block_table,
            context_lens=host_to_device(context_lens, torch.int32, device),
            cu_seqlens_q=host_to_device([0, *accumulate(query_lens)], torch.int32, device),
            query_lens=query_lens,
            context_lens_host=context_lens,
            page_size=page_size,
        )

    @classmethod
    def decode(cls, context_lens: Sequence[int], block_table: torch.Tensor, page_size: int, **kw) -> PagedMetadata:
        """One new token per sequence."""
        return cls.build([1] * len(context_lens), context_lens, block_table, page_size, **kw)

    def per_token_as_decode(self) -> PagedMetadata:
        """The per-token form (`token_seq`, `token_ctx`) as an ordinary decode batch, one row per token, for
        backends that read lengths on the host (it reads them back: not for graph capture). Padding tokens
        (length 0) attend to one slot instead, so their rows stay finite."""
        tokens = self.token_seq.shape[0]
        ctx = self.token_ctx.clamp(min=1)
        return PagedMetadata(
            slot_mapping=self.slot_mapping, block_table=self.block_table[self.token_seq.long()], context_lens=ctx,
            cu_seqlens_q=torch.arange(tokens + 1, dtype=torch.int32, device=self.device),
            query_lens=(1,) * tokens, context_lens_host=tuple(ctx.tolist()), page_size=self.page_size)

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host)

    @property
    def device(self) -> torch.device:
        return self.block_table.device

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def without_prefix(self) -> bool:
        """Every sequence is all new tokens: attention needs only the new k/v, not the pool."""
        return self.query_lens == self.context_lens_host

    cached = VarlenMetadata.cached

    @property
    def positions(self) -> torch.Tensor:
        """(T,) int64: absolute position of each new token in its sequence (for rotary)."""
        return self.cached("positions", lambda: _positions(self.query_lens, self.context_lens_host, self.device))

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        """int32 (B + 1,): cumulative context lengths (kernels that take varlen k over pages)."""
        return self.cached(
            "cu_seqlens_k",
            lambda: host_to_device([0, *accumulate(self.context_lens_host)], torch.int32, self.device),
        )


def host_to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device: `torch.tensor(..., device=)`
    synchronises the stream, which would stall a host that runs one step ahead of the device."""
    # device="cpu" explicitly: under `with torch.device("meta")` (models built without memory) a bare
    # torch.tensor would be a meta tensor, which has no data to copy.
    return torch.tensor(values, dtype=dtype, device="cpu").to(device, non_blocking=True)


def _positions(query_lens, context_lens, device) -> torch.Tensor:
    # Token i of a sequence with q new tokens out of c sits at position c - q + i; vectorised so
    # a batch of hundreds of sequences costs a handful of kernels, not one per sequence.
    starts = [0, *accumulate(query_lens)][:-1]
    shift = host_to_device([c - q - s for q, c, s in zip(query_lens, context_lens, starts)], torch.int64, device)
    seq = _sequence_ids(query_lens, device)
    return torch.arange(seq.numel(), device=device, dtype=torch.int64) + shift[seq]


def _sequence_ids(lens, device) -> torch.Tensor:
    counts = host_to_device(lens, torch.int64, device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), counts, output_size=sum(lens))


# The metadata of the forward pass in progress, for layers called without it (nano-vllm's context).
_CURRENT: contextvars.ContextVar[VarlenMetadata | PagedMetadata | None] = contextvars.ContextVar(
    "modalmesh_attention_metadata", default=None
)


@contextmanager
def attention_metadata(meta: VarlenMetadata | PagedMetadata | None):
    """Make `meta` the metadata every Attention layer called inside the block uses by default."""
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def current_metadata() -> VarlenMetadata | PagedMetadata | None:
    return _CURRENT.get()
