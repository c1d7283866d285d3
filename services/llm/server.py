"""LLMService: a thin gRPC servicer over the generation engine.

Generate validates and tokenises the request, splices multimodal embeddings,
hands it to the engine and streams its deltas. A cancelled call (client gone,
deadline passed) aborts the request, which frees its KV pages.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
import uuid


from modalmesh import pb
from modalmesh import tracing
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError, InvalidArgument, ModalmeshError
from modalmesh.image_grid import ImageGrid
from modalmesh.service import Service
from modalmesh.rpc.servicer import ForwardingServicer
from modalmesh.rpc.shm import ShmProbe, ShmReader, shm_available
from services.llm.embedding import Embedding
from services.llm.encoders import EncoderFanout, EncoderPool
from services.llm.prefix_items import ItemShape, ItemShapes, item_digests, plan_prefix
from services.llm.config import LLMConfig
from services.llm.engine import Delta, LLMEngine, ThreadSafeEmitter
from services.llm.inputs import check_modalities, prompt_length_before_encoding, splice_items, tokenize_prompt
from services.llm import flags as llm_flags
from services.llm.sampling import SamplingParams
from services.llm.runner import ModelRunner

_FINISH = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}
log = logging.getLogger("modalmesh.llm")


class LLMService(Service):
    name = llm_flags.NAME
    grpc_service = pb.LLM_SERVICE
    description = llm_flags.DESCRIPTION
    max_message_mb = llm_flags.MAX_MESSAGE_MB

    def __init__(self, args: argparse.Namespace, metrics):
        super().__init__(args, metrics)
        # The one place the LLM reads its flags: everything below takes this value.
        self.config = (LLMConfig.from_args(args, self.model_dir, device=self.device, dtype=self.dtype,
                                           security=self.security)
                       if self.model_dir is not None else None)
        self.engine: LLMEngine | None = None
        self.runner: ModelRunner | None = None
        self.fanout: EncoderFanout | None = None
        self.model_config: ModelConfig | None = None
        self.tokenizer = None
        self.spatial_merge = 2
        self.image_grid: ImageGrid | None = None  # counts raw images' rows before they are encoded
        self._grammars = None  # services.llm.structured.GrammarCompiler, made on the first structured request
        self.item_shapes = ItemShapes()  # what earlier encodes returned, by item digest (prefix cache lookups)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        llm_flags.add_arguments(parser)

    def register(self, server) -> None:
        server.add_service(self.grpc_service, pb.llm_pb2_grpc.add_LLMServiceServicer_to_server,
                           ForwardingServicer(self, Generate=self.generate))

    async def load(self) -> None:
        await super().load()
        if self.config is None:
            return
        await asyncio.to_thread(self._load)
        enc = self.config.encoders
        targets = [(m, t) for m, t in ((pb.IMAGE, enc.vision), (pb.AUDIO, enc.audio)) if t]
        probe = ShmProbe() if targets and enc.shared_memory and shm_available() else None
        reader = ShmReader() if probe is not None else None
        pools = {modality: EncoderPool(modality, target, max_message_bytes=enc.max_message_bytes, probe=probe,
                                       reader=reader, device=self.device, security=enc.security,
                                       metrics=self.metrics)
                 for modality, target in targets}
        self.fanout = EncoderFanout(pools, fingerprint=self.weights_fingerprint,
                                    check_fingerprint=not enc.allow_foreign, default_timeout=enc.timeout_s,
                                    metrics=self.metrics, probe=probe, device=self.device)
        self.engine.start()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        config = self.config
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        except Exception as exc:  # noqa: BLE001 - say which file is missing rather than a transformers trace
            raise ConfigError(f"--model {config.model_dir}: cannot load its tokenizer ({exc})") from exc
        # Rank 0 here; ranks 1.. (tensor parallel) as child processes running the same ModelRunner.
        self.runner = ModelRunner.launch(config, self.metrics)
        cfg = self.model_config = self.runner.model_config
        if self.runner.uses_mrope:
            vision = ModelConfig.from_hf(config.model_dir, part="vision")
            self.spatial_merge = int(vision.get("spatial_merge_size", 2))
            self.image_grid = _image_grid(config.model_dir, vision, self.spatial_merge)
        eos = tuple(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos += (self.tokenizer.eos_token_id,)
        self.engine = LLMEngine(self.runner, self.tokenizer, eos_token_ids=eos, metrics=self.metrics,
                                model_name=self.model_id)

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.runner is not None:
            await asyncio.to_thread(self.runner.shutdown)
        if self.fanout is not None:
            await self.fanout.close()

    def info(self) -> pb.ServiceInfo:
        info = super().info()
        if self.model_config is not None:
            info.architecture = ",".join(self.model_config.architectures)
            info.hidden_size = self.model_config.hidden_size
            info.vocab_size = self.model_config.vocab_size or 0
            info.max_model_len = self.config.max_model_len
            info.extra["tensor_parallel_size"] = str(self.config.tensor_parallel_size)
        if self.runner is not None:  # what the model's ranks chose, each rank's own selector
            info.extra["cuda_graphs"] = "on" if self.runner.graphs is not None else "off"
            del info.attention[:]
            info.attention.extend(
                pb.AttentionChoice(component=component, backend=backend, reason=reason, rank=report.rank,
                                   rejected=[pb.BackendRejection(backend=b, reason=why) for b, why in rejected])
                for report in self.runner.reports for component, backend, reason, rejected in report.attention)
        if self.engine is not None:
            pool = self.engine.pool
            info.pools.append(pb.PoolInfo(name="kv", capacity_tokens=pool.allocator.capacity_tokens,
                                          used_tokens=pool.allocator.used_tokens, bytes=pool.nbytes,
                                          page_size=pool.page_size, dtype=str(self.dtype).removeprefix("torch.")))
        return info

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
        """Generate: the request's deltas as they come; `timeout` is what the caller's deadline leaves."""
        if self.engine is None:
            raise self.not_ready("this LLM service")
        cfg = self.model_config
        limits = self.config.limits
        params = SamplingParams.from_proto(request.sampling, default_max_tokens=0, vocab_size=cfg.vocab_size,
                                           limits=limits)
        limits.check_items(len(request.items) + sum(part.HasField("item") for m in request.chat.messages
                                                    for part in m.content))
        ids, items = tokenize_prompt(request, self.tokenizer, cfg.vocab_size, self.config.chat_template)
        check_modalities(items, cfg)
        if items:  # before any Encode: a request that cannot fit is refused without encoding its items
            need = prompt_length_before_encoding(ids, items, cfg, image_grid=self.image_grid)
            limit = self.config.max_model_len
            if need >= limit or (params.max_tokens and need + params.max_tokens > limit):
                raise InvalidArgument(f"the prompt takes at least {need} tokens with its items' rows (counted "
                                      f"before encoding){f' + max_tokens {params.max_tokens}' if params.max_tokens else ''}"
                                      f"; this model's limit is {limit} tokens (prompt + output)")
        rid = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
        # n choices are n sequences of the engine, each its own request; the siblings take the prompt's pages
        # from the prefix cache. With a seed, choice i draws with seed + i (vLLM's rule), so the whole answer
        # is reproducible.
        rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        holds: list[str] = []  # pinned prefix pages, one hold per choice, until each choice has taken its own
        open_choices: set[int] = set()
        first_token_ns = None
        try:
            digests = await item_digests(items) if items and self.config.prefix_caching else []
            skip: set[int] = set()
            if digests:
                plan = plan_prefix(ids, items, digests, self.item_shapes, cfg, self.config.page_size)
                if plan.keys and plan.item_ends:
                    holds = [f"{choice_rid}/prefix-hold" for choice_rid in rids]
                    held = await self.engine.hold_prefix(holds, plan.keys)
                    skip = {i for i, end in plan.item_ends if end <= held}
                    log.debug("generate %s: %d of %d prompt pages cached; items %s not encoded", rid, held //
                              self.config.page_size, len(plan.keys), sorted(skip))
            # The encoders' Encode spans are children of this one (their calls carry its traceparent).
            with tracing.span("llm.encode_items", attributes={"modalmesh.items": len(items),
                                                               "modalmesh.items_cached": len(skip)}):
                embeddings = await self.fanout.resolve(items, timeout, skip=skip)  # each on self.device
            if digests:
                embeddings = self._with_digests(embeddings, items, digests)
            grammar = None
            if params.structured is not None:  # compiled in a worker thread (cached): never on the engine thread
                grammar = await self._grammar_compiler().compile(params.structured)
            prompt = splice_items(ids, embeddings, cfg, uses_mrope=self.engine.runner.uses_mrope,
                                  spatial_merge=self.spatial_merge)
            for span in prompt.spans:
                if span.embedding is not None:
                    span.embedding = span.embedding.to(self.device, self.dtype)
            loop = asyncio.get_running_loop()
            out: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
            added_ns, added_at = tracing.now_ns(), time.perf_counter()
            for i, choice_rid in enumerate(rids):
                choice = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64))
                self.engine.add(choice_rid, prompt, choice, ThreadSafeEmitter(loop, _Tagged(out, i)), grammar=grammar,
                                hold=holds[i] if holds else None)
                if holds:
                    holds[i] = None  # the request's now: released when it ends
                open_choices.add(i)
            log.debug("generate %s: %d prompt tokens, max_tokens %s, n %d", rid, len(prompt.token_ids),
                      params.max_tokens or "-", params.n)
            while open_choices:
                pairs = [await out.get()]
                while not out.empty():  # behind the engine: send what has piled up as one message per choice
                    pairs.append(out.get_nowait())
                if first_token_ns is None:
                    first_token_ns = tracing.now_ns()
                    _queue_and_prefill_spans(added_ns, added_at, pairs[0][1].scheduled_at, first_token_ns)
                by_choice: dict[int, list[Delta]] = {}
                for i, d in pairs:
                    by_choice.setdefault(i, []).append(d)
                for i, deltas in by_choice.items():
                    delta = _merge(deltas)
                    if delta.error is not None:
                        open_choices.discard(i)
                        if isinstance(delta.error, ModalmeshError):
                            raise delta.error
                        raise RuntimeError(f"generation failed: {type(delta.error).__name__}") from delta.error
                    if delta.finish_reason is not None:
                        open_choices.discard(i)
                    yield self._response(delta, i, params.logprobs > 0)
        finally:
            if first_token_ns is not None:
                tracing.timed_span("llm.decode", first_token_ns, tracing.now_ns(),
                                   {"modalmesh.finished": not open_choices})
            for i in open_choices:  # cancelled (the client went away, the deadline passed) or a sibling failed
                self.engine.abort(rids[i])
            unclaimed = [hold for hold in holds if hold is not None]
            if unclaimed:  # the request failed or went away before its choices were added
                self.engine.release(unclaimed)

    def _with_digests(self, embeddings: list[Embedding | None], items: list[pb.MultimodalItem],
                      digests: list[bytes]) -> list[Embedding]:
        """Each item's embedding named by its digest; the ones not encoded (None: their rows are cached) as
        their shape from an earlier encode. Encoded ones teach `item_shapes` their shape."""
        out = []
        for item, emb, digest in zip(items, embeddings, digests):
            if emb is None:
                shape = self.item_shapes.get(digest)
                emb = Embedding(None, item.modality, shape.grid_thw, num_placeholder_tokens=shape.rows)
            else:
                self.item_shapes.put(digest, ItemShape(emb.rows, emb.grid_thw))
            out.append(dataclasses.replace(emb, digest=digest))
        return out

    def _grammar_compiler(self):
        if self._grammars is None:
            from services.llm.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             tuple(self.engine.eos_token_ids))
        return self._grammars

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _response(self, delta: Delta, index: int, logprobs: bool) -> pb.GenerateResponse:
        response = _response(delta)
        response.index = index
        if logprobs:  # each token's own text: the gateway has no tokenizer
            response.tokens.extend(self._token_text(t) for t in delta.token_ids)
        for top in delta.top_logprobs:
            response.top_logprobs.append(pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[v for _, v in top],
                                                        tokens=[self._token_text(t) for t, _ in top]))
        return response


class _Tagged:
    """A choice's end of the shared queue: the engine puts deltas, the queue gets (choice index, delta)."""

    __slots__ = ("out", "index")

    def __init__(self, out: asyncio.Queue, index: int):
        self.out, self.index = out, index

    def put_nowait(self, delta: Delta) -> None:
        self.out.put_nowait((self.index, delta))


