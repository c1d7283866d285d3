"""The engine's one-step-ahead loop, over a scripted runner (no model): the order of the host work,
and what happens to a sequence whose token is still in flight when it ends.

`LLMEngine._run` launches step N before it detokenises and emits step N-1. The
scripted runner plays the model: each sequence's tokens come from a script, and
every call (submit, wait) is logged next to the deltas the engine emits, so the
tests read the order straight off the log.
"""

import queue
import threading
import types

import pytest
import torch

from modalmesh.testing import tiny
from modalmesh.kv.allocator import PageAllocator
from modalmesh.metrics import Metrics
from services.llm.engine import LLMEngine
from services.llm.inputs import PreparedPrompt
from services.llm.runner import InFlight
from services.llm.sampling import SamplingParams
from services.llm.scheduler import PENDING, Step


class ScriptedRunner:
    def __init__(self, scripts: dict[str, list[int]], log: list):
        self.config = types.SimpleNamespace(max_model_len=256, max_queue=16, max_num_seqs=8, max_batch_tokens=64,
                                            max_prefill_chunk=None, prefix_caching=False)
        allocator = PageAllocator(64, page_size=4)
        self.pool = types.SimpleNamespace(allocator=allocator, publish=lambda: None)
        self.model_config = types.SimpleNamespace(vocab_size=400)
        self.device = "cpu"
        self.scripts, self.log, self.steps = scripts, log, 0
        self.in_flight: dict[str, int] = {}  # request -> steps it was part of
        self.hold_at, self.release = None, threading.Event()  # submit step `hold_at` only once released
        self.paths: list[str] = []  # per submitted step

    def submit(self, step: Step, previous=None):
        n, self.steps = self.steps, self.steps + 1
        if n == self.hold_at:
            assert self.release.wait(30)
        names = sorted(c.seq.seq_id for c in step.chunks)
        for name in names:
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
        self.log.append(("submit", n, tuple(names)))
        for c in step.chunks:  # a token not read back yet must come from the step before, which sampled it
            if c.seq.output_ids and c.seq.output_ids[-1] == PENDING:
                assert previous is not None and c.seq.seq_id in previous.rows, (n, c.seq.seq_id)
        chunks = [c for c in step.chunks if c.sample]
        tokens = torch.tensor([self.scripts[c.seq.seq_id][len(c.seq.output_ids)] for c in chunks], dtype=torch.long)
        log = self.log

        class Logged(InFlight):
            def wait(self):
                log.append(("wait", n))
                return super().wait()

        # The path the step "ran" by: prompt chunks as a mixed graph, decode rows as a decode graph
        path = "mixed_graph" if any(c.is_prefill for c in step.chunks) else "decode_graph"
        self.paths.append(path)
        return Logged(step, chunks, tokens, torch.zeros(len(chunks)), path=path)

@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")


def _engine(tokenizer, scripts, log):
    runner = ScriptedRunner(scripts, log)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return LLMEngine(runner, tokenizer, eos_token_ids=(eos,), metrics=Metrics("llm", process_metrics=False)), runner


def _run(engine, log, requests):
    outs = {}
    for name, (prompt, params) in requests.items():
        outs[name] = queue.Queue()
        engine.add(name, PreparedPrompt(prompt), params,
                   lambda d, name=name: (log.append(("emit", name, tuple(d.token_ids), d.finish_reason)),
                                         outs[name].put(d)))
    engine.start()
    try:
        deltas = {}
        for name, out in outs.items():
            deltas[name] = []
            while True:
                d = out.get(timeout=30)
                assert d.error is None, d.error
                deltas[name].append(d)
                if d.finish_reason:
                    break
    finally:
        engine.stop()
    return deltas


