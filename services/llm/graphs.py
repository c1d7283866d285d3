"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (one new token per sequence) has the same kernels every time;
only the inputs change. Each bucket's forward is captured once, reading from
static buffers (token ids, positions, KV slots, block table, context lengths);
a step copies its inputs into the buffers — rank 0 has padded them to the
bucket: padding rows have context length 0 and write their k/v to rank 0's
scratch page — and replays. Under tensor parallelism every rank captures the
same buckets in the same order, all-reduces included, and replays the bucket
named in the step's inputs. This removes the per-layer Python and launch
overhead that dominates small-batch decode. Needs attention backends whose
records say ``graph_safe`` (`triton_paged`: device-side lengths, no host
synchronisation).
"""

from __future__ import annotations

import logging

import torch

from modalmesh.attention import PagedMetadata
from services.llm.step_inputs import StepInputs

log = logging.getLogger(__name__)


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

    def bucket(self, n: int) -> int:
        """The captured batch size a decode step of `n` sequences replays (0: larger than any)."""
        return next((b for b in self.sizes if b >= n), 0)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states (b, H) of a decode step whose inputs rank 0 padded to the bucket b."""
        b = inputs.graph_batch
        width = inputs.block_table.shape[1]
        self.input_ids[:b].copy_(inputs.input_ids)
        if self.uses_mrope:
            self.positions[:, :b].copy_(inputs.positions if inputs.positions.dim() == 2 else
                                        inputs.positions.expand(3, -1))
        else:
            self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(inputs.slot_mapping)
        self.context_lens[:b].copy_(inputs.context_lens_t)
        # Columns past `width` keep pages of earlier steps: never read, the context lengths stop short.
        self.block_table[:b, :width].copy_(inputs.block_table)
        self.graphs[b].replay()
        return self.outputs[b]
