"""One engine step's inputs as one typed value, and how rank 0 hands it to every rank.

Rank 0 builds a `StepInputs` from the scheduled chunks, its tensors on the host
(`ModelRunner.prepare`). `StepChannel.publish` packs every integer of it into
one int64 message — a header of sizes and flags, then token ids, positions,
per-sequence lengths, block table, sampled rows, KV slots and prompt rows to score —
copies it to the
device in one transfer and, under tensor parallelism, broadcasts it (NCCL on
CUDA, gloo on CPU). Ranks >= 1 `receive` the same message. Every rank then holds
the same `StepInputs`, its tensors views into the message on its device, and
runs the same forward.

A message that fits the channel's fixed buffer — every decode step of 256
sequences with contexts up to a few thousand tokens — is one broadcast; a longer
one (a long prefill) sends the rest in a second. Spliced multimodal embeddings
are floats, not ints: every rank embeds the token ids (the embedding is itself
sharded), rank 0 writes the encoder rows in, and the result is broadcast
(`share_embeds`).

Rank 0 publishes step N+1 before it has read step N's sampled tokens back: a
token it does not know yet is named by `carry` (its row among step N's sampled
tokens), and `share_tokens` hands step N's tokens, still on rank 0's device, to
every rank; each rank puts them in place on its own device (`with_carried_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from modalmesh import distributed

HEADER = 16  # int64 words before the payload
(_KIND, _TOKENS, _BATCH, _WIDTH, _MROPE, _ROWS, _SLOTS, _EMBEDS, _GRAPH, _LENGTH, _CARRY, _PREVIOUS,
 _GRAPH_TOKENS, _SCORED, _SCORED_TOP) = range(15)
STEP, STOP = 1, 2
DEFAULT_CAPACITY = 8192  # int64 words in one broadcast: 64 KiB


STEP_PATHS = ("decode_graph", "mixed_graph", "eager")  # how a step runs (`StepInputs.path`)


@dataclass(frozen=True)
class StepInputs:
    """Everything a rank needs to run one forward of the step; identical on every rank."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,), or (3, T) for M-RoPE models; int64
    query_lens: tuple[int, ...]  # new tokens per sequence
    context_lens: tuple[int, ...]  # tokens in the cache per sequence once this step has run
    block_table: torch.Tensor  # (B, W) int64 page ids, short rows padded with page 0
    sample_rows: torch.Tensor  # (n,) int64: rows of the hidden states whose logits are wanted
    slot_mapping: torch.Tensor | None = None  # (T,) int64 KV slots; None: derived from the block table
    # A decode step replayed from the CUDA graph of this batch bucket; its per-sequence inputs are
    # padded to the bucket (padding: context 0, slots in a scratch page). 0: an eager step.
    graph_batch: int = 0
    has_embeds: bool = False  # spliced input embeddings follow (`share_embeds`)
    # Rank 0 only, never sent: (row in the batch, encoder rows) written over the token embeddings.
    splices: tuple[tuple[int, torch.Tensor], ...] = ()
    context_lens_t: torch.Tensor | None = None  # (B,) int64 on the device, set by the channel
    # (T,) int64: for each token, its row among the previous step's sampled tokens when its id was not
    # known on the host yet (input_ids holds a placeholder there), else -1. None: every id is known.
    carry: torch.Tensor | None = None
    previous_samples: int = 0  # how many tokens the previous step sampled (what `share_tokens` moves)
    # A mixed step replayed from the CUDA graph of this token bucket (services/llm/graphs.py, MixedGraphs):
    # its tokens are padded to the bucket, and each is a decode query of its own — block-table row
    # token_seq[i], causal length token_ctx[i] (both (T,) int64; padding: row 0, length 0). 0: no graph.
    graph_tokens: int = 0
    token_seq: torch.Tensor | None = None
    token_ctx: torch.Tensor | None = None
    # Prompt logprobs: rows of the hidden states that score the prompt token after them (scored_rows, (R,)),
    # that token (scored_targets, (R,)), and the most alternatives any of them asks for (scored_top). Every
    # rank computes their logits (the LM head's all-gather); rank 0 scores them (sampling.score_prompt).
    scored_rows: torch.Tensor | None = None
    scored_targets: torch.Tensor | None = None
    scored_top: int = 0
    # Rank 0 only, never sent: (chunk, first prompt position scored, count) of each sequence's scored rows, in order.
    scored_spans: tuple = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def path(self) -> str:
        """How the step runs, one of `STEP_PATHS` (`modalmesh_engine_steps_total`)."""
        return "decode_graph" if self.graph_batch else "mixed_graph" if self.graph_tokens else "eager"

    def with_carried_ids(self, previous_tokens: torch.Tensor) -> StepInputs:
        """These inputs with the ids named by `carry` taken from the previous step's sampled tokens (on the
        device: no host synchronisation)."""
        if self.carry is None:
            return self
        carried = previous_tokens[self.carry.clamp(min=0)]
        return replace(self, input_ids=torch.where(self.carry >= 0, carried, self.input_ids), carry=None)