def test_step_n_plus_1_is_submitted_before_step_n_is_read_back(tokenizer):
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script}, log)
    deltas = _run(engine, log, {"a": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6))})
    assert [t for d in deltas["a"] for t in d.token_ids] == script[:6]
    assert deltas["a"][-1].finish_reason == "length"
    # while there is a next step, it is submitted before the step before it is waited for and emitted
    order = [e[:2] for e in log if e[0] in ("submit", "wait", "emit")]
    for k in range(5):
        assert order.index(("submit", k + 1)) < order.index(("wait", k)), order
    emits = [i for i, e in enumerate(order) if e[0] == "emit"]
    assert all(order[i - 1][0] == "wait" for i in emits)  # each emit right after its own read-back
    assert runner.in_flight["a"] == 6  # the length is known when the step is submitted: no wasted step
    assert engine.pool.allocator.used_tokens == 0


def test_a_stop_string_ends_the_stream_and_drops_the_token_in_flight(tokenizer):
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script, "b": script}, log)
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=("brown",))
    deltas = _run(engine, log, {"a": ([5, 6, 7], params), "b": ([8, 9], SamplingParams(temperature=0.0,
                                                                                        max_tokens=8))})
    text = "".join(d.text for d in deltas["a"])
    assert text == " the quick ", text
    assert deltas["a"][-1].finish_reason == "stop"
    stop_at = len([t for d in deltas["a"] for t in d.token_ids])
    # the stop string is seen once the token is read back, while the next step runs: one more token was
    # computed for "a", and it was never emitted
    assert runner.in_flight["a"] == stop_at + 1
    assert [e for e in log if e[0] == "emit" and e[1] == "a"][-1][3] == "stop"
    assert [t for d in deltas["b"] for t in d.token_ids] == script[:8]  # its neighbour is unaffected
    assert engine.pool.allocator.used_tokens == 0


def test_eos_ends_the_sequence_before_the_next_schedule(tokenizer):
    log: list = []
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = tokenizer.encode(" a picture") + [eos, 11, 12, 13]
    engine, runner = _engine(tokenizer, {"a": script}, log)
    deltas = _run(engine, log, {"a": ([5], SamplingParams(temperature=0.0, max_tokens=10))})
    tokens = [t for d in deltas["a"] for t in d.token_ids]
    assert tokens == script[:script.index(eos) + 1] and deltas["a"][-1].finish_reason == "stop"
    # EOS is known only once read back: the step after it is already running, and its token is dropped
    assert runner.in_flight["a"] == len(tokens) + 1
    assert engine.pool.allocator.used_tokens == 0


def test_eos_just_before_the_length_ends_with_stop(tokenizer):
    """The last step (the length) is submitted before the EOS one before it is read back: EOS still wins."""
    log: list = []
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = tokenizer.encode(" a picture")[:2] + [eos, 11]
    engine, runner = _engine(tokenizer, {"a": script}, log)
    deltas = _run(engine, log, {"a": ([5], SamplingParams(temperature=0.0, max_tokens=4))})
    assert [t for d in deltas["a"] for t in d.token_ids] == script[:3]
    assert deltas["a"][-1].finish_reason == "stop" and deltas["a"][-1].completion_tokens == 3
    assert runner.in_flight["a"] == 4
    assert engine.pool.allocator.used_tokens == 0


def test_a_sampler_that_needs_the_token_on_the_host_is_waited_for(tokenizer):
    """The repetition penalty reads the tokens seen so far: the next step is scheduled only once they are."""
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script}, log)
    params = SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3)
    deltas = _run(engine, log, {"a": ([5, 6, 7], params)})
    assert [t for d in deltas["a"] for t in d.token_ids] == script[:5]
    order = [e[:2] for e in log if e[0] in ("submit", "wait")]
    assert order == [x for k in range(5) for x in (("submit", k), ("wait", k))], order


