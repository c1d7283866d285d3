"""The LLM's engine process: the model, the engine and the encoders' clients, behind the gRPC edge.

    # the edge (server.py) starts it through engine_client.EngineClient:
    spawn -> engine_process_main(config, settings, requests_end, replies_end, edge_pid)

Everything of a Generate call but its stream runs here: the request is validated and tokenised, its
items resolved (prefix cache, encoders), its choices added to the engine. The engine thread hands each
step's deltas for every call to `LinkSink`, which sends them to the edge as one frame; the edge turns
them into each stream's messages. grpc's per-message work thus never takes this process's GIL from
the engine thread (issue 17: under 256 streams the two shared one GIL, about half each).

The process ends on the edge's Shutdown (after the edge has drained), when the link closes, or with the
edge itself (SIGKILL on the parent's death); its tensor-parallel ranks end with it (tp.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field

from modalmesh import distributed, heap, pb, tracing
from modalmesh import metrics as metrics_mod
from modalmesh.config import ModelConfig
from modalmesh.errors import ConfigError, InvalidArgument
from modalmesh.image_grid import ImageGrid
from modalmesh.interpreter import set_switch_interval
from modalmesh.logs import configure_logging
from modalmesh.process import set_parent_death_signal
from modalmesh.rpc.shm import ShmProbe, ShmReader, shm_available
from modalmesh.tracing import TracingConfig
from services.llm.config import LLMConfig
from services.llm.embedding import Embedding
from services.llm.engine import Delta, LLMEngine, SinkEmitter
from services.llm.inputs import check_modalities, prompt_length_before_encoding, splice_items, tokenize_prompt
from services.llm.link import (Answer, CallFailed, EndCall, FrameReader, FrameSender, GenerateCall, LoadFailed,
                               Query, Ready, Shutdown, StepDeltas, Stopped, error_info)
from services.llm.prefix_items import ItemShape, ItemShapes, item_digests, plan_prefix
from services.llm.sampling import SamplingParams

log = logging.getLogger("modalmesh.llm")


@dataclass(frozen=True)
class EngineSettings:
    """What the engine process takes from the edge besides the LLMConfig: the service's identity, and the
    metrics and tracing settings its own registry and spans are made with."""

    model_id: str
    weights_fingerprint: str
    metrics: metrics_mod.MetricsOptions = metrics_mod.MetricsOptions()
    tracing: TracingConfig = TracingConfig()


def engine_process_main(config: LLMConfig, settings: EngineSettings, requests: socket.socket,
                        replies: socket.socket, edge_pid: int) -> None:
    """The engine process's whole life (a multiprocessing spawn target); exits with its code."""
    set_parent_death_signal(signal.SIGKILL)  # never outlive the edge; the ranks follow this process
    if os.getppid() != edge_pid:
        os._exit(1)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the edge drains first, then sends Shutdown
        signal.signal(sig, signal.SIG_IGN)
    configure_logging("llm", level=config.log_level, fmt=config.log_format)
    set_switch_interval(config.switch_interval_s)
    metrics = metrics_mod.install(metrics_mod.Metrics("llm", options=settings.metrics))
    heap.observe_pauses(metrics.gc_pause_seconds)
    code = 1
    try:
        tracing.start(settings.tracing)
        core = EngineCore(config, settings, metrics, FrameSender(replies))
        code = asyncio.run(core.serve(requests))
    except BaseException:  # noqa: BLE001 - say why, then leave without finalisers
        log.exception("the LLM engine process failed")
    finally:
        tracing.stop()
    distributed.exit_rank(code)  # a rank-0 process holds gloo / NCCL threads: no interpreter finalisation


@dataclass
class _Call:
    """One Generate call the edge took: its set-up task, then its choices in the engine."""

    call_id: int
    task: asyncio.Task | None = None
    rids: list[str] = field(default_factory=list)
    added: int = 0  # choices handed to the engine so far (rids[:added])


class SetupClock:
    """A Generate call's set-up in the engine process, stage by stage (modalmesh_generate_setup_seconds): each
    `lap` observes the time since the last one under its stage. Starts at the edge's send (`sent_at`, the
    perf_counter clock every process of the service shares)."""

    def __init__(self, histogram, sent_at: float):
        self.histogram = histogram
        self.mark = sent_at

    def lap(self, stage: str | None) -> None:
        """The time since the last lap is `stage`'s (None: nobody's, e.g. a stage this call did not have)."""
        now = time.perf_counter()
        if stage is not None:
            self.histogram.labels(stage=stage).observe(max(now - self.mark, 0.0))
        self.mark = now


