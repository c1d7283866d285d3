"""The generation engine: a worker thread that runs scheduler steps over the model.

The engine process's event loop (core.py) adds requests and aborts through a
thread-safe inbox; the worker drains it between steps — so new requests join
the running batch between decode steps — schedules, runs the model, samples,
detokenises, checks stop conditions and hands each step's deltas to their sinks
at once (the link to the gRPC edge: one frame a step).
Finishing, cancelling or a client going away frees the request's KV pages.
The worker keeps the device busy: it submits step N+1 before it reads step N's
tokens back, detokenises and emits them (see `_run`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from modalmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from modalmesh.metrics import Metrics
from services.llm.detokenizer import IncrementalDetokenizer
from services.llm.inputs import PreparedPrompt
from services.llm.request import Delta, RequestState
from services.llm.runner import InFlight, ModelRunner, Sampled
from services.llm.sampling import SamplerRow, SamplingParams, unpack_logprobs, unpack_prompt_scores
from services.llm.scheduler import PENDING, Scheduler, Sequence, SeqStatus
from services.llm.step_inputs import STEP_PATHS
from modalmesh.kv.page_keys import ItemRows

log = logging.getLogger(__name__)


class LLMEngine:
    """Rank 0's engine over a `ModelRunner` (which, under TP, drives the other ranks)."""

    def __init__(self, runner: ModelRunner, tokenizer, *, eos_token_ids: tuple[int, ...], metrics: Metrics,
                 model_name: str = ""):
        config = runner.config
        self.runner = runner
        self.pool = runner.pool
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = runner.model_config.vocab_size
        self.max_model_len = config.max_model_len
        self.device = runner.device
        self.metrics = metrics
        self.model_name = model_name  # the request series' model_name label
        self.max_queue = config.max_queue
        self.prefix_caching = config.prefix_caching
        self.scheduler: Scheduler = Scheduler(self.pool.allocator, max_num_seqs=config.max_num_seqs,
                                              max_batch_tokens=config.max_batch_tokens,
                                              max_prefill_chunk=config.max_prefill_chunk,
                                              prefix_caching=config.prefix_caching)
        self._inbox: queue.Queue = queue.Queue()
        self._pending = 0  # added but not yet taken by the worker
        self._lock = threading.Lock()
        self._live: dict[str, Sequence[RequestState]] = {}
        self._thread: threading.Thread | None = None
        self.steps = 0
        # Cumulative seconds per phase of a step (bench/llm.py prints them): schedule, model (launching the
        # forward + sampling, and waiting for its tokens), post (stop checks, detokenise, emit; this part
        # runs while the device computes the next step).
        # Exported as modalmesh_engine_step_phase_seconds_total, and by path modalmesh_engine_steps_total.
        self.phase_seconds = {"schedule": 0.0, "model": 0.0, "post": 0.0}
        self._phase_counters = {phase: metrics.engine_step_phase_seconds_total.labels(phase=phase)
                                for phase in self.phase_seconds}
        self._step_counters = {path: metrics.engine_steps_total.labels(path=path) for path in STEP_PATHS}

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout=30)
            self._thread = None

    # -- called from the event loop ---------------------------------------------------------
    def add(self, request_id: str, prompt: PreparedPrompt, params: SamplingParams,
            emit: Callable[[Delta], None], *, grammar=None, hold: str | None = None) -> None:
        """`grammar`: `params.structured` compiled (a services.llm.structured.Grammar, made off this thread).
        `hold`: one of the ids `hold_prefix` pinned pages under, now this request's (released when it ends)."""
        n = len(prompt.token_ids)
        if n == 0:
            raise InvalidArgument("prompt is empty")
        if n >= self.max_model_len:
            raise InvalidArgument(f"prompt has {n} tokens; this model's limit is {self.max_model_len} "
                                  "(prompt + output)")
        if params.max_tokens and n + params.max_tokens > self.max_model_len:
            raise InvalidArgument(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds this model's "
                                  f"limit of {self.max_model_len} tokens")
        max_tokens = params.max_tokens or self.max_model_len - n  # 0: up to the model's limit
        with self._lock:
            waiting = self._pending + self.scheduler.num_waiting
            if waiting >= self.max_queue:
                raise ResourceExhausted(f"the LLM queue is full ({waiting} requests waiting, --max-queue "
                                        f"{self.max_queue})")
            self._pending += 1
        state = RequestState(
            request_id, params, prompt,
            SamplerRow.create(params, prompt.token_ids, self.device, vocab_size=self.vocab_size,
                              eos_token_ids=self.eos_token_ids, grammar=grammar),
            IncrementalDetokenizer(self.tokenizer, prompt.token_ids, skip_special_tokens=params.skip_special_tokens,
                                   stop=params.stop, include_stop=params.include_stop_str_in_output,
                                   min_tokens=params.min_tokens),
            emit,
        )
        if params.prompt_logprobs is not None:
            state.prompt_scores = [None] * (n - 1)
        items = tuple(ItemRows(span.start, span.end, span.digest) for span in prompt.spans)
        # An item without a digest could not be told from another behind the same placeholders: no cache.
        # Prompt logprobs need every prompt row computed: none may come from the cache.
        cacheable = (self.prefix_caching and all(item.digest for item in items)
                     and params.prompt_logprobs is None)
        self._inbox.put(("add", Sequence(request_id, list(prompt.token_ids), max_tokens, state=state, items=items,
                                         cacheable=cacheable, holds=(hold,) if hold is not None else ())))

    async def hold_prefix(self, hold_ids: list[str], keys: list[bytes]) -> int:
        """Pin the cached pages of the longest prefix of `keys` (page keys, modalmesh.kv.page_keys) once per id,
        so they stay cached until each hold is handed to a request (`add(hold=...)`) or `release`d; returns how
        many tokens they hold. The LLM service skips encoding the items those tokens cover."""
        if self._thread is None:  # not started, or stopped: nothing would answer
            return 0
        loop = asyncio.get_running_loop()
        held: asyncio.Future[int] = loop.create_future()

        def resolve(tokens: int) -> None:
            loop.call_soon_threadsafe(lambda: held.done() or held.set_result(tokens))

        self._inbox.put(("hold", (hold_ids, keys, resolve)))
        return await held

    def release(self, hold_ids: list[str]) -> None:
        """Give back holds no request took (it failed, or was cancelled, before it was added)."""
        self._inbox.put(("release", hold_ids))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # -- worker thread ----------------------------------------------------------------------
    # Step N+1 is scheduled and submitted before step N's tokens are read back, so the device never
    # waits for the host between steps:
    #
    #   schedule(N+1) -> submit(N+1) -> advance(N+1) -> wait(N) -> complete(N) -> emit(N) -> [inbox] -> ...
    #
    # `advance` gives each sampled sequence a PENDING token (the device feeds the real one into the next
    # step) and ends the sequences that reach their length with it. `complete` writes the tokens in and
    # ends sequences on EOS or a stop token; `emit` detokenises (stop strings) and sends the deltas. A
    # sequence that ends in `complete` or `emit` has one more step in flight: that result is dropped.
    # Freeing its pages meanwhile is safe: a later step that reuses them runs after it on the same stream.
    # A step whose sampler needs the tokens on the host first (repetition penalty) is waited for before
    # the next is scheduled.
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        inflight: InFlight | None = None
        while True:
            block = inflight is None and not self.scheduler.has_work()
            try:
                while True:
                    kind, value = self._inbox.get(block=block)
                    block = False
                    if kind == "stop":
                        if inflight is not None:
                            self._wait(inflight)  # the device is done with its pages before they go
                        self._abort_all("the LLM service is shutting down")
                        return
                    if kind == "add":
                        with self._lock:
                            self._pending -= 1
                        self._live[value.seq_id] = value
                        self.scheduler.add(value)
                    elif kind == "hold":
                        self._hold(*value)
                    elif kind == "release":
                        for hold in value:
                            if hold in self.pool.allocator:
                                self.pool.allocator.free(hold)
                    elif kind == "abort":
                        seq = self._live.pop(value, None)
                        if seq is not None:
                            self.scheduler.finish(seq, "abort")
                            self._finished(seq.state, "abort", len(seq.prompt_ids), seq.max_tokens,
                                           _generated(seq))
                            self.pool.publish()  # the pool gauge drops now, not at the next step
            except queue.Empty:
                pass
            launched = None
            if self.scheduler.has_work() and (inflight is None or inflight.feeds_next):
                launched = self._launch(inflight)
            if inflight is not None:
                done = self._complete(inflight)
                if done is not None:
                    self._emit(*done)
            inflight = launched
            self.metrics.queue_depth.set(self.scheduler.num_waiting + self._pending)
            self.metrics.num_requests_running.labels(model_name=self.model_name).set(len(self.scheduler.running))

    def _lap(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] += seconds
        self._phase_counters[phase].inc(seconds)

    def _hold(self, hold_ids: list[str], keys: list[bytes], resolve: Callable[[int], None]) -> None:
        alloc = self.pool.allocator
        pages = alloc.match(keys) if self.prefix_caching else []
        for hold in hold_ids:
            alloc.allocate(hold, len(pages) * alloc.page_size, cached=pages)  # no new page: cannot fail
        resolve(len(pages) * alloc.page_size)

    def _launch(self, previous: InFlight | None) -> InFlight | None:
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._lap("schedule", t1 - t0)
        if step.cache_queries:
            self.metrics.prefix_cache_queries_total.labels(model_name=self.model_name).inc(step.cache_queries)
            if step.cache_hits:
                self.metrics.prefix_cache_hits_total.labels(model_name=self.model_name).inc(step.cache_hits)
        if not step.chunks:
            if previous is not None:  # pages free up as the step in flight completes
                return None
            # cannot happen while max_model_len fits the pool; never spin on it
            self._fail([self.scheduler.waiting[0]], ResourceExhausted("no KV pages for this request"))
            return None
        for seq in step.preempted:
            log.info("preempted %s (KV pool full); it will be recomputed", seq.seq_id)
        if step.preempted:
            self.metrics.num_preemptions_total.labels(model_name=self.model_name).inc(len(step.preempted))
        for chunk in step.chunks:
            state = chunk.seq.state
            if state is not None and state.scheduled_at is None:
                state.scheduled_at = t1
                self.metrics.request_queue_time_seconds.labels(model_name=self.model_name).observe(
                    t1 - state.arrival)
        try:
            inflight = self.runner.submit(step, previous)
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            log.exception("engine step failed")
            self._fail([c.seq for c in step.chunks], exc)
            return None
        self._step_counters[inflight.path].inc()  # launched: counted even if it fails or shutdown drops it
        inflight.pending = self.scheduler.advance(step)
        for seq_id in inflight.pending:
            seq = self._live.get(seq_id)
            if seq is not None and (len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
                inflight.ending[seq_id] = "length"
                self._live.pop(seq_id, None)
                self.scheduler.finish(seq, "length")
        self._lap("model", time.perf_counter() - t1)
        return inflight

    def _wait(self, inflight: InFlight) -> list[Sampled] | None:
        t0 = time.perf_counter()
        try:
            sampled = inflight.wait()
        except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep serving the rest
            log.exception("engine step failed")
            # Its sequences ended by length at launch are finished but have not been told: they get the error.
            self._fail([c.seq for c in inflight.step.chunks], exc, unannounced=inflight.ending)
            return None
        self._lap("model", time.perf_counter() - t0)
        return sampled

    def _stop(self, seq: Sequence[RequestState], index: int) -> str:
        """End `seq` with its output `index` (EOS, stop token, stop string): later pending tokens go."""
        self._live.pop(seq.seq_id, None)
        self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"  # also over "length": the last step was submitted before this token was read
        del seq.output_ids[index + 1:]
        return "stop"

    def _complete(self, inflight: InFlight) -> tuple[list[tuple[Sampled, int, str | None]], float] | None:
        """A step's tokens read back and written in; sequences that end on them ended."""
        sampled = self._wait(inflight)
        if sampled is None:
            return None
        t0 = time.perf_counter()
        step = inflight.step
        if inflight.scored is not None:
            for chunk, first, rows in inflight.scored.rows():
                scores = chunk.seq.state.prompt_scores
                if scores is not None:  # else its first token (and the scores with it) has gone out already
                    scores[first:first + len(rows)] = rows
        self.steps += 1
        self.metrics.batch_size.observe(len(step.chunks))
        self.metrics.batch_tokens.observe(step.num_tokens)
        self.metrics.prompt_tokens_total.inc(sum(c.length for c in step.chunks if c.is_prefill))
        ended = []
        for s in sampled:
            seq, token = s.chunk.seq, s.token
            finish = inflight.ending.get(seq.seq_id)
            index = inflight.pending.get(seq.seq_id)
            if index is None or (seq.status is SeqStatus.FINISHED and seq.finish_reason != "length"):
                continue  # aborted, failed or stopped since the step was scheduled: its token is dropped
            self.scheduler.fill(seq, index, token)
            params = seq.state.params
            seq.state.sampler.observe(token)
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                finish = self._stop(seq, index)
            ended.append((s, index, finish))
        self._lap("post", time.perf_counter() - t0)
        return ended, time.perf_counter()

    def _emit(self, ended: list[tuple[Sampled, int, str | None]], now: float) -> None:
        """A completed step's host work that the device need not wait for: text, stop strings, deltas."""
        t0 = time.perf_counter()
        batched: dict[DeltaSink, list] = {}
        gaps: dict[float, int] = {}  # inter-token gap -> tokens: one per step in steady decode
        for s, index, finish in ended:
            state = s.chunk.seq.state
            delta = self._on_token(s.chunk.seq, index, s.token, s.logprob, finish, now, gaps)
            if isinstance(state.emit, SinkEmitter):
                batched.setdefault(state.emit.sink, []).append((state.emit.dest, delta))
            else:
                state.emit(delta)
        if ended:
            self.metrics.generation_tokens_total.inc(len(ended))  # once a step, not once a token
        for gap, count in gaps.items():
            self.metrics.inter_token_latency_seconds.observe_many(gap, count)
        for sink, pairs in batched.items():
            sink.deliver(pairs)
        self.pool.publish()
        self._lap("post", time.perf_counter() - t0)

    def _on_token(self, seq: Sequence[RequestState], index: int, token: int, logprob, finish: str | None,
                  now: float, gaps: dict[float, int]) -> Delta:
        """`gaps`: the step's inter-token gaps, counted here and observed once each by `_emit`."""
        state = seq.state
        params = state.params
        first = state.last_token_at is None
        if first:
            self.metrics.time_to_first_token_seconds.observe(now - state.arrival)
            state.first_token_at = now
            if state.scheduled_at is not None:
                self.metrics.request_prefill_time_seconds.labels(model_name=self.model_name).observe(
                    now - state.scheduled_at)
        else:
            gap = now - state.last_token_at
            gaps[gap] = gaps.get(gap, 0) + 1
        state.last_token_at = now
        if finish == "stop":  # EOS or a stop token: not part of the text
            text = state.detokenizer.finish()
        else:
            text = state.detokenizer.add(token)
            if state.detokenizer.stopped:  # a stop string: ends the sequence, whatever `advance` said
                finish = self._stop(seq, index)
            elif finish == "length":
                text += state.detokenizer.finish()
        delta = Delta([token], text)
        if params.logprobs:
            chosen, top = unpack_logprobs(logprob, params.top_logprobs)
            delta.logprobs.append(chosen)
            if params.top_logprobs:
                delta.top_logprobs.append(top)
        if first:
            delta.arrival, delta.scheduled_at = state.arrival, state.scheduled_at
            if state.prompt_scores is not None:
                k = params.prompt_logprobs
                delta.prompt_ids = list(seq.prompt_ids)
                delta.prompt_logprobs = [unpack_prompt_scores(row, k) for row in state.prompt_scores]
                state.prompt_scores = None
        if finish is not None:
            delta.finish_reason = finish
            delta.prompt_tokens = len(seq.prompt_ids)
            delta.completion_tokens = len(seq.output_ids)
            delta.cached_tokens = seq.num_cached
            self._finished(state, finish, len(seq.prompt_ids), seq.max_tokens, len(seq.output_ids), now)
        return delta

    def _finished(self, state: RequestState, reason: str, prompt_tokens: int, max_tokens: int,
                  generation_tokens: int, now: float | None = None) -> None:
        """A request's metrics, once, when it ends (stop, length, abort, error)."""
        if state is None or state.finished:
            return
        state.finished = True
        now = time.perf_counter() if now is None else now
        m, name = self.metrics, self.model_name
        m.requests_finished_total.labels(model_name=name, finished_reason=reason).inc()
        m.e2e_request_latency_seconds.labels(model_name=name).observe(now - state.arrival)
        if state.first_token_at is not None:
            m.request_decode_time_seconds.labels(model_name=name).observe(now - state.first_token_at)
            if generation_tokens > 1:  # TPOT: the mean gap of this request's tokens after its first
                m.time_per_output_token_seconds.observe((now - state.first_token_at) / (generation_tokens - 1))
        m.request_prompt_tokens.labels(model_name=name).observe(prompt_tokens)
        m.request_generation_tokens.labels(model_name=name).observe(generation_tokens)
        m.request_params_max_tokens.labels(model_name=name).observe(max_tokens)

    def _fail(self, seqs: list[Sequence[RequestState]], exc: BaseException, reason: str = "error",
              unannounced=()) -> None:
        """End `seqs` with `exc`; `reason` is the finished-requests label (error: a step failed).
        `unannounced`: ids of sequences already finished whose last delta is still to be sent."""
        for seq in seqs:
            if seq.status is SeqStatus.FINISHED and (seq.seq_id not in unannounced or seq.state.finished):
                continue
            self._live.pop(seq.seq_id, None)
            # Its pages' K/V may not have been written (the step failed): they leave the prefix cache.
            self.scheduler.finish(seq, "abort", computed=reason != "error")
            self._finished(seq.state, reason, len(seq.prompt_ids), seq.max_tokens, _generated(seq))
            seq.state.emit(Delta(finish_reason="abort", error=exc))
        self.pool.publish()

    def _abort_all(self, why: str) -> None:
        self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), Unavailable(why), "abort")
        while True:
            try:
                kind, value = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._finished(value.state, "abort", len(value.prompt_ids), value.max_tokens, 0)
                value.state.emit(Delta(finish_reason="abort", error=Unavailable(why)))
            elif kind == "hold":
                value[2](0)  # nothing pinned: the request fails when it is added

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)


def _generated(seq: Sequence) -> int:
    """Output tokens read back so far (a pending one is still on the device)."""
    return sum(1 for t in seq.output_ids if t != PENDING)


class DeltaSink(Protocol):
    """Where requests' deltas go: `deliver` takes one step's (destination, delta) pairs for this sink at once,
    on the engine thread (the LLM's engine process sends them to its gRPC edge as one frame: core.py)."""

    def deliver(self, pairs: list[tuple[Any, Delta]]) -> None: ...


class SinkEmitter:
    """A request's emitter whose deltas the engine hands to `sink` together with the step's others."""

    __slots__ = ("sink", "dest")

    def __init__(self, sink: DeltaSink, dest: Any):
        self.sink, self.dest = sink, dest

    def __call__(self, delta: Delta) -> None:  # a delta outside a step's batch (a failure, an abort)
        self.sink.deliver([(self.dest, delta)])


__all__ = ["Delta", "DeltaSink", "LLMEngine", "SeqStatus", "SinkEmitter"]
