"""Engine steps replayed from CUDA graphs: decode steps per batch bucket, mixed steps per token bucket.

A decode step (one new token per sequence) has the same kernels every time;
only the inputs change. Each bucket's forward is captured once, reading from
static buffers (token ids, positions, KV slots, block table, context lengths);
a step copies its inputs into the buffers — rank 0 has padded them to the
bucket: padding rows have context length 0 and write their k/v to rank 0's
scratch page — and replays. Under tensor parallelism every rank captures the
same buckets in the same order, all-reduces included, and replays the bucket
named in the step's inputs. This removes the per-layer Python and launch
overhead that dominates small-batch decode.

A mixed step (continuous batching: decode rows beside new prompts and prompt
chunks) is captured the same way per token bucket (`MixedGraphs`), from input
embeddings (the engine embeds and splices encoder rows eagerly): attention
runs every token as a decode query of its own (`PagedMetadata.token_seq` /
`token_ctx`), which needs no host-side lengths. Steps past the largest bucket
(`--max-graph-tokens`), or whose tokens would re-read too much context that
way, run eagerly.

Both need attention backends whose records say ``graph_safe`` (`triton_paged`:
device-side lengths, no host synchronisation).
"""

from __future__ import annotations

import logging

import torch

from modalmesh.attention import PagedMetadata
from modalmesh.batch_graphs import capture
from services.llm.step_inputs import StepInputs

log = logging.getLogger(__name__)


def buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 64 else sizes[-1] + 64)
    return [b for b in sizes if b < max_batch] + [max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """The mixed graphs' token counts up to `max_tokens`: finer where decode-heavy steps fall, then every 512."""
    sizes = [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] + 512)
    return [n for n in sizes if n < max_tokens] + [max_tokens]


def copy_positions(buffer: torch.Tensor, positions: torch.Tensor, n: int) -> None:
    """A step's positions into a graph's static buffer: (n,), or (3, n) for M-RoPE (1-D text positions are
    the same on the three axes)."""
    if buffer.dim() == 2:
        buffer[:, :n].copy_(positions if positions.dim() == 2 else positions.expand(3, -1))
    else:
        buffer[:n].copy_(positions)


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
    def capture(self, mempool) -> None:
        # Padding rows read nothing (context 0) and write to the scratch slot: safe to run eagerly too.
        self.context_lens.zero_()
        self.graphs, self.outputs = capture(self.sizes, self._forward, self.device, mempool)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def bucket(self, n: int) -> int:
        """The captured batch size a decode step of `n` sequences replays (0: larger than any)."""
        return next((b for b in self.sizes if b >= n), 0)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states (b, H) of a decode step whose inputs rank 0 padded to the bucket b."""
        b = inputs.graph_batch
        width = inputs.block_table.shape[1]
        self.input_ids[:b].copy_(inputs.input_ids)
        copy_positions(self.positions, inputs.positions, b)
        self.slot_mapping[:b].copy_(inputs.slot_mapping)
        self.context_lens[:b].copy_(inputs.context_lens_t)
        # Columns past `width` keep pages of earlier steps: never read, the context lengths stop short.
        self.block_table[:b, :width].copy_(inputs.block_table)
        self.graphs[b].replay()
        return self.outputs[b]


class MixedGraphs:
    """Steps of any shape up to `max_tokens` tokens, from input embeddings, per token bucket."""

    def __init__(self, model, pool, kv_caches, device: torch.device, *, max_tokens: int, max_seqs: int,
                 max_model_len: int, uses_mrope: bool, scratch_slot: int, hidden_size: int, dtype: torch.dtype):
        self.model = model
        self.pool = pool
        self.kv_caches = kv_caches
        self.device = device
        self.uses_mrope = uses_mrope
        self.sizes = token_buckets(max_tokens)
        self.scratch_slot = scratch_slot
        t = self.sizes[-1]
        self.max_seqs = min(max_seqs, t)
        self.max_pages = -(-max_model_len // pool.page_size) + 1
        self.embeds = torch.zeros((t, hidden_size), dtype=dtype, device=device)
        self.positions = torch.zeros((3, t) if uses_mrope else (t,), dtype=torch.long, device=device)
        self.slot_mapping = torch.full((t,), scratch_slot, dtype=torch.long, device=device)
        self.token_seq = torch.zeros(t, dtype=torch.int32, device=device)
        self.token_ctx = torch.zeros(t, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((self.max_seqs, self.max_pages), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, t: int) -> PagedMetadata:
        return PagedMetadata(
            slot_mapping=self.slot_mapping[:t], block_table=self.block_table, context_lens=self.token_ctx[:t],
            cu_seqlens_q=torch.arange(t + 1, dtype=torch.int32, device=self.device),
            query_lens=(1,) * t, context_lens_host=(1,) * t, page_size=self.pool.page_size,
            token_seq=self.token_seq[:t], token_ctx=self.token_ctx[:t])

    def _forward(self, t: int) -> torch.Tensor:
        positions = self.positions[:, :t] if self.uses_mrope else self.positions[:t]
        return self.model(positions, self._meta(t), self.kv_caches, inputs_embeds=self.embeds[:t])

    @torch.inference_mode()
    def capture(self, mempool) -> None:
        self.token_ctx.zero_()  # warm-up tokens read nothing and write to the scratch slot
        self.graphs, self.outputs = capture(self.sizes, self._forward, self.device, mempool)
        log.info("captured mixed-step CUDA graphs for token counts %s", self.sizes)

    def bucket(self, tokens: int, seqs: int) -> int:
        """The captured token count a step of `tokens` tokens over `seqs` sequences replays (0: none)."""
        if seqs > self.max_seqs:
            return 0
        return next((t for t in self.sizes if t >= tokens), 0)

    def run(self, inputs: StepInputs, embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states (t, H) of a step whose per-token inputs rank 0 padded to the bucket t."""
        t = inputs.graph_tokens
        batch, width = inputs.block_table.shape
        self.embeds[:t].copy_(embeds)
        copy_positions(self.positions, inputs.positions, t)
        self.slot_mapping[:t].copy_(inputs.slot_mapping)
        self.token_seq[:t].copy_(inputs.token_seq)
        self.token_ctx[:t].copy_(inputs.token_ctx)
        self.block_table[:batch, :width].copy_(inputs.block_table)
        self.graphs[t].replay()
        return self.outputs[t]
