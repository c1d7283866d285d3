"""One engine step on the model: batch tensors from the scheduled chunks, forward, sample.

All sequences' new tokens are packed into one forward (T = sum of chunk
lengths) over the paged KV pool; metadata is built once per step and shared by
every layer. Multimodal rows replace the placeholder tokens' embeddings in the
chunks that cover them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modalmesh.attention import PagedMetadata
from modalmesh.kv.pool import KVPool
from modalmesh.layers.rotary import RotaryEmbedding
from services.llm.inputs import PreparedPrompt
from services.llm.sampling import SamplerRow, sample
from services.llm.scheduler import Chunk, Step


@dataclass
class Sampled:
    chunk: Chunk
    token: int
    logprob: float


class ModelRunner:
    def __init__(self, model, pool: KVPool, device: torch.device, max_model_len: int | None = None):
        self.model = model
        self.pool = pool
        self.device = device
        if max_model_len:
            for module in model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.ensure(max_model_len + 1)
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.kv_caches = [pool.layer(i) for i in range(pool.layout.num_layers)]

    def _positions(self, chunk: Chunk, prompt: PreparedPrompt) -> torch.Tensor:
        start, end = chunk.start, chunk.start + chunk.length
        if not self.uses_mrope:
            return torch.arange(start, end)
        n_prompt = len(chunk.seq.prompt_ids)
        parts = []
        if start < n_prompt:
            parts.append(prompt.mrope[:, start:min(end, n_prompt)])
        if end > n_prompt:  # generated tokens: 1-D positions shifted by the prompt's delta, on all axes
            parts.append((torch.arange(max(start, n_prompt), end) + prompt.mrope_delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def run(self, step: Step) -> list[Sampled]:
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
        meta = PagedMetadata.build(query_lens, context_lens, self.pool.block_table(seq_ids), self.pool.page_size)
        inputs_embeds = None
        if splices:
            inputs_embeds = self.model.embed(input_ids)
            for row, rows in splices:
                inputs_embeds[row:row + rows.shape[0]] = rows.to(inputs_embeds.dtype)
        hidden = self.model(pos, meta, self.kv_caches, input_ids=None if splices else input_ids,
                            inputs_embeds=inputs_embeds)
        sampled_chunks = [c for c in step.chunks if c.sample]
        if not sampled_chunks:
            return []
        ends = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        which = torch.tensor([i for i, c in enumerate(step.chunks) if c.sample], device=self.device)
        logits = self.model.compute_logits(hidden[ends[which]])
        rows: list[SamplerRow] = [c.seq.payload.sampler for c in sampled_chunks]
        tokens, logprobs = sample(logits, rows)
        return [Sampled(c, t, lp) for c, t, lp in zip(sampled_chunks, tokens.tolist(), logprobs.tolist())]
