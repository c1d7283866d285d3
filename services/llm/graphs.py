"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (one new token per sequence) has the same kernels every time;
only the inputs change. Each bucket's forward is captured once, reading from
static buffers (token ids, positions, KV slots, block table, context lengths);
a step copies its inputs into the buffers, pads the batch to the bucket —
padding rows have context length 0 and write their k/v to a scratch page the
runner owns — and replays. This removes the per-layer Python and launch
overhead that dominates small-batch decode. Needs a graph-safe attention
backend (`triton_paged`: device-side lengths, no host synchronisation).
"""

from __future__ import annotations

import logging

import torch

from modalmesh.attention import PagedMetadata

log = logging.getLogger(__name__)

GRAPH_SAFE_BACKENDS = frozenset({"triton_paged"})


def buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 64 else sizes[-1] + 64)
    return [b for b in sizes if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model, pool, kv_caches, device: torch.device, *, max_batch: int, max_model_len: int,
                 uses_mrope: bool):
        self.model = model
        self.pool = pool
        self.kv_caches = kv_caches
        self.device = device
        self.uses_mrope = uses_mrope
        self.sizes = buckets(max_batch)
        page = pool.page_size
        self.max_pages = -(-max_model_len // page) + 1
        self.scratch_slot = pool.allocator.reserve_page() * page
        b = self.sizes[-1]
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, b) if uses_mrope else (b,), dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_table = torch.zeros((b, self.max_pages), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> PagedMetadata:
        return PagedMetadata(
            slot_mapping=self.slot_mapping[:b], block_table=self.block_table[:b], context_lens=self.context_lens[:b],
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device=self.device),
            query_lens=(1,) * b, context_lens_host=(1,) * b, page_size=self.pool.page_size)

    def _forward(self, b: int) -> torch.Tensor:
        positions = self.positions[:, :b] if self.uses_mrope else self.positions[:b]
        return self.model(positions, self._meta(b), self.kv_caches, input_ids=self.input_ids[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory."""
        # Padding rows read nothing (context 0) and write to the scratch slot: safe to run eagerly too.
        self.context_lens.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in self.sizes:  # warm-up: compiles kernels, settles allocator
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: torch.Tensor, slots: list[int], block_rows: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """Hidden states (n, H) of n decoding sequences, replayed from the smallest bucket that fits."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        width = max(len(r) for r in block_rows)
        table = torch.tensor([row + [0] * (width - len(row)) for row in block_rows], dtype=torch.int32)
        pad = b - n
        self.input_ids[:b].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        if self.uses_mrope:
            self.positions[:, :b].copy_(torch.cat([positions, torch.zeros(3, pad, dtype=torch.long)], dim=1),
                                        non_blocking=True)
        else:
            self.positions[:b].copy_(torch.cat([positions, torch.zeros(pad, dtype=torch.long)]), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.tensor(slots + [self.scratch_slot] * pad), non_blocking=True)
        self.context_lens[:b].copy_(torch.tensor(context_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_table[:n, :width].copy_(table, non_blocking=True)
        self.graphs[b].replay()
        return self.outputs[b][:n]
