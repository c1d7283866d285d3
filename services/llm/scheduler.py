"""Continuous-batching scheduler: pure Python over the KV page allocator.

Every step spends a token budget. Running sequences go first, oldest first:
one token each when decoding, the next chunk of their prompt when a long
prefill is still in progress. Waiting sequences then join, first come first
served, while budget, sequence slots and KV pages last. A sequence that needs
a page when none is free preempts the youngest running sequence (its pages are
freed and it is recomputed later, ahead of the queue); nothing is corrupted,
nothing crashes. Chunked prefill falls out of the budget: a prompt longer than
what is left this step continues next step.

The engine schedules step N+1 before it knows step N's sampled tokens: `advance`
records what step N computes and appends a `PENDING` token to each sampled
sequence (the device feeds the real one into step N+1); `fill` writes the token
in once it is read back.

Prefix caching (`prefix_caching=True`): a newcomer starts from the longest run
of cached pages its prompt's page keys match (`modalmesh.kv.page_keys`), as if
that much of a chunked prefill had run; its last token is always computed, for
its logits. `advance` enters each page in the cache once its K/V are computed
and its tokens known (an output token still `PENDING` waits a step). A newcomer
whose next uncached page another sequence computes in this very step waits one
step and takes it from the cache: siblings of an `n > 1` request, or a burst
sharing a system prompt, prefill it once.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from modalmesh.kv.allocator import PageAllocator
from modalmesh.kv.page_keys import ItemRows, extend_keys


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()
PENDING = -1  # an output token sampled on the device and not yet read back
StateT = TypeVar("StateT")


@dataclass(eq=False)
class Sequence(Generic[StateT]):
    seq_id: Hashable
    prompt_ids: list[int]
    max_tokens: int
    state: StateT | None = None  # the engine's per-request state (services.llm.request.RequestState)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrivals))
    num_preemptions: int = 0
    # Prefix caching. `items`: the prompt's multimodal rows (their keys take the item's digest); `cacheable`:
    # False keeps the sequence out of the cache both ways (prompt logprobs need every row computed; an item
    # without a digest could not be told from another). `holds`: pseudo-sequences of the allocator that keep
    # cached pages this prompt relies on (items whose encoding was skipped), freed when it finishes.
    items: tuple[ItemRows, ...] = ()
    cacheable: bool = True
    holds: tuple[Hashable, ...] = ()
    page_keys: list[bytes] = field(default_factory=list)  # keys of its first full pages, as far as known
    cached_pages: int = 0  # its first pages that are in the cache (matched, or entered by `advance`)
    num_cached: int = 0  # prompt tokens found in the cache when it was first scheduled (usage.cached_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + length) of `seq` run this step; `sample` if they reach its last token."""

    seq: Sequence
    start: int
    length: int
    sample: bool  # fixed when scheduled: the sequence grows once the step completes

    @classmethod
    def of(cls, seq: Sequence, length: int) -> Chunk:
        return cls(seq, seq.num_computed, length, seq.num_computed + length == seq.num_tokens)

    @property
    def is_prefill(self) -> bool:
        return self.start < len(self.seq.prompt_ids) or self.length > 1


