"""The model on one rank: one `ModelRunner(config)` per tensor-parallel rank, the same code on each.

Every rank builds the same things from the same `LLMConfig` (its own `rank`):
its attention selector, its shard of the model, its shard of the KV pool (the
same pages on every rank: one block table serves all), and, on CUDA, its decode
graphs. Then (nano-vllm's `call` / `loop`, `call` being submit's publish + execute):

    rank 0:      runner.submit(step, previous).wait()   # prepare -> publish, execute -> sample
    ranks >= 1:  runner.loop()                # receive the inputs, execute, until rank 0 stops the group

`submit` queues the step's work on the device
(sampling included) and starts one non-blocking copy of the sampled tokens to
the host; `wait` reads them. The engine submits step N+1 before it waits for
step N (`submit(step, previous=...)`): step N's tokens, not yet on the host, are
`PENDING` in the scheduler's sequences, and the device feeds them into step N+1
(`StepInputs.carry`). The host's work for step N — reading tokens back,
detokenising, emitting — overlaps the device's work on step N+1.

`execute` is the one forward path of every rank: a decode step that fits a
captured bucket replays its CUDA graph (all-reduces included), anything else
runs eagerly; the layers meet in their all-reduces and the LM head's
all-gather. Only rank 0 samples.

All sequences' new tokens are packed into one forward (T = sum of chunk
lengths) over the paged KV pool. Multimodal rows replace the placeholder
tokens' embeddings in the chunks that cover them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from modalmesh import distributed
from modalmesh.attention import Attention, AttentionSelector, PagedMetadata, registry
from modalmesh.errors import ConfigError
from modalmesh.kv.pool import build_kv_pool
from modalmesh.layers.rotary import RotaryEmbedding
from modalmesh.metrics import Metrics
from services.llm.config import LLMConfig
from modalmesh.attention.backends.triton_paged import PER_TOKEN_BUDGET
from services.llm.graphs import DecodeGraphs, MixedGraphs
from services.llm.loader import load_llm
from modalmesh.layers.linear import enable_gemv
from services.llm.request import RequestState
from services.llm.sampling import SamplerRow, sample, score_prompt
from services.llm.scheduler import PENDING, Chunk, Sequence, Step
from services.llm.step_inputs import StepChannel, StepInputs

log = logging.getLogger(__name__)

SCORE_ROWS = 512  # prompt rows whose logits are made at once (prompt logprobs)


@dataclass
class Sampled:
    chunk: Chunk
    token: int
    logprob: float


@dataclass
class PromptScores:
    """A step's prompt logprobs (`sampling.score_prompt` rows, in `spans`' order) and whose they are:
    `spans` is (chunk, first prompt position scored, count) per sequence (StepInputs.scored_spans)."""

    spans: tuple
    scores: torch.Tensor

    def rows(self) -> list[tuple[Chunk, int, list[list[float]]]]:
        """Per span: (chunk, first position, its rows) on the host."""
        values, out, at = self.scores.tolist(), [], 0
        for chunk, first, count in self.spans:
            out.append((chunk, first, values[at:at + count]))
            at += count
        return out


class PackedPositions:
    """A packed step's positions, chunk by chunk: (T,), or (3, T) for M-RoPE models.

    Kept as Python ints, with each prompt chunk's M-RoPE rows copied in once at the end: a torch call per
    chunk (a decode row's arange, shift, expand and the final cat) releases and retakes the GIL each time,
    and with the engine process's event loop busy each retake waited up to a switch interval (py-spy on the
    H200: a 59-chunk mixed step's positions took 6 ms of the engine thread under image+text load)."""

    def __init__(self, mrope: bool):
        self.mrope = mrope
        self.flat: list[int] = []  # 1-D positions; an M-RoPE prompt chunk's stand here until `tensor`
        self.patches: list[tuple[int, torch.Tensor]] = []  # (first column, (3, n) M-RoPE positions)

    def add(self, chunk: Chunk) -> None:
        start, end = chunk.start, chunk.start + chunk.length
        prompt = chunk.seq.state.prompt if self.mrope else None
        if prompt is None or prompt.mrope is None:  # text only: the three axes coincide
            self.flat += range(start, end)
            return
        n_prompt = len(chunk.seq.prompt_ids)
        if start < n_prompt:
            stop = min(end, n_prompt)
            self.patches.append((len(self.flat), prompt.mrope[:, start:stop]))
            self.flat += range(start, stop)
        if end > n_prompt:  # generated tokens: 1-D positions shifted by the prompt's delta, on all axes
            first = max(start, n_prompt)
            self.flat += range(first + prompt.mrope_delta, end + prompt.mrope_delta)

    def pad(self, n: int) -> None:
        self.flat += [0] * n

    def tensor(self) -> torch.Tensor:
        flat = torch.tensor(self.flat, dtype=torch.int64)
        if not self.mrope:
            return flat
        out = flat.expand(3, -1)
        if self.patches:
            out = out.clone()
            for at, rows in self.patches:
                out[:, at:at + rows.shape[1]] = rows
        return out


class InFlight:
    """A launched step: its sampled tokens and logprobs on their way to pinned host memory.

    `tokens` stays on the device for the next step (`carry`); `rows` is each sampled sequence's row in it.
    `feeds_next` is False when a row's sampler needs the token on the host before it samples again (the
    repetition penalty's seen tokens, a grammar's state: `SamplerRow.feeds_next`): then the engine waits for
    this step before it schedules the next. `scored`: the step's prompt logprobs, if any sequence asked.
    `path`: how it ran (`StepInputs.path`)."""

    def __init__(self, step: Step, chunks: list[Chunk], tokens: torch.Tensor | None, logprobs: torch.Tensor | None,
                 scored: PromptScores | None = None, *, path: str):
        self.step = step
        self.path = path
        self._chunks = chunks
        self.tokens = tokens
        self.rows = {c.seq.seq_id: i for i, c in enumerate(chunks)}
        self.feeds_next = all(c.seq.state.sampler.feeds_next for c in chunks)
        self.pending: dict = {}  # seq_id -> index of its PENDING output (the engine's `advance`)
        self.ending: dict = {}  # seq_id -> "length": known to end with this step's token
        self.scored = scored
        self._tokens, self._logprobs, self._ready = tokens, logprobs, None
        on_device = [t for t in (tokens, scored.scores if scored else None) if t is not None and t.is_cuda]
        if on_device:
            if tokens is not None:
                self._tokens = _to_pinned(tokens)
                self._logprobs = _to_pinned(logprobs)
            if scored is not None:
                self.scored = PromptScores(scored.spans, _to_pinned(scored.scores))
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> list[Sampled]:
        """The sampled token of each chunk that ends its sequence (blocks until the device has them, and the
        prompt scores with them)."""
        if self._ready is not None:
            self._ready.synchronize()
        if self._tokens is None:
            return []
        return [Sampled(c, t, lp) for c, t, lp in zip(self._chunks, self._tokens.tolist(), self._logprobs.tolist())]


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass(frozen=True)
class RankReport:
    """What one rank built: its attention choices and whether it captured decode graphs."""

    rank: int
    attention: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...]  # (component, backend, why, rejected)
    cuda_graphs: bool