def test_an_abort_with_a_step_in_flight_drops_its_token_and_frees_its_pages(tokenizer):
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script, "b": script}, log)
    runner.hold_at = 2  # step 2 waits to be submitted until the abort is in the inbox: step 1 is in flight
    outs = {"a": queue.Queue(), "b": queue.Queue()}
    for name in outs:
        engine.add(name, PreparedPrompt([5, 6]), SamplingParams(temperature=0.0, max_tokens=9),
                   lambda d, name=name: outs[name].put(d))
    engine.start()
    try:
        first = outs["a"].get(timeout=30)
        assert first.token_ids and first.error is None
        engine.abort("a")
        runner.release.set()
        got_b = []
        while True:
            d = outs["b"].get(timeout=30)
            got_b += d.token_ids
            if d.finish_reason:
                break
    finally:
        engine.stop()
    assert got_b == script[:9]
    rest = []
    while not outs["a"].empty():
        rest.append(outs["a"].get())
    assert all(not d.finish_reason for d in rest)  # an aborted request gets no more deltas, no finish
    assert engine.pool.allocator.used_tokens == 0


# -- request metrics: what the engine counts matches what happened to the requests -------------------------
def _sample(engine, name, **labels):
    return engine.metrics.registry.get_sample_value(name, {"service": "llm", "model_name": "tiny", **labels})


def test_request_metrics_count_each_finish_by_reason_and_size(tokenizer):
    log: list = []
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    stops = tokenizer.encode(" a picture")[:2] + [eos, 11]
    engine, runner = _engine(tokenizer, {"a": script, "b": script, "c": stops}, log)
    engine.model_name = "tiny"
    deltas = _run(engine, log, {"a": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6)),
                                "b": ([8, 9], SamplingParams(temperature=0.0, max_tokens=4)),
                                "c": ([5], SamplingParams(temperature=0.0, max_tokens=10))})
    assert [d[-1].finish_reason for d in deltas.values()] == ["length", "length", "stop"]
    finished = "modalmesh_requests_finished_total"
    assert _sample(engine, finished, finished_reason="length") == 2  # the two that hit max_tokens
    assert _sample(engine, finished, finished_reason="stop") == 1
    assert _sample(engine, finished, finished_reason="abort") is None
    assert _sample(engine, "modalmesh_request_prompt_tokens_sum") == 3 + 2 + 1
    assert _sample(engine, "modalmesh_request_prompt_tokens_count") == 3
    assert _sample(engine, "modalmesh_request_generation_tokens_sum") == 6 + 4 + 3  # c: 2 tokens and EOS
    assert _sample(engine, "modalmesh_request_params_max_tokens_sum") == 6 + 4 + 10
    for name in ("queue_time", "prefill_time", "decode_time"):
        assert _sample(engine, f"modalmesh_request_{name}_seconds_count") == 3, name
    assert _sample(engine, "modalmesh_e2e_request_latency_seconds_count") == 3
    e2e = _sample(engine, "modalmesh_e2e_request_latency_seconds_sum")
    parts = sum(_sample(engine, f"modalmesh_request_{n}_seconds_sum") for n in ("queue_time", "prefill_time",
                                                                                  "decode_time"))
    assert parts == pytest.approx(e2e, abs=1e-3)  # queue + prefill + decode is the whole request
    # end-to-end buckets reach hours: a long generation lands in a bucket, not only in +Inf
    assert _sample(engine, "modalmesh_e2e_request_latency_seconds_bucket", le="7200.0") == 3
    assert _sample(engine, "modalmesh_num_requests_running") == 0
    assert _sample(engine, "modalmesh_num_preemptions_total") is None
    # one inter-token gap per token after a request's first; one TPOT per request (each had 2+ tokens)
    get = engine.metrics.registry.get_sample_value
    assert get("modalmesh_inter_token_latency_seconds_count", {"service": "llm"}) == (6 - 1) + (4 - 1) + (3 - 1)
    # a request's gaps add up to its decode time (the step's gaps are observed together: engine._emit)
    assert get("modalmesh_inter_token_latency_seconds_sum", {"service": "llm"}) == pytest.approx(
        _sample(engine, "modalmesh_request_decode_time_seconds_sum"), rel=1e-9, abs=1e-12)
    assert get("modalmesh_time_per_output_token_seconds_count", {"service": "llm"}) == 3
    assert get("modalmesh_time_to_first_token_seconds_count", {"service": "llm"}) == 3