@dataclass
class Step:
    chunks: list[Chunk]
    preempted: list[Sequence]
    cache_queries: int = 0  # prompt tokens of the sequences scheduled for the first time
    cache_hits: int = 0  # of those, found in the prefix cache

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, allocator: PageAllocator, *, max_num_seqs: int = 256, max_batch_tokens: int = 1024,
                 max_prefill_chunk: int | None = None, prefix_caching: bool = False):
        if max_num_seqs <= 0 or max_batch_tokens <= 0:
            raise ValueError("max_num_seqs and max_batch_tokens must be positive")
        self.allocator = allocator
        self.prefix_caching = prefix_caching
        self.page_size = allocator.page_size
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> Step:
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget, self.max_prefill_chunk)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: it was the youngest, nothing after it
            chunks.append(Chunk.of(seq, n))
            budget -= n
            i += 1
        step = Step(chunks, preempted)
        # Keys of the pages this step's prefill chunks compute: a newcomer that needs one next waits a step.
        computing = {k for c in chunks if c.length > 1 for k in self._chunk_keys(c)} if self.prefix_caching else ()
        deferred: list[Sequence] = []
        # Newcomers only when nobody had to make room this step (no thrashing).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            hits = self._match(seq) if self.prefix_caching and seq.cacheable else []
            if len(seq.page_keys) > len(hits) and seq.page_keys[len(hits)] in computing:
                deferred.append(self.waiting.popleft())
                continue
            start = len(hits) * self.page_size
            n = min(seq.num_tokens - start, budget, self.max_prefill_chunk)
            if not self.allocator.allocate(seq.seq_id, start + n, cached=hits):
                break
            self.waiting.popleft()
            seq.num_computed = start
            seq.cached_pages = len(hits)
            if seq.num_preemptions == 0:  # its first time: what it asked of the cache and got
                seq.num_cached = start
                step.cache_queries += len(seq.prompt_ids)
                step.cache_hits += start
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunk = Chunk.of(seq, n)
            chunks.append(chunk)
            budget -= n
            if self.prefix_caching and n > 1:
                computing.update(self._chunk_keys(chunk))
        self.waiting.extendleft(reversed(deferred))
        return step

    def _match(self, seq: Sequence) -> list[int]:
        """The cached pages `seq` can start from: full pages before its last token (always computed: its
        logits are sampled), as far as its tokens are known."""
        upto = seq.num_tokens - 1
        keys = extend_keys(seq.page_keys, seq.token_ids, self.page_size, upto, seq.items, unknown=PENDING)
        return self.allocator.match(keys[:upto // self.page_size])

    def _chunk_keys(self, chunk: Chunk) -> list[bytes]:
        """Keys (known so far) of the full pages `chunk` completes."""
        p = self.page_size
        return chunk.seq.page_keys[chunk.start // p:(chunk.start + chunk.length) // p] if chunk.seq.cacheable else []

    def _reserve(self, seq: Sequence, total_tokens: int) -> bool:
        """Make the allocator hold at least `total_tokens` slots for seq."""
        if seq.seq_id not in self.allocator:
            return self.allocator.allocate(seq.seq_id, total_tokens)
        more = total_tokens - self.allocator.num_tokens(seq.seq_id)
        return more <= 0 or self.allocator.extend(seq.seq_id, more)

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.seq_id)  # its computed pages stay cached: it starts from them again
        seq.num_computed = 0
        seq.cached_pages = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def advance(self, step: Step) -> dict[Hashable, int]:
        """Record what a launched step computes: its chunks' K/V will be cached, and each sampled sequence
        gets a `PENDING` token. Returns the index of each pending token in its sequence's outputs."""
        pending = {}
        for chunk in step.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            seq.num_computed = chunk.start + chunk.length
            if self.prefix_caching and seq.num_computed // self.page_size > seq.cached_pages and seq.cacheable:
                self._cache_computed(seq)
            if chunk.sample:
                pending[seq.seq_id] = len(seq.output_ids)
                seq.output_ids.append(PENDING)
        return pending

    def _cache_computed(self, seq: Sequence) -> None:
        """Enter the sequence's computed full pages whose tokens are known in the prefix cache."""
        full = seq.num_computed // self.page_size
        keys = extend_keys(seq.page_keys, seq.token_ids, self.page_size, seq.num_computed, seq.items,
                           unknown=PENDING)
        known = min(len(keys), full)
        if known > seq.cached_pages:
            self.allocator.cache(seq.seq_id, keys[:known])
            seq.cached_pages = known

    @staticmethod
    def fill(seq: Sequence, index: int, token: int) -> None:
        """The sampled token read back, in place of its `PENDING` (also while preempted, to recompute)."""
        if seq.output_ids[index] != PENDING:
            raise RuntimeError(f"{seq.seq_id}: output {index} is {seq.output_ids[index]}, not pending")
        seq.output_ids[index] = token

    def finish(self, seq: Sequence, reason: str, *, computed: bool = True) -> None:
        """End a sequence (stop, length, abort): its pages go back to the pool now. `computed=False`: a step
        of it failed, so the pages only it holds leave the prefix cache too."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq.seq_id in self.allocator:
            if not computed:
                self.allocator.forget(seq.seq_id)
            self.allocator.free(seq.seq_id)
        for hold in seq.holds:
            if hold in self.allocator:
                self.allocator.free(hold)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