class StepChannel:
    """Rank 0 `publish`es each step's inputs; ranks >= 1 `receive` them (identity transport at TP=1)."""

    def __init__(self, device: torch.device, world_size: int, capacity: int = DEFAULT_CAPACITY):
        self.device = device
        self.world_size = world_size
        self.capacity = capacity
        self._pinned = device.type == "cuda"
        # Ranks >= 1 receive into this buffer; rank 0 sends from fresh (cached) allocations.
        self._inbox = torch.zeros(capacity, dtype=torch.int64, device=device) if world_size > 1 else None

    # ---- rank 0 -------------------------------------------------------------------------
    def publish(self, s: StepInputs) -> StepInputs:
        """Rank 0: `s` (host tensors) on this rank's device, and on every other rank's."""
        mrope = s.positions.dim() == 2
        lens = torch.tensor(s.query_lens + s.context_lens, dtype=torch.int64)
        parts = [s.input_ids, s.positions.reshape(-1), lens, s.block_table.reshape(-1), s.sample_rows]
        if s.slot_mapping is not None:
            parts.append(s.slot_mapping)
        if s.carry is not None:
            parts.append(s.carry)
        if s.graph_tokens:
            parts += [s.token_seq, s.token_ctx]
        scored = 0 if s.scored_rows is None else s.scored_rows.numel()
        if scored:
            parts += [s.scored_rows, s.scored_targets]
        length = sum(p.numel() for p in parts)
        header = [STEP, s.num_tokens, s.batch_size, s.block_table.shape[1], int(mrope), s.sample_rows.numel(),
                  int(s.slot_mapping is not None), int(s.has_embeds), s.graph_batch, length, int(s.carry is not None),
                  s.previous_samples, s.graph_tokens, scored, s.scored_top]
        # Pinned and from the caching host allocator: the copy below is asynchronous, and the allocator
        # keeps this block until the copy has run, so the next step cannot overwrite it early.
        # Under TP the first broadcast is always `capacity` words: allocate at least that, so it is a view.
        size = HEADER + length if self.world_size == 1 else max(HEADER + length, self.capacity)
        host = torch.empty(size, dtype=torch.int64, pin_memory=self._pinned)
        host[:HEADER] = torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64)
        torch.cat([p.reshape(-1).to(torch.int64) for p in parts], out=host[HEADER:HEADER + length])
        message = host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        if self.world_size > 1:
            distributed.broadcast(message[:self.capacity])  # receivers take a full buffer; the tail is unread
            if HEADER + length > self.capacity:
                distributed.broadcast(message[self.capacity:])
        return replace(_unpack(message, host, s.splices), scored_spans=s.scored_spans)

    def publish_stop(self) -> None:
        if self.world_size > 1:
            stop = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
            stop[_KIND] = STOP
            distributed.broadcast(stop)

    # ---- ranks >= 1 ---------------------------------------------------------------------
    def receive(self) -> StepInputs | None:
        """The next step's inputs from rank 0, or None when rank 0 has stopped the group."""
        first = distributed.broadcast(self._inbox)
        host = first.cpu()  # the one device->host copy of a step: sizes and lengths for the metadata
        if int(host[_KIND]) == STOP:
            return None
        total = HEADER + int(host[_LENGTH])
        if total <= self.capacity:
            return _unpack(first[:total], host[:total], ())
        rest = distributed.broadcast(torch.empty(total - self.capacity, dtype=torch.int64, device=self.device))
        return _unpack(torch.cat([first, rest]), torch.cat([host, rest.cpu()]), ())

    # ---- every rank ---------------------------------------------------------------------
    def share_tokens(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """The previous step's `n` sampled tokens on every rank: rank 0 gives its device tensor; ranks >= 1
        pass None and receive them."""
        if self.world_size == 1:
            return tokens
        if tokens is None:
            tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        return distributed.broadcast(tokens.contiguous())

    def share_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """Rank 0's spliced input embeddings (T, H) on every rank (in place on ranks >= 1)."""
        return distributed.broadcast(embeds.contiguous()) if self.world_size > 1 else embeds


def _unpack(message: torch.Tensor, host: torch.Tensor, splices) -> StepInputs:
    """Views into `message` (this rank's device); sizes and lengths read from its host copy `host`."""
    head = host[:HEADER].tolist()
    tokens, batch, width, rows = head[_TOKENS], head[_BATCH], head[_WIDTH], head[_ROWS]
    offset = HEADER

    def take(n: int) -> tuple[torch.Tensor, slice]:
        nonlocal offset
        where = slice(offset, offset + n)
        offset += n
        return message[where], where

    input_ids, _ = take(tokens)
    positions, _ = take(3 * tokens if head[_MROPE] else tokens)
    if head[_MROPE]:
        positions = positions.view(3, tokens)
    lens, lens_at = take(2 * batch)
    block_table, _ = take(batch * width)
    sample_rows, _ = take(rows)
    slot_mapping = take(tokens)[0] if head[_SLOTS] else None
    carry = take(tokens)[0] if head[_CARRY] else None
    token_seq = take(tokens)[0] if head[_GRAPH_TOKENS] else None
    token_ctx = take(tokens)[0] if head[_GRAPH_TOKENS] else None
    scored_rows = take(head[_SCORED])[0] if head[_SCORED] else None
    scored_targets = take(head[_SCORED])[0] if head[_SCORED] else None
    lens_host = host[lens_at].tolist()
    return StepInputs(
        input_ids=input_ids, positions=positions, query_lens=tuple(lens_host[:batch]),
        context_lens=tuple(lens_host[batch:]), block_table=block_table.view(batch, width), sample_rows=sample_rows,
        slot_mapping=slot_mapping, graph_batch=head[_GRAPH], has_embeds=bool(head[_EMBEDS]), splices=tuple(splices),
        context_lens_t=lens[batch:], carry=carry, previous_samples=head[_PREVIOUS],
        graph_tokens=head[_GRAPH_TOKENS], token_seq=token_seq, token_ctx=token_ctx,
        scored_rows=scored_rows, scored_targets=scored_targets, scored_top=head[_SCORED_TOP],
    )
