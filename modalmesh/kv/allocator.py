"""Paged KV allocation in pure Python: page ids and a free list, no tensors.

The KV cache is cut into pages of `page_size` token slots. A sequence owns a
list of pages (its block-table row); token ``i`` of the sequence lives at slot
``pages[i // page_size] * page_size + i % page_size``. Pages return to the free
list when the sequence is freed; any page fits any sequence, so there is no
external fragmentation, and at most ``page_size - 1`` slots per sequence sit
unused (internal fragmentation).

Running out of pages is not an exception: `allocate` / `extend` return False
and change nothing, so the scheduler can queue the request or preempt one.

Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache): a full
page whose K/V are computed can be `cache`d under a key (`modalmesh.kv.page_keys`:
a hash of its tokens chained with its parent's). A new sequence `match`es the
longest run of cached pages its own keys name and `allocate`s with them: they
are shared by reference count, never written again (a sequence writes only
slots past its cached prefix, in pages of its own). A cached page whose last
owner frees it keeps its key and K/V until a new page is needed and no plain
free page is left; then the least recently freed goes first. A page held by a
sequence is never evicted.

    alloc = PageAllocator(num_pages=1024, page_size=16)
    if not alloc.allocate("req-1", prompt_len):   # prefill
        ...                                        # wait: no room
    slots = alloc.slot_mapping("req-1")            # where prefill writes K/V
    alloc.extend("req-1", 1)                       # each decode step
    alloc.block_table(["req-1", "req-2"])          # padded rows for the kernel
    alloc.free("req-1")
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from modalmesh.errors import InvalidArgument


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_pages: int = 0  # its first pages that are in the cache (shared or registered by it)


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int = 16):
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"num_pages={num_pages}, page_size={page_size}: need num_pages >= 0, page_size > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))  # no owner, no cached content
        self._seqs: dict[Hashable, _Seq] = {}
        self._used_tokens = 0
        self._refs = [0] * num_pages  # owners of each page
        self._page_of: dict[bytes, int] = {}  # cache key -> page holding that content
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first

    # ---- accounting --------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages a new sequence could take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages whose content is in the cache (held or not)."""
        return len(self._key_of)

    @property
    def used_tokens(self) -> int:
        """Token slots written or reserved by live sequences (not counting page tails); a shared page once."""
        return self._used_tokens

    @property
    def free_tokens(self) -> int:
        """Tokens a new sequence could get now."""
        return self.num_free_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- allocate / extend / free ------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_free_pages

    def allocate(self, seq_id: Hashable, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Reserve slots for a new sequence's first `num_tokens` tokens; False (and no change) if they do not fit.

        `cached`: pages `match` found for its first tokens, shared with whoever holds them (full pages,
        within `num_tokens`)."""
        if seq_id in self._seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already holds KV pages")
        if num_tokens < 0:
            raise InvalidArgument(f"num_tokens={num_tokens} < 0")
        if len(cached) * self.page_size > num_tokens:
            raise InvalidArgument(f"{len(cached)} cached pages hold more than the {num_tokens} tokens asked for")
        needed = self.pages_for(num_tokens) - len(cached)
        idle_hits = sum(1 for page in cached if self._refs[page] == 0)  # counted free, but taken as hits
        if needed > self.num_free_pages - idle_hits:
            return False
        for page in cached:
            if page not in self._key_of:
                raise InvalidArgument(f"page {page} is not in the prefix cache")
            if self._refs[page]:
                self._used_tokens -= self.page_size  # already counted for its other holders
            else:
                del self._evictable[page]
            self._refs[page] += 1
        self._seqs[seq_id] = _Seq(list(cached) + [self._take() for _ in range(needed)], num_tokens, len(cached))
        self._used_tokens += num_tokens
        return True

    def can_extend(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        seq = self._get(seq_id)
        return self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages) <= self.num_free_pages

    def extend(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Grow a sequence by `num_new_tokens` slots; False (and no change) if the new pages do not fit."""
        if num_new_tokens < 0:
            raise InvalidArgument(f"num_new_tokens={num_new_tokens} < 0")
        seq = self._get(seq_id)
        needed = self.pages_for(seq.num_tokens + num_new_tokens) - len(seq.pages)
        if needed > 0:
            if needed > len(self._free) + len(self._evictable):
                return False
            seq.pages.extend(self._take() for _ in range(needed))
        seq.num_tokens += num_new_tokens
        self._used_tokens += num_new_tokens
        return True

    def _take(self) -> int:
        """One page for a sequence's new tokens: a free one, else the cached page freed longest ago."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    # ---- the prefix cache -----------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys` (one key per full page, in order)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def cache(self, seq_id: Hashable, keys: Sequence[bytes]) -> None:
        """Enter the sequence's first len(keys) pages in the cache under `keys`; each must be full and its
        K/V computed (or being computed by a step that runs before any that reads them). Pages entered
        already stay as they are; one whose content another page holds already stays out (the cache keeps
        one copy)."""
        seq = self._get(seq_id)
        if len(keys) * self.page_size > seq.num_tokens:
            raise InvalidArgument(f"{seq_id!r}: {len(keys)} keys for {seq.num_tokens} tokens (full pages only)")
        for i in range(seq.num_cached_pages, len(keys)):
            page, key = seq.pages[i], keys[i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key
        seq.num_cached_pages = max(seq.num_cached_pages, len(keys))

    def forget(self, seq_id: Hashable) -> None:
        """Take the sequence's pages out of the cache (their K/V may be wrong: its step failed). Pages other
        sequences share stay: they were computed by an earlier step."""
        for page in self._get(seq_id).pages:
            if self._refs[page] == 1 and page in self._key_of:
                del self._page_of[self._key_of.pop(page)]

    def reserve_page(self) -> int:
        """Take one free page out of circulation for good (e.g. a scratch page padding rows write to).

        It belongs to no sequence and leaves the capacity, so usage figures stay exact.
        """
        if not self._free:
            raise InvalidArgument("no free page to reserve")
        self.num_pages -= 1
        page = self._free.pop()
        self._refs[page] = -1  # out of circulation: no sequence, no cache
        return page

    def free(self, seq_id: Hashable) -> int:
        """Give back a sequence's pages; returns how many it held. A page others share stays theirs; a
        cached one nobody holds any more stays cached (evicted last for the sequence's first pages)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise InvalidArgument(f"sequence {seq_id!r} holds no KV pages")
        self._used_tokens -= seq.num_tokens
        for page in reversed(seq.pages):  # the tail first: a prefix outlives the turns that extend it
            self._refs[page] -= 1
            if self._refs[page]:
                self._used_tokens += self.page_size  # still held (a full, shared page)
            elif page in self._key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)
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
        """Assert the invariants: every page is free, cached and idle, or held (its count = its holders);
        only full pages are shared; counts add up."""
        holders: dict[int, int] = {}
        for s in self._seqs.values():
            for p in s.pages:
                holders[p] = holders.get(p, 0) + 1
        circulating = [p for p in range(len(self._refs)) if self._refs[p] >= 0]
        if len(circulating) != self.num_pages:
            raise AssertionError("reserved page count drifted")
        idle = list(self._free) + list(self._evictable)
        if sorted(idle + list(holders)) != circulating or len(set(idle)) != len(idle):
            raise AssertionError("KV pages leaked or both free and held")
        for p in circulating:
            if self._refs[p] != holders.get(p, 0):
                raise AssertionError(f"page {p}: count {self._refs[p]} but {holders.get(p, 0)} holders")
        if set(self._evictable) - set(self._key_of) or set(self._free) & set(self._key_of):
            raise AssertionError("an idle page's cache entry is wrong")
        if {self._page_of[k]: k for k in self._page_of} != self._key_of:
            raise AssertionError("the cache's two maps disagree")
        for seq_id, s in self._seqs.items():
            if len(s.pages) != self.pages_for(s.num_tokens):
                raise AssertionError(f"{seq_id!r}: {len(s.pages)} pages for {s.num_tokens} tokens")
            for i, p in enumerate(s.pages):
                if holders[p] > 1 and (i + 1) * self.page_size > s.num_tokens:
                    raise AssertionError(f"{seq_id!r}: shares its partial page {p}")
        shared_tail = sum((n - 1) * self.page_size for n in holders.values() if n > 1)
        if self._used_tokens != sum(s.num_tokens for s in self._seqs.values()) - shared_tail:
            raise AssertionError("used token count drifted")


def block_table_tensor(rows: list[list[int]], device: torch.device | str | None = None) -> torch.Tensor:
    """(batch, max_pages) int32, as the attention kernels take it."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), width)


def slot_mapping_tensor(slots: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64, device=device)


def context_lens_tensor(lens: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=device)
