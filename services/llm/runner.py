"""One engine step on the model: batch tensors from the scheduled chunks, forward, sample.

All sequences' new tokens are packed into one forward (T = sum of chunk
lengths) over the paged KV pool; metadata is built once per step and shared by
every layer. Multimodal rows replace the placeholder tokens' embeddings in the
chunks that cover them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from modalmesh.attention import Attention, PagedMetadata
from modalmesh.distributed import tp_size
from modalmesh.kv.pool import KVPool
from modalmesh.layers.rotary import RotaryEmbedding
from services.llm.graphs import GRAPH_SAFE_BACKENDS, DecodeGraphs
from services.llm.inputs import PreparedPrompt
from services.llm.sampling import SamplerRow, sample
from services.llm.tp import StepChannel, StepInputs
from services.llm.scheduler import Chunk, Step


log = logging.getLogger(__name__)


@dataclass
class Sampled:
    chunk: Chunk
    token: int
    logprob: float


class ModelRunner:
    def __init__(self, model, pool: KVPool, device: torch.device, max_model_len: int | None = None, *,
                 cuda_graphs: bool = False, max_num_seqs: int = 256):
        self.model = model
        # Tensor parallel (rank 0 of a group): broadcast each step to the worker ranks; graphs stay off.
        self.channel = StepChannel(device, model.cfg.hidden_size, model.dtype) if tp_size() > 1 else None
        cuda_graphs = cuda_graphs and self.channel is None
        self.pool = pool
        self.device = device
        if max_model_len:
            for module in model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.ensure(max_model_len + 1)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.kv_caches = [pool.layer(i) for i in range(pool.layout.num_layers)]
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and device.type == "cuda" and max_model_len:
            backends = {m.backend_name for m in model.modules() if isinstance(m, Attention)}
            if backends <= GRAPH_SAFE_BACKENDS:
                self.graphs = DecodeGraphs(model, pool, self.kv_caches, device, max_batch=max_num_seqs,
                                           max_model_len=max_model_len, uses_mrope=self.uses_mrope)
                self.graphs.capture()
            else:
                log.warning("decode runs eagerly: attention backend(s) %s cannot be captured in CUDA graphs",
                            sorted(backends))

    def _positions(self, chunk: Chunk, prompt: PreparedPrompt) -> torch.Tensor:
        start, end = chunk.start, chunk.start + chunk.length
        if not self.uses_mrope:
            return torch.arange(start, end)
        if prompt.mrope is None:  # text only: the three axes coincide
            return torch.arange(start, end).expand(3, -1)
        n_prompt = len(chunk.seq.prompt_ids)
        parts = []
        if start < n_prompt:
            parts.append(prompt.mrope[:, start:min(end, n_prompt)])
        if end > n_prompt:  # generated tokens: 1-D positions shifted by the prompt's delta, on all axes
            parts.append((torch.arange(max(start, n_prompt), end) + prompt.mrope_delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    def _is_decode(self, step: Step) -> bool:
        return all(c.length == 1 and c.sample and c.start >= len(c.seq.prompt_ids) for c in step.chunks)

    def _run_graph(self, step: Step) -> torch.Tensor:
        # Plain Python per sequence (no small tensors): at batch 256 this loop is on every step.
        alloc = self.pool.allocator
        ids, slots, rows, lens, positions = [], [], [], [], []
        for c in step.chunks:
            seq = c.seq
            ids.append(seq.output_ids[c.start - len(seq.prompt_ids)])  # decode: the last sampled token
            slots += alloc.slot_mapping(seq.seq_id, c.start, c.start + 1)
            rows.append(alloc.pages(seq.seq_id))
            lens.append(c.start + 1)
            prompt = seq.payload.prompt
            positions.append(c.start + (prompt.mrope_delta if self.uses_mrope else 0))
        pos = torch.tensor(positions)
        return self.graphs.run(ids, pos.expand(3, -1) if self.uses_mrope else pos, slots, rows, lens)

    @torch.inference_mode()
    def run(self, step: Step) -> list[Sampled]:
        if self.graphs is not None and self._is_decode(step) and self.graphs.fits(len(step.chunks)):
            hidden = self._run_graph(step)
            return self._sample(step.chunks, hidden, torch.arange(len(step.chunks), device=self.device))
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        splices: list[tuple[int, torch.Tensor]] = []  # (row in the packed batch, embedding rows)
        query_lens, context_lens, seq_ids = [], [], []
        for chunk in step.chunks:
            seq, prompt = chunk.seq, chunk.seq.payload.prompt
            start, end = chunk.start, chunk.start + chunk.length
            base = len(ids)
            ids += seq.token_ids(start, end)
            positions.append(self._positions(chunk, prompt))
            for span in prompt.spans:
                lo, hi = max(start, span.start), min(end, span.end)
                if lo < hi:
                    splices.append((base + lo - start, span.embedding[lo - span.start:hi - span.start]))
            query_lens.append(chunk.length)
            context_lens.append(end)
            seq_ids.append(seq.seq_id)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.cat(positions, dim=-1).to(self.device)
        block_table = self.pool.block_table(seq_ids)
        sampled_chunks = [c for c in step.chunks if c.sample]
        ends = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        rows_index = ends[torch.tensor([i for i, c in enumerate(step.chunks) if c.sample], dtype=torch.long,
                                       device=self.device)]
        if self.channel is not None:  # tensor parallel: the other ranks run this same step
            self.channel.send(StepInputs(input_ids, pos, query_lens, context_lens, block_table, rows_index,
                                         bool(splices)))
        meta = PagedMetadata.build(query_lens, context_lens, block_table, self.pool.page_size)
        inputs_embeds = None
        if splices:
            inputs_embeds = self.model.embed(input_ids)
            for row, rows in splices:
                inputs_embeds[row:row + rows.shape[0]] = rows.to(inputs_embeds.dtype)
            if self.channel is not None:
                self.channel.embeds(inputs_embeds)
        hidden = self.model(pos, meta, self.kv_caches, input_ids=None if splices else input_ids,
                            inputs_embeds=inputs_embeds)
        if not sampled_chunks:
            return []
        return self._sample(sampled_chunks, hidden, rows_index)

    def stop_workers(self) -> None:
        if self.channel is not None:
            self.channel.send_stop()

    def _sample(self, sampled_chunks: list[Chunk], hidden: torch.Tensor, rows_index: torch.Tensor) -> list[Sampled]:
        logits = self.model.compute_logits(hidden[rows_index])
        rows: list[SamplerRow] = [c.seq.payload.sampler for c in sampled_chunks]
        tokens, logprobs = sample(logits, rows)
        return [Sampled(c, t, lp) for c, t, lp in zip(sampled_chunks, tokens.tolist(), logprobs.tolist())]