class LinkSink:
    """The engine's deltas to the edge: a step's deltas for every call in one `StepDeltas` frame (engine thread).
    A destination is (call id, choice index, whether the call wants each token's text)."""

    def __init__(self, sender: FrameSender, token_text):
        self.sender = sender
        self.token_text = token_text

    def deliver(self, pairs: list[tuple[tuple[int, int, bool], Delta]]) -> None:
        rows = []
        for (call_id, index, texts), d in pairs:
            try:
                rows.append(self._row(call_id, index, texts, d))
            except Exception as exc:  # noqa: BLE001 - that call fails (the edge ends it); the engine thread goes on
                log.exception("delta of call %d could not be sent", call_id)
                rows.append((call_id, index, [], "", [], ("abort", 0, 0, 0), {"error": error_info(exc)}))
        self.sender.send(StepDeltas(rows))

    def _row(self, call_id: int, index: int, texts: bool, d: Delta) -> tuple:
        """One delta as a link.DeltaRow."""
        extra = None
        if texts or d.top_logprobs or d.scheduled_at is not None or d.error is not None or d.prompt_ids is not None:
            extra = {}
            if texts:  # the gateway has no tokenizer: logprobs come with each token's text
                extra["tokens"] = [self.token_text(t) for t in d.token_ids]
            if d.top_logprobs:
                extra["top"] = [([t for t, _ in top], [v for _, v in top], [self.token_text(t) for t, _ in top])
                                for top in d.top_logprobs]
            if d.scheduled_at is not None:
                extra["scheduled_at"], extra["arrival"] = d.scheduled_at, d.arrival
            if d.error is not None:
                extra["error"] = error_info(d.error)
            if d.prompt_ids is not None:
                text = self.token_text
                extra["prompt"] = (d.prompt_ids, [text(t) for t in d.prompt_ids],
                                   [lp for lp, _, _ in d.prompt_logprobs], [rank for _, rank, _ in d.prompt_logprobs],
                                   [([t for t, _ in top], [v for _, v in top], [text(t) for t, _ in top])
                                    for _, _, top in d.prompt_logprobs])
        finish = (None if d.finish_reason is None else
                  (d.finish_reason, d.prompt_tokens, d.completion_tokens, d.cached_tokens))
        return call_id, index, d.token_ids, d.text, d.logprobs, finish, extra


