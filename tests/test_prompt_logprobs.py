"""Prompt logprobs (vLLM's prompt_logprobs; OpenAI completions' echo with logprobs) against Hugging Face.

The engine in process on a tiny random Qwen2 (FP32, CPU): each prompt token's logprob given the tokens
before it, its rank and the top k at its position equal HF's log-softmax over the same prompt — across
prefill chunks (32 tokens a step), in slices of a few rows (SCORE_ROWS made small), beside requests that
ask for none, from a warm prefix cache (which such a request must not read), and through preemption.
"""

from __future__ import annotations

import queue

import pytest
import torch

from modalmesh.metrics import Metrics
from modalmesh.testing import tiny


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny.ensure("qwen2", tmp_path_factory.mktemp("prompt-logprobs"))


@pytest.fixture(scope="module")
def hf(qwen2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2, dtype=torch.float32).eval()


def _engine(path, *, kv_cache_tokens=1024, prefix_caching=True):
    from transformers import AutoTokenizer

    from services.llm.config import LLMConfig
    from services.llm.engine import LLMEngine
    from services.llm.runner import ModelRunner

    metrics = Metrics("llm", process_metrics=False)
    config = LLMConfig(model_dir=path, device_type="cpu", max_model_len=128, kv_cache_tokens=kv_cache_tokens,
                       page_size=4, max_batch_tokens=32, max_num_seqs=4, dtype=torch.float32,
                       prefix_caching=prefix_caching)
    engine = LLMEngine(ModelRunner(config, metrics), AutoTokenizer.from_pretrained(path), eos_token_ids=(),
                       metrics=metrics)
    engine.start()
    return engine


def _add(engine, rid, prompt, n, prompt_logprobs=None):
    from services.llm.inputs import PreparedPrompt
    from services.llm.sampling import SamplingParams

    out = queue.Queue()
    engine.add(rid, PreparedPrompt(list(prompt)), SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1, prompt_logprobs=prompt_logprobs), out.put)
    return out


def _collect(out):
    deltas = []
    while True:
        d = out.get(timeout=120)
        assert d.error is None, d.error
        deltas.append(d)
        if d.finish_reason:
            return deltas


def _check(hf, prompt, deltas, k):
    """The first delta's prompt scores equal HF's; no other delta carries any; the tokens are HF's greedy ones."""
    first = deltas[0]
    assert first.prompt_ids == prompt and all(d.prompt_logprobs is None for d in deltas[1:])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # row p scores token p + 1
    targets = torch.tensor(prompt[1:])
    chosen = ref.gather(1, targets[:, None])[:, 0]
    got = first.prompt_logprobs
    assert len(got) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got]), chosen, atol=1e-4, rtol=0)
    # Rank: how many tokens are at least as likely. A tiny random model's logprobs lie close together, so
    # float noise may reorder near-ties: the rank lies within them.
    for (_, rank, _), value, row in zip(got, chosen, ref):
        assert int((row > value + 1e-4).sum()) < rank <= int((row >= value - 1e-4).sum())
    top = ref.topk(k) if k else None
    for p, (_, _, alts) in enumerate(got):
        assert len(alts) == k
        if k:
            torch.testing.assert_close(torch.tensor([v for _, v in alts]), top.values[p], atol=1e-4, rtol=0)
            assert [t for t, _ in alts] == top.indices[p].tolist() or torch.allclose(
                ref[p, [t for t, _ in alts]], top.values[p], atol=1e-4)  # ties may order alike-valued ids apart
    ids = [t for d in deltas for t in d.token_ids]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ids), do_sample=False)[0, len(prompt):]
    assert ids == want.tolist()