def _queue_and_prefill_spans(added_ns: int, added_at: float, scheduled_at: float | None, first_token_ns: int) -> None:
    """llm.queue (added to the engine -> first in a step) and llm.prefill (-> first token). The engine marks
    the step with time.perf_counter; spans take wall-clock ns, so the mark is placed relative to `added`."""
    if scheduled_at is None:  # a request that ended before any step (cannot have a first token; kept whole)
        scheduled_ns = first_token_ns
    else:
        scheduled_ns = min(first_token_ns, max(added_ns, added_ns + int((scheduled_at - added_at) * 1e9)))
    tracing.timed_span("llm.queue", added_ns, scheduled_ns)
    tracing.timed_span("llm.prefill", scheduled_ns, first_token_ns)


def _merge(deltas: list[Delta]) -> Delta:
    if len(deltas) == 1:
        return deltas[0]
    merged = Delta()
    for d in deltas:
        merged.token_ids += d.token_ids
        merged.text += d.text
        merged.logprobs += d.logprobs
        merged.top_logprobs += d.top_logprobs
        if d.finish_reason is not None or d.error is not None:
            merged.finish_reason, merged.error = d.finish_reason, d.error
            merged.prompt_tokens, merged.completion_tokens = d.prompt_tokens, d.completion_tokens
            merged.cached_tokens = d.cached_tokens
            break  # nothing follows the last delta of a request
    return merged


def _response(delta: Delta) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token_ids=delta.token_ids, text=delta.text, logprobs=delta.logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH[delta.finish_reason]
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        response.usage.cached_tokens = delta.cached_tokens
    return response


def _image_grid(model_dir, vision: ModelConfig, merge: int) -> ImageGrid:
    """Qwen2-VL's image grid from the checkpoint's vision config and preprocessor_config.json."""
    import json

    path = model_dir / "preprocessor_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return ImageGrid.from_preprocessor(raw, patch_size=int(vision.get("patch_size", 14)), merge_size=merge)
