"""Paged KV allocation in pure Python: page ids and a free list, no tensors.

The KV cache is cut into pages of `page_size` token slots. A sequence owns a
list of pages (its block-table row); token ``i`` of the sequence lives at slot
``pages[i // page_size] * page_size + i % page_size``. Pages return to the free
list when the sequence is freed; any page fits any sequence, so there is no
external fragmentation, and at most ``page_size - 1`` slots per sequence sit
unused (internal fragmentation).

Running out of pages is not an exception: `allocate` / `extend` return False
and change nothing, so the scheduler can queue the request or preempt one.

    alloc = PageAllocator(num_pages=1024, page_size=16)
    if not alloc.allocate("req-1", prompt_len):   # prefill
        ...                                        # wait: no room
    slots = alloc.slot_mapping("req-1")            # where prefill writes K/V
    alloc.extend("req-1", 1)                       # each decode step
    alloc.block_table(["req-1", "req-2"])          # padded rows for the kernel
    alloc.free("req-1")
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from modalmesh.errors import InvalidArgument


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int = 16):
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size}: need num_pages >= 0, page_size > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._seqs: dict[Hashable, _Seq] = {}
        self._used_tokens = 0

    # ---- accounting --------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_tokens(self) -> int:
        """Token slots written or reserved by live sequences (not counting page tails)."""
        return self._used_tokens

    @property
    def free_tokens(self) -> int:
        """Tokens a new sequence could get now."""
        return len(self._free) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- allocate / extend / free ------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self._free)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Reserve slots for a new sequence's first `num_tokens` tokens; False (and no change) if they do not fit."""
        if seq_id in self._seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already holds KV pages")
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens={num_tokens} < 0")
        needed = self.pages_for(num_tokens)
        if needed > len(self._free):
            return False
        self._seqs[seq_id] = _Seq([self._free.popleft() for _ in range(needed)], num_tokens)
        self._used_tokens += num_tokens
        return True

    def can_extend(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        seq = self._get(seq_id)
        return self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages) <= len(self._free)

    def extend(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Grow a sequence by `num_new_tokens` slots; False (and no change) if the new pages do not fit."""
        if num_new_tokens < 0:
            raise InvalidArgument(f"num_new_tokens={num_new_tokens} < 0")
        seq = self._get(seq_id)
        needed = self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages)
        if needed > len(self._free):
            return False
        seq.pages.extend(self._free.popleft() for _ in range(needed))
        seq.num_tokens += num_new_tokens
        self._used_tokens += num_new_tokens
        return True

    def reserve_page(self) -> int:
        """Take one free page out of circulation for good (e.g. a scratch page padding rows write to).

        It belongs to no sequence and leaves the capacity, so usage figures stay exact.
        """
        if not self._free:
            raise InvalidArgument("no free page to reserve")
        self.num_pages -= 1
        return self._free.pop()

    def free(self, seq_id: Hashable) -> int:
        """Return a sequence's pages to the free list; returns how many pages came back."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise InvalidArgument(f"sequence {seq_id!r} holds no KV pages")
        self._free.extend(seq.pages)
        self._used_tokens -= seq.num_tokens
        return len(seq.pages)

    # ---- views for the attention kernels -----------------------------------------------
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise InvalidArgument(f"sequence {seq_id!r} holds no KV pages") from None

    def pages(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).pages)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Cache slots of the sequence's tokens [start, end) (default: all of them)."""
        seq = self._get(seq_id)
        end = seq.num_tokens if end is None else end
        if not 0 <= start <= end <= seq.num_tokens:
            raise InvalidArgument(f"tokens [{start}, {end}) outside the {seq.num_tokens} held by {seq_id!r}")
        p = self.page_size
        return [seq.pages[i // p] * p + i % p for i in range(start, end)]

    def block_table(self, seq_ids: Sequence[Hashable], max_pages: int | None = None, pad: int = 0) -> list[list[int]]:
        """One row of page ids per sequence, padded with `pad` to `max_pages` (default: the longest row).

        Padding entries are never read by a kernel that respects context_lens; 0 is
        a valid page id, so even one that does not stays in bounds.
        """
        rows = [self._get(s).pages for s in seq_ids]
        width = max((len(r) for r in rows), default=0) if max_pages is None else max_pages
        if any(len(r) > width for r in rows):
            raise InvalidArgument(f"a sequence holds more than max_pages={width} pages")
        return [r + [pad] * (width - len(r)) for r in rows]

    def check(self) -> None:
        """Assert the invariants: every page is free or owned by exactly one sequence, counts add up."""
        owned = [p for s in self._seqs.values() for p in s.pages]
        every = sorted(owned + list(self._free))
        if every != list(range(self.num_pages)):
            raise AssertionError("KV pages leaked or double-owned")
        for seq_id, s in self._seqs.items():
            if len(s.pages) != self.pages_for(s.num_tokens):
                raise AssertionError(f"{seq_id!r}: {len(s.pages)} pages for {s.num_tokens} tokens")
        if self._used_tokens != sum(s.num_tokens for s in self._seqs.values()):
            raise AssertionError("used token count drifted")


def block_table_tensor(rows: list[list[int]], device: torch.device | str | None = None) -> torch.Tensor:
    """(batch, max_pages) int32, as the attention kernels take it."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), width)


def slot_mapping_tensor(slots: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64, device=device)


def context_lens_tensor(lens: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=device)