def test_prompt_scores_equal_hf_across_chunks_and_slices_beside_requests_that_ask_none(qwen2, hf, monkeypatch):
    import services.llm.runner as runner

    monkeypatch.setattr(runner, "SCORE_ROWS", 5)  # a 70-token prompt's rows in 14 slices of its 3 chunks
    long = [(11 * i + 5) % 400 + 10 for i in range(70)]
    short = [(3 * i + 1) % 400 + 10 for i in range(9)]
    engine = _engine(qwen2)
    try:
        outs = [_add(engine, "long", long, 5, prompt_logprobs=3), _add(engine, "plain", short, 5),
                _add(engine, "short", short, 4, prompt_logprobs=0), _add(engine, "one", [42], 3, prompt_logprobs=2)]
        long_d, plain_d, short_d, one_d = (_collect(o) for o in outs)
    finally:
        engine.stop()
    _check(hf, long, long_d, 3)
    _check(hf, short, short_d, 0)
    assert all(d.prompt_ids is None and d.prompt_logprobs is None for d in plain_d)
    assert one_d[0].prompt_ids == [42] and one_d[0].prompt_logprobs == []  # nothing before the one token


def test_a_warm_prefix_cache_is_not_read_for_prompt_logprobs(qwen2, hf):
    prompt = [(7 * i + 3) % 400 + 10 for i in range(23)]
    engine = _engine(qwen2)
    try:
        warm = _collect(_add(engine, "warm", prompt, 4))
        again = _collect(_add(engine, "again", prompt, 4))
        scored = _collect(_add(engine, "scored", prompt, 4, prompt_logprobs=1))
    finally:
        engine.stop()
    assert again[-1].cached_tokens > 0  # the cache holds the prompt ...
    assert scored[-1].cached_tokens == 0  # ... and the scored request computed all of it
    _check(hf, prompt, scored, 1)
    assert [t for d in warm for t in d.token_ids] == [t for d in scored for t in d.token_ids]


def test_scores_survive_preemption(qwen2, hf):
    """Three 50-token prompts in a pool of 136 token slots: sequences are preempted and recomputed."""
    prompts = [[(5 * i + 17 * j) % 400 + 10 for i in range(50)] for j in range(3)]
    engine = _engine(qwen2, kv_cache_tokens=136, prefix_caching=False)
    try:
        outs = [_add(engine, f"r{j}", p, 8, prompt_logprobs=2) for j, p in enumerate(prompts)]
        results = [_collect(o) for o in outs]
        preempted = engine.metrics.registry.get_sample_value("modalmesh_num_preemptions_total",
                                                             {"service": "llm", "model_name": ""})
    finally:
        engine.stop()
    assert preempted, "the pool was meant to be too small for all three at once"
    for prompt, deltas in zip(prompts, results):
        _check(hf, prompt, deltas, 2)


def test_prompt_logprobs_are_validated():
    from modalmesh.errors import InvalidArgument
    from services.llm.sampling import SamplingParams

    SamplingParams(prompt_logprobs=20).validate(1000)
    for bad in (-1, 21):
        with pytest.raises(InvalidArgument, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate(1000)
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=0).validate(1 << 25)


def test_a_scoring_failure_fails_its_step_and_the_engine_goes_on(qwen2, hf, monkeypatch):
    """Scoring is rank 0's alone (a log-softmax over the slice's logits): when it fails (out of memory), the
    step's requests get the error after every rank's LM-head collectives, and the engine serves on."""
    import services.llm.runner as runner

    def fail(*a):
        raise RuntimeError("CUDA out of memory (scoring)")

    monkeypatch.setattr(runner, "score_prompt", fail)
    engine = _engine(qwen2)
    try:
        out = _add(engine, "scored", [5, 6, 7, 8], 2, prompt_logprobs=1)
        d = out.get(timeout=120)
        assert d.error is not None and "out of memory" in str(d.error)
        monkeypatch.undo()
        prompt = [9, 10, 11, 12, 13]
        _check(hf, prompt, _collect(_add(engine, "after", prompt, 3, prompt_logprobs=1)), 1)
    finally:
        engine.stop()
