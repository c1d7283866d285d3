"""An LRU cache of finished embeddings, bounded in bytes.

Keys are the model's cache keys (content hash + preprocessing parameters); values
are the serialised `Embedding` messages, so a hit returns the very bytes a miss
produced and costs no re-encoding. It reports under the shared pool schema
(pool="embedding_cache"): capacity and used rows, bytes, hits and misses.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from modalmesh import pb
from modalmesh.metrics import Metrics

POOL = "embedding_cache"


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, *, bytes_per_row: int, metrics: Metrics | None = None):
        self.capacity_bytes = max(0, int(capacity_bytes))
        self.bytes_per_row = max(1, int(bytes_per_row))
        self.metrics = metrics
        self._entries: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()  # key -> (message bytes, rows)
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

    def get(self, key: bytes) -> pb.Embedding | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if self.metrics is not None:
            (self.metrics.cache_hits_total if entry else self.metrics.cache_misses_total).labels(pool=POOL).inc()
        if entry is None:
            return None
        message = pb.Embedding.FromString(entry[0])
        message.cache_hit = True
        return message

    def put(self, key: bytes, message: pb.Embedding) -> None:
        data = message.SerializeToString()
        if len(data) > self.capacity_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        rows = message.num_placeholder_tokens
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
                self._rows -= old[1]
            while self._entries and self._bytes + len(data) > self.capacity_bytes:
                _, (evicted, evicted_rows) = self._entries.popitem(last=False)
                self._bytes -= len(evicted)
                self._rows -= evicted_rows
            self._entries[key] = (data, rows)
            self._bytes += len(data)
            self._rows += rows
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_pool(POOL, capacity_tokens=self.capacity_bytes // self.bytes_per_row,
                                  used_tokens=self._rows, nbytes=self.capacity_bytes, page_size=0)

    def info(self, dtype: str) -> pb.PoolInfo:
        return pb.PoolInfo(name=POOL, capacity_tokens=self.capacity_bytes // self.bytes_per_row,
                           used_tokens=self._rows, bytes=self.capacity_bytes, page_size=0, dtype=dtype)