class EngineCore:
    """The LLM service's work in the engine process; `serve` answers the edge's link until Shutdown."""

    def __init__(self, config: LLMConfig, settings: EngineSettings, metrics: metrics_mod.Metrics,
                 sender: FrameSender):
        self.config = config
        self.settings = settings
        self.metrics = metrics
        self.sender = sender
        self.device, self.dtype = config.device, config.dtype
        self.engine: LLMEngine | None = None
        self.runner = None
        self.fanout = None
        self.model_config: ModelConfig | None = None
        self.tokenizer = None
        self.spatial_merge = 2
        self.image_grid: ImageGrid | None = None  # counts raw images' rows before they are encoded
        self.tokens_per_second: float | None = None  # Qwen2.5-VL: its video positions are time-scaled
        self._grammars = None  # services.llm.structured.GrammarCompiler, made on the first structured request
        self.item_shapes = ItemShapes()  # what earlier encodes returned, by item digest (prefix cache lookups)
        self._token_texts: dict[int, str] = {}  # _token_text's, at most one per vocabulary id
        self.sink = LinkSink(sender, self._token_text)
        self.calls: dict[int, _Call] = {}

    # -- the link --------------------------------------------------------------------------------
    async def serve(self, requests: socket.socket) -> int:
        reader = await FrameReader.open(requests)
        try:
            await self.load()
        except Exception as exc:  # noqa: BLE001 - the edge logs it and exits 1, as a failed start-up does
            log.debug("load failed", exc_info=True)
            self.sender.send(LoadFailed(error_info(exc)))
            await self.close()
            return 1
        if self.config.gc_freeze:
            heap.freeze_startup_heap()  # serving's collections skip the model's objects
        self.sender.send(Ready())
        while True:
            message = await reader.recv()
            if message is None:
                log.error("the LLM's gRPC edge has gone: the engine process stops")
                await self.close()
                return 1
            if isinstance(message, GenerateCall):
                self._start_call(message)
            elif isinstance(message, EndCall):
                self._end_call(message)
            elif isinstance(message, Query):
                self.sender.send(Answer(message.query_id, self._answer(message.what)))
            elif isinstance(message, Shutdown):
                await self.close()
                self.sender.send(Stopped())
                return 0

    def _answer(self, what: str):
        if what == "metrics":
            return metrics_mod.plain_families(self.metrics.registry)
        return self.info().SerializeToString()

    # -- life cycle ------------------------------------------------------------------------------
    async def load(self) -> None:
        await asyncio.to_thread(self._load)
        from services.llm.encoders import EncoderFanout, EncoderPool

        enc = self.config.encoders
        targets = [(m, t) for m, t in ((pb.IMAGE, enc.vision), (pb.AUDIO, enc.audio)) if t]
        probe = ShmProbe() if targets and enc.shared_memory and shm_available() else None
        reader = ShmReader() if probe is not None else None
        pools = {modality: EncoderPool(modality, target, max_message_bytes=enc.max_message_bytes, probe=probe,
                                       reader=reader, device=self.device, security=enc.security,
                                       metrics=self.metrics)
                 for modality, target in targets}
        self.fanout = EncoderFanout(pools, fingerprint=self.settings.weights_fingerprint,
                                    check_fingerprint=not enc.allow_foreign, default_timeout=enc.timeout_s,
                                    metrics=self.metrics, probe=probe, device=self.device)
        self.engine.start()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from services.llm.runner import ModelRunner

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
            if "Qwen2_5_VLForConditionalGeneration" in self.runner.model_config.architectures:
                self.tokens_per_second = vision.get("tokens_per_second", 4)  # Qwen2_5_VLVisionConfig's default
        eos = tuple(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos += (self.tokenizer.eos_token_id,)
        self.engine = LLMEngine(self.runner, self.tokenizer, eos_token_ids=eos, metrics=self.metrics,
                                model_name=self.settings.model_id)

    async def close(self) -> None:
        for call in list(self.calls.values()):
            if call.task is not None and not call.task.done():
                call.task.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.runner is not None:
            await asyncio.to_thread(self.runner.shutdown)
        if self.fanout is not None:
            await self.fanout.close()

    def info(self) -> pb.ServiceInfo:
        """The engine's part of Info; the edge adds the service's own fields."""
        info = pb.ServiceInfo()
        if self.model_config is not None:
            info.architecture = ",".join(self.model_config.architectures)
            info.hidden_size = self.model_config.hidden_size
            info.vocab_size = self.model_config.vocab_size or 0
            info.max_model_len = self.config.max_model_len
            info.extra["tensor_parallel_size"] = str(self.config.tensor_parallel_size)
        if self.runner is not None:  # what the model's ranks chose, each rank's own selector
            info.extra["cuda_graphs"] = "on" if self.runner.graphs is not None else "off"
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

    # -- calls -----------------------------------------------------------------------------------
    def _start_call(self, message: GenerateCall) -> None:
        call = _Call(message.call_id)
        self.calls[call.call_id] = call
        call.task = asyncio.ensure_future(self._generate(call, message))

    def _end_call(self, message: EndCall) -> None:
        """The edge is done with the call: a cancelled one's set-up stops, and its choices leave the engine."""
        call = self.calls.pop(message.call_id, None)
        if call is None:
            return
        if call.task is not None and not call.task.done():
            call.task.cancel()
        if not message.complete:
            for rid in call.rids[:call.added]:
                self.engine.abort(rid)  # frees its KV pages; a no-op for a choice that has finished

    async def _generate(self, call: _Call, message: GenerateCall) -> None:
        # The call's request id and trace context, as the edge's interceptor set them for the Generate call:
        # this task's log records and the encoders' calls carry them.
        clock = SetupClock(self.metrics.generate_setup_seconds, message.sent_at)
        clock.lap("link")
        tracing.request_id.set(tracing.request_id_from(message.metadata))
        with tracing.within(tracing.extract(message.metadata)):
            try:
                request = pb.GenerateRequest.FromString(message.request)
                await self._add(call, request, len(message.request), message.timeout, clock)
            except asyncio.CancelledError:  # the edge ended the call (client gone, deadline): nobody to tell
                self._abort_added(call)
            except Exception as exc:  # noqa: BLE001 - the edge raises it again with its status
                self._abort_added(call)
                info = error_info(exc)
                if info.status is None:
                    log.exception("unexpected error in Generate")
                self.sender.send(CallFailed(call.call_id, info))

    def _abort_added(self, call: _Call) -> None:
        for rid in call.rids[:call.added]:
            self.engine.abort(rid)
        call.added = 0

    async def _add(self, call: _Call, request: pb.GenerateRequest, request_bytes: int, timeout: float | None,
                   clock: SetupClock) -> None:
        """Validate and tokenise `request` (`request_bytes` long as received), resolve its items and add its
        choices to the engine; each stage timed on `clock`."""
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
        clock.lap("validate")
        # n choices are n sequences of the engine, each its own request; the siblings take the prompt's pages
        # from the prefix cache. With a seed, choice i draws with seed + i (vLLM's rule), so the whole answer
        # is reproducible.
        call.rids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        holds: list[str | None] = []  # pinned prefix pages, one hold per choice, until each choice takes its own
        try:
            # Prompt logprobs need every prompt row computed: such a request neither reads the cache nor pins it.
            caching = self.config.prefix_caching and params.prompt_logprobs is None
            digests = await item_digests(items, request_bytes) if items and caching else []
            skip: set[int] = set()
            if digests:
                plan = plan_prefix(ids, items, digests, self.item_shapes, cfg, self.config.page_size)
                if plan.keys and plan.item_ends:
                    holds = [f"{choice_rid}/prefix-hold" for choice_rid in call.rids]
                    held = await self.engine.hold_prefix(holds, plan.keys)
                    skip = {i for i, end in plan.item_ends if end <= held}
                    log.debug("generate %s: %d of %d prompt pages cached; items %s not encoded", rid, held //
                              self.config.page_size, len(plan.keys), sorted(skip))
            clock.lap("prefix" if digests else None)
            # The encoders' Encode spans are children of this one (their calls carry its traceparent).
            with tracing.span("llm.encode_items", attributes={"modalmesh.items": len(items),
                                                               "modalmesh.items_cached": len(skip)}):
                embeddings = await self.fanout.resolve(items, timeout, skip=skip)  # each on self.device
            clock.lap("encode" if len(skip) < len(items) else None)
            if digests:
                embeddings = self._with_digests(embeddings, items, digests)
            grammar = None
            if params.structured is not None:  # compiled in a worker thread (cached): never on the engine thread
                grammar = await self._grammar_compiler().compile(params.structured)
            prompt = splice_items(ids, embeddings, cfg, uses_mrope=self.runner.uses_mrope,
                                  spatial_merge=self.spatial_merge, tokens_per_second=self.tokens_per_second)
            _check_positions(prompt, params.max_tokens, self.config.max_model_len)
            for span in prompt.spans:
                if span.embedding is not None:
                    span.embedding = span.embedding.to(self.device, self.dtype)
            texts = params.logprobs > 0
            for i, choice_rid in enumerate(call.rids):
                choice = params if params.n == 1 else dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else (params.seed + i) % (1 << 64))
                self.engine.add(choice_rid, prompt, choice, SinkEmitter(self.sink, (call.call_id, i, texts)),
                                grammar=grammar, hold=holds[i] if holds else None)
                if holds:
                    holds[i] = None  # the request's now: released when it ends
                call.added = i + 1
            clock.lap("admit")
            log.debug("generate %s: %d prompt tokens, max_tokens %s, n %d", rid, len(prompt.token_ids),
                      params.max_tokens or "-", params.n)
        finally:
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
                emb = Embedding(None, item.modality, shape.grid_thw, num_placeholder_tokens=shape.rows,
                                second_per_grid_t=shape.second_per_grid_t)
            else:
                self.item_shapes.put(digest, ItemShape(emb.rows, emb.grid_thw, emb.second_per_grid_t))
            out.append(dataclasses.replace(emb, digest=digest))
        return out

    def _grammar_compiler(self):
        if self._grammars is None:
            from services.llm.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             tuple(self.engine.eos_token_ids))
        return self._grammars

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, cached by id: prompt logprobs name every prompt token and its top k, on the
        engine thread (a 32k-token prompt at k = 20 decoded 670k ids, 1.8 s of every running request's time)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _check_positions(prompt, max_tokens: int, max_model_len: int) -> None:
    """A prompt whose M-RoPE positions run ahead of its tokens (Qwen2.5-VL video sampled sparsely: time-scaled
    steps wider than a frame's rows) continues decoding at positions past its token count: they must stay
    within the model's length, which the rotary tables cover."""
    if prompt.mrope is None or prompt.mrope_delta <= 0:
        return
    length = len(prompt.token_ids)
    last = length + prompt.mrope_delta + (max_tokens or max_model_len - length) - 1
    if last >= max_model_len:
        raise InvalidArgument(f"the prompt's video positions run {prompt.mrope_delta} ahead of its {length} tokens: "
                              f"with {'max_tokens ' + str(max_tokens) if max_tokens else 'its output'} they would "
                              f"reach position {last}; this model's limit is {max_model_len} (ask for fewer tokens, "
                              "or a denser video)")


def _image_grid(model_dir, vision: ModelConfig, merge: int) -> ImageGrid:
    """Qwen2-VL's image grid from the checkpoint's vision config and preprocessor_config.json."""
    import json

    path = model_dir / "preprocessor_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return ImageGrid.from_preprocessor(raw, patch_size=int(vision.get("patch_size", 14)), merge_size=merge)
