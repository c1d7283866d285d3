"""The LLM's KV pool: how big it can be, the cache tensors, and its gauges.

Sizing (per TP rank):

    bytes/token = sum over layers of kv_heads_per_rank * (head_dim + v_head_dim) * dtype size
    budget      = --kv-cache-tokens, or free device memory (measured after weights
                  and warm-up) * --mem-fraction
    pages       = budget rounded to whole pages of --page-size tokens

and it refuses to start (ConfigError) when not even one max-length request fits.

Layout, per layer (the attention package's contract):

    k_caches[l]: (num_pages, page_size, num_kv_heads_per_rank, head_dim)
    v_caches[l]: (num_pages, page_size, num_kv_heads_per_rank, v_head_dim)

Token slot = page * page_size + offset, i.e. ``k_caches[l].view(-1, H, D)[slot]``.
Page bookkeeping is the pure-Python `PageAllocator`; `KVPool` wraps it so every
allocate / extend / free also updates the ``modalmesh_kv_pool_*`` gauges.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from modalmesh import distributed
from modalmesh import metrics as metrics_mod
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError
from modalmesh.kv.allocator import PageAllocator, block_table_tensor, context_lens_tensor, slot_mapping_tensor

DEFAULT_PAGE_SIZE = 16
GiB = 1024**3


@dataclass(frozen=True)
class LayerKV:
    num_kv_heads: int  # per TP rank
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerKV, ...]
    dtype: torch.dtype

    def __post_init__(self):
        for i, layer in enumerate(self.layers):
            if min(layer.num_kv_heads, layer.head_dim, layer.v_head_dim) <= 0:
                raise ConfigError(f"KV layer {i}: {layer} has a zero-width dimension")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, *, tp_size: int = 1, dtype: torch.dtype | None = None) -> KVLayout:
        layers = []
        for i in range(cfg.num_layers):
            heads = cfg.kv_heads_per_rank(tp_size, layer=i)
            if cfg.layer_is_sliding(i):
                layers.append(LayerKV(heads, cfg.swa_head_dim, cfg.swa_v_head_dim))
            else:
                layers.append(LayerKV(heads, cfg.head_dim, cfg.v_head_dim))
        return cls(tuple(layers), dtype or cfg.dtype or torch.get_default_dtype())

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(layer.num_kv_heads * (layer.head_dim + layer.v_head_dim) * size for layer in self.layers)

    def describe(self, attr: str) -> str:
        """A label value: the one value, or the distinct values joined (mixed sliding/full layers)."""
        values = list(dict.fromkeys(getattr(layer, attr) for layer in self.layers))
        return "/".join(map(str, values))


@dataclass(frozen=True)
class KVPlan:
    num_pages: int
    page_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def free_device_memory(device: torch.device | str) -> int:
    """Bytes free now on `device`: the CUDA driver's figure, or MemAvailable on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv_pool(
    layout: KVLayout,
    *,
    max_model_len: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_cache_tokens: int | None = None,
    free_bytes: int | None = None,
    mem_fraction: float = 0.9,
) -> KVPlan:
    """How many pages the pool gets. Explicit tokens round up to pages; a memory budget rounds down."""
    if page_size <= 0:
        raise ConfigError(f"--page-size {page_size}: must be positive")
    if not 0 < mem_fraction <= 1:
        raise ConfigError(f"--mem-fraction {mem_fraction}: must be in (0, 1]")
    per_token = layout.bytes_per_token
    per_page = per_token * page_size
    if kv_cache_tokens is not None:
        if kv_cache_tokens <= 0:
            raise ConfigError(f"--kv-cache-tokens {kv_cache_tokens}: must be positive")
        num_pages = -(-kv_cache_tokens // page_size)
        source = f"--kv-cache-tokens {kv_cache_tokens}"
        if free_bytes is not None and num_pages * per_page > free_bytes:
            raise ConfigError(
                f"{source} needs {num_pages * per_page / GiB:.2f} GiB of KV cache "
                f"({per_token} bytes/token) but only {free_bytes / GiB:.2f} GiB is free"
            )
    else:
        if free_bytes is None:
            raise ConfigError("KV pool: give --kv-cache-tokens or a measured free-memory figure")
        budget = int(free_bytes * mem_fraction)
        num_pages = budget // per_page
        source = f"{budget / GiB:.2f} GiB (--mem-fraction {mem_fraction} of {free_bytes / GiB:.2f} GiB free)"
    needed_pages = -(-max_model_len // page_size)
    if num_pages < needed_pages:
        raise ConfigError(
            f"KV pool too small: {source} holds {num_pages * page_size} tokens "
            f"({num_pages} pages of {page_size}, {per_token} bytes/token over {layout.num_layers} layers), "
            f"but one max-length request needs {max_model_len}; lower --max-model-len, raise "
            f"--mem-fraction / --kv-cache-tokens, or shard over more GPUs"
        )
    return KVPlan(num_pages=num_pages, page_size=page_size, bytes_per_token=per_token)


class KVPool:
    """The cache tensors of every layer plus the page allocator, reported to Prometheus."""

    def __init__(self, layout: KVLayout, plan: KVPlan, device: torch.device | str, *,
                 pool: str = "kv", metrics: metrics_mod.Metrics | None = None):
        self.layout = layout
        self.plan = plan
        self.device = torch.device(device)
        self.page_size = plan.page_size
        self.allocator = PageAllocator(plan.num_pages, plan.page_size)
        shape = (plan.num_pages, plan.page_size)
        self.k_caches = [torch.zeros(*shape, l.num_kv_heads, l.head_dim, dtype=layout.dtype, device=self.device)
                         for l in layout.layers]
        self.v_caches = [torch.zeros(*shape, l.num_kv_heads, l.v_head_dim, dtype=layout.dtype, device=self.device)
                         for l in layout.layers]
        self.pool = pool
        self.metrics = metrics or metrics_mod.current()
        self._info_labels: dict | None = None
        self.publish_info()
        self.publish()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k_caches) + sum(t.nbytes for t in self.v_caches)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_caches[index], self.v_caches[index]

    # ---- allocation (delegates, then updates the gauges) --------------------------------
    def allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        ok = self.allocator.allocate(seq_id, num_tokens)
        self.publish()
        return ok

    def extend(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        ok = self.allocator.extend(seq_id, num_new_tokens)
        self.publish()
        return ok

    def free(self, seq_id: Hashable) -> int:
        pages = self.allocator.free(seq_id)
        self.publish()
        return pages

    # ---- kernel inputs -------------------------------------------------------------------
    def slot_mapping(self, spans: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        """int64 slots for (seq_id, start, end) token spans, concatenated in order (the new tokens of a batch)."""
        slots: list[int] = []
        for seq_id, start, end in spans:
            slots += self.allocator.slot_mapping(seq_id, start, end)
        return slot_mapping_tensor(slots, self.device)

    def block_table(self, seq_ids: Sequence[Hashable], max_pages: int | None = None) -> torch.Tensor:
        return block_table_tensor(self.allocator.block_table(seq_ids, max_pages), self.device)

    def context_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        return context_lens_tensor([self.allocator.num_tokens(s) for s in seq_ids], self.device)

    # ---- metrics -------------------------------------------------------------------------
    def publish(self) -> None:
        self.metrics.set_pool(self.pool, capacity_tokens=self.allocator.capacity_tokens,
                              used_tokens=self.allocator.used_tokens, nbytes=self.nbytes, page_size=self.page_size)

    def publish_info(self) -> None:
        labels = dict(pool=self.pool, dtype=str(self.layout.dtype).removeprefix("torch."),
                      layers=self.layout.num_layers, kv_heads=self.layout.describe("num_kv_heads"),
                      head_dim=self.layout.describe("head_dim"), v_head_dim=self.layout.describe("v_head_dim"))
        if self._info_labels is not None:
            self.metrics.kv_pool_info.remove(**self._info_labels)
        self.metrics.kv_pool_info.labels(**labels).set(1)
        self._info_labels = labels


def build_kv_pool(
    cfg: ModelConfig,
    device: torch.device | str,
    *,
    max_model_len: int | None = None,
    tp_size: int = 1,
    dtype: torch.dtype | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    kv_cache_tokens: int | None = None,
    mem_fraction: float = 0.9,
    metrics: metrics_mod.Metrics | None = None,
) -> KVPool:
    """The LLM service's pool: call after weights are loaded and warm-up ran, so free memory is what is left."""
    layout = KVLayout.from_model_config(cfg, tp_size=tp_size, dtype=dtype)
    max_model_len = max_model_len or cfg.max_position_embeddings
    if not max_model_len:
        raise ConfigError("KV pool: the config has no max_position_embeddings; pass --max-model-len")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # memory cached by warm-up is free for the pool
    free = free_device_memory(device)
    plan = plan_kv_pool(layout, max_model_len=max_model_len, page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                        free_bytes=free, mem_fraction=mem_fraction)
    # Tensor-parallel ranks index one shared block table: every rank gets the pages all of them fit.
    plan = dataclasses.replace(plan, num_pages=distributed.agree_min(plan.num_pages))
    return KVPool(layout, plan, device, metrics=metrics)
