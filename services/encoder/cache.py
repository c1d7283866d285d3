"""An LRU cache of finished embeddings, bounded in bytes.

Keys are the model's cache keys (content hash + preprocessing parameters); values
are `Answer`s (the Embedding without its bytes, and the embedding tensor, where the
model left it: on its device), so a hit returns the very tensor a miss produced,
costs no re-encoding and copies nothing (nobody writes into an answer's tensor; the
transport reads it). The byte budget counts the tensors' bytes, on the device or
the host. It reports under the shared pool schema
(pool="embedding_cache"): capacity and used rows, bytes, hits and misses.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from modalmesh import pb
from modalmesh.metrics import Metrics

POOL = "embedding_cache"


@dataclass(frozen=True)
class Answer:
    """One item's answer before it goes on the wire: the Embedding without its tensor bytes, and the tensor,
    which owns its memory (no view into a larger batch output that the cache would keep alive unseen)."""

    meta: pb.Embedding  # meta.embedding has dtype and shape, no data
    tensor: torch.Tensor  # on the model's device or the host; read, never written
    ready: "torch.cuda.Event | None" = None  # recorded after the tensor was made (CUDA): copies wait for it

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size() + self.meta.ByteSize()


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, *, bytes_per_row: int, metrics: Metrics | None = None):
        self.capacity_bytes = max(0, int(capacity_bytes))
        self.bytes_per_row = max(1, int(bytes_per_row))
        self.metrics = metrics
        self._entries: OrderedDict[bytes, Answer] = OrderedDict()
        self._bytes = 0
        self._rows = 0
        self._lock = threading.Lock()
        self._publish()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def used_rows(self) -> int:
        return self._rows

    def get(self, key: bytes) -> Answer | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if self.metrics is not None:
            (self.metrics.cache_hits_total if entry else self.metrics.cache_misses_total).labels(pool=POOL).inc()
        if entry is None:
            return None
        meta = pb.Embedding()
        meta.CopyFrom(entry.meta)  # small: no tensor bytes in it
        meta.cache_hit = True
        return dataclasses.replace(entry, meta=meta)

    def put(self, key: bytes, answer: Answer) -> None:
        size = answer.nbytes
        if size > self.capacity_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
                self._rows -= old.meta.num_placeholder_tokens
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._rows -= evicted.meta.num_placeholder_tokens
            self._entries[key] = answer
            self._bytes += size
            self._rows += answer.meta.num_placeholder_tokens
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_pool(POOL, capacity_tokens=self.capacity_bytes // self.bytes_per_row,
                                  used_tokens=self._rows, nbytes=self.capacity_bytes, page_size=0)

    def info(self, dtype: str) -> pb.PoolInfo:
        return pb.PoolInfo(name=POOL, capacity_tokens=self.capacity_bytes // self.bytes_per_row,
                           used_tokens=self._rows, bytes=self.capacity_bytes, page_size=0, dtype=dtype)