def test_engine_steps_are_counted_by_path_and_their_host_time_by_phase(tokenizer):
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script, "b": script}, log)
    _run(engine, log, {"a": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5)),
                       "b": ([8, 9], SamplingParams(temperature=0.0, max_tokens=3))})
    assert len(runner.paths) == engine.steps
    get = engine.metrics.registry.get_sample_value
    for path in ("decode_graph", "mixed_graph"):
        assert runner.paths.count(path) > 0, runner.paths
        assert get("modalmesh_engine_steps_total", {"service": "llm", "path": path}) == runner.paths.count(path)
    assert get("modalmesh_engine_steps_total", {"service": "llm", "path": "eager"}) == 0
    for phase, seconds in engine.phase_seconds.items():
        assert seconds > 0, phase
        assert get("modalmesh_engine_step_phase_seconds_total", {"service": "llm", "phase": phase}) == \
            pytest.approx(seconds), phase


def test_request_metrics_count_preemptions_and_aborts(tokenizer):
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog the quick brown fox")
    engine, runner = _engine(tokenizer, {"a": script, "b": script, "c": script}, log)
    engine.model_name = "tiny"
    # 5 pages of 4 tokens: two requests of 4 + 9 tokens (4 pages each) cannot both stay running
    engine.pool.allocator = engine.scheduler.allocator = PageAllocator(5, page_size=4)
    deltas = _run(engine, log, {"a": ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=9)),
                                "b": ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=9))})
    assert all(d[-1].finish_reason == "length" for d in deltas.values())
    assert _sample(engine, "modalmesh_num_preemptions_total") >= 1
    assert _sample(engine, "modalmesh_requests_finished_total", finished_reason="length") == 2

    # an aborted request counts once, as abort, with the tokens it had got
    engine2, runner2 = _engine(tokenizer, {"a": script}, log)
    engine2.model_name = "tiny"
    out = queue.Queue()
    engine2.add("a", PreparedPrompt([5, 6]), SamplingParams(temperature=0.0, max_tokens=12), out.put)
    runner2.hold_at = 3
    engine2.start()
    try:
        out.get(timeout=30)
        engine2.abort("a")
        runner2.release.set()
        engine2.abort("a")  # twice: still one
    finally:
        engine2.stop()
    assert _sample(engine2, "modalmesh_requests_finished_total", finished_reason="abort") == 1
    assert _sample(engine2, "modalmesh_request_prompt_tokens_sum") == 2
    assert _sample(engine2, "modalmesh_request_params_max_tokens_sum") == 12
    assert 1 <= _sample(engine2, "modalmesh_request_generation_tokens_sum") < 12


def test_a_failed_step_ends_its_requests_with_an_error_counted_as_error(tokenizer):
    """Also a request whose length ends with the failed step: it was finished when the step was
    launched, and still gets its error (it once waited forever)."""
    log: list = []
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    engine, runner = _engine(tokenizer, {"a": script, "b": script}, log)
    engine.model_name = "tiny"
    submit = runner.submit

    def failing(step, previous=None):
        inflight = submit(step, previous)
        if runner.steps == 2:  # the second step: "a" (max_tokens 2) ends with it, "b" does not
            inflight.wait = lambda: (_ for _ in ()).throw(RuntimeError("device fell over"))
        return inflight

    runner.submit = failing
    outs = {name: queue.Queue() for name in ("a", "b")}
    for name, n in (("a", 2), ("b", 8)):
        engine.add(name, PreparedPrompt([5, 6]), SamplingParams(temperature=0.0, max_tokens=n), outs[name].put)
    engine.start()
    try:
        last = {}
        for name, out in outs.items():
            while True:
                d = out.get(timeout=30)
                if d.finish_reason:
                    last[name] = d
                    break
    finally:
        engine.stop()
    assert all(isinstance(d.error, RuntimeError) for d in last.values()), last
    assert _sample(engine, "modalmesh_requests_finished_total", finished_reason="error") == 2
    assert _sample(engine, "modalmesh_requests_finished_total", finished_reason="length") is None
    assert engine.pool.allocator.used_tokens == 0