class ModelRunner:
    @classmethod
    def launch(cls, config: LLMConfig, metrics: Metrics | None = None) -> ModelRunner:
        """Rank 0 of `config`'s group in this process, ranks 1..N-1 spawned as children it owns."""
        if config.world_size == 1:
            return cls(config, metrics)
        from services.llm.tp import RankWorkers

        workers = RankWorkers(config)
        workers.start()
        try:
            runner = cls(workers.config, metrics)
        except BaseException:
            workers.kill()
            raise
        runner.workers = workers
        return runner

    def __init__(self, config: LLMConfig, metrics: Metrics | None = None):
        self.config = config
        self.workers = None  # rank 0 of a group started by `launch`: the other ranks' processes
        self.rank = config.rank
        self.device = config.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if config.world_size > 1:
            distributed.init_tp(config.rank, config.world_size, backend=distributed.default_backend(self.device),
                                init_method=f"tcp://127.0.0.1:{config.dist_port}")
        self.metrics = metrics or Metrics(f"llm-rank{config.rank}", process_metrics=False)
        # Built here, on every rank, from the config: what --attention-backend says reaches every rank.
        self.selector = AttentionSelector(config.attention_backend, device=self.device, metrics=self.metrics)
        self.model, self.model_config, _ = load_llm(config.model_dir, device=self.device, dtype=config.dtype,
                                                    page_size=config.page_size, dummy=config.dummy_weights,
                                                    selector=self.selector, fused_kernels=config.fused_kernels)
        if config.gemv_kernels and config.fused_kernels:  # one-row products (batch-1 decode): the Triton GEMV
            enable_gemv(self.model)
        self.pool = build_kv_pool(self.model_config, self.device, max_model_len=config.max_model_len,
                                  dtype=config.dtype, tp_size=config.world_size, page_size=config.page_size,
                                  kv_cache_tokens=config.kv_cache_tokens, mem_fraction=config.mem_fraction,
                                  metrics=self.metrics)
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.ensure(config.max_model_len + 1)
        self.uses_mrope = bool(getattr(self.model, "uses_mrope", False))
        self.kv_caches = [self.pool.layer(i) for i in range(self.pool.layout.num_layers)]
        self.channel = StepChannel(self.device, config.world_size)
        self.graphs, self.mixed_graphs = self._capture_graphs()
        self._warm_up()
        self._compile_attention()
        self.reports = self._gather_reports()
        self._stopped = False

    # ---- start-up -----------------------------------------------------------------------
    def _capture_graphs(self) -> tuple[DecodeGraphs | None, MixedGraphs | None]:
        if not (self.config.cuda_graphs and self.device.type == "cuda"):
            return None, None
        backends = {m.backend_name for m in self.model.modules() if isinstance(m, Attention)}
        if not all(registry.spec(name).graph_safe for name in backends):  # the backends' records say
            log.warning("steps run eagerly: attention backend(s) %s cannot be captured in CUDA graphs",
                        sorted(backends))
            return None, None
        config = self.config
        decode = DecodeGraphs(self.model, self.pool, self.kv_caches, self.device, max_batch=config.max_num_seqs,
                              max_model_len=config.max_model_len, uses_mrope=self.uses_mrope)
        mixed_tokens = min(config.max_batch_tokens, config.max_graph_tokens)
        mixed = MixedGraphs(self.model, self.pool, self.kv_caches, self.device, max_tokens=mixed_tokens,
                            max_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                            uses_mrope=self.uses_mrope, scratch_slot=decode.scratch_slot,
                            hidden_size=self.model_config.hidden_size, dtype=config.dtype) if mixed_tokens else None
        # Every rank in the same order (the warm-up forwards meet in their all-reduces); one memory pool:
        # no two graphs ever run at once.
        mempool = torch.cuda.graph_pool_handle()
        decode.capture(mempool)
        if mixed is not None:
            mixed.capture(mempool)
        return decode, mixed

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One eager prefill of a whole step's token budget, on every rank, before serving: the first step
        of a new size pays one-time costs (library heuristics, the allocator's first segments, lazy imports:
        torch's varlen attention imports torch._dynamo on its first call, 6.8 s on the H200 host) that the
        first requests would otherwise wait for."""
        if self.device.type != "cuda":
            return
        alloc = self.pool.allocator
        tokens = min(self.config.max_batch_tokens, self.config.max_model_len, alloc.free_tokens)
        if tokens < 1 or not alloc.allocate("warm-up", tokens):  # every rank's allocator is fresh: same pages
            return
        start = time.perf_counter()
        try:
            table = torch.tensor(alloc.block_table(["warm-up"]), dtype=torch.int32, device=self.device)
            meta = PagedMetadata.build((tokens,), (tokens,), table, self.pool.page_size)
            hidden = self.model(torch.arange(tokens, device=self.device), meta, self.kv_caches,
                                input_ids=torch.zeros(tokens, dtype=torch.long, device=self.device))
            self.model.compute_logits(hidden[-1:])  # its all-gather meets the other ranks'
            torch.cuda.synchronize(self.device)
        finally:
            alloc.free("warm-up")
        log.info("warm-up prefill of %d tokens: %.2f s", tokens, time.perf_counter() - start)

    @torch.inference_mode()
    def _compile_attention(self) -> None:
        """Every launch form of the attention kernels that steps of up to max_num_seqs sequences take, compiled
        before serving (`Attention.warm_paged`): a JIT kernel compiles on its first launch of a form, and a
        compile mid-serving holds the engine thread for most of a second."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        shapes = set()  # the layers of one shape share their kernels' launch forms: one call per shape
        for layer, cache in zip((m for m in self.model.modules() if isinstance(m, Attention)), self.kv_caches):
            shape = (layer.num_heads, layer.head_dim, layer.v_head_dim, layer.causal, layer.scale, layer.window,
                     layer.backend_name)
            if shape not in shapes:
                shapes.add(shape)
                layer.warm_paged(cache, self.config.max_num_seqs)
        torch.cuda.synchronize(self.device)
        log.info("attention kernels compiled for %d layer shape(s): %.2f s", len(shapes), time.perf_counter() - start)

    def _gather_reports(self) -> list[RankReport]:
        choices = tuple((s.component, s.backend, s.reason, tuple(s.rejected.items()))
                        for s in self.selector.selections())
        mine = RankReport(self.rank, choices, self.graphs is not None)
        reports = distributed.all_gather_object(mine)
        if len({r.cuda_graphs for r in reports}) > 1:  # a step replays on every rank or on none
            raise ConfigError(f"tensor-parallel ranks disagree on CUDA graphs: {reports}")
        return reports

    # ---- rank 0 -------------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, step: Step, previous: InFlight | None = None) -> InFlight:
        """Rank 0: queue one scheduled step on every rank, sampling included, without waiting for it.

        `previous`: the step before, whose tokens may still be `PENDING` in this step's sequences."""
        inputs = self.channel.publish(self.prepare(step, previous))
        logits, scores = self.execute(inputs, previous.tokens if previous is not None else None)
        scored = PromptScores(inputs.scored_spans, scores) if scores is not None else None
        sampled = [c for c in step.chunks if c.sample]
        if logits is None:
            return InFlight(step, [], None, None, scored, path=inputs.path)
        rows: list[SamplerRow] = [c.seq.state.sampler for c in sampled]
        tokens, logprobs = sample(logits, rows)
        return InFlight(step, sampled, tokens, logprobs, scored, path=inputs.path)

    def prepare(self, step: Step, previous: InFlight | None = None) -> StepInputs:
        """Rank 0: the step's inputs on the host, from the scheduled chunks and the page allocator."""
        if self.graphs is not None and self._is_decode(step):
            bucket = self.graphs.bucket(len(step.chunks))
            if bucket:
                return self._prepare_decode(step, bucket, previous)
        bucket = self.mixed_graphs.bucket(step.num_tokens, len(step.chunks)) if self.mixed_graphs else 0
        return self._prepare_packed(step, previous, bucket)

    @staticmethod
    def _carry(ids: list[int], step: Step, last_rows: list[int], previous: InFlight | None) -> dict:
        """`carry` and `previous_samples` for the tokens whose ids are still `PENDING` (always a sequence's
        last token, so the last row of its chunk): their rows among `previous`'s sampled tokens."""
        pairs = [(row, c.seq.seq_id) for c, row in zip(step.chunks, last_rows) if ids[row] == PENDING]
        if not pairs:
            return {}
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step carries pending tokens but no previous step sampled them")
        carry = [-1] * len(ids)
        for row, seq_id in pairs:
            carry[row] = previous.rows[seq_id]
        return dict(carry=torch.tensor(carry, dtype=torch.int64), previous_samples=int(previous.tokens.shape[0]))

    def _prepare_packed(self, step: Step, previous: InFlight | None, bucket: int = 0) -> StepInputs:
        """A step's tokens packed; padded to `bucket` tokens, with per-token attention inputs, to replay a
        mixed-step graph (unless the step's tokens would re-read too much context that way)."""
        ids: list[int] = []
        positions = PackedPositions(self.uses_mrope)
        splices: list[tuple[int, torch.Tensor]] = []  # (row in the packed batch, embedding rows)
        query_lens, context_lens, seq_ids, sample_rows, last_rows = [], [], [], [], []
        scored_rows, scored_targets, scored_spans, scored_top = [], [], [], 0
        for chunk in step.chunks:
            seq: Sequence[RequestState] = chunk.seq
            prompt = seq.state.prompt
            start, end = chunk.start, chunk.start + chunk.length
            base = len(ids)
            ids += seq.token_ids(start, end)
            positions.add(chunk)
            for span in prompt.spans:
                lo, hi = max(start, span.start), min(end, span.end)
                if lo < hi:
                    if span.embedding is None:  # the service skipped its encoding only where the cache holds it
                        raise RuntimeError(f"{seq.seq_id}: tokens [{lo}, {hi}) of an item not encoded (its rows "
                                           "were to come from the prefix cache)")
                    splices.append((base + lo - start, span.embedding[lo - span.start:hi - span.start]))
            query_lens.append(chunk.length)
            context_lens.append(end)
            seq_ids.append(seq.seq_id)
            last_rows.append(len(ids) - 1)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
            top = seq.state.params.prompt_logprobs
            scored_end = min(end, len(seq.prompt_ids) - 1)  # the row at position p scores prompt token p + 1
            # prompt_scores is None once they went out with the first token: a recompute (preemption) is not scored
            if top is not None and seq.state.prompt_scores is not None and start < scored_end:
                scored_rows += range(base, base + scored_end - start)
                scored_targets += seq.prompt_ids[start + 1:scored_end + 1]
                scored_spans.append((chunk, start, scored_end - start))
                scored_top = max(scored_top, top)
        graph = self._per_token(step, bucket) if bucket else {}
        if graph:
            pad = bucket - len(ids)
            ids += [0] * pad  # padding ids are never PENDING: `_carry` below leaves them alone
            positions.pad(pad)
        carry = self._carry(ids, step, last_rows, previous)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=positions.tensor(),
            query_lens=tuple(query_lens), context_lens=tuple(context_lens),
            block_table=torch.tensor(self.pool.allocator.block_table(seq_ids), dtype=torch.int64),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64), has_embeds=bool(splices),
            splices=tuple(splices), **carry, **graph, **(dict(
                scored_rows=torch.tensor(scored_rows, dtype=torch.int64),
                scored_targets=torch.tensor(scored_targets, dtype=torch.int64),
                scored_top=scored_top, scored_spans=tuple(scored_spans)) if scored_rows else {}))

    def _per_token(self, step: Step, bucket: int) -> dict:
        """A mixed graph's per-token inputs, padded to `bucket`: each token's KV slot, block-table row and
        causal length. {} when the tokens would re-read more context than an eager step costs."""
        ctx = [n for c in step.chunks for n in range(c.start + 1, c.start + c.length + 1)]
        if sum(ctx) > PER_TOKEN_BUDGET:  # the context the per-token attention re-reads (MixedPlan's measure)
            return {}
        alloc = self.pool.allocator
        slots, seq_rows = [], []
        for row, c in enumerate(step.chunks):
            slots += alloc.slot_mapping(c.seq.seq_id, c.start, c.start + c.length)
            seq_rows += [row] * c.length
        pad = bucket - len(slots)
        return dict(slot_mapping=torch.tensor(slots + [self.graphs.scratch_slot] * pad, dtype=torch.int64),
                    graph_tokens=bucket, token_seq=torch.tensor(seq_rows + [0] * pad, dtype=torch.int64),
                    token_ctx=torch.tensor(ctx + [0] * pad, dtype=torch.int64))

    def _prepare_decode(self, step: Step, bucket: int, previous: InFlight | None) -> StepInputs:
        # Plain Python per sequence (no small tensors): at batch 256 this loop is on every step.
        alloc, page = self.pool.allocator, self.pool.page_size
        n, pad = len(step.chunks), bucket - len(step.chunks)
        ids, slots, rows, lens, positions = [], [], [], [], []
        for c in step.chunks:
            seq: Sequence[RequestState] = c.seq
            pages = alloc.pages(seq.seq_id)
            ids.append(seq.output_ids[c.start - len(seq.prompt_ids)])  # the last sampled token (or PENDING)
            slots.append(pages[c.start // page] * page + c.start % page)
            rows.append(pages)
            lens.append(c.start + 1)
            positions.append(c.start + (seq.state.prompt.mrope_delta if self.uses_mrope else 0))
        width = max(len(r) for r in rows)
        table = [r + [0] * (width - len(r)) for r in rows] + [[0] * width] * pad
        pos = torch.tensor(positions + [0] * pad, dtype=torch.int64)
        ids += [0] * pad
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=pos.expand(3, -1) if self.uses_mrope else pos,
            query_lens=(1,) * bucket, context_lens=tuple(lens + [0] * pad),
            block_table=torch.tensor(table, dtype=torch.int64), sample_rows=torch.arange(n, dtype=torch.int64),
            slot_mapping=torch.tensor(slots + [self.graphs.scratch_slot] * pad, dtype=torch.int64),
            graph_batch=bucket, **self._carry(ids, step, list(range(n)), previous))

    @staticmethod
    def _is_decode(step: Step) -> bool:
        return all(c.length == 1 and c.sample and c.start >= len(c.seq.prompt_ids) for c in step.chunks)

    def shutdown(self) -> None:
        """Rank 0: stop the ranks' loops and wait for their processes to end (idempotent).

        The process should end soon after (`distributed.exit_rank`): the group is left, not torn down."""
        if self._stopped:
            return
        self._stopped = True
        if self.config.world_size == 1:
            return
        if self.workers is not None:
            self.workers.stopping()
        self.channel.publish_stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the stop message has left: every rank got it
        # No teardown of the group: see distributed.abandon_tp. Each rank exits once it has the message.
        distributed.abandon_tp()
        if self.workers is not None:
            codes = self.workers.join()
            log.log(logging.INFO if all(c == 0 for c in codes) else logging.WARNING,
                    "tensor-parallel ranks 1..%d exited with %s", self.config.world_size - 1, codes)

    # ---- ranks >= 1 ---------------------------------------------------------------------
    @torch.inference_mode()
    def loop(self) -> None:
        """Ranks >= 1: run every step rank 0 publishes, until it stops the group."""
        while (inputs := self.channel.receive()) is not None:
            self.execute(inputs)
        self._stopped = True
        distributed.abandon_tp()  # the process ends next (exit_rank): no teardown to hang in

    # ---- every rank ---------------------------------------------------------------------
    def _embed(self, inputs: StepInputs) -> torch.Tensor:
        """The step's input embeddings, encoder rows spliced in by rank 0 and shared with every rank."""
        embeds = self.model.embed(inputs.input_ids)  # sharded: every rank takes part
        if inputs.has_embeds:
            for row, rows in inputs.splices:  # rank 0 only; the others receive the result
                embeds[row:row + rows.shape[0]] = rows.to(embeds.dtype)
            embeds = self.channel.share_embeds(embeds)
        return embeds

    def execute(self, inputs: StepInputs, previous_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One forward of the step on this rank: float32 logits of the sampled rows (None if none), and on rank
        0 the scores of the prompt rows asked for (`sampling.score_prompt`; None if none).

        `previous_tokens`: rank 0's previous sampled tokens, when `inputs` carries some (ranks >= 1 receive
        them here)."""
        if inputs.carry is not None:
            inputs = inputs.with_carried_ids(self.channel.share_tokens(previous_tokens, inputs.previous_samples))
        if inputs.graph_batch:
            hidden = self.graphs.run(inputs)
        elif inputs.graph_tokens:
            hidden = self.mixed_graphs.run(inputs, self._embed(inputs))
        else:
            meta = PagedMetadata.build(inputs.query_lens, inputs.context_lens, inputs.block_table,
                                       self.pool.page_size, slot_mapping=inputs.slot_mapping)
            embeds = self._embed(inputs) if inputs.has_embeds else None
            hidden = self.model(inputs.positions, meta, self.kv_caches,
                                input_ids=None if embeds is not None else inputs.input_ids, inputs_embeds=embeds)
        scores, failed = self._score_prompt(hidden, inputs) if inputs.scored_rows is not None else (None, None)
        logits = self.model.compute_logits(hidden[inputs.sample_rows]) if inputs.sample_rows.numel() else None
        if failed is not None:  # raised once every rank has been through the same collectives
            raise failed
        return logits, scores

    def _score_prompt(self, hidden: torch.Tensor, inputs: StepInputs
                      ) -> tuple[torch.Tensor | None, BaseException | None]:
        """The prompt rows' scores, SCORE_ROWS rows at a time: a row's logits are a vocabulary of floats, and
        a long prompt chunk's all at once would be gigabytes. Every rank computes the logits (the LM head's
        all-gather); rank 0 scores them. Scoring is rank 0's alone (a log-softmax of the slice's logits): if
        it fails (out of memory), the other ranks' LM-head all-gathers must still be met, so the error is
        returned for `execute` to raise after them."""
        parts, failed = [], None
        for lo in range(0, inputs.scored_rows.numel(), SCORE_ROWS):
            logits = self.model.compute_logits(hidden[inputs.scored_rows[lo:lo + SCORE_ROWS]])
            if self.rank == 0 and failed is None:
                try:
                    parts.append(score_prompt(logits, inputs.scored_targets[lo:lo + SCORE_ROWS], inputs.scored_top))
                except Exception as exc:  # noqa: BLE001 - raised by execute, after the collectives
                    failed = exc
            del logits
        return (torch.cat(parts) if parts and failed is None else None), failed
